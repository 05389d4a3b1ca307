"""Train the MNIST classifier: `python -m mmspec.train classifier --out assets/mnist-classifier`.

`mmspec.models.classifier.MNISTClassifier` on MNIST padded to 32x32 in [-1, 1] (the model center-crops to 28x28),
cross-entropy with label smoothing and random +-2 px translations (drawn from the run's generator). The card records
test accuracy (and validation accuracy when trained on "train" only); the penultimate features are the in-domain
feature space for FID-like evaluation.
"""

import logging

import torch
import torch.nn.functional as F

from mmspec.cli.args import probability
from mmspec.data.mnist import load_mnist
from mmspec.models.classifier import MNISTClassifier
from mmspec.train.common import (
    add_common_arguments,
    add_mnist_data_argument,
    card_metrics,
    configure_threads,
    count_int,
    mnist_data_note,
    random_batch_indices,
    seed_everything,
    size_int,
    train_and_save,
    write_model_card,
)


logger = logging.getLogger(__name__)


def add_arguments(parser):
    add_common_arguments(parser, steps=3000, batch_size=64, lr=2e-3, warmup_steps=100, checkpoint_every=500, threads=1)
    add_mnist_data_argument(parser)
    parser.add_argument("--feature-dim", type=size_int, default=128)
    parser.add_argument("--max-shift", type=count_int, default=2, help="random translation in pixels (0: off)")
    parser.add_argument("--label-smoothing", type=probability, default=0.05)


def random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by an integer offset in [-max_shift, max_shift]^2, filling with background (-1)."""
    if max_shift <= 0:
        return images
    b, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4, value=-1.0)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, b), generator=generator)
    rows = (dy[:, None] + torch.arange(h)[None])[:, None, :, None].expand(b, 1, h, w + 2 * max_shift)
    out = padded.gather(2, rows)
    cols = (dx[:, None] + torch.arange(w)[None])[:, None, None, :].expand(b, 1, h, w)
    return out.gather(3, cols)


@torch.no_grad()
def accuracy(model: MNISTClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy (fraction) of `model` on `images`."""
    model.eval()
    return float((model.predict(images) == labels).float().mean())


def run(args):
    configure_threads(args.threads)
    generator = seed_everything(args.seed)
    images, labels = load_mnist(args.data)
    logger.info("training classifier on MNIST %s: %s", args.data, tuple(images.shape))
    model = MNISTClassifier(feature_dim=args.feature_dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def step_fn(step):
        idx = random_batch_indices(len(images), args.batch_size, generator)
        x = random_shift(images[idx], args.max_shift, generator)
        logits = model(x)
        loss = F.cross_entropy(logits, labels[idx], label_smoothing=args.label_smoothing)
        return {"loss": loss, "acc": (logits.argmax(-1) == labels[idx]).float().mean()}

    result, saved = train_and_save(model, optimizer, step_fn, args, generator, min_lr_ratio=0.02)
    metrics = card_metrics(result)
    test_images, test_labels = load_mnist("test")
    metrics["test_accuracy"] = accuracy(saved, test_images, test_labels)
    if "val" not in args.data.split("+"):
        metrics["val_accuracy"] = accuracy(saved, *load_mnist("val"))
    logger.info("metrics: %s", metrics)
    write_model_card(
        args.out,
        title="MNIST classifier (small CNN; accuracy + in-domain features)",
        description=(
            "`mmspec.models.classifier.MNISTClassifier`: two conv stages (32, 64 channels) + a "
            f"{args.feature_dim}-d ReLU feature layer + linear head, trained from scratch with label smoothing "
            f"{args.label_smoothing} and random +-{args.max_shift} px shifts. Inputs: [B, 1, 32, 32] (or 28x28) "
            "in [-1, 1]; 32x32 inputs are center-cropped to 28x28. `features(x)` (the penultimate layer) is the "
            "feature space for FID-like metrics on MNIST. Accuracies are fractions."
        ),
        model=saved,
        data=mnist_data_note(args.data),
        args=args,
        wall_time_s=result.wall_time_s,
        metrics=metrics,
        history=result.history,
    )
