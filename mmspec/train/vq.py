"""Train a VQ tokenizer: `python -m mmspec.train vq --out assets/mnist-vq` (MNIST), or on texture crops with
`--dataset textures` (64x64 crops -> 16x16 = 256 tokens; `assets/texture-vq`) or `--dataset natural --ch-mult 1 1`
(32x32 crops, downsample 2 -> 16x16 = 256 tokens; the natural-image zoo's `assets/natural-vq`).

LlamaGen VQ architecture (mmspec.models.llamagen.vq.LlamaGenVQ) at MNIST scale: 32x32 images, downsample 4 -> 8x8 = 64 tokens,
256 l2-normalised codes of dimension 8. Loss = L1 + L2 reconstruction + codebook + beta * commitment (+ optional
entropy term); no perceptual/GAN losses (no pretrained networks offline). Codes that go unused for a while are
restarted on random encoder outputs of the current batch (dead-code restarts), which keeps codebook usage high.

The model card records test-set reconstruction MSE/PSNR (on the original 28x28 pixels, [0, 1] scale), codebook usage
(% of codes used, perplexity of the code histogram), and a reconstruction grid image.
"""

import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.cli.args import int_in_range, non_negative_float, probability
from mmspec.data.datasets import border, data_note, load_images
from mmspec.models.llamagen.vq import LlamaGenVQ
from mmspec.train.common import (
    MAX_STEPS,
    add_common_arguments,
    add_dataset_argument,
    add_mnist_data_argument,
    card_metrics,
    configure_threads,
    mnist_splits,
    not_run_defining,
    random_batch_indices,
    seed_everything,
    size_int,
    train_and_save,
    write_model_card,
)


logger = logging.getLogger(__name__)

GRID_IMAGE = "reconstructions.png"


def add_autoencoder_arguments(parser, ch_mult):
    """--ch / --ch-mult / --num-res-blocks of the convolutional encoder-decoder (vq and kl tasks)."""
    parser.add_argument("--ch", type=size_int, default=32)
    parser.add_argument("--ch-mult", type=size_int, nargs="+", default=ch_mult)
    parser.add_argument("--num-res-blocks", type=size_int, default=1)


def add_arguments(parser):
    add_common_arguments(parser, steps=1500, batch_size=32, lr=1e-3, warmup_steps=100, checkpoint_every=250, threads=2)
    add_mnist_data_argument(parser)
    add_dataset_argument(parser)
    add_autoencoder_arguments(parser, ch_mult=[1, 1, 2])
    parser.add_argument("--z-channels", type=size_int, default=64)
    parser.add_argument("--codebook-size", type=size_int, default=256)
    parser.add_argument("--codebook-dim", type=size_int, default=8)
    parser.add_argument("--beta", type=non_negative_float, default=0.25, help="commitment loss weight")
    parser.add_argument(
        "--entropy-weight", type=non_negative_float, default=0.0, help="codebook entropy loss ratio (0: off)"
    )
    parser.add_argument(
        "--restart-every",
        type=int_in_range(0, MAX_STEPS),
        default=50,
        help="steps between dead-code restarts (0: off)",
    )
    parser.add_argument(
        "--restart-until", type=probability, default=0.8, help="stop restarts after this fraction of steps"
    )
    parser.add_argument("--eval-split", type=mnist_splits, default="test")
    not_run_defining(parser, "eval_split")


class CodeUsage:
    """Exponential moving count of code usage per step, for dead-code restarts (checkpointable)."""

    def __init__(self, codebook_size: int, decay: float = 0.95):
        self.counts = torch.ones(codebook_size)
        self.decay = decay
        self.restarts = 0  # total number of restarted codes

    def update(self, codes: torch.Tensor) -> None:
        hist = torch.bincount(codes.flatten(), minlength=self.counts.numel()).float()
        self.counts.mul_(self.decay).add_(hist, alpha=1 - self.decay)

    def state_dict(self):
        return {"counts": self.counts.clone(), "restarts": self.restarts}

    def load_state_dict(self, state):
        self.counts = state["counts"].clone()
        self.restarts = int(state["restarts"])


