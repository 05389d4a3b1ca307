"""Train a class-conditional MAR (target or draft) on KL-autoencoder tokens of MNIST: `python -m mmspec.train mar
--kl assets/mnist-kl --out assets/mnist-mar` (draft: `--preset draft --out assets/mnist-mar-draft`).

Data: MNIST train images encoded once by the KL autoencoder (posterior mean and std per token, cached in
`runs/`); each batch draws fresh posterior samples (as MAR's cached-latent training does). Model: `mmspec.models.mar.model.MAR`
(official parameter names) trained with MAR's loss -- random order, truncated-normal mask ratio, class dropout 0.1 to
`fake_latent`, the diffusion loss (epsilon MSE + variational term) on masked tokens -- with AdamW, warmup + cosine,
and an EMA of the weights (what is saved, as upstream evaluates the EMA). The draft is the same family, smaller in
every part that costs time per AR step (transformer depth/width and the head's depth/width), trained on the same data.
The card reports the zoo classifier's accuracy on class-conditional samples (`--eval-samples`).
"""

import copy
import hashlib
import logging
from pathlib import Path

import torch

from mmspec.cli.args import positive_float
from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    configure_threads,
    count_int,
    declare_paths,
    load_checkpoint,
    not_run_defining,
    random_batch_indices,
    seed_everything,
    size_int,
    train_and_save,
    write_model_card,
    zoo_folder,
)


logger = logging.getLogger(__name__)

PRESETS = {
    "target": dict(dim=128, depth=3, heads=4, head_depth=3, head_width=128),
    "draft": dict(dim=64, depth=1, heads=2, head_depth=1, head_width=64),
}


def add_arguments(parser):
    add_common_arguments(parser, steps=3000, batch_size=64, lr=1e-3, warmup_steps=200, checkpoint_every=250, threads=1)
    parser.set_defaults(weight_decay=0.02)
    parser.add_argument("--kl", default=zoo_folder("mnist-kl"), help="the KL autoencoder folder (mmspec.train kl)")
    parser.add_argument("--cache", default="runs/mnist-kl-latents.pt", help="cached posterior statistics")
    declare_paths(parser, model_folders=("kl",), output_files=("cache",))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="target", help="model size")
    for name in ("dim", "depth", "heads", "head_depth", "head_width"):
        parser.add_argument("--" + name.replace("_", "-"), type=size_int, default=None, help="overrides the preset")
    parser.add_argument("--buffer-size", type=size_int, default=4, help="class buffer tokens (upstream 64)")
    parser.add_argument("--sampling-steps", default="50", help="respaced diffusion steps saved in the config")
    parser.add_argument("--diffusion-batch-mul", type=size_int, default=2)
    parser.add_argument("--clip-denoised", type=positive_float, default=6.0,
                        help="x_start clamp while sampling (tokens have unit std; see DiffLossHead)")  # fmt: skip
    parser.add_argument("--ema", type=positive_float, default=0.999, help="EMA rate of the saved weights")
    parser.add_argument("--eval-samples", type=count_int, default=500, help="samples for the card's accuracy")
    parser.add_argument("--eval-cfg", type=positive_float, default=3.0)
    parser.add_argument("--eval-num-iter", type=size_int, default=64)
    not_run_defining(parser, "eval_samples", "eval_cfg", "eval_num_iter")


@torch.no_grad()
def encode_dataset(kl_folder, cache_path, split="train", batch_size=500):
    """Posterior mean/std tokens ``[N, L, D]`` (scaled) and labels of an MNIST split, cached by the KL weights' hash."""
    from mmspec.data.mnist import load_mnist
    from mmspec.models import load

    weights = next(Path(kl_folder).glob("*.safetensors"))
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16]
    cache = Path(cache_path).with_name(f"{Path(cache_path).stem}-{split}-{digest}.pt")
    if cache.is_file():
        data = load_checkpoint(cache)
        return data["mean"], data["std"], data["labels"], digest
    kl = load(kl_folder).eval()
    images, labels = load_mnist(split)
    means, stds = [], []
    scale = kl.config.scale_factor
    for i in range(0, len(images), batch_size):
        post = kl.encode(images[i : i + batch_size])
        means.append(post.mean.flatten(2).transpose(1, 2) * scale)  # [B, D, h, w] -> [B, L, D]
        stds.append(post.std.flatten(2).transpose(1, 2) * scale)
    mean, std = torch.cat(means), torch.cat(stds)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"mean": mean, "std": std, "labels": labels}, cache)
    return mean, std, labels, digest


class EMA:
    """Exponential moving average of a model's parameters (state-dict-able, so checkpoints resume it)."""

    def __init__(self, model, rate):
        self.rate, self.model = rate, copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, p in zip(self.model.parameters(), model.parameters(), strict=True):
            e.lerp_(p, 1 - self.rate)

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)


