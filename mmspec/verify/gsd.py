"""GSD grouped acceptance: compare the target and draft masses of a dynamic group around the draft token.

Paper: Grouped Speculative Decoding (So, Shin, Kook, Park, arXiv 2508.07747, ICCV 2025); release: junhyukso/GSD
(``scheduler/jacobi_iteration_lumina_mgpt.py``, ``SpeculativeSampler.__call__``). Built on SJD (the Jacobi loop of
`mmspec.verify.jacobi`); only the per-token test changes. Draft x is accepted with ``min(1, P / Q)`` where
``P = p_target(G(x))`` and ``Q = q_draft(G(x))`` are the masses of x's group ``G(x)``: the tokens in a rank window
of ``group_size`` around x in target-probability order, kept if their probability is within ``prob_threshold`` of
``p_target(x)`` and their embedding within squared distance ``dist_threshold`` of x's (`grouped_masses`).
"""

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from mmspec.verify.checks import Checks, check_int, gather_last, normalize
from mmspec.verify.rules import AcceptanceRule


__all__ = ["Grouped", "grouped_masses"]


def _group_window(p_target: Tensor, tokens: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """GSD window: ranks ``[r - G//2, r - G//2 + G)`` around the draft's rank r in ascending target-prob order
    (ties broken by token id, i.e. a stable argsort; the release sorts logits ascending).

    Returns ``(members [..., G], inside [..., G])``; position ``G//2`` is the draft itself.
    """
    vocab = p_target.shape[-1]
    n_lo, n_hi = group_size // 2, group_size - group_size // 2 - 1
    if p_target.dtype == torch.float32 and max(n_lo, n_hi) < vocab:
        # No full sort: an exact int64 key (float bits of p >= 0 are monotone; low 32 bits = token id) and two
        # small top-k selections give the n_lo keys just below and the n_hi keys just above x's key.
        ids = torch.arange(vocab, device=p_target.device)
        key = ((p_target + 0.0).view(torch.int32).to(torch.int64) << 32) | ids  # [..., V]; +0.0 maps -0 to 0
        key_x = key.gather(-1, tokens.unsqueeze(-1))  # [..., 1]
        lo_fill, hi_fill = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
        below = torch.where(key < key_x, key, lo_fill).topk(n_lo, dim=-1)  # nearest first
        above = torch.where(key > key_x, key, hi_fill).topk(n_hi, dim=-1, largest=False)
        members = torch.cat([below.indices.flip(-1), tokens.unsqueeze(-1), above.indices], dim=-1)  # [..., G]
        inside = torch.cat(
            [below.values.flip(-1) != lo_fill, torch.ones_like(key_x, dtype=torch.bool), above.values != hi_fill],
            dim=-1,
        )
        return members, inside
    order = torch.argsort(p_target, dim=-1, stable=True)  # [..., V] ascending
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(vocab, device=order.device).expand_as(order))
    r = gather_last(rank, tokens)  # [...]
    pos = r.unsqueeze(-1) + torch.arange(group_size, device=order.device) - n_lo  # [..., G]
    inside = (pos >= 0) & (pos < vocab)
    return order.gather(-1, pos.clamp(0, vocab - 1)), inside


