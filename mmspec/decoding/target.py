"""The target interface: what the decoding loop needs from the model whose distribution it must reproduce.

A target adapter owns the model's KV cache and its row layout (CFG streams, `mmspec.decoding.guidance`) and speaks
in batch items: it scores `M` new tokens per row after the committed prefix -- a chain, or a token tree given by
`parents` -- and returns the processed distributions `p_target [B, M, V]` (and, for feature drafters such as EAGLE,
the hidden states of every model row). Prefill is model-specific (class ids, text features, images) and is called
by the pipeline, not by the loop.

Adapters: `mmspec.models.llamagen.target.LlamaGenTarget` (LlamaGen GPT on `mmspec.cache.StaticKVCache`) and
`mmspec.models.hf.target.HFTarget`, both on `mmspec.decoding.cached_target.CachedTarget` (the cache's commit /
select_rows / lengths, written once). A transformers model plugs in the same way (a `Cache` subclass over `StaticKVCache`); where a cache slot is not the
RoPE position (left padding, image tokens that collapse to fewer positions, Qwen2-VL M-RoPE) the adapter keeps a
per-row position offset / position provider and passes explicit positions and 4-D masks to the model.
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor


__all__ = ["Target", "TargetOutput"]


@dataclass
class TargetOutput:
    """One target forward.

    Attributes:
        p_target: `[B, M, V]` processed distributions (CFG, temperature, top-k/p; float32) at each scored token.
        hidden: `[rows, M, dim]` final hidden states of every model row (all CFG streams), when asked for.
        input_ids, lengths: prefill of a text target only: the right-padded prompt `[rows, L]` and its lengths
            `[rows]` (with `hidden [rows, L, dim]`, EAGLE's pairs over the whole prompt).
        inputs_embeds, image_mask: prefill of a text target, only when asked for (`return_vision=True`, drafters
            with `needs_vision`): what the decoder received, `[rows, L, dim]` (the projected image features merged
            in at the image tokens), and `[rows, L]` True at the image tokens of the prompt (never at padding).
        positions: prefill of a text target whose positions are not its slots (M-RoPE): the prompt's position ids
            as the target used them, `[3, rows, L]`; None where position == slot.
    """

    p_target: Tensor
    hidden: Tensor | None = None
    input_ids: Tensor | None = None
    lengths: Tensor | None = None
    inputs_embeds: Tensor | None = None
    image_mask: Tensor | None = None
    positions: Tensor | None = None


@runtime_checkable
class Target(Protocol):
    """Scores drafts against a committed prefix, and commits what was accepted."""

    vocab_size: int

    def forward(self, tokens: Tensor, parents: Tensor | None = None, return_hidden: bool = False) -> TargetOutput:
        """Score `tokens [B, M]` after each row's committed prefix: a chain, or a tree (`parents [B, M]`,
        topological, -1 = child of the last committed token). Writes scratch K/V; commits nothing."""

    def commit(self, num_tokens: Tensor, path: Tensor | None = None) -> None:
        """Commit the first `num_tokens [B]` scored tokens of a chain, or the tree nodes `path [B, P]`."""

    def select_rows(self, index: Tensor) -> None:
        """Keep only batch items `index [B']`.

        Optional (looked up with `getattr`, on a target or a drafter): `sync_value() -> Tensor | None` (a device
        scalar, or a 1-D tensor of several) and `sync_host(value)`: the loop reads it with its one read per round
        and hands it back after compaction (an int, or a list for a 1-D tensor), for host-side bookkeeping (the
        transformers adapters' attention windows, an adaptive draft length's next width)."""
