"""`CachedTarget`: the part of a target adapter (`mmspec.decoding.target.Target`) that is the same for every model
family: it owns one `mmspec.cache.StaticKVCache` over every model row (`[cond; uncond]` with guidance on, the
conditional rows only with guidance off, `mmspec.decoding.guidance.Guidance`) and commits, compacts and reports it
in batch items.

A family's adapter subclasses it and adds `prefill` (which creates `self.cache`) and `forward`:
`mmspec.models.llamagen.target.LlamaGenTarget`, `mmspec.models.hf.target.HFTarget` (and `JanusTarget` on it).
"""

from torch import Tensor

from mmspec.cache import StaticKVCache
from mmspec.decoding.guidance import Guidance


__all__ = ["CachedTarget"]


class CachedTarget:
    """A target adapter's cache bookkeeping: `commit`, `select_rows` and `lengths` over `self.cache`.

    Args:
        guidance: the call's `Guidance` (stream layout of the cache rows).

    Subclasses set `self.cache` at prefill; per-row state they keep beside the cache follows `select_rows` through
    `select_state_rows`.
    """

    def __init__(self, guidance: Guidance):
        self.guidance = guidance
        self.cache: StaticKVCache | None = None
        self.compiler = None  # a `mmspec.decoding.compiled.Compiler`: the forwards run captured (enable_compile)

    def commit(self, num_tokens: Tensor, path: Tensor | None = None) -> None:
        """Commit the first `num_tokens [B]` scored tokens of a chain, or the tree nodes `path [B, P]`, in every
        stream's rows."""
        num = self.guidance.rows(num_tokens)
        if path is None:
            self.cache.commit(num)
        else:
            self.cache.commit_path(self.guidance.rows(path), num)

    def select_rows(self, index: Tensor) -> None:
        """Keep only batch items `index [B']` (their rows in every stream)."""
        rows = self.guidance.row_index(index, self.cache.rows // self.guidance.streams)
        self.cache.select_rows(rows)
        self.select_state_rows(rows)

    def select_state_rows(self, rows: Tensor) -> None:
        """Keep only model rows `rows` of per-row state held beside the cache (none here)."""

    @property
    def lengths(self) -> Tensor:
        """`[B]` committed cache lengths of the batch items."""
        return self.guidance.items(self.cache.lengths)
