"""The fast paths of a forward over `StaticKVCache` (issue 19: the plain VLM loop no slower than `generate`).

* `StaticKVCache.update` writes a contiguous run of slots shared by every row with one slice copy instead of an
  `index_put`: it must write exactly what a per-(row, slot) reference write gives, for ragged rows, M = 1 and M > 1,
  chains and trees, and take the slice only where the run really is shared.
* `HFTarget.run` hands SDPA one additive float mask per forward (not a boolean mask every layer converts).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vlm_fixtures import tiny_lm

from mmspec import cache as cache_module
from mmspec.cache import StaticKVCache, chain_inputs, tree_inputs
from mmspec.decoding.guidance import Guidance
from mmspec.models.hf.target import HFTarget
from mmspec.sampling import SamplingParams


class OpLog(TorchDispatchMode):
    """Names of the aten ops run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def reference_write(cache, layer, write_slots, k_new, v_new):
    """What a write must do: element by element, row by row, slot by slot."""
    for r in range(write_slots.shape[0]):
        for i in range(write_slots.shape[1]):
            s = int(write_slots[r, i])
            cache.k[layer, r, :, s] = k_new[r, :, i].to(cache.dtype)
            cache.v[layer, r, :, s] = v_new[r, :, i].to(cache.dtype)


def filled_cache(rows, lengths, max_seq=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = StaticKVCache(3, rows, 2, max_seq, 4)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.lengths = torch.tensor(lengths)
    return cache


def tree_slots(lengths, parents):
    return tree_inputs(torch.tensor(parents), torch.tensor(lengths))[1]


CASES = {  # name: (lengths, write_slots builder, whether every row shares one contiguous run)
    "one token, equal lengths": ([7, 7, 7], lambda n: chain_inputs(torch.tensor(n), 1)[1], True),
    "one token, ragged": ([7, 3, 9], lambda n: chain_inputs(torch.tensor(n), 1)[1], False),
    "chain, equal lengths": ([5, 5], lambda n: chain_inputs(torch.tensor(n), 4)[1], True),
    "chain, ragged": ([5, 8], lambda n: chain_inputs(torch.tensor(n), 4)[1], False),
    "batch 1 chain": ([11], lambda n: chain_inputs(torch.tensor(n), 3)[1], True),
    "tree, equal lengths": ([6, 6], lambda n: tree_slots(n, [[-1, 0, 0, 1, 2]] * 2), True),
    "tree, ragged": ([6, 4], lambda n: tree_slots(n, [[-1, 0, 0, 1, 2]] * 2), False),
    "prefill from 0": ([0, 0], lambda n: chain_inputs(torch.tensor(n), 9)[1], True),
    "same start, gap": ([4, 4], lambda n: torch.tensor([[4, 6], [4, 6]]), False),
    "reversed run": ([4], lambda n: torch.tensor([[6, 5, 4]]), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_update_writes_what_a_slot_by_slot_write_writes(name):
    lengths, build, shared = CASES[name]
    slots = build(lengths)
    fast, ref = filled_cache(len(lengths), lengths), filled_cache(len(lengths), lengths)
    g = torch.Generator().manual_seed(1)
    for layer in (0, 2):
        k_new = torch.randn(len(lengths), 2, slots.shape[1], 4, generator=g, dtype=torch.float64)  # cast on write
        v_new = torch.randn(len(lengths), 2, slots.shape[1], 4, generator=g, dtype=torch.float64)
        with OpLog() as log:
            k, v = fast.update(layer, slots, k_new, v_new)
        reference_write(ref, layer, slots, k_new, v_new)
        assert ("index_put_" in log.ops) != shared, log.ops  # the slice copy exactly where the run is shared
        assert k.data_ptr() == fast.k[layer].data_ptr() and k.shape == (len(lengths), 2, 24, 4)
        assert torch.equal(k, fast.k[layer]) and torch.equal(v, fast.v[layer])
    assert torch.equal(fast.k, ref.k) and torch.equal(fast.v, ref.v)  # every layer, every slot (scratch too)
    assert (cache_module.contiguous_run(slots) is not None) == shared


def test_run_is_decided_once_per_forward_and_again_after_an_in_place_change():
    cache, ref = filled_cache(2, [5, 5]), filled_cache(2, [5, 5])
    slots = chain_inputs(torch.tensor([5, 5]), 2)[1]
    g = torch.Generator().manual_seed(2)
    new = [torch.randn(2, 2, 2, 4, generator=g) for _ in range(4)]
    with OpLog() as log:
        for layer in range(3):  # one forward: three layers, one decision
            cache.update(layer, slots, new[0], new[1])
    assert log.ops.count("equal") == 1
    for layer in range(3):
        reference_write(ref, layer, slots, new[0], new[1])
    slots[1] += 3  # the same tensor, now ragged: decided again, written row by row
    cache.update(1, slots, new[2], new[3])
    reference_write(ref, 1, slots, new[2], new[3])
    assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)


def test_runs_past_the_cache_keep_the_general_write_and_its_error():
    cache = filled_cache(1, [22])
    slots = chain_inputs(torch.tensor([22]), 4)[1]  # slots 22..25 of 24
    assert cache_module.contiguous_run(slots) == 22
    with pytest.raises(IndexError):
        cache.update(0, slots, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4))


def test_commit_path_and_select_rows_after_fast_writes_match_slot_by_slot_writes():
    fast, ref = filled_cache(2, [6, 6]), filled_cache(2, [6, 6])
    parents = [[-1, 0, 0, 1, 2]] * 2
    slots = tree_slots([6, 6], parents)
    g = torch.Generator().manual_seed(3)
    for layer in range(3):
        k_new, v_new = torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g)
        fast.update(layer, slots, k_new, v_new)
        reference_write(ref, layer, slots, k_new, v_new)
    for c in (fast, ref):
        c.commit_path(torch.tensor([[0, 2, 4], [0, 1, 0]]), torch.tensor([3, 2])).select_rows(torch.tensor([1]))
    assert torch.equal(fast.k, ref.k) and torch.equal(fast.v, ref.v) and torch.equal(fast.lengths, ref.lengths)
    step = chain_inputs(fast.lengths, 1)[1]  # batch 1 after the selection: a shared run again
    k_new, v_new = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g)
    with OpLog() as log:
        fast.update(0, step, k_new, v_new)
    reference_write(ref, 0, step, k_new, v_new)
    assert torch.equal(fast.k, ref.k) and torch.equal(fast.v, ref.v)
    assert "index_put_" not in log.ops


