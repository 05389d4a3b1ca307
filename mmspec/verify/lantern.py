"""LANTERN relaxed acceptance: credit a draft with the target mass of its latent-space neighbours.

Papers: LANTERN (Jang et al., arXiv 2410.03355), LANTERN++ (arXiv 2502.06352); TV-optimal resampling G* from Cool-SD
(arXiv 2601.09212). Release: jadohu/LANTERN (``ea_model_llamagen.py``). Visual AR models spread their probability
over many interchangeable codes, so exact drafts are often rejected although a code next to them in the VQ latent
space would decode to nearly the same patch. LANTERN accepts draft x with ``min(1, p~(x) / q_draft(x))`` where

    p~(x) = p_target(x) + c_{m*},   c_m = sum_{j <= m} p_target(n_j(x)),

``n_1(x), n_2(x), ...`` are x's nearest codes (`codebook_neighbours`) and ``m*`` is the largest ``m <= k`` with
``c_m <= delta`` (LANTERN: an additive total-variation budget) or ``c_m <= (lam - 1) p_target(x)`` (LANTERN++: a
multiplicative one, ``p~(x) <= lam p_target(x)``). See `relaxed_numerator` and the `Lantern` rule.
"""

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from mmspec.sampling import prob_dtype
from mmspec.verify.checks import Checks, check_int, gather_last, normalize
from mmspec.verify.rules import AcceptanceRule, ratio_accept


__all__ = ["Lantern", "codebook_neighbours", "relaxed_numerator"]


def codebook_neighbours(codebook: Tensor, k: int, *, chunk_size: int = 1024) -> Tensor:
    """LANTERN latent neighbourhoods: the ``k`` nearest codes of every code, nearest first, self excluded.

    Distances are L2 between L2-NORMALISED codebook vectors (what LlamaGen's quantiser actually decodes; the
    LANTERN release uses the raw weights), computed in row chunks so V = 16384 fits in memory
    (``chunk_size x V`` similarities at a time). Computed once per codebook and passed to the rules.

    Args:
        codebook: ``[V, d]`` code vectors.
        k: neighbours per code, ``0 <= k <= V - 1``.
        chunk_size: rows per chunk.

    Returns:
        ``[V, k]`` LongTensor of code indices.
    """
    if codebook.ndim != 2:
        raise ValueError(f"codebook must be [V, d], got shape {tuple(codebook.shape)}")
    vocab = codebook.shape[0]
    if not 0 <= k <= vocab - 1:
        raise ValueError(f"k must be in [0, {vocab - 1}], got {k}")
    unit = torch.nn.functional.normalize(codebook.to(prob_dtype(codebook.dtype)), dim=-1)  # [V, d]
    out = torch.empty(vocab, k, dtype=torch.long, device=codebook.device)
    if k == 0:
        return out
    for start in range(0, vocab, chunk_size):
        rows = unit[start : start + chunk_size]  # [c, d]
        # For unit vectors ||a - b||^2 = 2 - 2 a.b: nearest by L2 = largest cosine.
        sim = rows @ unit.T  # [c, V]
        idx = torch.arange(start, start + rows.shape[0], device=codebook.device)
        sim[torch.arange(rows.shape[0], device=codebook.device), idx] = float("-inf")
        out[start : start + rows.shape[0]] = sim.topk(k, dim=-1).indices
    return out


