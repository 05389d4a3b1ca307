"""Logits -> the exact distribution a token is drawn from, and sync-free sampling.

Speculative decoding is lossless only if the target distribution ``p_target`` and the draft distribution
``q_draft`` are the distributions vanilla sampling would draw from, i.e. after the *same* processing:
classifier-free guidance (CFG), temperature, top-k, top-p. `SamplingParams.probs` is that single processing
path; pipelines apply it identically to target and draft logits and hand the results to `mmspec.verify`.

Conventions
-----------
* CFG follows LlamaGen / Lumina-mGPT / MAR: ``logits = uncond + s * (cond - uncond)``. With the stacked batch
  layout ``[cond rows; uncond rows]`` (first half cond, second half uncond) use `cfg_combine_stacked`.
* Probabilities are computed in float32 whatever the input dtype (bf16/fp16 logits are upcast); float64 inputs
  stay float64 so that exactness tests can run in double precision.
* Greedy decoding (``do_sample=False`` or ``temperature == 0``) is the one-hot distribution at the argmax, so
  greedy and sampled decoding share one code path (a one-hot ``q_draft`` is a point-mass draft).
* Every random draw takes an explicit ``torch.Generator``; nothing here touches the global RNG.

Knobs (`SamplingParams`, `logits_to_probs`): a knob of the wrong type is a ``TypeError`` naming it (bools are not
numbers, ``top_k`` must be an int), a value out of range a ``ValueError`` naming it:

* ``guidance_scale``: in [0, ``GUIDANCE_MAX``]. 1 = no guidance (conditional logits), 0 = the unconditional logits
  exactly, > 1 the usual CFG; negative scales (anti-guidance) are rejected.
* ``temperature``: 0 (greedy) or in ``TEMPERATURE_RANGE`` (``inf`` is rejected rather than read as "uniform").
* ``top_k``: None or an int in [1, ``TOP_K_MAX``]; ``top_p``: None or a number in (0, 1]; ``do_sample``: a bool.

The bounds keep the knobs where float32 holds ordinary logits (a temperature of 1e-40 or a guidance scale of 1e30 turn
them into inf; far inside the bounds, real samplers use temperatures of 0.1-2 and guidance scales of 1-10): the CLI
checks them by these same rules before any model loads. Extreme logits can still overflow, which would silently turn
every probability into NaN. ``logits_to_probs(..., validate=True)`` therefore checks its *output*
(one host sync; NaN logits are caught by the same check) and raises a ``ValueError`` naming the knobs involved.
Hot loops run with ``validate=False`` and keep a device-side `finite_flag` per distribution instead, checked once
with `check_probs_finite`. Greedy one-hot distributions carry NaN when their row's maximum is not finite, so the same
check covers them.
"""

import logging
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from mmspec.random import Generators, num_rows, rand


logger = logging.getLogger(__name__)

__all__ = [
    "SamplingParams",
    "cfg_combine",
    "cfg_combine_stacked",
    "check_probs_finite",
    "finite_flag",
    "inverse_cdf",
    "logits_to_probs",
    "prob_dtype",
    "sample",
]


def prob_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype probabilities are computed in: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cfg_combine(logits_cond: Tensor, logits_uncond: Tensor, guidance_scale: float) -> Tensor:
    """Classifier-free guidance in the LlamaGen form ``uncond + s * (cond - uncond)``.

    Args:
        logits_cond: ``[..., V]`` conditional logits.
        logits_uncond: ``[..., V]`` unconditional logits (same shape).
        guidance_scale: ``s``; 1.0 returns the conditional logits, 0.0 the unconditional ones (exactly: masked
            ``-inf`` conditional logits do not turn into ``0 * -inf = NaN``).

    Returns:
        ``[..., V]`` guided logits in the probability dtype (float32 / float64).
    """
    if logits_cond.shape != logits_uncond.shape:
        raise ValueError(
            f"logits_uncond shape {tuple(logits_uncond.shape)} != logits_cond shape {tuple(logits_cond.shape)}"
        )
    dtype = prob_dtype(logits_cond.dtype)
    cond, uncond = logits_cond.to(dtype), logits_uncond.to(dtype)
    if guidance_scale == 1.0:
        return cond
    if guidance_scale == 0.0:
        return uncond
    return uncond + guidance_scale * (cond - uncond)


