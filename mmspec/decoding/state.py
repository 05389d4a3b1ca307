"""`SequenceState`: the ragged batch of sequences a decoding loop is extending.

Rows are batch items (CFG streams are the models' business, see `mmspec.decoding.guidance`). Every row has its own
number of generated tokens `count [B']`; it is *finished* when it reached `max_length` tokens or emitted
`eos_token_id`. Finished rows are compacted out of the per-round work (`keep`), together with their per-row
generators; `full()` / `full_trace()` give the whole `[B, N]` grid of the call at any time.

The last generated token of a row is *pending*: emitted, but not yet fed to the target (the target's cache holds the
condition prefix and tokens `0 .. count - 2`).
"""

import torch
from torch import Tensor

from mmspec.decoding.trace import ACCEPTED, BONUS, PREFILL, RESAMPLED, DecodeTrace
from mmspec.random import Generators, select_generators


__all__ = ["SequenceState", "append_tokens"]


def append_tokens(tokens, count, ended, new_tokens, num_new, max_length: int, eos, inplace: bool = False):
    """The tensor part of `SequenceState.emit`: append `new_tokens[b, :num_new[b]]` to row b of the buffer `tokens`
    (after `count[b]` tokens), cut at `max_length` and after an EOS of `eos` (ids or None). A pure function when
    `inplace` is False (`tokens` comes back as a new buffer: what a captured graph runs,
    `mmspec.decoding.captured_verify`); `inplace=True` writes `tokens` in place (eager `emit`).

    Returns ``(tokens, count + num, ended, num)``, ``num [B']`` the tokens appended per row."""
    m = new_tokens.shape[1]
    j = torch.arange(m, device=new_tokens.device)
    num = torch.minimum(num_new, max_length - count)
    if eos is not None:
        eos_at = torch.where((new_tokens[..., None] == eos).any(-1) & (j < num[:, None]), j, m).amin(1)
        ended = ended | (eos_at < num)
        num = torch.minimum(num, eos_at + 1)
    keep = j[None, :] < num[:, None]  # [B', M]
    cols = torch.where(keep, count[:, None] + j[None, :], max_length + j[None, :])
    tokens = tokens.scatter_(1, cols, new_tokens) if inplace else tokens.scatter(1, cols, new_tokens)
    return tokens, count + num, ended, num


