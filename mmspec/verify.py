"""Verifier core: pure, batched acceptance rules for speculative decoding.

Notation (spelled out once): ``p_target`` is the target model's distribution, ``q_draft`` the distribution the
draft token was actually drawn from, both *after* the same processing (`mmspec.sampling.SamplingParams.probs`).
``q_draft=None`` means point-mass drafts (argmax, top-k tree children, lookup, fresh Jacobi tokens): ``q(x) = 1``.

Every rule is a pure function of tensors plus a ``torch.Generator``; it keeps a leading batch dim ``B`` with
ragged acceptance per row, is vectorised over batch and vocabulary (Python loops only run over draft positions,
tree depth / siblings, or residual-sampling tries) and computes probabilities in float32 (float64 inputs stay
float64). All rules return a `VerifyResult`.

Rules (``RULES`` / `get_rule`):

=============  =====================================================================  ==========
name           paper                                                                  lossless
=============  =====================================================================  ==========
exact          Leviathan et al. 2023 (arXiv 2211.17192); Chen et al. 2023 (2302.01318)  yes
greedy         argmax matching                                                        yes (T=0)
tree           SpecInfer (2305.09781), EAGLE-2 (2406.16858), RSD (2402.14160)         yes
relaxed        LANTERN (2410.03355), LANTERN++ (2502.06352), Cool-SD G* (2601.09212)  no (TV bound)
grouped        GSD (2508.07747)                                                       no
jacobi         SJD (2410.01699); coupling: SCD / MC-SJD (2510.24211)                  yes
continuous     CSpD (2411.11925)                                                      yes (T_in=1)
=============  =====================================================================  ==========

Building blocks shared by chains and trees: `acceptance_probs` (the per-position acceptance probability of any
rule), `rejection_step` (one step of recursive rejection sampling: acceptance probability + the residual after a
rejection), `residual_probs`, `relaxed_numerator`, `grouped_masses`, `codebook_neighbours`.

RNG consumption order (so that rules sharing a generator state see the same coins): chains draw the acceptance
uniforms ``[B, K]`` first, then the exponential noise ``[B, V]`` of the correction/bonus sample. This is what makes
"relaxed acceptance is never below exact acceptance on the same draws" and "a singleton neighbourhood is
bit-identical to `verify_exact`" testable.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mmspec.sampling import prob_dtype, sample


logger = logging.getLogger(__name__)

__all__ = [
    "RULES",
    "ContinuousResult",
    "JacobiResult",
    "VerifyResult",
    "acceptance_probs",
    "codebook_neighbours",
    "get_rule",
    "grouped_masses",
    "rejection_step",
    "relaxed_numerator",
    "residual_probs",
    "verify_continuous",
    "verify_exact",
    "verify_greedy",
    "verify_grouped",
    "verify_jacobi",
    "verify_relaxed",
    "verify_tree",
]

PROB_TOL = 1e-3  # tolerance on "rows sum to one" (raised to 2 eps for low-precision inputs: bf16 -> 1.6e-2)
ACCEPTANCES = ("exact", "relaxed", "grouped")
RESAMPLES = ("optimal", "released")
TREE_MODES = ("deterministic", "iid", "without_replacement")


# ----------------------------------------------------------------------------------------------------------------
# Result types


@dataclass
class VerifyResult:
    """Outcome of one verification call.

    Attributes:
        num_accepted: ``[B]`` accepted DRAFT tokens per row (the correction / bonus token is not counted).
        accept_mask: ``[B, K]`` (chains; prefix-closed) or ``[B, N]`` (trees: nodes on the accepted path).
        tokens: ``[B, K+1]`` (chains) or ``[B, depth+1]`` (trees): accepted drafts, then the next token
            (correction or bonus) at index ``num_accepted``, then -1. ``None`` for continuous tokens.
        values: continuous rule only: ``[B, K, D]`` emitted values (NaN where nothing was emitted).
        path: tree rules only: ``[B, depth+1]`` rows of the verified sequence ``[root, node 0, ..., node N-1]``
            on the accepted path: ``path[:, 0] = 0`` (the root), ``path[:, j] = 1 + node index`` of the j-th
            accepted node, -1 padded. These index ``p_target``'s second dim and the KV rows to keep.
        accept_prob: ``[B, K]`` / ``[B, N]`` acceptance probability of each draft (chains: every position, given
            its draft prefix; trees: NaN for nodes that were never tried). Its mean estimates the acceptance rate.
        num_emitted: ``[B]`` tokens emitted by this call (``num_accepted + 1`` unless a rule says otherwise).
    """

    num_accepted: Tensor
    accept_mask: Tensor
    tokens: Tensor | None
    values: Tensor | None = None
    path: Tensor | None = None
    accept_prob: Tensor | None = None
    num_emitted: Tensor | None = None

    def __post_init__(self):
        if self.num_emitted is None:
            self.num_emitted = self.num_accepted + 1


@dataclass
class JacobiResult(VerifyResult):
    """`verify_jacobi` result: the verification plus the next window's carried-over drafts.

    Attributes:
        next_drafts: ``[B, K]`` re-drafted tokens for the positions after the committed ones, left-aligned;
            -1 from ``num_carried`` on (the caller fills those with fresh initial tokens, q = one-hot).
        next_q: ``[B, K, V]`` the distribution each carried draft is (marginally) distributed as; zeros where
            ``next_drafts == -1``.
        num_carried: ``[B]`` number of valid entries in ``next_drafts``.
    """

    next_drafts: Tensor | None = None
    next_q: Tensor | None = None
    num_carried: Tensor | None = None


@dataclass
class ContinuousResult(VerifyResult):
    """`verify_continuous` result.

    Attributes:
        num_fallbacks: ``[B]`` residual samples that fell back to a plain target sample because no proposal was
            accepted within ``max_residual_tries``.
    """

    num_fallbacks: Tensor | None = None


# ----------------------------------------------------------------------------------------------------------------
# Validation: shape errors raise immediately; value checks are collected and synced once per call.


class _Checks:
    def __init__(self):
        self.flags: list[Tensor] = []
        self.messages: list[str] = []

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

    def tokens(self, name: str, tokens: Tensor, vocab: int, valid: Tensor | None = None) -> None:
        bad = (tokens < 0) | (tokens >= vocab)
        if valid is not None:
            bad = bad & valid
        self.add(bad.any(), f"{name} out of range [0, {vocab})")

    def run(self) -> None:
        if not self.flags:
            return
        _raise_first(torch.stack(self.flags).tolist(), self.messages)  # the one host sync


def _raise_first(flags: list, messages: list) -> None:
    for flag, message in zip(flags, messages):
        if flag:
            raise ValueError(message() if callable(message) else message)


def _check_shape(name: str, x: Tensor, shape: tuple) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def _check_choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _num_draft_mask(num_draft: Tensor | None, batch: int, k: int, device) -> tuple[Tensor, Tensor]:
    """-> (lengths [B], valid [B, K])."""
    if num_draft is None:
        lengths = torch.full((batch,), k, dtype=torch.long, device=device)
    else:
        _check_shape("num_draft", num_draft, (batch,))
        lengths = num_draft.to(device=device, dtype=torch.long)
    valid = torch.arange(k, device=device) < lengths[:, None]  # [B, K]
    return lengths, valid


def _gather_last(x: Tensor, index: Tensor) -> Tensor:
    """``x [..., V]``, ``index [...]`` -> ``x[..., index]`` of shape ``[...]``."""
    return x.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _normalize(weights: Tensor, fallback: Tensor) -> Tensor:
    """Normalise ``weights [..., V]`` row-wise; rows with no mass take ``fallback`` (already normalised)."""
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(weights.dtype).tiny), fallback)


# ----------------------------------------------------------------------------------------------------------------
# Building blocks


def residual_probs(p_target: Tensor, q_draft: Tensor | None = None, tokens: Tensor | None = None) -> Tensor:
    """The residual ``norm(max(0, p_target - q_draft))`` of Leviathan et al. / Chen et al.

    Args:
        p_target: ``[..., V]``.
        q_draft: ``[..., V]``, or ``None`` for point-mass drafts at ``tokens`` (then the residual is
            ``p_target`` with the draft token zeroed, renormalised).
        tokens: ``[...]`` draft tokens, required when ``q_draft`` is None.

    Returns:
        ``[..., V]``; rows whose residual has no mass (``p_target <= q_draft`` everywhere, i.e. p == q: the
        residual is then never sampled) fall back to ``p_target`` instead of producing NaN.
    """
    if q_draft is None:
        if tokens is None:
            raise ValueError("tokens is required when q_draft is None (point-mass drafts)")
        weights = p_target.scatter(-1, tokens.unsqueeze(-1), 0.0)
    else:
        weights = (p_target - q_draft).clamp_min(0)
    return _normalize(weights, p_target)


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
    p_x = _gather_last(p_target, tokens)  # [...]
    if k == 0:
        return p_x, torch.zeros_like(tokens)
    nb = neighbours.to(p_target.device)[tokens, :k]  # [..., k]
    cum = p_target.gather(-1, nb).cumsum(-1)  # [..., k]; monotone, so {m: c_m <= bound} is a prefix
    bound = delta if delta is not None else ((lam - 1) * p_x).unsqueeze(-1)
    within = cum <= bound  # [..., k]
    c_star = torch.where(within, cum, torch.zeros_like(cum)).amax(-1)  # c_{m*}, 0 when m* = 0
    return p_x + c_star, within.sum(-1)


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
    r = _gather_last(rank, tokens)  # [...]
    pos = r.unsqueeze(-1) + torch.arange(group_size, device=order.device) - n_lo  # [..., G]
    inside = (pos >= 0) & (pos < vocab)
    return order.gather(-1, pos.clamp(0, vocab - 1)), inside


def grouped_masses(
    p_target: Tensor,
    q_draft: Tensor | None,
    tokens: Tensor,
    *,
    group_size: int = 14,
    prob_threshold: float = 0.15,
    dist_threshold: float = 0.5,
    embeddings: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GSD dynamic group masses ``P = p(G(x))``, ``Q = q(G(x))``.

    ``G(x)``: tokens in a rank window of ``group_size`` around x in the target's probability order (ascending,
    ``group_size//2`` below x and the rest above, as the release's ``order[r-7:r+7]``), kept if
    ``|p(v) - p(x)| < prob_threshold`` and ``||e_v - e_x||^2 < dist_threshold`` (``embeddings=None`` skips the
    distance filter). x is always in its group.

    Args:
        p_target: ``[..., V]``; q_draft: ``[..., V]`` or None (point mass at x: ``Q = 1``); tokens: ``[...]``.
        embeddings: ``[V, d]`` (the release uses the LLM input-embedding rows of the image tokens).

    Returns:
        ``(P [...], Q [...])``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    members, inside = _group_window(p_target, tokens, group_size)
    p_x = _gather_last(p_target, tokens)
    p_m = p_target.gather(-1, members)  # [..., G]
    keep = inside & ((p_m - p_x.unsqueeze(-1)).abs() < prob_threshold)
    if embeddings is not None:
        emb = embeddings.to(device=p_target.device, dtype=p_target.dtype)
        dist2 = (emb[members] - emb[tokens].unsqueeze(-2)).pow(2).sum(-1)  # [..., G]
        keep = keep & (dist2 < dist_threshold)
    keep[..., group_size // 2] = True  # x itself
    big_p = torch.where(keep, p_m, torch.zeros_like(p_m)).sum(-1)
    if q_draft is None:
        return big_p, torch.ones_like(big_p)
    q_m = q_draft.gather(-1, members)
    return big_p, torch.where(keep, q_m, torch.zeros_like(q_m)).sum(-1)


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


def _accept(
    p_target: Tensor, q_draft: Tensor | None, tokens: Tensor, acceptance: str, knobs: dict
) -> tuple[Tensor, Tensor | None]:
    """-> (acceptance probability [...], LANTERN m* [...] or None)."""
    p_x = _gather_last(p_target, tokens)
    q_x = None if q_draft is None else _gather_last(q_draft, tokens)
    m_star = None
    if acceptance == "exact":
        num, den = p_x, q_x
    elif acceptance == "relaxed":
        num, m_star = relaxed_numerator(
            p_target, tokens, knobs["neighbours"], k=knobs.get("k"), delta=knobs.get("delta"), lam=knobs.get("lam")
        )
        den = q_x  # only the numerator is aggregated (as released)
    elif acceptance == "grouped":
        big_p, big_q = grouped_masses(
            p_target,
            q_draft,
            tokens,
            group_size=knobs.get("group_size", 14),
            prob_threshold=knobs.get("prob_threshold", 0.15),
            dist_threshold=knobs.get("dist_threshold", 0.5),
            embeddings=knobs.get("embeddings"),
        )
        ratio = big_p / big_q
        delta = knobs.get("delta")
        if delta is not None:
            # Our cap: the extra accepted mass q(x) a(x) - p(x) is at most delta, and acceptance is never below
            # the exact rule's (delta = 0 is exactly verify_exact).
            qx = torch.ones_like(p_x) if q_x is None else q_x
            ratio = torch.maximum(p_x / qx, torch.minimum(ratio, (p_x + delta) / qx))
        return ratio.clamp_max(1), None
    else:
        _check_choice("acceptance", acceptance, ACCEPTANCES)
    if den is None:
        return num.clamp_max(1), m_star
    # q = 0 at a draft token is invalid input (caught by validation); ratio inf -> accept, 0/0 -> reject.
    return (num / den).clamp_max(1).nan_to_num(0.0), m_star


def acceptance_probs(
    p_target: Tensor, q_draft: Tensor | None, tokens: Tensor, *, acceptance: str = "exact", **knobs
) -> Tensor:
    """Per-position acceptance probability of a draft token, for any acceptance rule.

    * ``"exact"``: ``min(1, p(x)/q(x))`` (Leviathan et al. 2023; ``q(x) = 1`` for point-mass drafts).
    * ``"relaxed"``: ``min(1, p~(x)/q(x))`` with LANTERN's numerator (`relaxed_numerator`; knobs
      ``neighbours``, ``k``, ``delta`` | ``lam``).
    * ``"grouped"``: ``min(1, P/Q)`` with GSD group masses (`grouped_masses`; knobs ``group_size``,
      ``prob_threshold``, ``dist_threshold``, ``embeddings``, ``delta``).

    Args:
        p_target: ``[..., V]``; q_draft: ``[..., V]`` or None; tokens: ``[...]``.

    Returns:
        ``[...]`` probabilities in [0, 1].
    """
    return _accept(p_target, q_draft, tokens, acceptance, knobs)[0]


def rejection_step(
    residual: Tensor,
    q_draft: Tensor | None,
    tokens: Tensor,
    *,
    acceptance: str = "exact",
    resample: str = "optimal",
    **knobs,
) -> tuple[Tensor, Tensor]:
    """One step of (recursive) rejection sampling at a node (SpecInfer; EAGLE-2; RSD).

    Given the current target residual ``r`` at a node (``p_target`` before any sibling was rejected) and a draft
    ``x ~ q_draft`` (``None``: point mass), returns the probability of accepting ``x`` and the distribution to
    continue with after rejecting it:

    * ``resample="optimal"``: Cool-SD's TV-optimal ``G* = norm([r - q * a]_+)`` with ``a`` the acceptance
      function. For the exact rule this is the Leviathan residual ``norm([r - q]_+)``; for any rule whose
      acceptance is pointwise >= the exact one (relaxed; grouped with ``delta``) it is the *same* residual
      (``q a >= min(q, r)`` and ``a <= 1`` give ``[r - q a]_+ = [r - q]_+``), so only uncapped grouped
      acceptance with sampled drafts needs the full acceptance function (O(V * group_size) extra work).
    * ``resample="released"``: as the LANTERN release: point-mass drafts (dynamic tree): zero ``x`` and, if
      ``m* > 0``, its first ``k + 1`` neighbours in ``r``; sampled drafts (static tree): if ``m* > 0`` zero ``q``
      at the first ``k + 1`` neighbours, then ``r <- [r - q]_+``. (The release's ``q_res`` additionally has the
      tried sibling x zeroed and renormalised; we keep the RSD conditional ``q`` so that ``k = 0`` is exact.)
      Rows left without mass fall back to ``r`` (the release falls back to uniform). For exact/grouped
      acceptance "released" is the plain residual ``norm([r - q]_+)`` (GSD release).

    Args:
        residual: ``[..., V]`` current target residual; q_draft: ``[..., V]`` or None; tokens: ``[...]``.

    Returns:
        ``(accept_prob [...], next_residual [..., V])``.
    """
    _check_choice("resample", resample, RESAMPLES)
    a, m_star = _accept(residual, q_draft, tokens, acceptance, knobs)
    return a, _rejection_residual(residual, q_draft, tokens, acceptance, resample, knobs, m_star)


def _rejection_residual(
    residual: Tensor,
    q_draft: Tensor | None,
    tokens: Tensor,
    acceptance: str,
    resample: str,
    knobs: dict,
    m_star: Tensor | None = None,
) -> Tensor:
    """The ``next_residual`` of `rejection_step` alone (chains need no acceptance probability there: their
    acceptances are computed for all positions at once). ``m_star`` is computed if the rule needs it and it is None."""
    if m_star is None and resample == "released" and acceptance == "relaxed":
        m_star = _accept(residual, q_draft, tokens, acceptance, knobs)[1]
    if q_draft is None:
        weights = residual.scatter(-1, tokens.unsqueeze(-1), 0.0)  # [r - delta_x]_+ (r <= 1)
    elif (
        resample == "optimal"
        and acceptance == "grouped"
        and knobs.get("delta") is None
        and knobs.get("group_size", 14) > 1
    ):
        a_all = _grouped_accept_all(
            residual,
            q_draft,
            group_size=knobs.get("group_size", 14),
            prob_threshold=knobs.get("prob_threshold", 0.15),
            dist_threshold=knobs.get("dist_threshold", 0.5),
            embeddings=knobs.get("embeddings"),
        )
        weights = (residual - q_draft * a_all).clamp_min(0)
    elif resample == "released" and acceptance == "relaxed":
        # static tree: q zeroed at the first k+1 neighbours when m* > 0, so they keep their target mass
        weights = (residual - _zero_neighbours(q_draft, tokens, m_star, knobs)).clamp_min(0)
    else:
        weights = (residual - q_draft).clamp_min(0)
    if q_draft is None and resample == "released" and acceptance == "relaxed":
        weights = _zero_neighbours(weights, tokens, m_star, knobs)
    return _normalize(weights, residual)


def _zero_neighbours(weights: Tensor, tokens: Tensor, m_star: Tensor, knobs: dict) -> Tensor:
    """LANTERN release: if ``m* > 0`` zero the first ``k + 1`` neighbours of x (over-removal kept as released)."""
    neighbours = knobs["neighbours"].to(weights.device)
    k = neighbours.shape[-1] if knobs.get("k") is None else knobs["k"]
    width = min(k + 1, neighbours.shape[-1])
    if width == 0:
        return weights
    nb = neighbours[tokens, :width]  # [..., k+1]
    zero = torch.zeros(nb.shape, dtype=weights.dtype, device=weights.device)
    return torch.where((m_star > 0).unsqueeze(-1), weights.scatter(-1, nb, zero), weights)


# ----------------------------------------------------------------------------------------------------------------
# Chains


def _chain_setup(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    num_draft: Tensor | None,
    validate: bool,
    check_probs: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, _Checks]:
    """Shape checks + dtype promotion.

    Returns ``(p [B,K+1,V], q [B,K,V] | None, safe tokens [B,K], lengths [B], valid [B,K], pending value checks)``.
    """
    if not isinstance(draft_tokens, Tensor) or draft_tokens.ndim != 2:
        raise ValueError("draft_tokens must be a [B, K] LongTensor")
    if draft_tokens.dtype.is_floating_point:
        raise TypeError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    batch, k = draft_tokens.shape
    if not isinstance(p_target, Tensor) or p_target.ndim != 3:
        raise ValueError(f"p_target must be [B, K+1, V] = [{batch}, {k + 1}, V]")
    vocab = p_target.shape[-1]
    _check_shape("p_target", p_target, (batch, k + 1, vocab))
    p = p_target.to(prob_dtype(p_target.dtype))
    q = None
    if q_draft is not None:
        _check_shape("q_draft", q_draft, (batch, k, vocab))
        q = q_draft.to(p.dtype)
    lengths, valid = _num_draft_mask(num_draft, batch, k, p.device)
    checks = _Checks()
    if validate:
        checks.add(((lengths < 0) | (lengths > k)).any(), f"num_draft must be in [0, {k}]")
        checks.tokens("draft_tokens", draft_tokens, vocab, valid)
        if check_probs:
            valid_p = torch.arange(k + 1, device=p.device) <= lengths[:, None]  # [B, K+1]
            checks.probs("p_target", p, valid_p, p_target.dtype)
            if q is not None:
                checks.probs("q_draft", q, valid, q_draft.dtype)
    tokens = torch.where(valid, draft_tokens, 0).clamp(0, vocab - 1)  # safe for gathers  [B, K]
    if validate and check_probs and q is not None:
        checks.add(
            ((_gather_last(q, tokens) <= 0) & valid).any(),
            "q_draft is 0 at a draft token (a draft cannot have been sampled from q_draft)",
        )
    return p, q, tokens, lengths, valid, checks


def _assemble_chain(
    draft_tokens: Tensor, num_accepted: Tensor, next_token: Tensor, accept_prob: Tensor
) -> VerifyResult:
    batch, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device)  # [K+1]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)  # [B, K+1]
    n = num_accepted[:, None]
    tokens = torch.where(pos < n, padded, torch.where(pos == n, next_token[:, None], -1))
    return VerifyResult(
        num_accepted=num_accepted,
        accept_mask=pos[:k] < n,
        tokens=tokens,
        accept_prob=accept_prob,
    )


def _verify_chain(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    *,
    generator: torch.Generator | None,
    num_draft: Tensor | None,
    acceptance: str,
    resample: str,
    knobs: dict,
    validate: bool,
    greedy: bool = False,
) -> VerifyResult:
    """Shared chain engine: vectorised acceptance, first rejection, residual/bonus at that position."""
    _check_choice("acceptance", acceptance, ACCEPTANCES)
    _check_choice("resample", resample, RESAMPLES)
    p, q, tokens, lengths, valid, checks = _chain_setup(draft_tokens, p_target, q_draft, num_draft, validate)
    checks.run()
    batch, k = tokens.shape
    rows = torch.arange(batch, device=p.device)
    if greedy:
        if acceptance == "exact":
            ok = tokens == p[:, :k].argmax(-1)
        elif acceptance == "relaxed":
            p_tilde, _ = _accept_relaxed_numerator(p[:, :k], tokens, knobs)
            ok = p_tilde >= p[:, :k].amax(-1)  # argmax of p with p(x) raised to p~(x) is x
        else:
            raise ValueError("greedy=True is defined for acceptance 'exact' and 'relaxed' only")
        accept_prob = (ok & valid).to(p.dtype)
        accepted = ok & valid
    else:
        accept_prob = _accept(p[:, :k], q, tokens, acceptance, knobs)[0]  # [B, K]
        accept_prob = torch.where(valid, accept_prob, 0.0)
        coins = torch.rand(batch, k, generator=generator, device=p.device, dtype=p.dtype)  # [B, K]
        accepted = (coins < accept_prob) & valid
    n = accepted.long().cumprod(-1).sum(-1)  # [B] first rejection (prefix-closed)
    p_sel = p[rows, n]  # [B, V] target dist at the next position
    if greedy:
        next_token = p_sel.argmax(-1)
    else:
        idx = n.clamp(max=k - 1) if k > 0 else n
        if k > 0:
            q_sel = None if q is None else q[rows, idx]
            resid = _rejection_residual(p_sel, q_sel, tokens[rows, idx], acceptance, resample, knobs)
        else:
            resid = p_sel
        dist = torch.where((n >= lengths)[:, None], p_sel, resid)  # bonus if every valid draft was accepted
        next_token = sample(dist, generator)
    return _assemble_chain(draft_tokens, n, next_token, accept_prob)


def _accept_relaxed_numerator(p: Tensor, tokens: Tensor, knobs: dict) -> tuple[Tensor, Tensor]:
    return relaxed_numerator(
        p, tokens, knobs["neighbours"], k=knobs.get("k"), delta=knobs.get("delta"), lam=knobs.get("lam")
    )


def verify_exact(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    generator: torch.Generator | None,
    num_draft: Tensor | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Standard speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, 2302.01318).

    Accept draft ``x_i`` with probability ``min(1, p_i(x_i)/q_i(x_i))``; at the first rejection emit
    ``y ~ norm(max(0, p_i - q_i))`` and stop; if every valid draft is accepted emit a bonus ``y ~ p_{L}``
    (``L = num_draft[b]``). Every emitted token is distributed as ``p_target`` given the emitted prefix.
    ``q_draft=None``: point-mass drafts; accept with probability ``p(x)`` and on rejection sample ``p`` with ``x``
    zeroed. ``p == q`` gives acceptance 1 (no NaN); an all-zero residual falls back to ``p``.

    Args:
        draft_tokens: ``[B, K]`` drafts (entries at positions ``>= num_draft[b]`` are ignored, may be -1).
        p_target: ``[B, K+1, V]``; ``p_target[:, i]`` is the target distribution at draft position i,
            ``p_target[:, K]`` (or ``[b, num_draft[b]]``) the bonus distribution.
        q_draft: ``[B, K, V]`` distributions the drafts were drawn from, or None (point masses).
        generator: source of every random draw.
        num_draft: ``[B]`` valid drafts per row (ragged), default K.
        validate: value checks (one host sync).

    Returns:
        `VerifyResult` with ``tokens [B, K+1]``.
    """
    return _verify_chain(
        draft_tokens,
        p_target,
        q_draft,
        generator=generator,
        num_draft=num_draft,
        acceptance="exact",
        resample="optimal",
        knobs={},
        validate=validate,
    )


