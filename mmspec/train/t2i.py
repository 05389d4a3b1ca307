"""Train a text-to-image LlamaGen GPT on MNIST token grids with MiniLM captions: `python -m mmspec.train t2i
--data runs/mnist-codes.pt --out assets/mnist-t2i`.

Data: the tokenized-MNIST file of `python -m mmspec.train tokenize` (codes [N, 64]) and its captions file
(`mmspec.train.captions`: per image `--prompts-per-image` prompts such as "a thick handwritten seven" or "the digit 3,
slanted to the right", the MiniLM features of the unique prompts, left-aligned in `--max-text-tokens` slots). The
captions file is built on the first run when `--captions` does not exist.

Model: `LlamaGenGPT` t2i (default 8 layers, dim 256, 8 heads as `mnist-c2i`; `cls_token_num` = the captions' token
slots, `caption_dim` 384), next-token cross-entropy on (codes, one of the image's prompts drawn per step), caption
dropout `--class-dropout` (0.1) to the learned null caption `uncond_embedding` for classifier-free guidance. A
dropped row keeps its prompt's text mask, as upstream LlamaGen samples with the same mask for the conditional and
the unconditional rows (`LlamaGenTarget.prefill` does the same). AdamW, warmup + cosine as the c2i task.
`--init-from assets/mnist-c2i` optionally starts every weight but the condition embedder from a trained LlamaGen GPT
of the same shape (the image positions' 2-D RoPE does not depend on the prefix length).

At the end: held-out NLL (with the prompt and with the null caption), then `--sample-size` images for held-out
prompts (an equal number per digit, drawn from the prompts of the `--eval-split` images) with plain AR sampling and
CFG (`mmspec.decoding`), decoded with the VQ and classified with the zoo classifier: `sample_accuracy` is the
fraction classified as the digit the prompt names; `sample_thickness_agreement` / `sample_slant_agreement` compare
the attributes measured on the samples (train-split thresholds) with the ones the prompt names (chance 1/3). The
samples go to `sample_eval.json` and `samples.png` (one row per digit) in the model folder.

Cost: a training step of the default model takes ~1.3x a c2i step (16 text slots + 63 image tokens instead of 1 + 63;
estimated ~2.2 s on 2 idle CPU cores), so the defaults (1000 steps of batch 64) take about 37 min, plus ~1-2 min for
the held-out NLL and the 500 samples.
"""

import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.cli.args import positive_float, probability
from mmspec.data.captions import attribute_labels
from mmspec.models.llamagen.gpt import LlamaGenGPT
from mmspec.train.captions import add_caption_arguments, ensure_captions, split_rows
from mmspec.train.common import (
    add_common_arguments,
    card_metrics,
    configure_threads,
    count_int,
    declare_paths,
    not_run_defining,
    random_batch_indices,
    seed_everything,
    size_int,
    train_and_save,
    write_model_card,
    zoo_folder,
)
from mmspec.train.gpt import (
    add_data_arguments,
    add_size_arguments,
    build_gpt,
    build_optimizer,
    check_args,  # noqa: F401  (the task's usage checks: --dim / --n-head)
    evaluate_nll,
    load_data,
)


logger = logging.getLogger(__name__)


def add_arguments(parser):
    add_common_arguments(parser, steps=1000, batch_size=64, lr=1e-3, warmup_steps=100, checkpoint_every=100, threads=2)
    parser.set_defaults(weight_decay=0.05)
    add_data_arguments(parser)
    add_caption_arguments(parser)
    add_size_arguments(parser, dim=256, n_layer=8, n_head=8, multiple_of=256)
    parser.add_argument("--dropout", type=probability, default=0.0, help="token / residual / FFN dropout")
    parser.add_argument("--class-dropout", type=probability, default=0.1, help="probability of the null caption (CFG)")
    parser.add_argument("--init-from", default=None, help="LlamaGen GPT folder to start from (not its cond. embedder)")
    parser.add_argument("--vq", default=None, help="VQ folder for the sample evaluation (default: the codes' VQ)")
    parser.add_argument("--classifier", default=zoo_folder("mnist-classifier"), help="classifier for the evaluation")
    declare_paths(parser, model_folders=("init_from", "vq", "classifier"))
    parser.add_argument(
        "--sample-size", type=count_int, default=500, help="images sampled at the end (0: no sampling)"
    )
    parser.add_argument("--guidance-scale", type=positive_float, default=2.0, help="CFG scale of the evaluation")
    parser.add_argument("--sample-batch-size", type=size_int, default=250)
    not_run_defining(parser, "vq", "classifier", "sample_size", "guidance_scale", "sample_batch_size")