def relaxed_numerator(
    p_target: Tensor,
    tokens: Tensor,
    neighbours: Tensor,
    *,
    k: int | None = None,
    delta: float | None = None,
    lam: float | None = None,
) -> tuple[Tensor, Tensor]:
    """LANTERN's relaxed acceptance numerator ``p~(x) = p(x) + c_{m*}``.

    ``c_m`` is the cumulative target mass of the first ``m`` latent neighbours of ``x`` and ``m*`` the largest
    ``m <= k`` with ``c_m <= bound``; ``bound = delta`` (LANTERN, additive total-variation budget) or
    ``(lam - 1) * p(x)`` (LANTERN++, multiplicative: ``p~(x) <= lam * p(x)``).

    Args:
        p_target: ``[..., V]``.
        tokens: ``[...]`` draft tokens.
        neighbours: ``[V, k_max]`` from `codebook_neighbours`.
        k: neighbours to use (default all ``k_max``); 0 disables the relaxation.
        delta / lam: exactly one of them.

    Returns:
        ``(p_tilde [...], m_star [...])``.
    """
    if (delta is None) == (lam is None):
        raise ValueError("relaxed acceptance needs exactly one of delta (LANTERN) or lam (LANTERN++)")
    if delta is not None and not delta >= 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    if lam is not None and not lam >= 1:
        raise ValueError(f"lam must be >= 1, got {lam}")
    k_max = neighbours.shape[-1]
    k = k_max if k is None else k
    if not 0 <= k <= k_max:
        raise ValueError(f"k must be in [0, {k_max}] (neighbours has {k_max} columns), got {k}")
    p_x = gather_last(p_target, tokens)  # [...]
    if k == 0:
        return p_x, torch.zeros_like(tokens)
    nb = neighbours.to(p_target.device)[tokens, :k]  # [..., k]
    cum = p_target.gather(-1, nb).cumsum(-1)  # [..., k]; monotone, so {m: c_m <= bound} is a prefix
    bound = delta if delta is not None else ((lam - 1) * p_x).unsqueeze(-1)
    within = cum <= bound  # [..., k]
    c_star = torch.where(within, cum, torch.zeros_like(cum)).amax(-1)  # c_{m*}, 0 when m* = 0
    return p_x + c_star, within.sum(-1)


