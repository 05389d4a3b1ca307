"""What every verification rule returns: `VerifyResult`, and its Jacobi / continuous extensions."""

from dataclasses import dataclass

from torch import Tensor


__all__ = ["ContinuousResult", "JacobiResult", "VerifyResult"]


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

    @classmethod
    def carrying(
        cls, result: VerifyResult, next_drafts: Tensor, next_q: Tensor, num_carried: Tensor
    ) -> "JacobiResult":
        """`result`'s verification (path included) with the next window."""
        return cls(num_accepted=result.num_accepted, accept_mask=result.accept_mask, tokens=result.tokens,
                   path=result.path, accept_prob=result.accept_prob, num_emitted=result.num_emitted,
                   next_drafts=next_drafts, next_q=next_q, num_carried=num_carried)  # fmt: skip


@dataclass
class ContinuousResult(VerifyResult):
    """`verify_continuous` result.

    Attributes:
        num_fallbacks: ``[B]`` residual samples that fell back to a plain target sample because no proposal was
            accepted within ``max_residual_tries``.
    """

    num_fallbacks: Tensor | None = None
