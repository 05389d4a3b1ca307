"""Input validation and small tensor helpers shared by every rule.

Shape and type errors raise at once; value checks (NaN, negative or non-normalised probabilities, token ranges) are
collected in a `Checks` and synced once per call (`Checks.run`), so a validated call costs one host sync.
"""

import operator
from collections.abc import Callable

import torch
from torch import Tensor


__all__ = [
    "PROB_TOL",
    "Checks",
    "check_choice",
    "check_int",
    "check_shape",
    "gather_last",
    "normalize",
    "num_draft_mask",
    "raise_first",
]

PROB_TOL = 1e-3  # tolerance on "rows sum to one" (raised to 2 eps for low-precision inputs: bf16 -> 1.6e-2)


class Checks:
    """Pending value checks: boolean flags (``True`` = bad) and their error messages."""

    def __init__(self):
        self.flags: list[Tensor] = []
        self.messages: list[str | Callable[[], str]] = []

    def add(self, flag: Tensor, message: str | Callable[[], str]) -> None:
        self.flags.append(flag.reshape(()).to(torch.bool))
        self.messages.append(message)

    def probs(self, name: str, x: Tensor, valid: Tensor | None = None, dtype: torch.dtype | None = None) -> None:
        """NaN, negative and not-normalised rows of ``x [..., V]`` (``valid [...]`` masks padded rows); ``dtype``
        is the caller's input dtype, which sets the tolerance."""
        tol = max(PROB_TOL, 2 * torch.finfo(dtype or x.dtype).eps)
        bad_sum = (x.sum(-1) - 1).abs() > tol
        if valid is not None:
            bad_sum = bad_sum & valid
        # One fast float reduction catches both NaN (min propagates it) and negatives; which one is worked out
        # only on failure. (Bool reductions are ~30x slower on CPU.)
        self.add(
            ~(x.amin() >= 0) if x.numel() else torch.zeros((), dtype=torch.bool),
            lambda: (
                f"{name} contains NaN" if bool(torch.isnan(x).any()) else f"{name} contains negative probabilities"
            ),
        )
        self.add(bad_sum.any(), f"{name} rows must sum to 1 (tolerance {tol:.1e})")

    def not_nan(self, name: str, x: Tensor) -> None:
        """NaN anywhere in ``x`` (greedy rules take logits: any other value is fine)."""
        self.add(torch.isnan(x.amax()) if x.numel() else torch.zeros((), dtype=torch.bool), f"{name} contains NaN")

    def tokens(self, name: str, tokens: Tensor, vocab: int, valid: Tensor | None = None) -> None:
        bad = (tokens < 0) | (tokens >= vocab)
        if valid is not None:
            bad = bad & valid
        self.add(bad.any(), f"{name} out of range [0, {vocab})")

    def run(self) -> None:
        if not self.flags:
            return
        raise_first(torch.stack(self.flags).tolist(), self.messages)  # the one host sync


def raise_first(flags: list, messages: list) -> None:
    for flag, message in zip(flags, messages):
        if flag:
            raise ValueError(message() if callable(message) else message)


def check_tokens_and_probs(name: str, tokens, p_target, dims: str) -> tuple[int, int, int]:
    """Shape / dtype checks of draft tokens `[B, K]` (integer) and `p_target [B, K+1, V]` (``dims`` names K in
    messages). Returns ``(B, K, V)``."""
    if not isinstance(tokens, Tensor) or tokens.ndim != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"{name} must be [B, {dims}], got shape {shape}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {tokens.dtype}")
    batch, k = tokens.shape
    if not isinstance(p_target, Tensor) or p_target.ndim != 3:
        raise ValueError(f"p_target must be [B, {dims}+1, V] = [{batch}, {k + 1}, V]")
    vocab = p_target.shape[-1]
    check_shape("p_target", p_target, (batch, k + 1, vocab))
    return batch, k, vocab


def check_shape(name: str, x: Tensor, shape: tuple) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def check_choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int ``>= minimum``: TypeError for bools and non-integers (2.5), ValueError below."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool ({value})")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def num_draft_mask(num_draft: Tensor | None, batch: int, k: int, device) -> tuple[Tensor, Tensor]:
    """-> (lengths [B], valid [B, K])."""
    if num_draft is None:
        lengths = torch.full((batch,), k, dtype=torch.long, device=device)
    else:
        check_shape("num_draft", num_draft, (batch,))
        if num_draft.dtype == torch.bool or num_draft.dtype.is_floating_point or num_draft.dtype.is_complex:
            raise TypeError(f"num_draft must be an integer tensor, got {num_draft.dtype}")
        lengths = num_draft.to(device=device, dtype=torch.long)
    valid = torch.arange(k, device=device) < lengths[:, None]  # [B, K]
    return lengths, valid


def gather_last(x: Tensor, index: Tensor) -> Tensor:
    """``x [..., V]``, ``index [...]`` -> ``x[..., index]`` of shape ``[...]``."""
    return x.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def normalize(weights: Tensor, fallback: Tensor) -> Tensor:
    """Normalise ``weights [..., V]`` row-wise; rows with no mass take ``fallback`` (already normalised).

    A row with no mass divides 0 / 0 in the branch `where` does not select (no NaN reaches the result); a row with
    a subnormal total is normalised exactly like any other (``weights <= total``: no overflow). Three ops."""
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total, fallback)
