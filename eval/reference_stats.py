"""Feature statistics (mean, covariance) for Frechet distances, in the ADM `.npz` layout.

ADM's evaluator (openai/guided-diffusion `evaluations/evaluator.py`, `read_statistics`) reads the keys `mu` and
`sigma` of a reference batch such as `VIRTUAL_imagenet256_labeled.npz` (which also holds `arr_0`, the reference
images as uint8 [N, H, W, 3], and the spatial statistics `mu_s`, `sigma_s`). clean-fid and torch-fidelity caches use
the same two keys. We write `mu` (float64 [d]) and `sigma` (float64 [d, d]), plus `num_samples` and `protocol` (a
JSON string) that other readers ignore; we read any file with `mu` and `sigma`, and an ADM batch with only `arr_0`
through `reference_stats_from_images(adm_batch_to_tensor(np.load(path)["arr_0"]), extractor)`.

Examples:
    >>> stats = reference_stats_from_images(real_images, FIDInceptionV3())
    >>> save_reference_stats("mnist_test_inception.npz", stats)
    >>> stats = load_reference_stats("VIRTUAL_imagenet256_labeled.npz")
"""

import json
import logging
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


logger = logging.getLogger(__name__)


@dataclass
class ReferenceStats:
    """Mean `mu` [d] and covariance `sigma` [d, d] (float64) of features of `num_samples` images."""

    mu: np.ndarray
    sigma: np.ndarray
    num_samples: int | None = None
    protocol: dict = field(default_factory=dict)

    def __post_init__(self):
        self.mu, self.sigma = check_stats(self.mu, self.sigma, "mu", "sigma")

    @property
    def feature_dim(self) -> int:
        return self.mu.shape[0]


def check_stats(mu, sigma, mu_name: str = "mu", sigma_name: str = "sigma") -> tuple[np.ndarray, np.ndarray]:
    """Validate and convert a (mean [d], covariance [d, d]) pair to float64 arrays."""
    try:
        mu, sigma = np.asarray(mu, dtype=np.float64), np.asarray(sigma, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{mu_name} and {sigma_name} must be numeric arrays: {err}") from err
    if mu.ndim != 1 or mu.shape[0] == 0:
        raise ValueError(f"{mu_name} must have shape [d] with d >= 1, got {mu.shape}")
    if sigma.shape != (mu.shape[0], mu.shape[0]):
        raise ValueError(
            f"{sigma_name} must have shape [d, d] = {(mu.shape[0],) * 2} to match {mu_name}, got {sigma.shape}"
        )
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise ValueError(f"{mu_name} and {sigma_name} must be finite")
    return mu, sigma


def feature_statistics(features) -> tuple[np.ndarray, np.ndarray]:
    """Features [N, d] (N >= 2) -> (mean [d], unbiased covariance [d, d]) in float64, as ADM / pytorch-fid."""
    feats = features.detach().cpu().double().numpy() if isinstance(features, torch.Tensor) else np.asarray(features)
    if feats.ndim != 2:
        raise ValueError(f"features must have shape [N, d], got {feats.shape}")
    if feats.shape[0] < 2:
        raise ValueError(f"features need at least 2 samples for a covariance, got {feats.shape[0]}")
    feats = feats.astype(np.float64, copy=False)
    return feats.mean(axis=0), np.cov(feats, rowvar=False)


def _batches(images, batch_size: int):
    if isinstance(images, torch.Tensor):
        if images.dim() != 4:
            raise ValueError(f"images must have shape [N, C, H, W], got {tuple(images.shape)}")
        yield from images.split(batch_size)
    elif isinstance(images, Iterable) and not isinstance(images, (str, bytes, np.ndarray)):
        for i, batch in enumerate(images):
            if not isinstance(batch, torch.Tensor):
                raise TypeError(f"images batch {i} must be a torch.Tensor [B, C, H, W], got {type(batch).__name__}")
            yield batch
    else:
        raise TypeError(
            "images must be a torch.Tensor [N, C, H, W] or an iterable of such batches "
            f"(convert ADM uint8 NHWC arrays with adm_batch_to_tensor), got {type(images).__name__}"
        )


def extract_features(images, extractor: torch.nn.Module, batch_size: int = 50) -> np.ndarray:
    """Run `extractor` over images (a tensor [N, C, H, W] or an iterable of batches) -> float64 features [N, d]."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    expected = getattr(extractor, "num_features", None)
    out = []
    with torch.no_grad():
        for batch in _batches(images, batch_size):
            feats = extractor(batch)
            if feats.dim() != 2 or feats.shape[0] != batch.shape[0] or (expected and feats.shape[1] != expected):
                raise ValueError(
                    f"extractor returned features of shape {tuple(feats.shape)} for a batch of {batch.shape[0]} "
                    f"(expected [B, {expected or 'd'}])"
                )
            out.append(feats.detach().cpu().double().numpy())
    if not out:
        raise ValueError("images is empty")
    return np.concatenate(out)


def reference_stats_from_images(images, extractor: torch.nn.Module, batch_size: int = 50) -> ReferenceStats:
    """Statistics of `extractor` features of images; the extractor's `protocol()` (if any) is recorded."""
    feats = extract_features(images, extractor, batch_size)
    mu, sigma = feature_statistics(feats)
    protocol = extractor.protocol() if hasattr(extractor, "protocol") else {}
    return ReferenceStats(mu, sigma, num_samples=len(feats), protocol=protocol)


def adm_batch_to_tensor(array: np.ndarray) -> torch.Tensor:
    """ADM sample/reference batch `arr_0` (uint8 [N, H, W, 3 or 1]) -> uint8 tensor [N, C, H, W]."""
    array = np.asarray(array)
    if array.dtype != np.uint8:
        raise TypeError(f"array must be uint8 (ADM batches are uint8 [N, H, W, 3]), got {array.dtype}")
    if array.ndim != 4 or array.shape[-1] not in (1, 3):
        raise ValueError(f"array must have shape [N, H, W, 3] (or [..., 1]), got {array.shape}")
    return torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2)