def cfg_combine_stacked(logits: Tensor, guidance_scale: float) -> Tensor:
    """CFG for the stacked batch layout ``[cond rows; uncond rows]`` along dim 0.

    Args:
        logits: ``[2B, ..., V]``; rows ``[:B]`` are conditional, rows ``[B:]`` unconditional.
        guidance_scale: ``s``.

    Returns:
        ``[B, ..., V]`` guided logits.
    """
    if logits.shape[0] % 2 != 0:
        raise ValueError(f"logits: stacked CFG layout needs an even batch dim, got {logits.shape[0]}")
    cond, uncond = logits.chunk(2, dim=0)
    return cfg_combine(cond, uncond, guidance_scale)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

# the sampling knobs' bounds (also `mmspec.methods.SAMPLING_LIMITS`, which the CLI reads): 0 is greedy; a temperature
# below the range or a guidance scale above it only turns ordinary logits into overflow
TEMPERATURE_RANGE = (1e-4, 1e4)
GUIDANCE_MAX = 1e4
# past the largest vocabulary in use (Gemma: 262k tokens) a top-k is a typo; pipelines also refuse one above their
# model's vocabulary
TOP_K_MAX = 2**20


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _validate_knobs(
    temperature: float, top_k: int | None, top_p: float | None, guidance_scale: float, do_sample: bool = True
) -> tuple[float, int | None, float | None, float, bool]:
    """Check the sampling knobs (see the module docstring); returns them as plain Python float / int / bool."""
    for name, value, optional in (("temperature", temperature, False), ("top_p", top_p, True),
                                  ("guidance_scale", guidance_scale, False)):  # fmt: skip
        if not (_is_real(value) or (optional and value is None)):
            none = " or None" if optional else ""
            raise TypeError(f"{name} must be a real number{none}, got {value!r} ({type(value).__name__})")
    if top_k is not None and not _is_int(top_k):
        raise TypeError(f"top_k must be an int or None, got {top_k!r} ({type(top_k).__name__})")
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {do_sample!r} ({type(do_sample).__name__})")
    temperature, guidance_scale = float(temperature), float(guidance_scale)
    low, high = TEMPERATURE_RANGE
    if not (temperature == 0 or low <= temperature <= high):  # also rejects NaN and inf
        raise ValueError(f"temperature must be 0 (greedy) or in [{low:g}, {high:g}], got {temperature:g}")
    if not 0 <= guidance_scale <= GUIDANCE_MAX:  # also rejects NaN
        raise ValueError(
            f"guidance_scale must be in [0, {GUIDANCE_MAX:g}] (1 = no guidance, 0 = unconditional), got {guidance_scale:g}"
        )
    if top_k is not None:
        top_k = int(top_k)
        if top_k < 1:
            raise ValueError(f"top_k must be an int >= 1 or None, got {top_k}")
        if top_k > TOP_K_MAX:
            raise ValueError(f"top_k must be at most {TOP_K_MAX} (and the model's vocabulary), got {top_k}")
    if top_p is not None:
        top_p = float(top_p)
        if not 0 < top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
    return temperature, top_k, top_p, guidance_scale, do_sample


_FIXES = {"guidance_scale": "a smaller guidance_scale", "temperature": "a larger temperature"}


def _overflow_knobs(guidance_scale: float | None, temperature: float | None) -> dict[str, float]:
    """The knobs in use that can overflow: CFG with a scale other than 0 / 1, a temperature other than 0 / 1."""
    knobs = {"guidance_scale": guidance_scale, "temperature": temperature}
    return {k: v for k, v in knobs.items() if v is not None and v not in (0.0, 1.0)}


def _nonfinite_error(logits, logits_uncond, guidance_scale, temperature, dtype) -> ValueError:
    """Why `logits_to_probs` produced non-finite probabilities (error path only: syncs freely)."""
    if bool(torch.isnan(logits).any()):
        return ValueError("logits contain NaN")
    if logits_uncond is not None and bool(torch.isnan(logits_uncond).any()):
        return ValueError("logits_uncond contain NaN")
    if bool(torch.isposinf(logits).any()) or (logits_uncond is not None and bool(torch.isposinf(logits_uncond).any())):
        return ValueError("logits contain +inf (the sampling distribution would be NaN)")
    knobs = _overflow_knobs(guidance_scale if logits_uncond is not None else None, temperature)
    if not knobs:
        return ValueError("sampling probabilities are not finite: a row of logits is entirely -inf")
    return ValueError(
        f"sampling probabilities are not finite: {', '.join(f'{k}={v:g}' for k, v in knobs.items())} overflow "
        f"{str(dtype).replace('torch.', '')} on these logits (or a row of logits is entirely -inf / -inf in both CFG "
        f"streams); use {' or '.join(_FIXES[k] for k in knobs)}"
    )