def verify_greedy(draft_tokens: Tensor, p_target: Tensor, num_draft: Tensor | None = None) -> VerifyResult:
    """Greedy verification: accept ``x_i`` iff ``x_i == argmax p_i``; emit ``argmax p`` at the first mismatch
    (or the bonus position). Exactly reproduces target-only greedy decoding.

    Args:
        draft_tokens: ``[B, K]``.
        p_target: ``[B, K+1, V]`` probabilities or logits (only the argmax is used).
        num_draft: ``[B]`` valid drafts per row.

    Returns:
        `VerifyResult` (``accept_prob`` is 0/1).
    """
    p, _, tokens, _, valid, checks = _chain_setup(
        draft_tokens, p_target, None, num_draft, validate=True, check_probs=False
    )
    checks.run()
    k = tokens.shape[1]
    best = p.argmax(-1)  # [B, K+1]
    ok = (tokens == best[:, :k]) & valid
    n = ok.long().cumprod(-1).sum(-1)
    return _assemble_chain(draft_tokens, n, best.gather(1, n[:, None]).squeeze(1), ok.to(p.dtype))


def verify_relaxed(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    neighbours: Tensor,
    k: int | None = None,
    delta: float | None = None,
    lam: float | None = None,
    resample: str = "optimal",
    generator: torch.Generator | None,
    num_draft: Tensor | None = None,
    greedy: bool = False,
    validate: bool = True,
) -> VerifyResult:
    """LANTERN relaxed acceptance (Jang et al., arXiv 2410.03355; LANTERN++ arXiv 2502.06352), chain form.

    Accept draft x with ``min(1, p~(x)/q(x))`` where ``p~(x) = p(x) + c_{m*}`` credits x with the target mass of
    its first ``m*`` latent neighbours (`relaxed_numerator`): ``c_{m*} <= delta`` (LANTERN) or
    ``<= (lam-1) p(x)`` (LANTERN++). ``q = 1`` for point-mass drafts. On rejection resample from
    ``G* = norm([p - q a]_+)`` (Cool-SD, arXiv 2601.09212; equals the standard residual because the relaxation
    only raises acceptance, see `rejection_step`) or as released (``resample="released"``). ``greedy=True``:
    accept iff ``p~(x) >= max p`` (the released greedy mode), correction = argmax p.
    Trees (LANTERN's main mode: EAGLE-2 dynamic tree, deterministic children):
    ``verify_tree(..., acceptance="relaxed", neighbours=..., delta=...)``.

    Distortion bounds (per position, with ``resample="optimal"``; derived here, checked by the tests). The output
    law is ``P(y) = q(y) a(y) + (1 - sum q a) G*(y)`` and ``TV(P, p) = sum_y [q(y) a(y) - p(y)]_+``. So
      * point-mass draft x: ``TV = min(p~(x), 1) - p(x) <= c_{m*} <= delta`` (or ``<= (lam-1) p(x)``);
      * sampled drafts: ``TV = sum_{y: q>p} min(q(y) - p(y), c(y)) <= sum_y min(q(y), delta)`` (additive) and
        ``<= (lam-1) sum_{y: q>p} p(y) <= lam - 1`` (multiplicative), ``c(y) = p~(y) - p(y)``.
    With ``k=0``, ``delta=0`` or ``lam=1`` the rule is bit-identical to `verify_exact` (same generator state).

    Where we differ from the released code (see the AR-image brief, sections 3.2-3.4):
      * neighbours come from the L2-normalised codebook (what LlamaGen decodes), the release uses raw weights;
      * only the top-``k_max`` neighbours are stored (``[V, k_max]``), the release stores all ``V-1`` (512 MB for
        V=16384);
      * default resampling is G*; the release zeroes x *and the first k+1 neighbours* (one more than the
        aggregated set, even when ``m* < k``) and falls back to uniform; ``resample="released"`` reproduces the
        zeroing but falls back to the node's target distribution;
      * like the release, only the numerator is aggregated (``q(x)``, not ``q`` of the neighbourhood, is the
        denominator).

    Args:
        draft_tokens: ``[B, K]``; p_target: ``[B, K+1, V]``; q_draft: ``[B, K, V]`` or None.
        neighbours: ``[V, k_max]`` from `codebook_neighbours` (precomputed once).
        k: neighbours to use (default ``k_max``); delta / lam: exactly one.
        resample: ``"optimal"`` or ``"released"``.
        generator, num_draft, validate: as `verify_exact`.
    """
    _check_neighbours(neighbours, p_target.shape[-1])
    knobs = {"neighbours": neighbours, "k": k, "delta": delta, "lam": lam}
    return _verify_chain(
        draft_tokens,
        p_target,
        q_draft,
        generator=generator,
        num_draft=num_draft,
        acceptance="relaxed",
        resample=resample,
        knobs=knobs,
        validate=validate,
        greedy=greedy,
    )