@torch.no_grad()
def sample_accuracy(model_folder, kl_folder, num, cfg, num_iter, seed=0, batch_size=50):
    """Zoo classifier accuracy on ``num`` class-conditional samples (labels cycle 0..9)."""
    from mmspec.models import load
    from mmspec.pipelines.continuous import SpeculativeContinuousARPipeline

    pipe = SpeculativeContinuousARPipeline(transformer=load(model_folder), vae=load(kl_folder))
    pipe.set_progress_bar_config(disable=True)
    classifier = load(Path(kl_folder).parent / "mnist-classifier").eval()
    correct = 0
    for i in range(0, num, batch_size):
        labels = [j % 10 for j in range(i, min(i + batch_size, num))]
        gen = torch.Generator().manual_seed(seed + i)
        images = pipe(labels, guidance_scale=cfg, num_ar_steps=num_iter, generator=gen, output_type="pt").images
        correct += int((classifier(images * 2 - 1).argmax(-1) == torch.tensor(labels)).sum())
    return correct / max(num, 1)


def check_args(parser, args):
    """Usage error before any data loads: the model width must split into its heads (preset or flags)."""
    size = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in PRESETS[args.preset].items()}
    if size["dim"] % size["heads"]:
        parser.error(f"argument --heads: --dim {size['dim']} is not divisible by --heads {size['heads']}")


def run(args):
    from mmspec.models.mar.model import MAR

    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    mean, std, labels, digest = encode_dataset(args.kl, args.cache)
    size = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in PRESETS[args.preset].items()}
    h = w = int(round(mean.shape[1] ** 0.5))
    model = MAR(seq_h=h, seq_w=w, token_embed_dim=mean.shape[2], encoder_embed_dim=size["dim"],
                encoder_depth=size["depth"], encoder_num_heads=size["heads"], decoder_embed_dim=size["dim"],
                decoder_depth=size["depth"], decoder_num_heads=size["heads"], class_num=int(labels.max()) + 1,
                buffer_size=args.buffer_size, diffloss_d=size["head_depth"], diffloss_w=size["head_width"],
                num_sampling_steps=str(args.sampling_steps), diffusion_batch_mul=args.diffusion_batch_mul,
                clip_denoised=args.clip_denoised)  # fmt: skip
    ema = EMA(model, args.ema)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )  # fmt: skip

    def step_fn(step):
        idx = random_batch_indices(len(mean), args.batch_size, generator)
        tokens = mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=generator)
        return {"loss": model.loss(tokens, labels[idx], generator)}

    result, _ = train_and_save(model, optimizer, step_fn, args, generator, extra_state={"ema": ema},
                               after_step=lambda s, m: ema.update(model))  # fmt: skip
    # The EMA weights are what ships: overwrite the saved (raw) weights with them.
    from mmspec.models import load
    from mmspec.train.common import save_model

    save_model(ema.model, args.out, storage=args.storage)
    saved = load(args.out)
    metrics = card_metrics(result)
    if args.eval_samples:
        metrics["classifier_accuracy"] = sample_accuracy(args.out, args.kl, args.eval_samples, args.eval_cfg,
                                                         args.eval_num_iter)  # fmt: skip
        logger.info("classifier accuracy on %d samples: %.3f", args.eval_samples, metrics["classifier_accuracy"])
    write_model_card(
        args.out,
        title=f"MNIST class-conditional MAR ({args.preset}: {size['depth']}+{size['depth']} blocks / {size['dim']}, "
        f"head {size['head_depth']}x{size['head_width']}, {h}x{w} tokens)",
        description=(
            "`mmspec.models.mar.model.MAR` (official MAR parameter names) trained from scratch on KL-autoencoder tokens of "
            f"MNIST ({h}x{w} tokens of {mean.shape[2]} dims, posterior samples) with MAR's masked diffusion loss; "
            f"class dropout 0.1 to `fake_latent` (the CFG branch); EMA {args.ema} weights. Sampling defaults: "
            f"{args.sampling_steps} respaced diffusion steps, predicted x_start clamped to +-{args.clip_denoised} (the "
            "cosine schedule's first reverse step amplifies epsilon errors ~2e4x). `classifier_accuracy`: the zoo classifier on "
            f"{args.eval_samples} samples (labels cycling 0-9, CFG {args.eval_cfg} linear, {args.eval_num_iter} AR "
            "steps, temperature 1)."
        ),
        model=saved,
        data=f"MNIST train ({len(mean)} images) through {args.kl} (weights sha256 {digest}...)",
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=metrics,
        extra={"preset": args.preset, **size},
        history=result.history,
    )
    return saved
