"""`CachedTarget`: the cache bookkeeping every target adapter shares (`LlamaGenTarget`, `HFTarget`, `JanusTarget`):
commits and row selection reach every CFG stream's rows, per-row state beside the cache follows `select_rows`."""

import torch

from mmspec.cache import StaticKVCache
from mmspec.decoding.cached_target import CachedTarget
from mmspec.decoding.guidance import Guidance
from mmspec.sampling import SamplingParams


class _Adapter(CachedTarget):
    """A target with CFG rows `[cond; uncond]` and one number of per-row state beside its cache."""

    def __init__(self, guidance, batch):
        super().__init__(guidance)
        rows = batch * guidance.streams
        self.cache = StaticKVCache(1, rows, 1, 16, 2)
        self.cache.lengths = torch.arange(rows) + 3
        self.tag = torch.arange(rows) * 10
        with torch.no_grad():  # K at slot s of row r: r * 100 + s, to see where a commit moved it
            self.cache.k[0, :, 0, :, 0] = torch.arange(rows)[:, None] * 100 + torch.arange(16)[None]

    def select_state_rows(self, rows):
        self.tag = self.tag[rows]


def test_commit_and_select_rows_address_every_stream():
    target = _Adapter(Guidance(SamplingParams(guidance_scale=2.0)), batch=3)
    assert target.lengths.tolist() == [3, 4, 5]  # batch items: the cond stream
    target.commit(torch.tensor([1, 0, 2]))  # a chain: each item's rows in both streams
    assert target.cache.lengths.tolist() == [4, 4, 7, 7, 7, 10]
    # a tree path: item 0 keeps node 2 (written at length + 2), in both of its rows
    target.commit(torch.tensor([1, 0, 0]), torch.tensor([[2], [0], [0]]))
    assert target.cache.lengths.tolist() == [5, 4, 7, 8, 7, 10]
    assert target.cache.k[0, 0, 0, 4, 0] == 6 and target.cache.k[0, 3, 0, 7, 0] == 309
    target.select_rows(torch.tensor([2, 0]))
    assert target.cache.lengths.tolist() == [7, 5, 10, 8]
    assert target.tag.tolist() == [20, 0, 50, 30]  # the hook got the model rows of both streams
    assert target.lengths.tolist() == [7, 5]


def test_one_stream_without_guidance():
    target = _Adapter(Guidance(SamplingParams()), batch=2)
    target.commit(torch.tensor([2, 1]))
    target.select_rows(torch.tensor([1]))
    assert target.cache.lengths.tolist() == [5] and target.tag.tolist() == [10] and target.lengths.tolist() == [5]