class SequenceState:
    """Token buffer of the rows still being decoded.

    Args:
        first: `[B]` the first generated token of every row (from the prefill forward).
        max_length: N, tokens to generate per row (image tokens, or `max_new_tokens` for text).
        eos_token_id: optional id(s) that end a row (text); the EOS token itself is kept.
        generator: a `torch.Generator` or one per row (compacted with the rows).

    Positions a row never generated (after its EOS) hold -1. The trace is logged per round (a few tensor references,
    no work on the hot path) and assembled by `full_trace()`.
    """

    def __init__(self, first: Tensor, max_length: int, *, eos_token_id: int | list[int] | None = None,
                 generator: Generators = None):  # fmt: skip
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
        if eos_token_id is not None:
            ids = [eos_token_id] if not isinstance(eos_token_id, (list, tuple)) else list(eos_token_id)
            if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise TypeError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
        batch, device = first.shape[0], first.device
        self.max_length = max_length
        self.eos = None if eos_token_id is None else torch.as_tensor(eos_token_id, device=device).reshape(-1)
        self.tokens = torch.full((batch, self.max_length), -1, dtype=torch.long, device=device)
        self.tokens[:, 0] = first
        self.count = torch.ones(batch, dtype=torch.long, device=device)
        self.ended = self._is_eos(first)  # [B] emitted EOS
        self.ids = torch.arange(batch, device=device)  # rows of the call's batch
        self.generator = generator
        self.rounds = 0
        self.max_remaining = self.max_length - 1  # refreshed by the loop once per round (one host sync)
        self._grid = self.tokens.clone()  # rows that left keep their tokens here
        self._left_generated = torch.zeros((), dtype=torch.long, device=device)  # tokens of rows that left
        self._widest = 0
        self._log = []  # per round: (ids, count before, tokens emitted, index of the closing token, bonus flags)

    # ------------------------------------------------------------------ per-row views
    @property
    def batch_size(self) -> int:
        """Rows still in the buffer."""
        return self.count.shape[0]

    @property
    def finished(self) -> Tensor:
        """`[B']` bool: row reached `max_length` or emitted EOS."""
        return (self.count >= self.max_length) | self.ended

    @property
    def pending(self) -> Tensor:
        """`[B']` the last generated token (not yet in the target's cache)."""
        return self.tokens.gather(1, (self.count - 1)[:, None])[:, 0]

    @property
    def last_committed(self) -> Tensor:
        """`[B']` the token before the pending one (the pending one itself for a row with one token)."""
        return self.tokens.gather(1, (self.count - 2).clamp(min=0)[:, None])[:, 0]

    def remaining(self) -> Tensor:
        """`[B']` tokens a row may still emit."""
        return self.max_length - self.count

    def _is_eos(self, tokens: Tensor) -> Tensor:
        if self.eos is None:
            return torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
        return (tokens[..., None] == self.eos).any(-1)

    # ------------------------------------------------------------------ updates
    def emit(self, new_tokens: Tensor, num_new: Tensor, bonus: Tensor | None = None) -> Tensor:
        """Append `new_tokens[b, :num_new[b]]` to each row, cut at `max_length` and after an EOS.

        Trace origins: the first `num_new - 1` tokens are accepted drafts; the last one is `BONUS` where `bonus [B']`
        says it was drawn from `p_target` itself (every draft on its path accepted; default: all rows, as in plain
        decoding), else `RESAMPLED`. Fixed-shape writes (no boolean indexing): no host sync.

        Returns:
            `[B']` tokens appended per row.
        """
        m = new_tokens.shape[1]
        self.reserve(m)
        self.tokens, count, self.ended, num = append_tokens(
            self.tokens, self.count, self.ended, new_tokens, num_new, self.max_length, self.eos, inplace=True
        )
        self.log_round(m, count, num, num_new - 1, bonus)
        return num

    def reserve(self, m: int) -> None:
        """Scratch columns after `max_length` for a round of `m` tokens (the writes that are not kept go there)."""
        if self.tokens.shape[1] < self.max_length + m:
            pad = self.tokens.new_full((self.batch_size, self.max_length + m - self.tokens.shape[1]), -1)
            self.tokens = torch.cat([self.tokens, pad], dim=1)

    def log_round(self, m: int, count: Tensor, num: Tensor, last: Tensor, bonus: Tensor | None) -> None:
        """The host-side part of `emit` (the tensors were written by `append_tokens`): log the round (`last`: the
        index of its closing token, `num_new - 1`) and take the new `count`."""
        self.rounds += 1
        self._log.append((self.ids, self.count, num, last, bonus))
        self._widest = max(self._widest, m)  # host-known: the widest round, for `full_trace`
        self.count = count

    def keep(self, index: Tensor, host_index: list[int] | None = None) -> None:
        """Keep only rows `index [B'']` (positions in the current buffer) for the rounds to come. `host_index`: the
        same rows as a host list (per-row generators are reindexed on the host without a read)."""
        self._grid[self.ids] = self.tokens[:, : self.max_length]
        self._left_generated = self._left_generated + self.count.sum() - self.count[index].sum()
        self.tokens, self.count, self.ended, self.ids = (
            self.tokens[index], self.count[index], self.ended[index], self.ids[index]
        )  # fmt: skip
        self.generator = select_generators(self.generator, index if host_index is None else host_index)

    # ------------------------------------------------------------------ whole grid
    def full(self) -> Tensor:
        """The `[B, N]` token grid of every row of the call (-1 where nothing was generated)."""
        grid = self._grid.clone()
        grid[self.ids] = self.tokens[:, : self.max_length]
        return grid

    def full_trace(self) -> DecodeTrace:
        """The `DecodeTrace` of every row of the call, assembled from the per-round log."""
        batch, n = self._grid.shape
        device = self._grid.device
        trace = DecodeTrace.empty(batch, n, device)
        trace.round[:, 0], trace.origin[:, 0] = 0, PREFILL
        if not self._log:
            return trace
        # every round at once (no host read: the widest round is known on the host); tokens not kept go to a dump
        # column `n` that is cut off
        ids, start, num, last = (torch.cat([entry[i] for entry in self._log]) for i in range(4))
        bonus = torch.cat([torch.ones_like(e[2], dtype=torch.bool) if e[4] is None else e[4] for e in self._log])
        index = torch.cat([torch.full_like(e[2], r) for r, e in enumerate(self._log, 1)])
        j = torch.arange(self._widest, device=device)
        keep = j[None, :] < num[:, None]
        rows = ids[:, None].expand_as(keep)
        cols = torch.where(keep, start[:, None] + j[None, :], n)
        origin = torch.where(j[None, :] < last[:, None], ACCEPTED, torch.where(bonus, BONUS, RESAMPLED)[:, None])
        round_ = torch.cat([trace.round, trace.round[:, :1]], dim=1)
        origin_ = torch.cat([trace.origin, trace.origin[:, :1]], dim=1)
        round_.index_put_((rows, cols), index[:, None].expand_as(keep).to(round_.dtype))
        origin_.index_put_((rows, cols), origin.to(origin_.dtype))
        trace.round, trace.origin = round_[:, :n].contiguous(), origin_[:, :n].contiguous()
        return trace

    def total_generated(self) -> Tensor:
        """Tokens generated so far over the whole call (a 0-d tensor: no host sync)."""
        return self._left_generated + self.count.sum()

    def num_generated(self) -> Tensor:
        """`[B]` tokens generated per row of the call (a tensor: no host sync)."""
        return (self.full() >= 0).sum(1)
