"""`CachedTarget`: the part of a target adapter (`mmspec.decoding.target.Target`) that is the same for every model
family: it owns one `mmspec.cache.StaticKVCache` over every model row (`[cond; uncond]` with guidance on, the
conditional rows only with guidance off, `mmspec.decoding.guidance.Guidance`) and commits, compacts and reports it
in batch items.

A family's adapter subclasses it and adds `prefill` (which creates `self.cache`) and `forward`:
`mmspec.models.llamagen.target.LlamaGenTarget`, `mmspec.models.hf.target.HFTarget` (and `JanusTarget` on it).
"""

import torch
from torch import Tensor

from mmspec.cache import StaticKVCache
from mmspec.decoding.captured_draft import captures_rounds
from mmspec.decoding.compiled import pad_rows, row_bucket
from mmspec.decoding.guidance import Guidance


__all__ = ["CachedTarget", "commit_path"]


class CachedTarget:
    """A target adapter's cache bookkeeping: `commit`, `select_rows` and `lengths` over `self.cache`.

    Args:
        guidance: the call's `Guidance` (stream layout of the cache rows).

    Subclasses set `self.cache` at prefill; per-row state they keep beside the cache follows `select_rows` through
    `select_state_rows`.
    """

    bucket_rows = False  # the adapter's `forward` pads its items (`pad_items` / `live_items`) when captured

    def __init__(self, guidance: Guidance):
        self.guidance = guidance
        self.cache: StaticKVCache | None = None
        self.compiler = None  # a `mmspec.decoding.compiled.Compiler`: the forwards run captured (enable_compile)
        self.live = None  # captured, after a compaction: the items in use; the cache's items past them are padding

    def pad_items(self, x: Tensor | None, fill=None) -> Tensor | None:
        """`x [B', ...]` over the items in use, padded to the cache's items (`mmspec.decoding.compiled.pad_rows`)."""
        return x if self.live is None else pad_rows(x, self.cache.rows // self.guidance.streams, fill)

    def live_items(self, x: Tensor | None) -> Tensor | None:
        """`x [items, ...]` cut to the items in use."""
        return x if self.live is None or x is None else x[: self.live]

    def live_rows(self, x: Tensor | None) -> Tensor | None:
        """`x [rows, ...]` over the cache's model rows cut to those of the items in use (every stream)."""
        if self.live is None or x is None:
            return x
        index = torch.arange(self.live, device=x.device)
        return x[self.guidance.row_index(index, self.cache.rows // self.guidance.streams)]

    def commit(self, num_tokens: Tensor, path: Tensor | None = None) -> None:
        """Commit the first `num_tokens [B]` scored tokens of a chain, or the tree nodes `path [B, P]`, in every
        stream's rows (padding items commit nothing)."""
        num = self.guidance.rows(self.pad_items(num_tokens, fill=0))
        if path is None:
            self.cache.commit(num)
        elif captures_rounds(self.compiler):  # the path's K/V copies as one graph (eager: ~30 ops a round)
            self.compiler.static(self.cache)
            run = self.compiler.forward("commit", commit_path, device=self.cache.device)
            self.cache.lengths = run(self.cache, self.guidance.rows(self.pad_items(path)), num)
        else:
            self.cache.commit_path(self.guidance.rows(self.pad_items(path)), num)

    def select_rows(self, index: Tensor) -> None:
        """Keep only batch items `index [B']` (their rows in every stream). Captured (`bucket_rows`), the cache
        keeps `row_bucket(B')` items: the kept ones first, then copies of the first as padding that commits nothing
        and is never read back, so the captured forwards see a few row counts over a whole generation."""
        items = self.cache.rows // self.guidance.streams
        if self.compiler is not None and self.bucket_rows:
            self.live = index.shape[0]
            index = pad_rows(index, row_bucket(self.live, items))
        rows = self.guidance.row_index(index, items)
        self.cache.select_rows(rows)
        self.select_state_rows(rows)

    def select_state_rows(self, rows: Tensor) -> None:
        """Keep only model rows `rows` of per-row state held beside the cache (none here)."""

    @property
    def lengths(self) -> Tensor:
        """`[B]` committed cache lengths of the batch items."""
        return self.live_items(self.guidance.items(self.cache.lengths))


def commit_path(cache: StaticKVCache, path: Tensor, path_len: Tensor) -> Tensor:
    """`cache.commit_path(path, path_len)` as a function for a captured graph (role "commit", with
    `enable_compile(verify=True)`): the K/V copies are written in the cache's own storage; returns the new committed
    lengths, which the caller sets (a graph's outputs are the caller's)."""
    cache.commit_path(path, path_len)
    return cache.lengths