def _grouped_accept_all(
    p_target: Tensor,
    q_draft: Tensor,
    *,
    group_size: int,
    prob_threshold: float,
    dist_threshold: float,
    embeddings: Tensor | None,
    max_elements: int = 1 << 24,
) -> Tensor:
    """Uncapped GSD acceptance ``min(1, P/Q)`` for EVERY token: ``[..., V] -> [..., V]`` (for the G* resample).

    Vectorised over the ``group_size`` window (unfold of the sorted row); rows are processed in chunks of at most
    ``max_elements`` window entries (``V * G * d`` per row with embeddings of width d).
    """
    lead, vocab = p_target.shape[:-1], p_target.shape[-1]
    p2, q2 = p_target.reshape(-1, vocab), q_draft.reshape(-1, vocab)  # [R, V]
    d = 1 if embeddings is None else embeddings.shape[-1]
    step = max(1, max_elements // (vocab * group_size * d))
    n_lo, n_hi = group_size // 2, group_size - group_size // 2 - 1

    def windows(x, fill):  # [r, V, ...] sorted -> [r, V, ..., G]: entry g is sorted position s - n_lo + g
        x = x.movedim(1, -1)
        return F.pad(x, (n_lo, n_hi), value=fill).unfold(-1, group_size, 1).movedim(-2, 1)

    out = torch.empty_like(p2)
    for start in range(0, p2.shape[0], step):
        p, q = p2[start : start + step], q2[start : start + step]  # [r, V]
        order = torch.argsort(p, dim=-1, stable=True)
        p_s, q_s = p.gather(-1, order), q.gather(-1, order)  # sorted ascending  [r, V]
        p_win, q_win = windows(p_s, 0.0), windows(q_s, 0.0)  # [r, V, G]
        inside = windows(torch.ones_like(p_s, dtype=torch.bool), False)
        keep = inside & ((p_win - p_s.unsqueeze(-1)).abs() < prob_threshold)
        if embeddings is not None:
            e_s = embeddings.to(device=p.device, dtype=p.dtype)[order]  # [r, V, d]
            dist2 = (windows(e_s, 0.0) - e_s.unsqueeze(-1)).pow(2).sum(-2)  # [r, V, G]
            keep = keep & (dist2 < dist_threshold)
        keep[..., n_lo] = True  # the token itself
        big_p = torch.where(keep, p_win, 0.0).sum(-1)
        big_q = torch.where(keep, q_win, 0.0).sum(-1)
        ratio = torch.where(big_q > 0, big_p / big_q.clamp_min(torch.finfo(p.dtype).tiny), 1.0).clamp_max(1)
        out[start : start + step] = torch.empty_like(ratio).scatter_(-1, order, ratio)
    return out.reshape(*lead, vocab)


@dataclass(frozen=True, eq=False)
class Grouped(AcceptanceRule):
    """GSD dynamic-group acceptance (``acceptance="grouped"``).

    Accept x with ``min(1, P / Q)``, ``P, Q`` the target / draft masses of x's dynamic group (`masses`; a point-mass
    draft has ``Q = 1``). Lossy, and unlike LANTERN not monotone: for *sampled* drafts ``P/Q`` can be below
    ``p(x)/q(x)`` (neighbours with more draft than target mass), so acceptance is not pointwise above the exact
    rule's (GSD's Theorem 1 is about fixed partitions). For point-mass drafts ``P >= p(x)`` is.

    ``delta`` (our addition; None = as released) caps the extra accepted mass:
    ``a = min(1, max(p/q, min(P/Q, (p(x) + delta)/q(x))))``, so acceptance is never below the exact rule's,
    ``q(x) a(x) - p(x) <= delta`` and, with G*, ``TV <= sum_y min(q(y), delta)`` (``<= delta`` for point-mass
    drafts). ``group_size=1`` or ``delta=0`` reproduce `Exact` bit for bit.

    Resampling after a rejection: ``"released"`` = the paper's and release's plain ``norm([p - q]_+)``;
    ``"optimal"`` = Cool-SD's ``G* = norm([p - q a]_+)`` (arXiv 2601.09212), which with sampled drafts and no
    ``delta`` evaluates the group of every token (O(V * group_size) extra work; otherwise it is the plain residual).

    Defaults: the GSD release uses a 14-token window (``order[r-7:r+7]``), ``prob_threshold=0.15`` and
    ``dist_threshold=0.5`` on squared distances between rows of the LLM's INPUT embedding table (Lumina-mGPT's
    ``embed_tokens``); the paper reports G = 25 on MS-COCO and G = 50 on Parti. Our image pipeline has no such LLM
    table and passes the L2-normalised VQ codebook vectors the decoder uses instead, whose squared distances live
    on another scale ([0, 4]), so the release's 0.5 does not carry over; ``group_size=25`` / ``dist_threshold=1.0``
    are the values picked by measured step compression on the MNIST zoo (README, Benchmarks), with the release's
    ``prob_threshold``.

    Attributes:
        embeddings: ``[V, d]`` vectors for the distance filter (None skips it).
        group_size: rank-window size ``G >= 1`` (``G//2`` tokens below x, the rest above).
        prob_threshold: keep window members with ``|p(v) - p(x)| < prob_threshold``.
        dist_threshold: keep window members with ``||e_v - e_x||^2 < dist_threshold``.
        delta: cap on the extra accepted mass (None = uncapped, as released).
        resample: ``"optimal"`` | ``"released"`` (above).
    """

    name: ClassVar[str] = "grouped"
    lossless: ClassVar[bool] = False
    embeddings: Tensor | None = field(default=None, repr=False)
    group_size: int = 25
    prob_threshold: float = 0.15
    dist_threshold: float = 1.0
    delta: float | None = None

    def __post_init__(self):
        super().__post_init__()
        check_int("group_size", self.group_size, 1)
        if self.delta is not None and not self.delta >= 0:
            raise ValueError(f"delta must be >= 0 or None, got {self.delta}")

    def check(self, vocab: int, checks: Checks | None = None) -> None:
        emb = self.embeddings
        if emb is not None and (not isinstance(emb, Tensor) or emb.ndim != 2 or emb.shape[0] != vocab):
            shape = tuple(emb.shape) if isinstance(emb, Tensor) else type(emb).__name__
            raise ValueError(f"embeddings must be [V={vocab}, d], got {shape}")

    def masses(self, p_target: Tensor, q_draft: Tensor | None, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``(P [...], Q [...])``: target / draft mass of each draft's group (``Q = 1`` for point-mass drafts)."""
        members, inside = _group_window(p_target, tokens, self.group_size)
        p_x = gather_last(p_target, tokens)
        p_m = p_target.gather(-1, members)  # [..., G]
        keep = inside & ((p_m - p_x.unsqueeze(-1)).abs() < self.prob_threshold)
        if self.embeddings is not None:
            emb = self.embeddings.to(device=p_target.device, dtype=p_target.dtype)
            dist2 = (emb[members] - emb[tokens].unsqueeze(-2)).pow(2).sum(-1)  # [..., G]
            keep = keep & (dist2 < self.dist_threshold)
        keep[..., self.group_size // 2] = True  # x itself
        big_p = torch.where(keep, p_m, torch.zeros_like(p_m)).sum(-1)
        if q_draft is None:
            return big_p, torch.ones_like(big_p)
        q_m = q_draft.gather(-1, members)
        return big_p, torch.where(keep, q_m, torch.zeros_like(q_m)).sum(-1)

    def accept(self, p_target: Tensor, q_draft: Tensor | None, tokens: Tensor) -> Tensor:
        p_x = gather_last(p_target, tokens)
        big_p, big_q = self.masses(p_target, q_draft, tokens)
        ratio = big_p / big_q
        if self.delta is not None:
            # The extra accepted mass q(x) a(x) - p(x) is at most delta, and acceptance is never below the exact
            # rule's (delta = 0 is exactly `Exact`).
            q_x = torch.ones_like(p_x) if q_draft is None else gather_last(q_draft, tokens)
            ratio = torch.maximum(p_x / q_x, torch.minimum(ratio, (p_x + self.delta) / q_x))
        return ratio.clamp_max(1)

    def residual(self, residual: Tensor, q_draft: Tensor | None, tokens: Tensor) -> Tensor:
        if q_draft is not None and self.resample == "optimal" and self.delta is None and self.group_size > 1:
            a_all = _grouped_accept_all(
                residual,
                q_draft,
                group_size=self.group_size,
                prob_threshold=self.prob_threshold,
                dist_threshold=self.dist_threshold,
                embeddings=self.embeddings,
            )
            return normalize((residual - q_draft * a_all).clamp_min(0), residual)
        return super().residual(residual, q_draft, tokens)  # plain [r - q]_+ (= G* when a >= the exact rule's)


def grouped_masses(
    p_target: Tensor,
    q_draft: Tensor | None,
    tokens: Tensor,
    *,
    group_size: int | None = None,
    prob_threshold: float | None = None,
    dist_threshold: float | None = None,
    embeddings: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GSD dynamic group masses ``P = p(G(x))``, ``Q = q(G(x))`` (`Grouped.masses`).

    ``G(x)``: tokens in a rank window of ``group_size`` around x in the target's probability order (ascending,
    ``group_size//2`` below x and the rest above, as the release's ``order[r-7:r+7]``), kept if
    ``|p(v) - p(x)| < prob_threshold`` and ``||e_v - e_x||^2 < dist_threshold`` (``embeddings=None`` skips the
    distance filter). x is always in its group.

    Args:
        p_target: ``[..., V]``; q_draft: ``[..., V]`` or None (point mass at x: ``Q = 1``); tokens: ``[...]``.
        group_size, prob_threshold, dist_threshold, embeddings: `Grouped`'s knobs (None = its default).

    Returns:
        ``(P [...], Q [...])``.
    """
    knobs = {"group_size": group_size, "prob_threshold": prob_threshold, "dist_threshold": dist_threshold}
    rule = Grouped(embeddings=embeddings, **{name: v for name, v in knobs.items() if v is not None})
    return rule.masses(p_target, q_draft, tokens)