STORED_DTYPES = ("float16", "float32", "float64")


def save_reference_stats(
    path: str | Path, stats: ReferenceStats, dtype: str = "float64", packed: bool = False
) -> Path:
    """Write `stats` as an ADM-style `.npz` (`mu`, `sigma`, plus `num_samples` and `protocol` JSON).

    `dtype="float32"` halves the file, `"float16"` quarters it (the covariance only: `mu` stays float32; readers
    compute in float64 either way); the stored
    dtype is recorded in the protocol. float16 keeps about 3 significant digits of every entry: on the shipped MNIST
    Inception statistics it moves an FID by at most a few thousandths (measured in `docs/evaluation.md`).
    `packed=True` stores a symmetric `sigma` as its upper triangle `sigma_triu` (exact, half the bytes; read back by
    `load_reference_stats`, not by ADM's own tools).
    """
    if not isinstance(stats, ReferenceStats):
        raise TypeError(f"stats must be a ReferenceStats, got {type(stats).__name__}")
    if dtype not in STORED_DTYPES:
        raise ValueError(f"dtype must be one of {STORED_DTYPES}, got {dtype!r}")
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"path must end in .npz, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {}
    if stats.num_samples is not None:
        extra["num_samples"] = np.int64(stats.num_samples)
    protocol = stats.protocol | ({"stored_dtype": dtype} if dtype != "float64" else {})
    sigma = stats.sigma.astype(dtype)
    if packed and np.array_equal(sigma, sigma.T):  # its upper triangle holds it exactly, in half the bytes
        extra["sigma_triu"] = sigma[np.triu_indices(sigma.shape[0])]
    else:
        extra["sigma"] = sigma
    mu = stats.mu.astype("float32" if dtype == "float16" else dtype)  # the mean is small: never below float32
    np.savez(path, mu=mu, protocol=np.str_(json.dumps(protocol)), **extra)
    logger.info("saved reference statistics (d=%d, n=%s) to %s", stats.feature_dim, stats.num_samples, path)
    return path


def unpack_symmetric(triu: np.ndarray, dim: int) -> np.ndarray:
    """The symmetric `[dim, dim]` matrix whose upper triangle (row-major, `np.triu_indices(dim)`) is `triu`."""
    if triu.ndim != 1 or triu.shape[0] != dim * (dim + 1) // 2:
        raise ValueError(
            f"sigma_triu has shape {triu.shape}, expected ({dim * (dim + 1) // 2},) for mu of length {dim}"
        )
    sigma = np.zeros((dim, dim), dtype=triu.dtype)
    sigma[np.triu_indices(dim)] = triu
    return sigma + np.triu(sigma, 1).T


