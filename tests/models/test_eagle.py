"""EagleHead shapes / cache consistency and the EAGLE-2 dynamic tree builder."""

import pytest
import torch
from test_llamagen import tiny_gpt

import mmspec.models
from mmspec.cache import check_parents, prepend_root, tree_inputs
from mmspec.drafters.eagle import cfg_combine, draft_tree
from mmspec.models.llamagen.eagle import EagleHead


ATOL = 1e-5


def tiny_head(target, seed=0):
    head = EagleHead.from_target(target, multiple_of=16)
    head.init_weights(generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # larger weights -> peaky, distinct draft distributions
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return head.eval()


def _setup(batch=2, seed=0, guidance=True):
    target = tiny_gpt(seed, "c2i")
    head = tiny_head(target, seed)
    labels = torch.arange(batch) % 5
    cond = torch.cat([labels, target.null_condition(batch)]) if guidance else labels
    rows = cond.shape[0]
    cache = target.setup_cache(rows, 40)
    first = target.prefill(cond, cache, return_hidden=True)
    return target, head, cond, rows, first


def test_shapes_and_config():
    target, head, cond, rows, first = _setup()
    assert head.config.dim == target.config.dim and head.config.vocab_size == target.config.vocab_size
    assert not any("tok_embeddings" in k or "output" in k for k in head.state_dict())  # nothing of the target
    hcache = head.setup_cache(rows, 40)
    assert hcache.lengths.tolist() == [1] * rows and not hcache.key_valid[:, 0].any()
    ids = torch.randint(0, 29, (rows, 3))
    hidden = torch.randn(rows, 3, 32)
    feats = head(hidden, ids, target, hcache)
    assert feats.shape == (rows, 3, 32)
    assert head.compute_logits(target, feats).shape == (rows, 3, 29)
    assert head.forward_train(hidden, ids, target).shape == (rows, 3, 32)


def test_cached_chain_matches_train_forward():
    target, head, cond, rows, first = _setup(seed=1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 29, (rows, 6), generator=gen)
    hidden = torch.randn(rows, 6, 32, generator=gen)
    ref = head.forward_train(hidden, ids, target)
    hcache = head.setup_cache(rows, 40)
    a = head(hidden[:, :2], ids[:, :2], target, hcache)
    hcache.commit(torch.tensor([2, 1, 2, 1]))
    torch.testing.assert_close(a, ref[:, :2], atol=ATOL, rtol=0)
    # ragged continuation
    nxt_h = torch.stack([hidden[r, n : n + 3] for r, n in enumerate([2, 1, 2, 1])])
    nxt_i = torch.stack([ids[r, n : n + 3] for r, n in enumerate([2, 1, 2, 1])])
    b = head(nxt_h, nxt_i, target, hcache)
    for r, n in enumerate([2, 1, 2, 1]):
        torch.testing.assert_close(b[r], ref[r, n : n + 3], atol=ATOL, rtol=0)


def test_unrolled_training_matches_cached_chain_drafting():
    """Step j of `forward_unrolled` at position i = the head drafting the (j+1)-th chain token at inference: true
    pairs up to i - j committed in the head cache, then its own features fed back j times."""
    target, head, cond, rows, first = _setup(seed=3)
    gen = torch.Generator().manual_seed(2)
    n, steps = 7, 3
    ids = torch.randint(0, 29, (rows, n), generator=gen)
    hidden = torch.randn(rows, n, 32, generator=gen)
    outs = head.forward_unrolled(hidden, ids, target, steps)
    assert len(outs) == steps and all(o.shape == (rows, n, 32) for o in outs)
    torch.testing.assert_close(outs[0], head.forward_train(hidden, ids, target), atol=ATOL, rtol=0)
    for start in (0, 2, 3):  # last true pair
        hcache = head.setup_cache(rows, 40)
        feat = head(hidden[:, : start + 1], ids[:, : start + 1], target, hcache)[:, -1:]
        hcache.commit(start + 1)
        torch.testing.assert_close(feat[:, 0], outs[0][:, start], atol=ATOL, rtol=0)
        for j in range(1, steps):
            feat = head(feat, ids[:, start + j : start + j + 1], target, hcache)
            hcache.commit(1)
            torch.testing.assert_close(feat[:, 0], outs[j][:, start + j], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="steps"):
        head.forward_unrolled(hidden, ids, target, 0)


def test_head_tree_forward_matches_chains():
    target, head, cond, rows, first = _setup(seed=2)
    gen = torch.Generator().manual_seed(1)
    hcache = head.setup_cache(rows, 40)
    head(torch.randn(rows, 2, 32, generator=gen), torch.randint(0, 29, (rows, 2), generator=gen), target, hcache)
    hcache.commit(2)
    parents = torch.tensor([[-1, 0, 0, 1, -1]] * rows)
    ids = torch.randint(0, 29, (rows, 5), generator=gen)
    hidden = torch.randn(rows, 5, 32, generator=gen)
    out = head(hidden, ids, target, hcache, *tree_inputs(parents, hcache.lengths))
    for path in ([0, 1, 3], [0, 2], [4]):
        c = hcache.clone()
        ref = head(hidden[:, path], ids[:, path], target, c)
        torch.testing.assert_close(out[:, path[-1]], ref[:, -1], atol=ATOL, rtol=0)


def _reference_score(head, target, hcache, root_feat, path_tokens, scale):
    """Cumulative CFG-combined log-prob of a token path, drafting one token per head forward."""
    cache = hcache.clone()
    feat = root_feat  # [rows, 1, dim]
    total = torch.zeros(root_feat.shape[0] // 2)
    for tok in path_tokens.T:  # tok: [B]
        lp = torch.log_softmax(cfg_combine(head.compute_logits(target, feat)[:, 0], scale), -1)
        total = total + lp.gather(1, tok[:, None])[:, 0]
        feat = head(feat, torch.cat([tok, tok])[:, None], target, cache)
        cache.commit(1)
    return total


@pytest.mark.parametrize("depth,top_k,total", [(3, 3, 10), (2, 4, 20), (4, 2, 30), (1, 5, 3)])
def test_draft_tree_invariants_and_scores(depth, top_k, total):
    target, head, cond, rows, first = _setup(batch=2, seed=3)
    scale = 2.5
    gen = torch.Generator().manual_seed(2)
    hcache = head.setup_cache(rows, 48)
    # accepted chain with ragged lengths (cond/uncond rows of one item share them)
    hidden = torch.randn(rows, 3, 32, generator=gen)
    ids = torch.randint(0, 29, (rows, 3), generator=gen)
    ids[2:] = ids[:2]
    num_valid = torch.tensor([3, 1, 3, 1])
    before = hcache.clone()
    tree = draft_tree(
        head, target, hcache, hidden, ids, num_valid, guidance_scale=scale, depth=depth, top_k=top_k, total=total
    )
    assert hcache.lengths.tolist() == (before.lengths + num_valid).tolist()

    n = min(total, top_k + (depth - 1) * top_k * top_k)
    for t in tree:
        assert t.shape == (2, n)
    check_parents(tree.parents)
    for b in range(2):
        par, dep = tree.parents[b].tolist(), tree.depths[b].tolist()
        for i, p in enumerate(par):
            assert dep[i] == (1 if p < 0 else dep[p] + 1) and dep[i] <= depth
            if p >= 0:
                assert tree.scores[b, i] <= tree.scores[b, p] + 1e-6
        for p in set(par):
            children = [i for i, q in enumerate(par) if q == p]
            assert len(children) <= top_k
            assert len({int(tree.tokens[b, i]) for i in children}) == len(children)  # distinct siblings

    # scores are the step-by-step cumulative draft log-probs along each path
    chain = head(hidden, ids, target, before)
    before.commit(num_valid)
    root_feat = chain[torch.arange(rows), num_valid - 1][:, None]
    root_lp = torch.log_softmax(cfg_combine(head.compute_logits(target, root_feat)[:, 0], scale), -1)
    for b in range(2):
        depth1 = tree.tokens[b][tree.depths[b] == 1]
        assert set(depth1.tolist()) <= set(root_lp[b].topk(top_k).indices.tolist())
    for i in range(n):
        paths = []
        for b in range(2):
            path, j = [], i
            while j >= 0:
                path.append(int(tree.tokens[b, j]))
                j = int(tree.parents[b, j])
            paths.append(path[::-1])
        if len(paths[0]) != len(paths[1]):
            continue  # reference below batches equal-depth paths only
        ref = _reference_score(head, target, before, root_feat, torch.tensor(paths), scale)
        torch.testing.assert_close(tree.scores[:, i], ref, atol=1e-4, rtol=0)


def test_draft_tree_keeps_the_globally_best_nodes():
    """With total = all candidates minus a few, the dropped ones are the lowest scored."""
    target, head, cond, rows, first = _setup(batch=1, seed=4, guidance=False)
    hcache = head.setup_cache(rows, 48)
    hidden, ids = first.hidden, torch.tensor([[3]])
    full = draft_tree(head, target, hcache.clone(), hidden, ids, depth=3, top_k=3, total=1000)
    assert full.tokens.shape[1] == 3 + 2 * 9
    part = draft_tree(head, target, hcache.clone(), hidden, ids, depth=3, top_k=3, total=12)
    kept = part.scores[0].sort(descending=True).values
    torch.testing.assert_close(kept, full.scores[0].sort(descending=True).values[:12])


def test_prepend_root():
    tokens, parents = prepend_root(
        torch.tensor([7, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[-1, 0, -1], [-1, -1, 1]])
    )
    assert tokens.tolist() == [[7, 1, 2, 3], [8, 4, 5, 6]]
    assert parents.tolist() == [[-1, 0, 1, 0], [-1, 0, 0, 2]]
    check_parents(parents)


def test_save_load_round_trip(tmp_path):
    target = tiny_gpt(5)
    head = tiny_head(target, 5)
    head.save_pretrained(tmp_path / "eagle")
    loaded = mmspec.models.load(tmp_path / "eagle")
    assert isinstance(loaded, EagleHead)
    for (k, v), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_bad_inputs():
    target, head, cond, rows, first = _setup()
    hcache = head.setup_cache(rows, 40)
    with pytest.raises(ValueError, match="hidden"):
        head(torch.randn(rows, 2, 16), torch.zeros(rows, 2, dtype=torch.long), target, hcache)
    with pytest.raises(ValueError, match="input_ids"):
        head(torch.randn(rows, 2, 32), torch.zeros(rows, 3, dtype=torch.long), target, hcache)
    with pytest.raises(ValueError, match="input_ids"):
        head(torch.randn(rows, 1, 32), torch.full((rows, 1), 29), target, hcache)
    other = tiny_gpt(0, n_layer=1)
    other_big = type(other)(**{**other.config, "dim": 64, "n_head": 4})
    with pytest.raises(ValueError, match="dim"):
        head(torch.randn(rows, 1, 32), torch.zeros(rows, 1, dtype=torch.long), other_big, hcache)
    with pytest.raises(ValueError, match="rows"):
        draft_tree(
            head,
            target,
            head.setup_cache(3, 40),
            torch.randn(3, 1, 32),
            torch.zeros(3, 1, dtype=torch.long),
            guidance_scale=2.0,
        )
    with pytest.raises(ValueError, match="num_valid"):
        draft_tree(
            head,
            target,
            hcache,
            torch.randn(rows, 1, 32),
            torch.zeros(rows, 1, dtype=torch.long),
            torch.tensor([0, 1, 1, 1]),
        )


def test_training_tasks_smoke(tmp_path):
    """c2i -> draft -> eagle on a synthetic token file: a few steps each, zoo folders load back, eagle resumes."""
    import argparse

    from mmspec.train import draft as draft_task
    from mmspec.train import eagle as eagle_task
    from mmspec.train import gpt as gpt_task

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (60,), generator=g)
    codes = ((labels[:, None] * 25 + torch.arange(64)[None] // 8) % 256).to(torch.int16)
    data = tmp_path / "codes.pt"
    torch.save(
        {
            "codes": codes,
            "labels": labels,
            "splits": ["train", "val"],
            "codebook_size": 256,
            "split_ranges": {"train": [0, 50], "val": [50, 60]},
        },
        data,
    )
    common = f"--data {data} --batch-size 4 --log-every 2 --threads 1 --eval-size 10 --warmup-steps 1"

    def run(task, extra):
        parser = argparse.ArgumentParser()
        task.add_arguments(parser)
        return task.run(parser.parse_args(f"{common} {extra}".split()))

    target = run(gpt_task, f"--out {tmp_path / 'c2i'} --steps 3 --dim 32 --n-layer 2 --n-head 2 --multiple-of 32")
    assert target.config.num_classes == 10 and target.config.block_size == 64 and target.config.vocab_size == 256
    small = run(
        draft_task,
        f"--out {tmp_path / 'draft'} --target {tmp_path / 'c2i'} --steps 2 --dim 16 --n-layer 1 "
        "--n-head 2 --multiple-of 16",
    )
    assert small.config.vocab_size == 256 and small.config.n_layer == 1
    args = f"--out {tmp_path / 'eagle'} --target {tmp_path / 'c2i'}"
    run(eagle_task, f"{args} --steps 2")
    head = run(eagle_task, f"{args} --steps 3")  # resumes from step 2
    assert isinstance(mmspec.models.load(tmp_path / "eagle"), EagleHead) and head.config.dim == 32
    record = (tmp_path / "eagle" / "training.json").read_text()
    assert "val_accept_prob" in record and "val_accept_prob_step3" in record
    tuned = run(
        eagle_task,
        f"--out {tmp_path / 'eagle-ttt'} --target {tmp_path / 'c2i'} --init {tmp_path / 'eagle'} --steps 2 --unroll 3",
    )
    assert tuned.config.dim == 32
    with pytest.raises(ValueError, match="EagleHead"):
        run(eagle_task, f"--out {tmp_path / 'bad'} --target {tmp_path / 'c2i'} --init {tmp_path / 'draft'} --steps 1")