def finite_flag(probs: Tensor) -> Tensor:
    """Device-side 0-d bool: every entry of ``probs`` is finite (no host sync; combine flags with ``&``)."""
    return torch.isfinite(probs).all()


def check_probs_finite(probs: Tensor, sampling: "SamplingParams | None" = None, source: str = "sampling") -> None:
    """Raise ``ValueError`` naming the knobs involved unless ``probs`` is finite (one host sync).

    For decoding loops that process logits with ``validate=False``: call it on the first distribution (prefill), and
    at the end on the AND of the device-side `finite_flag` s of every distribution made since.

    Args:
        probs: ``[..., V]`` processed probabilities, or a bool tensor of `finite_flag` s (True = all finite).
        sampling: the `SamplingParams` the distributions were made with (named in the message).
        source: what the distributions are, for the message (e.g. ``"target"``, ``"draft"``).
    """
    ok = probs.all() if probs.dtype == torch.bool else finite_flag(probs)
    if bool(ok):
        return
    knobs = {} if sampling is None else _overflow_knobs(sampling.guidance_scale, sampling.temperature)
    dtype = "float32" if probs.dtype == torch.bool else str(probs.dtype).replace("torch.", "")
    cause = f"{', '.join(f'{k}={v:g}' for k, v in knobs.items())} overflow {dtype}, or " if knobs else ""
    raise ValueError(f"{source} probabilities are not finite: {cause}the model's logits hold NaN / +inf")


def logits_to_probs(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    *,
    logits_uncond: Tensor | None = None,
    guidance_scale: float = 1.0,
    do_sample: bool = True,
    validate: bool = True,
) -> Tensor:
    """Raw logits -> the exact float32 distribution a sample is drawn from.

    Order of operations (as in LlamaGen's ``sample``): CFG -> temperature -> top-k -> top-p -> softmax.
    top-k keeps every token whose logit ties the k-th largest; top-p keeps the smallest prefix of the
    probability-sorted vocabulary whose mass reaches ``top_p`` (at least one token).

    Args:
        logits: ``[..., V]`` (conditional) logits, any float dtype.
        temperature: finite, > 0 divides the logits; 0 means greedy.
        top_k: keep the k most likely tokens (``None`` = off).
        top_p: nucleus mass in (0, 1] (``None`` or 1 = off).
        logits_uncond: ``[..., V]`` unconditional logits for CFG (``None`` = no CFG).
        guidance_scale: CFG scale ``s`` (finite, >= 0; 0 = the unconditional logits).
        do_sample: False gives the one-hot distribution at the argmax (greedy).
        validate: check the *output* is finite (one host sync): NaN logits, or guidance / temperature overflowing
            the float dtype, raise ``ValueError`` naming the cause. Without it a non-finite result is returned as
            is (NaN rows; see `check_probs_finite`).

    Returns:
        ``[..., V]`` probabilities (float32, or float64 for float64 logits), rows sum to one.
    """
    temperature, top_k, top_p, guidance_scale, do_sample = _validate_knobs(
        temperature, top_k, top_p, guidance_scale, do_sample
    )
    probs = _process(logits, temperature, top_k, top_p, logits_uncond, guidance_scale, do_sample)
    if validate and not bool(finite_flag(probs)):
        raise _nonfinite_error(logits, logits_uncond, guidance_scale, temperature, probs.dtype)
    return probs


