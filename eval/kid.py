"""Kernel Inception Distance (Binkowski et al. 2018, "Demystifying MMD GANs"): the unbiased MMD^2 between real and
generated features under the cubic polynomial kernel k(x, y) = (x.y / d + 1)^3, averaged over random subsets.

The kernel and the MMD estimator are torchmetrics' own (`torchmetrics.image.kid.poly_mmd`); the subset draw follows
`KernelInceptionDistance.compute` (per subset: a permutation of the real features, then one of the fake features,
first `subset_size` of each) but from an explicit `torch.Generator` instead of the global RNG, so given the same
seed the value equals torchmetrics' after `torch.manual_seed(seed)` (tested). Unlike FID, KID needs the real
features themselves, not only their mean and covariance: a statistics-only `.npz` cannot give it.

Examples:
    >>> result = kernel_inception_distance(real_feats, fake_feats, num_subsets=100, subset_size=1000)
    >>> result["kid_mean"], result["kid_std"]
"""

import logging

import numpy as np
import torch


logger = logging.getLogger(__name__)


def _features(name, value) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or array [N, d], got {type(value).__name__}")
    if value.dim() != 2 or value.shape[0] < 2:
        raise ValueError(f"{name} must have shape [N, d] with N >= 2, got {tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be floating point features, got dtype {value.dtype}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{name} has non-finite values")
    return value.double()


def kernel_inception_distance(
    real_features,
    fake_features,
    num_subsets: int = 100,
    subset_size: int = 1000,
    degree: int = 3,
    gamma: float | None = None,
    coef: float = 1.0,
    generator: torch.Generator | None = None,
) -> dict:
    """KID of `fake_features` [N_fake, d] against `real_features` [N_real, d] (any feature net).

    Args:
        num_subsets, subset_size: subsets averaged (torchmetrics' defaults: 100 of 1000); `subset_size` larger
            than either set is reduced to the smaller set's size (recorded as `subset_size` in the result).
        degree, gamma, coef: polynomial kernel (gamma None = 1 / d).
        generator: draws the subsets (default: a CPU generator seeded 0, so the value is reproducible).

    Returns:
        {"kid_mean", "kid_std" (population std over subsets), "num_subsets", "subset_size", "num_real", "num_fake", "kernel"}.
    """
    from torchmetrics.image.kid import poly_mmd

    real = _features("real_features", real_features)
    fake = _features("fake_features", fake_features)
    if real.shape[1] != fake.shape[1]:
        raise ValueError(f"feature dimensions differ: real_features {real.shape[1]}, fake_features {fake.shape[1]}")
    for name, value in (("num_subsets", num_subsets), ("subset_size", subset_size), ("degree", degree)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if subset_size < 2:
        raise ValueError(f"subset_size must be >= 2 (the estimator divides by m (m - 1)), got {subset_size}")
    size = min(subset_size, real.shape[0], fake.shape[0])
    if size < subset_size:
        logger.info("KID subset_size %d > available samples: using %d", subset_size, size)
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    values = []
    for _ in range(num_subsets):
        real_idx = torch.randperm(real.shape[0], generator=generator)[:size]
        fake_idx = torch.randperm(fake.shape[0], generator=generator)[:size]
        values.append(poly_mmd(real[real_idx.to(real.device)], fake[fake_idx.to(fake.device)], degree, gamma, coef))
    kid = torch.stack(values)
    return {
        "kid_mean": float(kid.mean()),
        "kid_std": float(kid.std(unbiased=False)),  # population std over subsets, as torchmetrics
        "num_subsets": num_subsets,
        "subset_size": size,
        "num_real": int(real.shape[0]),
        "num_fake": int(fake.shape[0]),
        "kernel": f"(x.y * {gamma if gamma is not None else '1/d'} + {coef})^{degree}; unbiased MMD^2 (torchmetrics)",
    }
