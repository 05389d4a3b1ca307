"""Draft-side vision-token policies: which of a VLM target's projected image embeddings the draft keeps, each at the
target's position (ViSpec: Kang et al., NeurIPS 2025; SpecVLM: arXiv 2509.11815; MSD: arXiv 2505.14260). They only
touch the draft side, so decoding stays lossless.

`build_policy(name, dim, tokens_per_image, **kwargs)` makes one by name (`POLICIES`); `default_experts` is SpecVLM's
expert set for `Elastic`.
"""

import inspect

import torch

from mmspec.compressors.base import VisionPolicy, VisionTokens, gather_images
from mmspec.compressors.conv import Conv
from mmspec.compressors.elastic import Elastic
from mmspec.compressors.passthrough import Passthrough
from mmspec.compressors.pool import Pool
from mmspec.compressors.prune import Prune
from mmspec.compressors.resampler import Resampler
from mmspec.compressors.text_only import TextOnly


__all__ = [
    "POLICIES",
    "Conv",
    "Elastic",
    "Passthrough",
    "Pool",
    "Prune",
    "Resampler",
    "TextOnly",
    "VisionPolicy",
    "VisionTokens",
    "build_policy",
    "default_experts",
    "gather_images",
]

POLICIES: dict[str, type[VisionPolicy]] = {
    "passthrough": Passthrough,
    "text-only": TextOnly,
    "prune": Prune,
    "pool": Pool,
    "conv": Conv,
    "resampler": Resampler,
    "elastic": Elastic,
}


def _default_heads(dim: int) -> int:
    """Heads of 64 channels where they fit (SmolLM2-135M: 576 = 9 x 64), else the largest of 8, 4, 2, 1 dividing dim."""
    return next(h for h in (dim // 64, 8, 4, 2, 1) if h >= 1 and dim % h == 0)


def default_experts(
    dim: int, tokens_per_image: int, ratio: int = 4, num_queries: int = 2, generator: torch.Generator | None = None
) -> dict[str, VisionPolicy]:
    """SpecVLM's expert set: prune / pool / conv at `ratio`, a `num_queries` resampler (initial weights drawn with
    `generator`), and text-only."""
    return {
        "prune": Prune(ratio, tokens_per_image=tokens_per_image, dim=dim),
        "pool": Pool(ratio, tokens_per_image=tokens_per_image, dim=dim),
        "conv": Conv(ratio, tokens_per_image=tokens_per_image, dim=dim),
        "resampler": Resampler(
            num_queries, _default_heads(dim), tokens_per_image=tokens_per_image, dim=dim, generator=generator
        ),
        "text-only": TextOnly(tokens_per_image=tokens_per_image, dim=dim),
    }


def build_policy(name: str, dim: int, tokens_per_image: int = 64, **kwargs) -> VisionPolicy:
    """A policy by name (`POLICIES`), e.g. `build_policy("pool", 576, 64, ratio=4)`. `"resampler"` defaults to
    64-channel heads; `"elastic"` defaults to `default_experts(dim, tokens_per_image)`. ValueError naming an unknown
    `name` or keyword."""
    if name not in POLICIES:
        raise ValueError(f"name: unknown vision policy {name!r}; known: {', '.join(POLICIES)}")
    cls = POLICIES[name]
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self", "dim", "tokens_per_image"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"{unknown[0]}: not an argument of vision policy {name!r}; it takes {sorted(allowed)}")
    if name == "elastic":
        experts = kwargs.pop("experts", None)
        if experts is None:
            experts = default_experts(dim, tokens_per_image, generator=kwargs.get("generator"))
        policy = Elastic(experts, dim, **kwargs)
        if policy.tokens_per_image != tokens_per_image:
            raise ValueError(f"experts use tokens_per_image={policy.tokens_per_image}, not {tokens_per_image}")
        return policy
    if name == "resampler":
        kwargs.setdefault("num_heads", _default_heads(dim))
    return cls(tokens_per_image=tokens_per_image, dim=dim, **kwargs)