def _check_neighbours(neighbours: Tensor, vocab: int) -> None:
    if not isinstance(neighbours, Tensor) or neighbours.ndim != 2 or neighbours.shape[0] != vocab:
        shape = tuple(neighbours.shape) if isinstance(neighbours, Tensor) else type(neighbours).__name__
        raise ValueError(f"neighbours must be a [V={vocab}, k] LongTensor, got {shape}")


def _check_embeddings(embeddings: Tensor | None, vocab: int) -> None:
    if embeddings is not None and (embeddings.ndim != 2 or embeddings.shape[0] != vocab):
        raise ValueError(f"embeddings must be [V={vocab}, d], got {tuple(embeddings.shape)}")


KNOBS = {
    "exact": set(),
    "relaxed": {"neighbours", "k", "delta", "lam"},
    "grouped": {"group_size", "prob_threshold", "dist_threshold", "embeddings", "delta"},
}


def _check_knobs(acceptance: str, knobs: dict, vocab: int) -> None:
    """Unknown knob names raise TypeError; missing / malformed required knobs raise ValueError."""
    _check_choice("acceptance", acceptance, ACCEPTANCES)
    unknown = set(knobs) - KNOBS[acceptance]
    if unknown:
        raise TypeError(
            f"unexpected keyword(s) {sorted(unknown)} for acceptance={acceptance!r}; valid: {sorted(KNOBS[acceptance])}"
        )
    if acceptance == "relaxed":
        _check_neighbours(knobs.get("neighbours"), vocab)
        if (knobs.get("delta") is None) == (knobs.get("lam") is None):
            raise ValueError("relaxed acceptance needs exactly one of delta (LANTERN) or lam (LANTERN++)")
    if acceptance == "grouped":
        _check_embeddings(knobs.get("embeddings"), vocab)
        if knobs.get("group_size", 14) < 1:
            raise ValueError(f"group_size must be >= 1, got {knobs['group_size']}")