@dataclass(frozen=True, eq=False)
class Lantern(AcceptanceRule):
    """LANTERN / LANTERN++ relaxed acceptance (``acceptance="relaxed"``).

    Accept draft x with ``min(1, p~(x) / q_draft(x))`` (`relaxed_numerator`; ``q_draft(x) = 1`` for point-mass
    drafts). Like the release, only the numerator is aggregated (``q_draft(x)``, not the neighbourhood's draft mass,
    is the denominator). Greedy decoding: accept iff ``p~(x) >= max p_target`` (the released greedy mode: the argmax
    of ``p_target`` with ``p(x)`` raised to ``p~(x)`` is x).

    Resampling after a rejection:

    * ``"optimal"``: Cool-SD's ``G* = norm([p - q a]_+)``, which for LANTERN equals the standard residual
      ``norm([p - q]_+)`` because the relaxation only raises acceptance (``q a >= min(q, p)`` and ``a <= 1``);
    * ``"released"``: as the LANTERN release: point-mass drafts (EAGLE-2 dynamic tree) zero x and, if ``m* > 0``, its
      first ``k + 1`` neighbours in the residual; sampled drafts (static tree) zero ``q_draft`` at the first
      ``k + 1`` neighbours when ``m* > 0``, then take ``[p - q]_+``. (The release's ``q_res`` additionally has
      the tried sibling zeroed and renormalised; we keep the RSD conditional ``q`` so that ``k = 0`` is exact.)
      Rows left without mass fall back to the node's target residual (the release falls back to uniform).

    Distortion bounds (per position, ``resample="optimal"``; checked by the tests). The output law is
    ``P(y) = q(y) a(y) + (1 - sum q a) G*(y)`` and ``TV(P, p) = sum_y [q(y) a(y) - p(y)]_+``, so
      * point-mass draft x: ``TV = min(p~(x), 1) - p(x) <= c_{m*} <= delta`` (or ``<= (lam - 1) p(x)``);
      * sampled drafts: ``TV <= sum_y min(q(y), delta)`` (additive) and ``<= (lam - 1) sum_{y: q>p} p(y)``
        (multiplicative).
    With ``k=0``, ``delta=0`` or ``lam=1`` the rule is bit-identical to `Exact` (same generator state).

    Where we differ from the release (AR-image brief, sections 3.2-3.4): neighbours come from the L2-normalised
    codebook (what LlamaGen decodes; the release uses raw weights); only the top-``k_max`` neighbours are stored
    (``[V, k_max]``; the release stores all ``V - 1``, 512 MB for V = 16384); the default resampling is G*.

    Attributes:
        neighbours: ``[V, k_max]`` from `codebook_neighbours` (required; None only as the placeholder default).
        k: neighbours to use, ``0 <= k <= k_max`` (None = all ``k_max``).
        delta: LANTERN's additive TV budget (release default 0.1; paper sweeps up to 0.4).
        lam: LANTERN++'s multiplicative bound ``>= 1`` (release runs 5-20); when set it replaces ``delta``.
        resample: ``"optimal"`` | ``"released"`` (above).
    """

    name: ClassVar[str] = "relaxed"
    lossless: ClassVar[bool] = False
    neighbours: Tensor | None = field(default=None, repr=False)
    k: int | None = None
    delta: float | None = 0.2
    lam: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.k is not None:
            check_int("k", self.k, 0)
        if self.delta is not None and not self.delta >= 0:
            raise ValueError(f"delta must be >= 0, got {self.delta}")
        if self.lam is not None and not self.lam >= 1:
            raise ValueError(f"lam must be >= 1, got {self.lam}")
        if self.delta is None and self.lam is None:
            raise ValueError("relaxed acceptance needs delta (LANTERN) or lam (LANTERN++), got neither")

    def check(self, vocab: int, checks: Checks | None = None) -> None:
        nb = self.neighbours
        if not isinstance(nb, Tensor) or nb.ndim != 2 or nb.shape[0] != vocab:
            shape = tuple(nb.shape) if isinstance(nb, Tensor) else type(nb).__name__
            raise ValueError(f"neighbours must be a [V={vocab}, k] LongTensor, got {shape}")
        if nb.dtype.is_floating_point or nb.dtype.is_complex or nb.dtype == torch.bool:
            raise TypeError(f"neighbours must be an integer tensor, got {nb.dtype}")
        if self.k is not None and self.k > nb.shape[1]:
            raise ValueError(f"k must be in [0, {nb.shape[1]}] (neighbours has {nb.shape[1]} columns), got {self.k}")
        if checks is not None and nb.numel():
            low, high = nb.aminmax()
            checks.add((low < 0) | (high >= vocab), f"neighbours out of range [0, {vocab})")

    def numerator(self, p_target: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``(p~(x) [...], m* [...])`` with this rule's knobs (`relaxed_numerator`)."""
        delta = None if self.lam is not None else self.delta  # lam replaces delta
        return relaxed_numerator(p_target, tokens, self.neighbours, k=self.k, delta=delta, lam=self.lam)

    def accept(self, p_target: Tensor, q_draft: Tensor | None, tokens: Tensor) -> Tensor:
        q_x = None if q_draft is None else gather_last(q_draft, tokens)
        return ratio_accept(self.numerator(p_target, tokens)[0], q_x)

    def residual(self, residual: Tensor, q_draft: Tensor | None, tokens: Tensor) -> Tensor:
        if self.resample == "optimal":
            return super().residual(residual, q_draft, tokens)
        return self._released_residual(residual, q_draft, tokens, self.numerator(residual, tokens)[1])

    def step(self, residual: Tensor, q_draft: Tensor | None, tokens: Tensor) -> tuple[Tensor, Tensor]:
        p_tilde, m_star = self.numerator(residual, tokens)  # once for both
        q_x = None if q_draft is None else gather_last(q_draft, tokens)
        if self.resample == "optimal":
            return ratio_accept(p_tilde, q_x), super().residual(residual, q_draft, tokens)
        return ratio_accept(p_tilde, q_x), self._released_residual(residual, q_draft, tokens, m_star)

    def greedy_accept(self, p_target: Tensor, tokens: Tensor) -> Tensor:
        return self.numerator(p_target, tokens)[0] >= p_target.amax(-1)

    def _released_residual(self, residual: Tensor, q_draft: Tensor | None, tokens: Tensor, m_star: Tensor) -> Tensor:
        if q_draft is None:  # dynamic tree: zero x, then (if m* > 0) its first k + 1 neighbours
            weights = self._zero_neighbours(residual.scatter(-1, tokens.unsqueeze(-1), 0.0), tokens, m_star)
        else:  # static tree: q zeroed at the first k + 1 neighbours when m* > 0, so they keep their target mass
            weights = (residual - self._zero_neighbours(q_draft, tokens, m_star)).clamp_min(0)
        return normalize(weights, residual)

    def _zero_neighbours(self, weights: Tensor, tokens: Tensor, m_star: Tensor) -> Tensor:
        """If ``m* > 0`` zero the first ``k + 1`` neighbours of x (one more than aggregated: kept as released)."""
        neighbours = self.neighbours.to(weights.device)
        k = neighbours.shape[-1] if self.k is None else self.k
        width = min(k + 1, neighbours.shape[-1])
        if width == 0:
            return weights
        nb = neighbours[tokens, :width]  # [..., k+1]
        zero = torch.zeros(nb.shape, dtype=weights.dtype, device=weights.device)
        return torch.where((m_star > 0).unsqueeze(-1), weights.scatter(-1, nb, zero), weights)
