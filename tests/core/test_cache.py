"""StaticKVCache bookkeeping and the chain / tree input helpers (model-free)."""

import pytest
import torch
from factories import random_forest, root_path

from mmspec.cache import StaticKVCache, chain_inputs, check_parents, path_to_leaf, tree_ancestry, tree_inputs


def test_chain_inputs():
    pos, slots, mask = chain_inputs(torch.tensor([3, 5]), 4)
    assert pos.tolist() == [[3, 4, 5, 6], [5, 6, 7, 8]]
    assert torch.equal(slots, pos)
    assert torch.equal(mask[1], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_inputs_match_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    parents = random_forest(3, 9, gen)
    lengths = torch.tensor([2, 7, 4])
    pos, slots, mask = tree_inputs(parents, lengths)
    for r in range(3):
        for i in range(9):
            anc = root_path(parents[r], i)
            assert pos[r, i] == lengths[r] + len(anc) - 1
            assert slots[r, i] == lengths[r] + i
            assert mask[r, i].nonzero().flatten().tolist() == sorted(anc)
    depth, _ = tree_ancestry(parents)
    assert torch.equal(pos - lengths[:, None], depth)


def _old_tree_ancestry(parents):
    """tree_ancestry as it was (an int64 one-hot [rows, M, M] per level): the reference for bit-identity."""
    rows, m = parents.shape
    mask = torch.eye(m, dtype=torch.bool).expand(rows, m, m).clone()
    depth = torch.zeros(rows, m, dtype=torch.long)
    ancestor = parents.clone()
    while bool((ancestor >= 0).any()):
        found = ancestor >= 0
        mask |= torch.nn.functional.one_hot(ancestor.clamp(min=0), m).bool() & found[..., None]
        depth += found.long()
        ancestor = torch.where(found, parents.gather(1, ancestor.clamp(min=0)), -1)
    return depth, mask


@pytest.mark.parametrize("seed", range(6))
def test_tree_ancestry_bit_identical_to_one_hot_version(seed):
    """The scatter version gives exactly the old depths and masks (random forests, a chain, a flat tree, an SJD-PAC
    layout), with and without a fixed `max_depth` step count."""
    from mmspec.drafters.jacobi_pac import tree_layout

    gen = torch.Generator().manual_seed(seed)
    cases = [random_forest(4, 1 + 5 * seed, gen), torch.arange(-1, 7)[None].repeat(2, 1),
             torch.full((3, 5), -1), torch.tensor(tree_layout(3, 3, 6)[0])[None].repeat(2, 1)]  # fmt: skip
    for parents in cases:
        want_depth, want_mask = _old_tree_ancestry(parents)
        depth, mask = tree_ancestry(parents)
        assert torch.equal(depth, want_depth) and torch.equal(mask, want_mask)
        bound = int(want_depth.max()) if want_depth.numel() else 0  # the tightest step count
        for max_depth in (bound, bound + 2):
            depth, mask = tree_ancestry(parents, max_depth=max_depth)
            assert torch.equal(depth, want_depth) and torch.equal(mask, want_mask)
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert tree_ancestry(empty)[1].shape == (2, 0, 0)


def test_chain_is_the_linear_tree():
    lengths = torch.tensor([1, 4])
    parents = torch.tensor([[-1, 0, 1, 2]] * 2)
    assert all(torch.equal(a, b) for a, b in zip(tree_inputs(parents, lengths), chain_inputs(lengths, 4)))


def test_check_parents_rejects_non_topological():
    with pytest.raises(ValueError, match="parents"):
        check_parents(torch.tensor([[-1, 2, 0]]))
    with pytest.raises(ValueError, match="parents"):
        check_parents(torch.tensor([[-1, -2]]))
    with pytest.raises(ValueError, match="parents"):
        check_parents(torch.tensor([-1, 0]))


def test_path_to_leaf():
    parents = torch.tensor([[-1, 0, 0, 1, 3], [-1, -1, 1, 2, 2]])
    path, n = path_to_leaf(parents, torch.tensor([4, 3]))
    assert n.tolist() == [4, 3]
    assert path[0].tolist() == [0, 1, 3, 4]
    assert path[1, :3].tolist() == [1, 2, 3]
    path, n = path_to_leaf(parents, torch.tensor([-1, 0]))
    assert n.tolist() == [0, 1] and path[1, 0] == 0


def _filled_cache(rows=3, max_seq=16):
    cache = StaticKVCache(2, rows, 2, max_seq, 4)
    # K/V value encodes (layer, row, slot) so that moves are traceable
    layer = torch.arange(2)[:, None, None, None, None]
    row = torch.arange(rows)[None, :, None, None, None]
    slot = torch.arange(max_seq)[None, None, None, :, None]
    cache.k[:] = (layer * 1000 + row * 100 + slot).float()
    cache.v[:] = -cache.k
    return cache


def test_commit_path_gathers_into_contiguous_slots():
    cache = _filled_cache()
    cache.lengths = torch.tensor([2, 5, 3])
    parents = torch.tensor([[-1, 0, 0, 2, 3], [-1, 0, 1, 0, 3], [-1, -1, 0, 1, 2]])
    path, n = path_to_leaf(parents, torch.tensor([4, 2, -1]))
    old = cache.clone()
    cache.commit_path(path, n)
    assert cache.lengths.tolist() == [2 + 4, 5 + 3, 3]
    for r, nodes in enumerate([[0, 2, 3, 4], [0, 1, 2], []]):
        base = int(old.lengths[r])
        for j, node in enumerate(nodes):
            assert torch.equal(cache.k[:, r, :, base + j], old.k[:, r, :, base + node])
            assert torch.equal(cache.v[:, r, :, base + j], old.v[:, r, :, base + node])
        # the committed prefix is untouched
        assert torch.equal(cache.k[:, r, :, :base], old.k[:, r, :, :base])


def test_rollback_and_commit():
    cache = _filled_cache()
    cache.commit(torch.tensor([1, 2, 3]))
    snapshot = cache.lengths
    cache.commit(4)
    assert cache.lengths.tolist() == [5, 6, 7]
    cache.rollback(snapshot)
    assert cache.lengths.tolist() == [1, 2, 3]
    cache.rollback(0)
    assert cache.lengths.tolist() == [0, 0, 0]


def test_visibility_and_slot_checks():
    cache = StaticKVCache(1, 2, 1, 8, 4)
    cache.lengths = torch.tensor([2, 3])
    cache.key_valid[0, 0] = False
    pos, slots, mask = chain_inputs(cache.lengths, 2)
    vis = cache.visibility(slots, mask)
    assert vis[0].int().tolist() == [[0, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]]
    assert vis[1].int().tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="write_slots"):
        cache.check_slots(torch.tensor([[7, 8], [1, 2]]))
    with pytest.raises(ValueError, match="write_slots"):
        cache.check_slots(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="rows"):
        StaticKVCache(1, 0, 1, 8, 4)


def test_select_rows_keeps_the_chosen_sequences():
    cache = StaticKVCache(2, 4, 1, 8, 2)
    cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view_as(cache.k))
    cache.lengths = torch.tensor([1, 2, 3, 4])
    cache.key_valid[2, 0] = False
    ref = cache.clone()
    cache.select_rows(torch.tensor([2, 0]))
    assert cache.rows == 2 and cache.lengths.tolist() == [3, 1]
    assert torch.equal(cache.k, ref.k[:, [2, 0]]) and torch.equal(cache.key_valid, ref.key_valid[[2, 0]])