@torch.no_grad()
def restart_dead_codes(model, optimizer, usage, latents, generator, threshold=0.03):
    """Re-initialise codes with moving usage < `threshold` to random (normalised) encoder vectors of the batch.

    Returns the number of restarted codes. Adam moments of the restarted rows are zeroed.
    """
    dead = (usage.counts < threshold).nonzero().flatten()
    if dead.numel() == 0:
        return 0
    vectors = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    pick = torch.randint(vectors.shape[0], (dead.numel(),), generator=generator)
    new = vectors[pick] + 0.01 * torch.randn(dead.numel(), vectors.shape[1], generator=generator)
    weight = model.quantize.embedding.weight
    weight[dead] = F.normalize(new, dim=-1) if model.config.codebook_l2_norm else new
    state = optimizer.state.get(weight, {})
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key][dead] = 0
    usage.counts[dead] = 1.0  # give the restarted codes time to be picked
    return int(dead.numel())


def psnr_from_mse(mse: float, peak: float = 1.0) -> float:
    return 10 * math.log10(peak**2 / max(mse, 1e-12))


@torch.no_grad()
def evaluate_vq(model: LlamaGenVQ, images: torch.Tensor, batch_size: int = 500, pad: int = 2) -> dict:
    """Reconstruction and codebook-usage metrics of `model` on `images` [N, 1, H, W] in [-1, 1].

    MSE/PSNR are measured inside a `pad`-pixel border (MNIST's 2 px background padding, excluded: the original 28x28
    pixels) on the [0, 1] scale:
    `mse` (mean over all pixels), `psnr_db` (from that MSE), `psnr_db_per_image` (mean of per-image PSNRs).
    Usage: `codes_used_pct` (share of codes appearing at least once), `perplexity` (exp entropy of the histogram).
    """
    model.eval()
    sq_err, per_image_psnr, hist = [], [], torch.zeros(model.config.codebook_size)
    crop = slice(pad, images.shape[-1] - pad)
    for i in range(0, len(images), batch_size):
        x = images[i : i + batch_size]
        codes = model.encode(x)
        recon = model.decode_codes(codes)
        err = ((recon - x)[..., crop, crop] / 2).pow(2).flatten(1).mean(1)  # [0, 1] scale
        sq_err.append(err)
        per_image_psnr.append(10 * torch.log10(1.0 / err.clamp_min(1e-12)))
        hist += torch.bincount(codes.flatten(), minlength=model.config.codebook_size).float()
    mse = float(torch.cat(sq_err).mean())
    probs = hist / hist.sum()
    entropy = float(-(probs[probs > 0] * probs[probs > 0].log()).sum())
    return {
        "mse": mse,
        "psnr_db": psnr_from_mse(mse),
        "psnr_db_per_image": float(torch.cat(per_image_psnr).mean()),
        "codes_used_pct": 100.0 * float((hist > 0).float().mean()),
        "perplexity": math.exp(entropy),
    }