def load_reference_stats(path: str | Path) -> ReferenceStats:
    """Read `mu` and `sigma` from an `.npz` (ours, ADM's reference batches, clean-fid / torch-fidelity caches)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference statistics file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = set(data.files)
            if "mu" not in keys or not keys & {"sigma", "sigma_triu"}:
                hint = " (an ADM batch without statistics: use reference_stats_from_images)" if "arr_0" in keys else ""
                raise ValueError(f"{path} has keys {sorted(keys)}, expected 'mu' and 'sigma'{hint}")
            mu = data["mu"]
            sigma = data["sigma"] if "sigma" in keys else unpack_symmetric(data["sigma_triu"], mu.shape[-1])
            num = int(data["num_samples"]) if "num_samples" in keys else None
            protocol = json.loads(str(data["protocol"])) if "protocol" in keys else {}
    except (zipfile.BadZipFile, OSError, EOFError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a readable statistics .npz: {err}") from err
    except ValueError as err:
        if "expected 'mu' and 'sigma'" in str(err):
            raise
        raise ValueError(f"{path} is not a readable statistics .npz: {err}") from err
    try:
        return ReferenceStats(mu, sigma, num_samples=num, protocol=protocol)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: bad statistics: {err}") from err


def _chunk_problem(path: Path, expected: dict) -> str | None:
    """None if the chunk at `path` holds the features `expected` describes, else why not."""
    from mmspec.eval.fingerprint import array_hash, decode, describe, diff_fields

    try:
        with np.load(path, allow_pickle=False) as data:
            feats, stored, content = data["features"], decode(data["fingerprint"]), str(data["content"])
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError) as err:
        return f"is unreadable or truncated ({type(err).__name__}: {err})"
    fields = diff_fields(stored, expected)
    if fields:
        return f"was made by another feature net or from other images: {describe(stored, expected, fields)}"
    if feats.ndim != 2 or feats.shape[0] != expected["stop"] - expected["start"] or content != array_hash(feats):
        return "does not match its checksum (features changed after writing)"
    return None


def chunked_features(images: torch.Tensor, extractor, work_dir: Path, chunk_size: int = 500, batch_size: int = 50,
                     progress: bool = True) -> np.ndarray:  # fmt: skip
    """Features [N, d] of `images` [N, C, H, W], one `.npz` per chunk in `work_dir` (kept; a rerun reuses them).

    Each chunk stores its fingerprint (the extractor's protocol and weights hash, its image range and a hash of its
    input images) and a checksum of its features; a chunk that does not match (made by another feature net or from
    other images, truncated, edited) is recomputed with a warning naming the file and the differing fields."""
    from tqdm.auto import tqdm

    from mmspec.eval.fingerprint import array_hash, encode, weights_hash

    work_dir.mkdir(parents=True, exist_ok=True)
    protocol = extractor.protocol() if hasattr(extractor, "protocol") else type(extractor).__name__
    base = {"format": 1, "protocol": protocol, "weights": weights_hash(extractor), "num_images": int(images.shape[0])}
    out = []
    starts = range(0, images.shape[0], chunk_size)
    for start in tqdm(starts, desc="feature chunks", unit="chunk", disable=not progress):
        chunk = images[start : start + chunk_size]
        path = work_dir / f"chunk-{start // chunk_size:05d}.npz"
        expected = base | {"start": start, "stop": start + len(chunk), "images": array_hash(chunk)}
        if path.is_file():
            problem = _chunk_problem(path, expected)
            if problem is None:
                with np.load(path, allow_pickle=False) as data:
                    out.append(data["features"])
                continue
            logger.warning("%s %s: recomputing it", path, problem)
        feats = extract_features(chunk, extractor, batch_size)
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, features=feats, fingerprint=encode(expected), content=np.str_(array_hash(feats)))
        os.replace(tmp, path)  # atomic: a killed run never leaves a partial chunk
        out.append(feats)
    return np.concatenate(out)
