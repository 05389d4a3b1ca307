"""Train the MNIST KL autoencoder (continuous tokens): `python -m mmspec.train kl --out assets/mnist-kl`.

MAR's KL-VAE architecture (mmspec.models.mar.kl_vae.AutoencoderKL, official parameter names) at MNIST scale: 32x32 images,
`ch_mult` (1, 2, 2) -> downsample 4 -> 8x8 = 64 tokens of dimension `--embed-dim` (4), no attention outside the middle
blocks. Loss = L1 + L2 reconstruction of a posterior sample's decoding (means over pixels, as the VQ task) +
`--kl-weight` x KL(posterior || N(0, I)) per latent element; no perceptual/GAN losses (no pretrained networks
offline). Every posterior sample takes the task's seeded generator.

After training, `scale_factor` = 1 / std of posterior samples of `--scale-images` training images (MAR's 0.2325 for
kl16 plays the same role) is stored in the config, so tokens (`encode_tokens`) have unit variance. The model card
records test-set reconstruction MSE/PSNR (posterior means; original 28x28 pixels, [0, 1] scale), the mean posterior
std (also in token units), the zoo classifier's accuracy on `--classifier-images` test reconstructions (from the
posterior mean and from a posterior sample) next to its accuracy on the originals, and a reconstruction grid image.
"""

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.cli.args import non_negative_float
from mmspec.data.mnist import MNIST_PAD, load_mnist
from mmspec.models.mar.kl_vae import AutoencoderKL
from mmspec.train.common import (
    add_common_arguments,
    add_mnist_data_argument,
    card_metrics,
    configure_threads,
    declare_paths,
    mnist_data_note,
    mnist_splits,
    not_run_defining,
    random_batch_indices,
    save_model,
    seed_everything,
    size_int,
    train_and_save,
    write_model_card,
    zoo_folder,
)
from mmspec.train.vq import add_autoencoder_arguments, psnr_from_mse


logger = logging.getLogger(__name__)

GRID_IMAGE = "reconstructions.png"


def add_arguments(parser):
    add_common_arguments(parser, steps=1100, batch_size=32, lr=1e-3, warmup_steps=100, checkpoint_every=100, threads=1)
    add_mnist_data_argument(parser)
    add_autoencoder_arguments(parser, ch_mult=[1, 2, 2])
    parser.add_argument("--embed-dim", type=size_int, default=4, help="latent channels = token dimension")
    parser.add_argument("--num-groups", type=size_int, default=8, help="GroupNorm groups")
    parser.add_argument(
        "--kl-weight", type=non_negative_float, default=1e-3, help="weight of the per-element KL next to L1 + L2"
    )
    parser.add_argument(
        "--scale-images", type=size_int, default=10000, help="training images whose latents set scale_factor"
    )
    parser.add_argument("--eval-split", type=mnist_splits, default="test")
    parser.add_argument(
        "--eval-images", type=size_int, default=10000, help="first images of the eval split to reconstruct"
    )
    parser.add_argument("--classifier", default=zoo_folder("mnist-classifier"), help="classifier for the evaluation")
    declare_paths(parser, model_folders=("classifier",))
    parser.add_argument(
        "--classifier-images", type=size_int, default=1000, help="eval images classified after reconstruction"
    )
    not_run_defining(parser, "scale_images", "eval_split", "eval_images", "classifier", "classifier_images")


@torch.no_grad()
def latent_std(model: AutoencoderKL, images: torch.Tensor, generator: torch.Generator, batch_size: int = 500) -> float:
    """Std of posterior samples (all elements of [N, D, h, w] pooled) of `images` [N, C, H, W] in [-1, 1]."""
    model.eval()
    samples = torch.cat([model.encode(x).sample(generator) for x in images.split(batch_size)])
    return float(samples.std())


@torch.no_grad()
def evaluate_kl(model: AutoencoderKL, images: torch.Tensor, batch_size: int = 500) -> dict:
    """Reconstruction and posterior metrics of `model` on `images` [N, 1, 32, 32] in [-1, 1].

    Reconstructions decode the posterior mean (clamped to [-1, 1]); MSE/PSNR are measured on the original 28x28 pixels
    (padding excluded) on the [0, 1] scale: `mse`, `psnr_db`. Posterior: `posterior_std` (mean sigma over latent
    elements), `posterior_std_tokens` (the same times `scale_factor`, i.e. relative to the tokens' unit std),
    `kl_per_element` (mean KL to N(0, I) per latent element).
    """
    model.eval()
    crop = slice(MNIST_PAD, images.shape[-1] - MNIST_PAD)
    sq_err, sigma, kl = [], [], []
    for x in images.split(batch_size):
        posterior = model.encode(x)
        recon = model.decode(posterior.mode()).clamp(-1.0, 1.0)
        sq_err.append(((recon - x)[..., crop, crop] / 2).pow(2).flatten(1).mean(1))  # [0, 1] scale
        sigma.append(posterior.std.flatten(1).mean(1))
        kl.append(posterior.kl() / posterior.mean[0].numel())
    mse, std = float(torch.cat(sq_err).mean()), float(torch.cat(sigma).mean())
    return {
        "mse": mse,
        "psnr_db": psnr_from_mse(mse),
        "posterior_std": std,
        "posterior_std_tokens": std * model.config.scale_factor,
        "kl_per_element": float(torch.cat(kl).mean()),
    }


