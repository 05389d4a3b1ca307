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


__all__ = ["SequenceState"]


class SequenceState:
    """Token buffer of the rows still being decoded.

    Args:
        first: `[B]` the first generated token of every row (from the prefill forward).
        max_length: N, tokens to generate per row (image tokens, or `max_new_tokens` for text).
        eos_token_id: optional id(s) that end a row (text); the EOS token itself is kept.
        generator: a `torch.Generator` or one per row (compacted with the rows).
        pad_token_id: value of positions a row never generated (after its EOS).
    """

    def __init__(
        self,
        first: Tensor,
        max_length: int,
        *,
        eos_token_id: int | list[int] | None = None,
        generator: Generators = None,
        pad_token_id: int = -1,
    ):
        batch, device = first.shape[0], first.device
        self.max_length, self.pad_token_id = int(max_length), pad_token_id
        self.eos = None if eos_token_id is None else torch.as_tensor(eos_token_id, device=device).reshape(-1)
        self.tokens = torch.full((batch, self.max_length), pad_token_id, dtype=torch.long, device=device)
        self.tokens[:, 0] = first
        self.count = torch.ones(batch, dtype=torch.long, device=device)
        self.ended = self._is_eos(first)  # [B] emitted EOS
        self.ids = torch.arange(batch, device=device)  # rows of the call's batch
        self.generator = generator
        self.rounds = 0
        trace = DecodeTrace.empty(batch, self.max_length, device)
        trace.round[:, 0], trace.origin[:, 0] = 0, PREFILL
        self.round, self.origin = trace.round, trace.origin
        self._grid = self.tokens.clone()  # rows that left keep their tokens here
        self._left_generated = torch.zeros((), dtype=torch.long, device=device)  # tokens of rows that left
        self._trace = DecodeTrace(trace.round.clone(), trace.origin.clone())

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
    def emit(self, new_tokens: Tensor, num_new: Tensor, num_draft: Tensor | None = None) -> Tensor:
        """Append `new_tokens[b, :num_new[b]]` to each row, cut at `max_length` and after an EOS.

        `num_draft [B']` (drafts proposed this round) sets the trace origins: the first `num_new - 1` tokens are
        accepted drafts, the last is `BONUS` if every draft was accepted, else `RESAMPLED`.

        Returns:
            `[B']` tokens appended per row.
        """
        j = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        num = torch.minimum(num_new, self.remaining())
        eos_at = torch.where(self._is_eos(new_tokens) & (j < num[:, None]), j, new_tokens.shape[1]).amin(1)
        self.ended = self.ended | (eos_at < num)
        num = torch.minimum(num, eos_at + 1)
        keep = j[None, :] < num[:, None]  # [B', M]
        rows = torch.arange(self.batch_size, device=j.device)[:, None].expand_as(keep)
        cols = (self.count[:, None] + j[None, :]).clamp(max=self.max_length - 1)
        self.tokens[rows[keep], cols[keep]] = new_tokens[keep]
        self.rounds += 1
        self.round[rows[keep], cols[keep]] = self.rounds
        last = num_new - 1  # index of the correction / bonus token
        all_accepted = last >= (num_draft if num_draft is not None else 0)
        origin = torch.where(
            j[None, :] < last[:, None], ACCEPTED, torch.where(all_accepted, BONUS, RESAMPLED)[:, None]
        )
        self.origin[rows[keep], cols[keep]] = origin[keep].to(self.origin.dtype)
        self.count = self.count + num
        return num

    def keep(self, index: Tensor) -> None:
        """Keep only rows `index [B'']` (positions in the current buffer) for the rounds to come."""
        self._store()
        self._left_generated = self._left_generated + self.count.sum() - self.count[index].sum()
        self.tokens, self.count, self.ended, self.ids = (
            self.tokens[index], self.count[index], self.ended[index], self.ids[index]
        )  # fmt: skip
        self.round, self.origin = self.round[index], self.origin[index]
        self.generator = select_generators(self.generator, index)

    def _store(self) -> None:
        self._grid[self.ids] = self.tokens
        self._trace.round[self.ids], self._trace.origin[self.ids] = self.round, self.origin

    # ------------------------------------------------------------------ whole grid
    def full(self) -> Tensor:
        """The `[B, N]` token grid of every row of the call (`pad_token_id` where nothing was generated)."""
        self._store()
        return self._grid.clone()

    def full_trace(self) -> DecodeTrace:
        """The `DecodeTrace` of every row of the call."""
        self._store()
        return DecodeTrace(self._trace.round.clone(), self._trace.origin.clone())

    def total_generated(self) -> Tensor:
        """Tokens generated so far over the whole call (a 0-d tensor: no host sync)."""
        return self._left_generated + self.count.sum()

    def num_generated(self) -> Tensor:
        """`[B]` tokens generated per row of the call (a tensor: no host sync)."""
        self._store()
        return (self._trace.origin >= 0).sum(1)