def _process(logits, temperature, top_k, top_p, logits_uncond, guidance_scale, do_sample) -> Tensor:
    if logits_uncond is not None:
        logits = cfg_combine(logits, logits_uncond, guidance_scale)
    else:
        logits = logits.to(prob_dtype(logits.dtype))
    vocab = logits.shape[-1]
    if not do_sample or temperature == 0:
        # Greedy: a point mass at the argmax, NaN when the row's maximum is NaN / +inf / -inf (all -inf), so that
        # the finiteness checks also cover greedy rows.  # [..., V]
        top = logits.argmax(-1, keepdim=True)  # [..., 1]
        return torch.zeros_like(logits).scatter_(-1, top, logits.gather(-1, top) * 0 + 1)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k < vocab:
        kth = torch.topk(logits, int(top_k), dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [..., V]
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # exclusive cumulative mass
        drop_sorted = mass_before >= top_p  # never drops the first (most likely) token
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs, applied identically to target and draft logits (checked as in the module docstring).

    Attributes:
        guidance_scale: CFG scale ``s``, in [0, GUIDANCE_MAX] (1.0 = no guidance: the uncond logits are then ignored;
            0.0 = the unconditional logits).
        temperature: softmax temperature, 0 (greedy) or in TEMPERATURE_RANGE.
        top_k: keep the k most likely tokens, ``None`` = off.
        top_p: nucleus mass in (0, 1], ``None`` = off.
        do_sample: False = greedy (one-hot at the argmax).
    """

    guidance_scale: float = 1.0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool = True

    def __post_init__(self):
        values = _validate_knobs(self.temperature, self.top_k, self.top_p, self.guidance_scale, self.do_sample)
        for name, value in zip(("temperature", "top_k", "top_p", "guidance_scale", "do_sample"), values):
            object.__setattr__(self, name, value)  # plain Python numbers (numpy scalars and the like converted)

    @property
    def greedy(self) -> bool:
        """True when the processed distribution is a one-hot argmax."""
        return not self.do_sample or self.temperature == 0

    def probs(self, logits: Tensor, logits_uncond: Tensor | None = None, *, validate: bool = True) -> Tensor:
        """``[..., V]`` logits (and optional uncond logits) -> ``[..., V]`` float32 sampling distribution.

        ``validate=True`` raises on a non-finite result (one host sync); see `logits_to_probs`."""
        return logits_to_probs(
            logits,
            self.temperature,
            self.top_k,
            self.top_p,
            logits_uncond=logits_uncond if self.guidance_scale != 1.0 else None,
            guidance_scale=self.guidance_scale,
            do_sample=self.do_sample,
            validate=validate,
        )


def sample(
    probs: Tensor, generator: Generators, method: str = "inverse_cdf", *, counts: Tensor | None = None
) -> Tensor:
    """Draw one token per row of ``probs`` without a host sync.

    Methods (all select token v with probability ``probs[v] / sum(probs)``, so rows need not be normalised):

    * ``"inverse_cdf"`` (default): ``searchsorted(cumsum(probs), U * total)`` with one uniform per row; the
      cumulative sum is accumulated in float64 so rounding bias is ~1e-16. O(V) and ~20x faster than the
      exponential race on CPU (one uniform per row instead of V exponentials); sync-free on GPU too.
    * ``"exponential"``: the exponential race ``argmax(probs / E)``, ``E ~ Exp(1)`` i.i.d. (gpt-fast's
      ``multinomial_sample_one_no_sync``).
    * ``"multinomial"``: ``torch.multinomial``.

    Args:
        probs: ``[..., V]`` non-negative weights, at least one positive per row.
        generator: the only source of randomness: a ``torch.Generator``, or one per leading row (`mmspec.random`;
            ``None`` falls back to torch's default generator, which library code never passes).
        method: see above.
        counts: with per-row generators and ``probs [B, K, V]``, row ``b`` draws only its first ``counts[b]``
            tokens (the rest are drawn from a dummy uniform and must be ignored); see `mmspec.random`.

    Returns:
        ``[...]`` LongTensor of token ids.
    """
    vocab = probs.shape[-1]
    if method == "inverse_cdf":
        u = rand((*probs.shape[:-1], 1), generator, device=probs.device, dtype=torch.float64, counts=counts)
        return inverse_cdf(probs, u)
    if method == "exponential":
        if num_rows(generator) is None:
            noise = torch.empty_like(probs).exponential_(generator=generator)  # [..., V]
        else:
            noise = -torch.log1p(-rand(probs.shape, generator, device=probs.device, dtype=probs.dtype, counts=counts))
        # Exp(1) can underflow to 0; clamping keeps 0-probability tokens at 0 instead of NaN.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(-1)
    if method == "multinomial":
        if num_rows(generator) is not None:
            rows = [torch.multinomial(p.reshape(-1, vocab), 1, generator=g) for p, g in zip(probs, generator)]
            return torch.stack(rows).reshape(probs.shape[:-1])
        flat = probs.reshape(-1, vocab)  # [N, V]
        return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
    raise ValueError(f"method must be 'inverse_cdf', 'exponential' or 'multinomial', got {method!r}")


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The token of ``probs [..., V]`` (non-negative weights, unnormalised) at the uniform ``u [..., 1]`` (float64,
    in [0, 1)): ``searchsorted(cumsum(probs), u * total)``, accumulated in float64. `sample`'s default method with its
    uniform drawn beforehand: a pure tensor function, so a captured graph can sample from pre-drawn uniforms
    (`mmspec.verify.chain.chain_from_uniforms`). Returns ``[...]`` token ids."""
    cdf = probs.to(torch.float64).cumsum(-1)  # [..., V]
    # right=True skips zero-probability tokens (their cdf equals the previous entry).
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).clamp_max(probs.shape[-1] - 1).squeeze(-1)