@torch.no_grad()
def save_reconstruction_grid(model: LlamaGenVQ, images: torch.Tensor, path, per_row: int = 16, scale: int = 2):
    """Save a PNG with rows alternating originals / reconstructions (`len(images)` must be a multiple of per_row)."""
    from PIL import Image

    recon = model.decode_codes(model.encode(images))
    rows = []
    for i in range(0, len(images), per_row):
        rows += [images[i : i + per_row], recon[i : i + per_row]]
    grid = torch.stack(rows)  # (R, per_row, 1, H, W)
    r, c, _, h, w = grid.shape
    grid = F.pad(grid, (1, 1, 1, 1), value=1.0)  # white separators
    grid = grid[:, :, 0].permute(0, 2, 1, 3).reshape(r * (h + 2), c * (w + 2))
    pixels = ((grid + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    image = Image.fromarray(pixels, mode="L")
    image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    image.save(path)
    return path


def run(args):
    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    images, _ = load_images(args.dataset, args.data)
    logger.info("training VQ on %s %s: %s", args.dataset, args.data, tuple(images.shape))
    model = LlamaGenVQ(
        in_channels=1,
        ch=args.ch,
        ch_mult=tuple(args.ch_mult),
        num_res_blocks=args.num_res_blocks,
        z_channels=args.z_channels,
        codebook_size=args.codebook_size,
        codebook_embed_dim=args.codebook_dim,
        commit_loss_beta=args.beta,
        entropy_loss_ratio=args.entropy_weight,
        sample_size=images.shape[-1],
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    usage = CodeUsage(args.codebook_size)
    last = {}

    def step_fn(step):
        x = images[random_batch_indices(len(images), args.batch_size, generator)]
        out = model(x)
        l1 = F.l1_loss(out.reconstruction, x)
        l2 = F.mse_loss(out.reconstruction, x)
        loss = l1 + l2 + out.codebook_loss + out.commitment_loss + out.entropy_loss
        last["latents"], last["codes"] = out.latents.detach(), out.codes
        return {"loss": loss, "l1": l1, "l2": l2, "codebook": out.codebook_loss, "commit": out.commitment_loss}

    def after_step(step, metrics):
        usage.update(last["codes"])
        if args.restart_every and (step + 1) % args.restart_every == 0 and step < args.restart_until * args.steps:
            n = restart_dead_codes(model, optimizer, usage, last["latents"], generator)
            usage.restarts += n
            if n:
                logger.info("step %d: restarted %d dead codes", step + 1, n)

    result, saved = train_and_save(
        model, optimizer, step_fn, args, generator, extra_state={"usage": usage}, after_step=after_step
    )
    pad = border(args.dataset)
    test_images, _ = load_images(args.dataset, args.eval_split)
    metrics = evaluate_vq(saved, test_images, pad=pad)
    train_metrics = evaluate_vq(saved, images[:2000], pad=pad)
    save_reconstruction_grid(saved, test_images[:32], Path(args.out) / GRID_IMAGE)
    logger.info("%s metrics: %s", args.eval_split, metrics)
    side = images.shape[-1] // model.downsample_factor
    codes = f"codebook of {args.codebook_size} l2-normalised codes of dimension {args.codebook_dim}"
    if args.dataset == "mnist":
        name, content = (
            "MNIST",
            (
                f"on MNIST padded to 32x32, values in [-1, 1]. Downsample 4 gives an 8x8 grid = 64 tokens per image, "
                f"raster order; {codes}."
            ),
        )
        where = "on the original 28x28 pixels (padding excluded)"
    else:
        what = {
            "textures": "64x64 greyscale textile crops (`mmspec.data.textures`)",
            "natural": "32x32 greyscale crops of natural images at two scales (`mmspec.data.natural`)",
        }
        name, content = (
            {"textures": "Texture", "natural": "Natural-image"}[args.dataset],
            (
                f"on {what[args.dataset]}, values in [-1, 1]. Downsample "
                f"{model.downsample_factor} gives a {side}x{side} grid = {side * side} tokens per crop, raster order; "
                f"{codes}."
            ),
        )
        where = "on all pixels"
    write_model_card(
        args.out,
        title=f"{name} VQ tokenizer (LlamaGen VQ architecture, {side}x{side} tokens, {args.codebook_size} codes)",
        description=(
            "LlamaGen VQ architecture (`mmspec.models.llamagen.vq.LlamaGenVQ`, official parameter names) trained from scratch "
            f"{content} Losses: L1 + L2 reconstruction, "
            f"codebook + {args.beta} x commitment{' + entropy' if args.entropy_weight else ''}, dead-code restarts "
            f"(no perceptual or GAN loss). Reconstruction metrics are {where} "
            f"on the [0, 1] scale; `{args.eval_split}_*` on the {name} {args.eval_split} split "
            f"({len(test_images)} images), `train_*` on the first 2k training images."
        ),
        model=saved,
        data=data_note(args.dataset, args.data),
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(
            result, (f"{args.eval_split}_", metrics), ("train_", train_metrics), train_prefix="final_"
        ),
        extra={
            "token_grid": f"{side}x{side} ({side * side} tokens, raster order)",
            "dead_code_restarts": usage.restarts,
        },
        images={GRID_IMAGE: f"{name} {args.eval_split} images (odd rows) and their VQ reconstructions (even rows)"},
        history=result.history,
    )