# ----------------------------------------------------------------------------- helpers
class CaptionConditioned:
    """A t2i `LlamaGenGPT` seen as conditioned on prompt ids: `forward_train(x, prompt_ids, drop)` looks up the
    prompts' features and masks (so `mmspec.train.gpt.evaluate_nll` works unchanged)."""

    def __init__(self, model, features, masks):
        self.model, self.features, self.masks = model, features, masks

    def condition(self, prompt_ids):
        """(features float32 `[B, T, D]`, bool masks `[B, T]`) of `prompt_ids [B]`."""
        device = self.model.tok_embeddings.weight.device
        return self.features[prompt_ids].float().to(device), self.masks[prompt_ids].to(device)

    def eval(self):
        self.model.eval()
        return self

    def forward_train(self, input_ids, prompt_ids, drop=None, generator=None):
        cond, mask = self.condition(prompt_ids)
        return self.model.forward_train(input_ids, cond, cond_mask=mask, drop=drop, generator=generator)


def init_from(model, folder):
    """Copy every weight of the LlamaGen GPT in `folder` except the condition embedder into `model` (shapes must
    match). Returns the number of tensors copied."""
    from mmspec.models import load

    source = load(folder)
    if not isinstance(source, LlamaGenGPT):
        raise ValueError(f"--init-from {str(folder)!r} is a {type(source).__name__}, expected a LlamaGenGPT")
    own = model.state_dict()
    copied = {k: v for k, v in source.state_dict().items() if not k.startswith("cls_embedding.")}
    bad = [k for k, v in copied.items() if k not in own or own[k].shape != v.shape]
    if bad:
        raise ValueError(f"--init-from {str(folder)!r} does not fit this model (e.g. {bad[0]}); use its dim/layers")
    model.load_state_dict(copied, strict=False)
    return len(copied)