def verify_grouped(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    group_size: int = 14,
    prob_threshold: float = 0.15,
    dist_threshold: float = 0.5,
    embeddings: Tensor | None = None,
    delta: float | None = None,
    resample: str = "released",
    generator: torch.Generator | None,
    num_draft: Tensor | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Grouped speculative decoding, dynamic groups (GSD, So et al., arXiv 2508.07747), chain form.

    Accept x with ``min(1, P/Q)``, ``P, Q`` = target / draft mass of x's dynamic group (`grouped_masses`: a rank
    window of ``group_size`` around x in target-probability order, filtered by ``|p(v)-p(x)| < prob_threshold``
    and ``||e_v - e_x||^2 < dist_threshold``; release defaults 14 / 0.15 / 0.5). Reject -> ``norm([p - q]_+)``
    (``resample="released"``, as the paper and code) or Cool-SD's ``G* = norm([p - q a]_+)``
    (``"optimal"``; with sampled drafts and no ``delta`` this evaluates the group of every token).

    Lossy, and unlike LANTERN not monotone: for *sampled* drafts ``P/Q`` can be below ``p(x)/q(x)`` (neighbours
    with more draft than target mass), so acceptance is not pointwise above the exact rule (GSD's Theorem 1 is
    about fixed partitions). For point-mass drafts ``Q = 1`` and acceptance ``P >= p(x)`` is.
    ``delta`` (our addition, None = as released) caps the extra accepted mass: ``a = min(1, max(p/q, min(P/Q,
    (p(x)+delta)/q(x))))``, so acceptance is never below exact, ``q(x) a(x) - p(x) <= delta`` and, with G*,
    ``TV <= sum_y min(q(y), delta)`` (``<= delta`` for point-mass drafts). ``group_size=1`` or ``delta=0``
    reproduce `verify_exact` bit for bit.

    Args:
        draft_tokens: ``[B, K]``; p_target: ``[B, K+1, V]``; q_draft: ``[B, K, V]`` or None (point masses).
        embeddings: ``[V, d]`` embedding table for the distance filter (None skips it).
        generator, num_draft, validate: as `verify_exact`.
    """
    _check_embeddings(embeddings, p_target.shape[-1])
    if delta is not None and not delta >= 0:
        raise ValueError(f"delta must be >= 0 or None, got {delta}")
    knobs = {
        "group_size": group_size,
        "prob_threshold": prob_threshold,
        "dist_threshold": dist_threshold,
        "embeddings": embeddings,
        "delta": delta,
    }
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return _verify_chain(
        draft_tokens,
        p_target,
        q_draft,
        generator=generator,
        num_draft=num_draft,
        acceptance="grouped",
        resample=resample,
        knobs=knobs,
        validate=validate,
    )


def verify_jacobi(
    draft_tokens: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    generator: torch.Generator | None,
    coupling: bool = False,
    num_draft: Tensor | None = None,
    acceptance: str = "exact",
    resample: str = "optimal",
    validate: bool = True,
    **knobs,
) -> JacobiResult:
    """Speculative Jacobi decoding step (SJD, Teng et al., arXiv 2410.01699) with optional coupling (SCD /
    MC-SJD, So et al., arXiv 2510.24211).

    The window's drafts were produced by the previous Jacobi iteration; ``q_draft`` is that iteration's processed
    distribution at each position (one-hot for freshly initialised tokens, or None if all are fresh). Verification
    is `verify_exact` (or the ``acceptance`` rule: GSD = ``acceptance="grouped"``). Then every position after
    the committed correction is re-drafted from THIS iteration's distributions ``p_target[:, j]`` (conditioned on
    the stale drafts) with ``q := p_target[:, j]``:

    * ``coupling=False`` (SJD): independent samples ``y_j ~ p_j``;
    * ``coupling=True`` (SCD): maximal coupling with the old draft: keep ``d_j`` with probability
      ``min(1, p_j(d_j)/q_j(d_j))`` (re-using the unused verification coin of position j), else sample
      ``norm([p_j - q_j]_+)``. Marginally ``y_j ~ p_j`` (so verification stays lossless) while drafts repeat far
      more often, which raises acceptance.

    Args:
        draft_tokens: ``[B, K]`` window drafts; p_target: ``[B, K+1, V]`` this iteration's distributions;
        q_draft: ``[B, K, V]`` or None.
        coupling: maximal-coupling re-draft.
        acceptance, resample, knobs: verification rule (see `acceptance_probs`).
        generator, num_draft, validate: as `verify_exact`.

    Returns:
        `JacobiResult`: the verification plus ``next_drafts [B, K]`` (left-aligned, ``num_carried`` valid, -1
        after), their distributions ``next_q [B, K, V]``. Row b carries ``L - n`` drafts (positions ``n+1..L``,
        ``L = num_draft[b]``) when it stopped at a rejection, else 0.
    """
    _check_knobs(acceptance, knobs, p_target.shape[-1])
    _check_choice("resample", resample, RESAMPLES)
    p, q, tokens, lengths, valid, checks = _chain_setup(draft_tokens, p_target, q_draft, num_draft, validate)
    checks.run()
    batch, k = tokens.shape
    vocab = p.shape[-1]
    rows = torch.arange(batch, device=p.device)
    accept_prob = torch.where(valid, _accept(p[:, :k], q, tokens, acceptance, knobs)[0], 0.0)  # [B, K]
    coins = torch.rand(batch, k, generator=generator, device=p.device, dtype=p.dtype)  # [B, K]
    accepted = (coins < accept_prob) & valid
    n = accepted.long().cumprod(-1).sum(-1)  # [B]
    p_sel = p[rows, n]  # [B, V]
    if k > 0:
        idx = n.clamp(max=k - 1)
        q_sel = None if q is None else q[rows, idx]
        resid = _rejection_residual(p_sel, q_sel, tokens[rows, idx], acceptance, resample, knobs)
    else:
        resid = p_sel
    next_token = sample(torch.where((n >= lengths)[:, None], p_sel, resid), generator)
    result = _assemble_chain(draft_tokens, n, next_token, accept_prob)

    # Re-draft every position j = 0..K from this iteration's p_j (only j in n+1..L are kept).
    fresh = sample(p, generator)  # [B, K+1]
    if coupling and k > 0:
        keep = coins < (accept_prob if acceptance == "exact" else _accept(p[:, :k], q, tokens, "exact", {})[0])
        if q is None:
            resid_all = residual_probs(p[:, :k], None, tokens)  # [B, K, V]
        else:
            resid_all = residual_probs(p[:, :k], q)
        moved = sample(resid_all, generator)  # [B, K]
        coupled = torch.where(keep, tokens, moved)
        redraft = torch.cat([coupled, fresh[:, k:]], dim=1)  # [B, K+1]; position K has no old draft
    else:
        redraft = fresh
    num_carried = torch.where(n < lengths, lengths - n, 0)  # [B]
    slot = torch.arange(k, device=p.device)
    src = (n[:, None] + 1 + slot).clamp(max=k)  # [B, K] source position in this window
    carried = slot < num_carried[:, None]
    next_drafts = torch.where(carried, redraft.gather(1, src), -1)
    next_q = torch.where(carried[..., None], p.gather(1, src[..., None].expand(batch, k, vocab)), 0.0)
    return JacobiResult(
        num_accepted=result.num_accepted,
        accept_mask=result.accept_mask,
        tokens=result.tokens,
        accept_prob=accept_prob,
        next_drafts=next_drafts,
        next_q=next_q,
        num_carried=num_carried,
    )


# ----------------------------------------------------------------------------------------------------------------
# Trees


def _tree_children(parents: Tensor, present: Tensor, validate: bool, checks: _Checks) -> tuple[Tensor, int]:
    """-> (children [B, N+1, C]: node indices of the children of each p_target row in index order, -1 padded;
    max depth). One host sync (validation flags + loop bounds)."""
    batch, n = present.shape
    node = torch.arange(n, device=parents.device)
    if validate:
        checks.add(((parents < -1) | (parents >= node)).any(), "parents[i] must be -1 (root) or in [0, i-1]")
        par_present = present.gather(1, parents.clamp(0, max(n - 1, 0))) | (parents < 0)
        checks.add((present & ~par_present).any(), "a present node has an absent parent (tree_tokens -1)")
    parents = parents.clamp(-1, n - 1)
    same = (parents[:, :, None] == parents[:, None, :]) & present[:, None, :]  # [B, N(i), N(j)]
    rank = (same & (node[None, :] < node[:, None])).sum(-1)  # earlier siblings of node i  [B, N]
    depth = torch.zeros(batch, n, dtype=torch.long, device=parents.device)
    for i in range(n):  # parents[i] < i, so depth[parent] is ready
        par = parents[:, i].clamp(min=0)
        depth[:, i] = torch.where(parents[:, i] >= 0, depth.gather(1, par[:, None]).squeeze(1) + 1, 1)
    zero = torch.zeros((), dtype=torch.long, device=parents.device)
    max_depth = torch.where(present, depth, 0).amax() if n else zero
    max_children = torch.where(present, rank + 1, 0).amax() if n else zero
    values = torch.stack([f.to(torch.long) for f in checks.flags] + [max_depth, max_children]).tolist()
    _raise_first(values[:-2], checks.messages)
    width = int(values[-1])
    # children[b, row, slot]; absent nodes are written to a dump slot that is cut off.
    children = torch.full((batch, (n + 1) * (width + 1)), -1, dtype=torch.long, device=parents.device)
    flat = torch.where(present, (parents + 1) * (width + 1) + rank, (width + 1) * (n + 1) - 1)
    children.scatter_(1, flat, torch.where(present, node, -1).expand(batch, n).contiguous())
    children = children.view(batch, n + 1, width + 1)[..., :width]
    return children, int(values[-2])


def verify_tree(
    tree_tokens: Tensor,
    parents: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None = None,
    *,
    mode: str = "deterministic",
    generator: torch.Generator | None,
    greedy: bool = False,
    acceptance: str = "exact",
    resample: str = "optimal",
    validate: bool = True,
    **knobs,
) -> VerifyResult:
    """Tree verification by recursive rejection sampling over siblings (SpecInfer, Miao et al. arXiv 2305.09781;
    EAGLE-2, Li et al. arXiv 2406.16858; RSD, Jeon et al. arXiv 2402.14160).

    At the current node (starting at the root) with target residual ``r = p_target`` there, try the children in
    index order; child ``c_j`` is accepted with probability ``min(1, r(c_j)/q_j(c_j))``, otherwise
    ``r <- norm([r - q_j]_+)`` (`rejection_step`). On acceptance descend into the child (new ``r`` = the
    target distribution after it); at a node with no accepted child emit ``y ~ r`` (correction, or the bonus at a
    leaf) and stop. Modes, i.e. how the children were drawn (the tree shape must not depend on target coins):

    * ``"deterministic"``: top-k / fixed children, ``q`` = point mass (``q_draft`` must be None): accept with
      ``r(c)``, on reject zero ``c`` and renormalise (EAGLE-2 ``evaluate_posterior``). Duplicates are fine.
    * ``"iid"``: children drawn i.i.d. from ``q_draft[:, i]`` (SpecInfer multi-step speculative sampling).
    * ``"without_replacement"``: the sibling set was drawn without replacement from ``q_draft[:, i]`` (RSD;
      EAGLE-1 static-tree sampling); sibling j is checked against the conditional
      ``q_j = q 1[x not in earlier siblings] / (1 - q(earlier siblings))``. Siblings must be distinct.

    Every emitted token is distributed as ``p_target`` given the emitted prefix (exact acceptance).
    ``acceptance="relaxed"`` / ``"grouped"`` plug LANTERN / GSD acceptance into the same recursion (the numerator
    / group masses are computed on the current residual ``r``, as in LANTERN's dynamic-tree code); knobs as in
    `verify_relaxed` / `verify_grouped`. ``greedy=True``: accept the first child equal to ``argmax p`` (relaxed:
    with ``p~(c) >= max p``) and emit the argmax; no randomness.

    Args:
        tree_tokens: ``[B, N]`` node tokens; -1 marks an absent node (ragged trees; its children must be absent).
        parents: ``[N]`` or ``[B, N]``: ``parents[i] = -1`` (child of the root) or an earlier node in ``[0, i)``.
        p_target: ``[B, N+1, V]``; index 0 = target distribution at the root, index ``i+1`` = after node i.
        q_draft: ``[B, N, V]`` draft distribution node i was drawn from (``iid``) / its sibling set was drawn
            from (``without_replacement``), or None (``deterministic``).
        mode, generator, greedy, acceptance, resample, validate, knobs: see above.

    Returns:
        `VerifyResult` with ``path [B, D+1]`` (rows of ``p_target``: 0 = root, then ``1 + node`` per accepted
        node, -1 padded), ``tokens [B, D+1]`` (accepted tokens along the path, the emitted token at index
        ``num_accepted``, -1 after), ``accept_mask [B, N]`` (accepted nodes), ``accept_prob [B, N]`` (NaN where a
        node was never tried); ``D`` = tree depth.
    """
    _check_choice("mode", mode, TREE_MODES)
    _check_choice("acceptance", acceptance, ACCEPTANCES)
    _check_choice("resample", resample, RESAMPLES)
    if tree_tokens.ndim != 2:
        raise ValueError(f"tree_tokens must be [B, N], got shape {tuple(tree_tokens.shape)}")
    if tree_tokens.dtype.is_floating_point:
        raise TypeError(f"tree_tokens must be an integer tensor, got {tree_tokens.dtype}")
    batch, n = tree_tokens.shape
    if p_target.ndim != 3:
        raise ValueError(f"p_target must be [B, N+1, V] = [{batch}, {n + 1}, V]")
    vocab = p_target.shape[-1]
    _check_shape("p_target", p_target, (batch, n + 1, vocab))
    if parents.ndim == 1:
        _check_shape("parents", parents, (n,))
        parents = parents[None].expand(batch, n)
    else:
        _check_shape("parents", parents, (batch, n))
    parents = parents.to(device=p_target.device, dtype=torch.long)
    if mode == "deterministic" and q_draft is not None:
        raise ValueError("q_draft must be None for mode='deterministic' (children are point masses)")
    if mode != "deterministic" and q_draft is None and not greedy:
        raise ValueError(f"q_draft [B, N, V] is required for mode={mode!r}")
    _check_knobs(acceptance, knobs, vocab)
    p = p_target.to(prob_dtype(p_target.dtype))
    q = None if (q_draft is None or greedy) else q_draft.to(p.dtype)
    if q_draft is not None and not greedy:
        _check_shape("q_draft", q_draft, (batch, n, vocab))
    present = tree_tokens >= 0  # [B, N]
    tokens = tree_tokens.clamp(0, vocab - 1)
    checks = _Checks()
    if validate:
        checks.add((tree_tokens >= vocab).any(), f"tree_tokens out of range [-1 (absent), {vocab})")
        valid_p = torch.cat([torch.ones_like(present[:, :1]), present], dim=1)  # [B, N+1]
        if not greedy:  # greedy trees accept logits
            checks.probs("p_target", p, valid_p, p_target.dtype)
        if q is not None:
            checks.probs("q_draft", q, present, q_draft.dtype)
            checks.add(
                ((_gather_last(q, tokens) <= 0) & present).any(),
                "q_draft is 0 at a draft token (a draft cannot have been sampled from q_draft)",
            )
        if mode == "without_replacement":
            sib = (parents[:, :, None] == parents[:, None, :]) & present[:, :, None] & present[:, None, :]
            dup = sib & (tokens[:, :, None] == tokens[:, None, :])
            dup = dup & ~torch.eye(n, dtype=torch.bool, device=p.device)
            checks.add(dup.any(), "mode='without_replacement' needs distinct siblings")
    children, max_depth = _tree_children(parents, present, validate, checks)  # [B, N+1, C]
    width = children.shape[-1]

    rows = torch.arange(batch, device=p.device)
    cur = torch.zeros(batch, dtype=torch.long, device=p.device)  # p_target row of the current node (0 = root)
    resid = p[:, 0]  # [B, V]
    removed = torch.zeros(batch, vocab, dtype=torch.bool, device=p.device)  # tried siblings (without_replacement)
    done = torch.zeros(batch, dtype=torch.bool, device=p.device)
    final = resid
    num_acc = torch.zeros(batch, dtype=torch.long, device=p.device)
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=p.device)
    path[:, 0] = 0
    out = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=p.device)
    accept_mask = torch.zeros(batch, n + 1, dtype=torch.bool, device=p.device)  # last column: dump slot
    accept_prob = torch.full((batch, n + 1), float("nan"), dtype=p.dtype, device=p.device)
    for depth in range(max_depth):
        kids = children.gather(1, cur.view(batch, 1, 1).expand(batch, 1, width)).squeeze(1)  # [B, C]
        found = torch.zeros(batch, dtype=torch.bool, device=p.device)
        chosen = torch.zeros(batch, dtype=torch.long, device=p.device)
        probs_here = torch.full((batch, width), float("nan"), dtype=p.dtype, device=p.device)  # [B, C]
        for slot in range(width):
            child = kids[:, slot].clamp(min=0)  # [B]
            active = (kids[:, slot] >= 0) & ~done & ~found  # [B]
            x = tokens.gather(1, child[:, None]).squeeze(1)  # [B]
            if greedy:
                if acceptance == "relaxed":
                    p_tilde, _ = _accept_relaxed_numerator(resid, x, knobs)
                    ok = p_tilde >= resid.amax(-1)
                elif acceptance == "exact":
                    ok = x == resid.argmax(-1)
                else:
                    raise ValueError("greedy=True is defined for acceptance 'exact' and 'relaxed' only")
                a, acc = ok.to(p.dtype), active & ok
                next_resid = resid
            else:
                q_child = None
                if q is not None:
                    q_child = q.gather(1, child.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)  # [B, V]
                    if mode == "without_replacement":
                        q_child = _normalize(q_child.masked_fill(removed, 0.0), q_child)
                a, next_resid = rejection_step(resid, q_child, x, acceptance=acceptance, resample=resample, **knobs)
                coins = torch.rand(batch, generator=generator, device=p.device, dtype=p.dtype)  # [B]
                acc = active & (coins < a)
            probs_here[:, slot] = torch.where(active, a, float("nan"))
            rejected = active & ~acc
            resid = torch.where(rejected[:, None], next_resid, resid)
            if mode == "without_replacement":
                removed.scatter_(1, x[:, None], rejected[:, None] | removed.gather(1, x[:, None]))
            found |= acc
            chosen = torch.where(acc, child, chosen)
        tried = ~torch.isnan(probs_here)
        accept_prob.scatter_(1, torch.where(tried, kids, n), probs_here)
        stop = ~done & ~found
        final = torch.where(stop[:, None], resid, final)
        done = done | stop
        adv = found  # rows descending into an accepted child
        path[:, depth + 1] = torch.where(adv, chosen + 1, -1)
        out[:, depth] = torch.where(adv, tokens.gather(1, chosen[:, None]).squeeze(1), out[:, depth])
        accept_mask.scatter_(1, torch.where(adv, chosen, n)[:, None], True)
        num_acc = num_acc + adv.long()
        cur = torch.where(adv, chosen + 1, cur)
        resid = torch.where(adv[:, None], p.gather(1, cur.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1), resid)
        removed = removed & ~adv[:, None]
    final = torch.where(done[:, None], final, resid)  # rows that reached a leaf: bonus from p at the leaf
    if greedy:
        next_token = final.argmax(-1)
    else:
        next_token = sample(final, generator)
    out[rows, num_acc] = next_token
    return VerifyResult(
        num_accepted=num_acc,
        accept_mask=accept_mask[:, :n],
        tokens=out,
        path=path,
        accept_prob=accept_prob[:, :n],
    )


# ----------------------------------------------------------------------------------------------------------------
# Continuous tokens


def _gauss_logpdf(x: Tensor, mean: Tensor, std: Tensor, temperature: float = 1.0) -> Tensor:
    """Diagonal Gaussian log-density summed over the last dim, up to ``-D/2 log(2 pi)``; ``temperature`` widens
    only the exponent (the CSpD release's inner temperature)."""
    z = (x - mean) / (std * temperature)
    return -0.5 * z.pow(2).sum(-1) - std.log().sum(-1)


def verify_continuous(
    draft_values: Tensor,
    target_mean: Tensor,
    target_std: Tensor,
    draft_mean: Tensor,
    draft_std: Tensor,
    *,
    generator: torch.Generator | None,
    log_ratio_offset: Tensor | None = None,
    inner_temperature: float = 1.0,
    max_residual_tries: int = 100,
    prefix: bool = True,
    num_draft: Tensor | None = None,
    validate: bool = True,
) -> ContinuousResult:
    """Continuous speculative decoding for diffusion-head tokens (CSpD, Wang et al., arXiv 2411.11925).

    With aligned noise (same ``x_T`` and per-step noise for draft and target), the last denoising step is Gaussian:
    ``q = N(draft_mean, draft_std^2)``, ``p = N(target_mean, target_std^2)`` (diagonal). Accept draft ``x`` with
    ``min(1, p(x)/q(x) * exp(log_ratio_offset))``, computed in log space. On rejection sample
    ``norm([p - q a]_+)`` (= ``norm([p - q]_+)`` for the exact rule) by acceptance-rejection with proposal p:
    accept ``z ~ p`` with probability ``[1 - q(z) a(z) / p(z)]_+``, up to ``max_residual_tries``; a token never
    accepted falls back to a plain sample from p (the release leaves it at zero) and is counted in
    ``num_fallbacks``. With ``inner_temperature=1`` and no offset the output is exactly distributed as p.

    ``inner_temperature`` (release: 42) widens both Gaussians in the acceptance exponent only (the normalisers
    keep the true std), a heuristic that makes near-deterministic last steps comparable; ``log_ratio_offset``
    adds a per-token trajectory term (the release's ``sum_t log sigma`` difference over the earlier steps).

    ``prefix=True``: AR order, stop at the first rejection (emit the residual sample there; no bonus token since
    the target produced no extra sample). ``prefix=False``: every token is checked independently and every valid
    position is emitted (accepted draft or residual sample), as the CSpD release does for MAR blocks.

    Args:
        draft_values: ``[B, K, D]`` draft samples x.
        target_mean, target_std, draft_mean, draft_std: ``[B, K, D]`` last-step Gaussian parameters (std > 0).
        generator: source of every random draw.
        log_ratio_offset: ``[B, K]`` added to the log acceptance ratio (None = 0).
        inner_temperature: exponent temperature (1 = exact).
        max_residual_tries: proposals per rejected token before the fallback.
        prefix: AR prefix acceptance (True) or independent per-token acceptance (False).
        num_draft: ``[B]`` valid drafts per row.

    Returns:
        `ContinuousResult`: ``values [B, K, D]`` (emitted values at positions ``< num_emitted``, NaN after),
        ``accept_mask [B, K]``, ``num_accepted`` (prefix: accepted prefix length; else accepted count),
        ``num_emitted``, ``num_fallbacks [B]``, ``accept_prob [B, K]``; ``tokens`` is None.
    """
    if draft_values.ndim != 3:
        raise ValueError(f"draft_values must be [B, K, D], got shape {tuple(draft_values.shape)}")
    shape = tuple(draft_values.shape)
    for name, t in [
        ("target_mean", target_mean),
        ("target_std", target_std),
        ("draft_mean", draft_mean),
        ("draft_std", draft_std),
    ]:
        _check_shape(name, t, shape)
    if max_residual_tries < 1:
        raise ValueError(f"max_residual_tries must be >= 1, got {max_residual_tries}")
    if not inner_temperature > 0:
        raise ValueError(f"inner_temperature must be > 0, got {inner_temperature}")
    batch, k, _ = shape
    dtype = prob_dtype(draft_values.dtype)
    x, mu_p, sd_p, mu_q, sd_q = (t.to(dtype) for t in (draft_values, target_mean, target_std, draft_mean, draft_std))
    offset = torch.zeros(batch, k, dtype=dtype, device=x.device)
    if log_ratio_offset is not None:
        _check_shape("log_ratio_offset", log_ratio_offset, (batch, k))
        offset = log_ratio_offset.to(dtype)
    lengths, valid = _num_draft_mask(num_draft, batch, k, x.device)
    if validate:
        checks = _Checks()
        for name, t in [("draft_values", x), ("target_mean", mu_p), ("draft_mean", mu_q)]:
            checks.add(~torch.isfinite(t).all(), f"{name} must be finite")
        for name, t in [("target_std", sd_p), ("draft_std", sd_q)]:
            checks.add(~(t > 0).all(), f"{name} must be > 0 (and not NaN)")
        checks.add(((lengths < 0) | (lengths > k)).any(), f"num_draft must be in [0, {k}]")
        checks.run()

    def log_ratio(z: Tensor) -> Tensor:  # acceptance log-ratio at z  [..., B, K]
        return (
            _gauss_logpdf(z, mu_p, sd_p, inner_temperature) - _gauss_logpdf(z, mu_q, sd_q, inner_temperature) + offset
        )

    accept_prob = torch.where(valid, log_ratio(x).clamp_max(0).exp(), 0.0)  # [B, K]
    coins = torch.rand(batch, k, generator=generator, device=x.device, dtype=dtype)
    accepted = (coins < accept_prob) & valid  # [B, K]
    if prefix:
        n = accepted.long().cumprod(-1).sum(-1)
        pos = torch.arange(k, device=x.device)
        need = (pos == n[:, None]) & valid  # the first rejected position  [B, K]
        accept_mask = pos < n[:, None]
        num_emitted = torch.minimum(n + 1, lengths)
    else:
        n = accepted.sum(-1)
        need = valid & ~accepted
        accept_mask = accepted
        num_emitted = lengths

    # Residual by acceptance-rejection with proposal p: accept z w.p. [1 - q(z) a(z) / p(z)]_+ (G* for a).
    resid = torch.zeros_like(x)
    filled = ~need
    chunk = min(max_residual_tries, 16)
    tries = 0
    while tries < max_residual_tries and not bool(filled.all()):  # one sync per chunk of tries
        c = min(chunk, max_residual_tries - tries)
        z = mu_p + sd_p * torch.randn((c, *shape), generator=generator, device=x.device, dtype=dtype)  # [c, B, K, D]
        lq_lp = _gauss_logpdf(z, mu_q, sd_q) - _gauss_logpdf(z, mu_p, sd_p)  # exact densities  [c, B, K]
        take_prob = (1 - (lq_lp + log_ratio(z).clamp_max(0)).exp()).clamp_min(0)
        ok = torch.rand((c, batch, k), generator=generator, device=x.device, dtype=dtype) < take_prob
        first = ok.long().argmax(0)  # [B, K] first accepted try
        pick = z.gather(0, first[None, ..., None].expand(1, *shape)).squeeze(0)  # [B, K, D]
        take = ~filled & ok.any(0)
        resid = torch.where(take[..., None], pick, resid)
        filled = filled | take
        tries += c
    fallback = ~filled  # [B, K]
    plain = mu_p + sd_p * torch.randn(shape, generator=generator, device=x.device, dtype=dtype)
    resid = torch.where(fallback[..., None], plain, resid)
    num_fallbacks = fallback.sum(-1)
    if bool(fallback.any()):
        logger.debug("verify_continuous: %d residual samples fell back to plain target samples", int(fallback.sum()))

    values = torch.where(accepted[..., None], x, resid)
    emitted = torch.arange(k, device=x.device) < num_emitted[:, None]
    values = torch.where(emitted[..., None], values, float("nan"))
    return ContinuousResult(
        num_accepted=n,
        accept_mask=accept_mask,
        tokens=None,
        values=values,
        accept_prob=accept_prob,
        num_emitted=num_emitted,
        num_fallbacks=num_fallbacks,
    )


# ----------------------------------------------------------------------------------------------------------------
# Registry


RULES: dict[str, Callable[..., VerifyResult]] = {
    "exact": verify_exact,
    "greedy": verify_greedy,
    "tree": verify_tree,
    "relaxed": verify_relaxed,
    "grouped": verify_grouped,
    "jacobi": verify_jacobi,
    "continuous": verify_continuous,
}


def get_rule(name: str) -> Callable[..., VerifyResult]:
    """Look up a verification rule by name (``RULES``); unknown names raise ValueError listing the valid ones."""
    if name not in RULES:
        raise ValueError(f"unknown rule {name!r}; valid rules: {sorted(RULES)}")
    return RULES[name]