@torch.no_grad()
def classifier_accuracy(model, classifier, images, labels, generator, batch_size=500) -> dict:
    """Zoo-classifier accuracy on `images`, on their token round trip (posterior mean) and on a posterior sample."""
    model.eval()
    recon_mean, recon_sample = [], []
    for x in images.split(batch_size):
        recon_mean.append(model.decode_tokens(model.encode_tokens(x)).clamp(-1.0, 1.0))
        recon_sample.append(model.decode_tokens(model.encode_tokens(x, generator)).clamp(-1.0, 1.0))

    def accuracy(batch):
        return float((classifier.predict(batch) == labels).float().mean())

    return {
        "classifier_acc_original": accuracy(images),
        "classifier_acc_recon": accuracy(torch.cat(recon_mean)),
        "classifier_acc_recon_sample": accuracy(torch.cat(recon_sample)),
    }


@torch.no_grad()
def save_reconstruction_grid(model: AutoencoderKL, images: torch.Tensor, path, per_row: int = 16, scale: int = 2):
    """Save a PNG with rows alternating originals / reconstructions (`len(images)` a multiple of `per_row`)."""
    from PIL import Image

    from mmspec.eval.images import make_grid

    recon = model.decode_tokens(model.encode_tokens(images)).clamp(-1.0, 1.0)
    rows = []
    for i in range(0, len(images), per_row):
        rows += [images[i : i + per_row], recon[i : i + per_row]]
    pixels = ((torch.cat(rows)[:, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    grid = make_grid([Image.fromarray(p, mode="L") for p in pixels], ncols=per_row)
    grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST).save(path)
    return path


def run(args):
    from mmspec.models import load

    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    images, _ = load_mnist(args.data)
    logger.info("training KL autoencoder on MNIST %s: %s", args.data, tuple(images.shape))
    model = AutoencoderKL(
        in_channels=1,
        out_channels=1,
        ch=args.ch,
        ch_mult=tuple(args.ch_mult),
        num_res_blocks=args.num_res_blocks,
        attn_resolutions=(),
        decoder_attn_resolutions=(),
        resolution=images.shape[-1],
        embed_dim=args.embed_dim,
        num_groups=args.num_groups,
        scale_factor=1.0,  # set from the trained latents below
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    def step_fn(step):
        x = images[random_batch_indices(len(images), args.batch_size, generator)]
        out = model(x, generator)
        l1 = F.l1_loss(out.reconstruction, x)
        l2 = F.mse_loss(out.reconstruction, x)
        kl = out.posterior.kl().mean() / out.latents[0].numel()  # per latent element
        loss = l1 + l2 + args.kl_weight * kl
        return {"loss": loss, "l1": l1, "l2": l2, "kl": kl, "posterior_std": out.posterior.std.mean()}

    result, saved = train_and_save(model, optimizer, step_fn, args, generator)

    # tokens of unit variance: scale_factor = 1 / std of posterior samples (of the saved, possibly float16, weights)
    std = latent_std(saved, images[: args.scale_images], generator)
    saved.register_to_config(scale_factor=1.0 / std)
    save_model(saved, args.out, storage=args.storage)
    saved = load(args.out)
    logger.info("latent std %.4g -> scale_factor %.4g", std, saved.config.scale_factor)

    test_images, test_labels = load_mnist(args.eval_split)
    test_images, test_labels = test_images[: args.eval_images], test_labels[: args.eval_images]
    metrics = evaluate_kl(saved, test_images)
    n = args.classifier_images
    classifier = load(args.classifier)
    accuracy = classifier_accuracy(saved, classifier, test_images[:n], test_labels[:n], generator)
    save_reconstruction_grid(saved, test_images[:32], Path(args.out) / GRID_IMAGE)
    logger.info("%s metrics: %s %s", args.eval_split, metrics, accuracy)
    h, w = saved.token_grid
    write_model_card(
        args.out,
        title=f"MNIST KL autoencoder (MAR KL-VAE architecture, {h}x{w} continuous tokens of dimension "
        f"{args.embed_dim})",
        description=(
            "MAR / LDM KL-VAE architecture (`mmspec.models.mar.kl_vae.AutoencoderKL`, official parameter names) trained "
            "from scratch on MNIST padded to 32x32, values in [-1, 1]. Downsample "
            f"{saved.downsample_factor} gives {h}x{w} = {h * w} continuous tokens of dimension "
            f"{args.embed_dim} per image (`encode_tokens`: posterior mean or sample x scale_factor, raster order, "
            f"channels last). Loss: L1 + L2 reconstruction of a posterior sample + {args.kl_weight:g} x KL per latent "
            "element (no perceptual or GAN loss). `scale_factor` = 1 / std of posterior samples of the first "
            f"{min(args.scale_images, len(images))} training images. Reconstruction metrics decode the posterior mean "
            "and are on the original 28x28 pixels (padding excluded) on the [0, 1] scale, on the first "
            f"{len(test_images)} images of the MNIST {args.eval_split} split; classifier accuracies "
            f"(`{args.classifier}`) on its first {n} images."
        ),
        model=saved,
        data=mnist_data_note(args.data),
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=card_metrics(
            result, (f"{args.eval_split}_", metrics), (f"{args.eval_split}_", accuracy), train_prefix="final_"
        ),  # fmt: skip
        extra={
            "token_grid": f"{h}x{w} ({h * w} tokens of dimension {args.embed_dim}, raster order)",
            "latent_std": std,
            "scale_factor": saved.config.scale_factor,
        },
        images={GRID_IMAGE: f"MNIST {args.eval_split} images (odd rows) and their reconstructions (even rows)"},
        history=result.history,
    )