def eval_prompts(captions, split, size, generator):
    """`size` (prompt id, image row) pairs of the `split` images, an equal share per digit (ordered by digit)."""
    rows = split_rows(captions, split)
    index = captions["prompt_index"][rows]  # [n, K]
    pids, image_rows = index.reshape(-1), rows[:, None].expand_as(index).reshape(-1)
    digits = captions["prompt_digit"][pids]
    per = -(-size // 10)
    chosen = []
    for d in range(10):
        cand = (digits == d).nonzero()[:, 0]
        chosen.append(cand[torch.randperm(len(cand), generator=generator)[:per]])
    chosen = torch.cat(chosen)[:size]
    return pids[chosen], image_rows[chosen]


@torch.no_grad()
def sample_images(model, cond, cond_mask, vq, guidance_scale, generator, batch_size=250, temperature=1.0):
    """Plain AR sampling with CFG through the decoding engine -> (token grids `[B, N]`, images `[B, C, H, W]` in
    [-1, 1])."""
    from mmspec.decoding import Guidance, SequenceState, decode
    from mmspec.models.llamagen.target import LlamaGenTarget
    from mmspec.sampling import SamplingParams, sample
    from mmspec.stats import SpecStats
    from mmspec.verify import Exact

    model.eval()
    guidance = Guidance(SamplingParams(guidance_scale=guidance_scale, temperature=temperature))
    n_tokens = model.config.block_size
    tokens, images = [], []
    for i in range(0, len(cond), batch_size):
        c, m = cond[i : i + batch_size], cond_mask[i : i + batch_size]
        target = LlamaGenTarget(model, guidance)
        first = target.prefill(c, n_tokens, scratch=1, cond_mask=m)
        state = SequenceState(sample(first.p_target[:, 0], generator), n_tokens, generator=generator)
        decode(target, None, Exact(), state, guidance, SpecStats(len(c)))
        tokens.append(state.full())
        images.append(vq.decode_codes(state.full()).float().clamp(-1, 1))
    return torch.cat(tokens), torch.cat(images)


def save_grid(images, path, ncols):
    """Images `[N, 1, H, W]` in [-1, 1] -> one PNG, `ncols` per row (2 px gutters)."""
    import PIL.Image

    n, _, h, w = images.shape
    nrows = -(-n // ncols)
    pad = 2
    canvas = torch.zeros(nrows * (h + pad) + pad, ncols * (w + pad) + pad)
    for i, img in enumerate(images):
        r, c = divmod(i, ncols)
        canvas[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = img[0]
    pixels = ((canvas.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    PIL.Image.fromarray(pixels, mode="L").save(path)


def _mean(flags):
    """Fraction of True in a bool tensor; None when it is empty (JSON-safe, unlike NaN)."""
    return float(flags.float().mean()) if flags.numel() else None


def evaluate_samples(model, captions, args, split, size):
    """Sample `size` images for held-out prompts of `split`; classifier accuracy on the named digit, attribute
    agreement; writes `sample_eval.json` and `samples.png` into `args.out`. Returns the metrics."""
    from mmspec.models import load

    generator = torch.Generator().manual_seed(args.seed + 12345)  # independent of the training stream
    pids, _ = eval_prompts(captions, split, size, generator)
    vq = load(args.vq or captions["vq"])
    classifier = load(args.classifier).eval()
    conditioned = CaptionConditioned(model, captions["features"], captions["masks"])
    cond, mask = conditioned.condition(pids)
    start = time.perf_counter()
    _, images = sample_images(model, cond, mask, vq, args.guidance_scale, generator, args.sample_batch_size)
    wall = time.perf_counter() - start
    preds = classifier.predict(images)
    digits = captions["prompt_digit"][pids]
    correct = preds == digits
    thickness, slant = attribute_labels(images, digits, captions["thresholds"])
    named_t, named_s = captions["prompt_thickness"][pids], captions["prompt_slant"][pids]
    metrics = {
        "sample_accuracy": _mean(correct),
        "sample_thickness_agreement": _mean((thickness == named_t)[named_t >= 0]),
        "sample_slant_agreement": _mean((slant == named_s)[named_s >= 0]),
    }
    per_digit = [_mean(correct[digits == d]) for d in range(10)]
    logger.info("samples: %s (per digit %s, %.0f s)", metrics, per_digit, wall)
    show = min(10, -(-size // 10))
    rows = torch.cat([(digits == d).nonzero()[:show, 0] for d in range(10)])
    out = Path(args.out)
    save_grid(images[rows], out / "samples.png", show)
    record = {
        "method": "plain AR sampling (mmspec.decoding, no drafter)",
        "guidance_scale": args.guidance_scale,
        "temperature": 1.0,
        "num_images": len(pids),
        "prompts_from": f"{args.captions} ({split} split images' prompts, {-(-size // 10)} per digit)",
        **metrics,
        "per_digit_accuracy": per_digit,
        "seed": args.seed + 12345,
        "wall_s": wall,
        "grid": "samples.png",
        "grid_prompts": [captions["prompts"][int(p)] for p in pids[rows]],
        "prompts": [captions["prompts"][int(p)] for p in pids],
        "predictions": preds.tolist(),
    }
    (out / "sample_eval.json").write_text(json.dumps(record, indent=2) + "\n")
    return {**metrics, "sample_wall_s": wall}


# ----------------------------------------------------------------------------- task
def run(args):
    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    codes, labels, eval_codes, _, meta = load_data(args)
    captions = ensure_captions(args)
    captions["vq"] = meta.get("vq", "assets/mnist-vq")
    features, masks = captions["features"], captions["masks"]
    train_prompts = captions["prompt_index"][split_rows(captions, args.train_split)]  # [N, K]
    eval_prompt_ids = captions["prompt_index"][split_rows(captions, args.eval_split)][: len(eval_codes), 0]
    if not torch.equal(captions["prompt_digit"][train_prompts[:, 0]], labels):
        raise ValueError(f"captions {args.captions!r} do not match the rows of {args.data!r}")
    vocab = int(meta.get("codebook_size", int(codes.max()) + 1))
    cls_token_num, caption_dim = masks.shape[1], features.shape[2]
    model = build_gpt(args, vocab, codes.shape[1], args.class_dropout, model_type="t2i", caption_dim=caption_dim,
                      cls_token_num=cls_token_num)  # fmt: skip
    model.init_weights(generator=generator)  # upstream init, output layer zeroed
    if args.init_from:
        logger.info("initialised %d tensors from %s", init_from(model, args.init_from), args.init_from)
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    conditioned = CaptionConditioned(model, features, masks)
    per_image = train_prompts.shape[1]

    def step_fn(step):
        idx = random_batch_indices(len(codes), args.batch_size, generator)
        col = torch.randint(per_image, (args.batch_size,), generator=generator)
        x = codes[idx]
        logits = conditioned.forward_train(x, train_prompts[idx, col], generator=generator).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))
        return {"loss": loss}

    result, saved = train_and_save(model, optimizer, step_fn, args, generator)
    metrics = evaluate_nll(CaptionConditioned(saved, features, masks), eval_codes, eval_prompt_ids)
    logger.info("%s metrics: %s", args.eval_split, metrics)
    sample_metrics = {}
    if args.sample_size:
        sample_metrics = evaluate_samples(saved, captions, args, args.eval_split, args.sample_size)
    images = {"samples.png": "samples for held-out prompts, one row per digit (sample_eval.json lists the prompts)"}
    write_model_card(
        args.out,
        title=f"MNIST text-to-image LlamaGen GPT ({args.n_layer}L/{args.dim}, {cls_token_num} text + "
        f"{codes.shape[1]} image tokens)",
        description=(
            "`mmspec.models.llamagen.gpt.LlamaGenGPT` (official LlamaGen parameter names, 2-D RoPE, t2i) trained "
            f"{'from scratch' if not args.init_from else f'from {args.init_from} (all but the condition embedder)'} "
            f"on VQ token grids of MNIST ({vocab} codes, {codes.shape[1]} tokens in raster order) conditioned on "
            f"MiniLM (all-MiniLM-L6-v2, {caption_dim}-d) token features of prompts such as "
            f"{captions['prompts'][0]!r}, left-aligned in {cls_token_num} slots with a text mask "
            "(`mmspec.models.llamagen.text.encode_prompts`). Prompts name the digit (numeral or word) and optionally the "
            "stroke thickness and slant measured on the image (`mmspec.train.captions`). Caption dropout "
            f"{args.class_dropout} to the learned null caption (`uncond_embedding`, the CFG unconditional stream); "
            "dropped rows keep the prompt's text mask, so sample with the same mask on the cond and the uncond "
            f"rows. Held-out NLL: per-token (nats) on the first {len(eval_codes)} `{args.eval_split}` items with "
            "their first prompt and with the null caption. Sample metrics: see `sample_eval.json`."
        ),
        model=saved,
        data=(
            f"{args.data} ({args.train_split}: {len(codes)} items; VQ {meta.get('vq', '?')}) + {args.captions} "
            f"({len(captions['prompts'])} unique prompts, {per_image} per image)"
        ),
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(result, (f"{args.eval_split}_", metrics), sample_metrics),
        extra={
            "text_encoder": captions["encoder"],
            "cls_token_num": cls_token_num,
            "num_prompts": len(captions["prompts"]),
            "longest_prompt_tokens": captions["max_prompt_tokens"],
            "captions_sha256": captions["sha256"],
            "templates": captions["templates"],
            "vq_sha256": meta.get("vq_sha256", ""),
            "sample_guidance_scale": args.guidance_scale if args.sample_size else None,
        },
        images=images if args.sample_size else None,
        history=result.history,
    )
    return saved