def test_sdpa_gets_one_float_mask_per_forward_and_a_plain_step_no_index_put(monkeypatch):
    model = tiny_lm(3, seed=1)
    model.config._attn_implementation = "sdpa"
    target = HFTarget(model, Guidance(SamplingParams(do_sample=False)))
    target.prefill(torch.randint(4, 60, (1, 9)), torch.tensor([9]), 20, 4)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kwargs):
        calls.append((attn_mask, k.shape[-2]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with OpLog() as log:
        target.forward(torch.randint(4, 60, (1, 1)))
    # a plain CPU step: exactly the 9 prompt slots + the new token, no mask at all (SDPA's unmasked kernel)
    assert calls == [(None, 10)] * 3
    assert "index_put_" not in log.ops
    target.commit(torch.tensor([1]))
    calls.clear()
    target.forward(torch.randint(4, 60, (1, 3)))  # a chain: one additive float mask, shared by the layers
    assert len(calls) == 3 and {k for _, k in calls} == {13}
    masks = [m for m, _ in calls]
    assert all(m is not None and m.dtype == torch.float32 for m in masks)
    assert len({m.data_ptr() for m in masks}) == 1
    visible = masks[0].reshape(3, 13) == 0  # committed 10 slots + the causal chain
    assert visible[:, :10].all() and torch.equal(visible[:, 10:], torch.ones(3, 3, dtype=torch.bool).tril())
