"""The position provider of `HFTarget`: the position ids of the tokens a forward writes.

The default is position == slot (1-D RoPE), or `slot - offset[r]` with a per-row offset; `mmspec.models.hf.mrope`
is the 3-D one of the Qwen-VL family. A provider may also give the prompt's own ids at prefill (`prompt`)."""

from torch import Tensor


__all__ = ["Positions"]


class Positions:
    """Position ids of the new tokens: `position = logical - offset[r]` (default offset 0: position == slot).

    Subclass for other schemes (M-RoPE); `select_rows` keeps the per-row state in step with the cache.
    """

    def __init__(self, offset: Tensor | None = None):
        self.offset = offset

    def prompt(self, input_ids: Tensor, lengths: Tensor, model_inputs: dict) -> Tensor | None:
        """The prompt's position ids at prefill (right-padded `input_ids [rows, L]`, `lengths [rows]`, the
        processor's other inputs), or None: the slots' own (`__call__` of the slots)."""
        return None

    def __call__(self, logical: Tensor) -> Tensor:
        """`logical [rows, M]` (the token's index along its row: slot for chains, `length + depth` in a tree)."""
        return logical if self.offset is None else logical - self.offset[:, None]

    def select_rows(self, index: Tensor) -> None:
        if self.offset is not None:
            self.offset = self.offset[index]
