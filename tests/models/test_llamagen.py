"""LlamaGenGPT: cached chain/tree forwards vs step-by-step decoding and an independent naive reference."""

import math

import factories
import pytest
import torch
from factories import random_forest, root_path

import mmspec.models
from mmspec.cache import path_to_leaf, tree_inputs
from mmspec.models.llamagen.gpt import LlamaGenGPT, ffn_hidden_dim, rope_2d


ATOL = 1e-5


def tiny_gpt(seed=0, model_type="c2i", n_kv_head=None, n_layer=2, cls_token_num=None):
    return factories.tiny_gpt(seed, vocab_size=29, n_layer=n_layer, n_head=4, n_kv_head=n_kv_head, multiple_of=16,
                              num_classes=5, caption_dim=12, model_type=model_type,
                              cls_token_num=cls_token_num or (1 if model_type == "c2i" else 4), token_dropout_p=0.0,
                              resid_dropout_p=0.0, ffn_dropout_p=0.0, random_norms=True)  # fmt: skip


# ---------------------------------------------------------------------- independent reference
def upstream_rope_table(grid, head_dim, base, cls_token_num):
    """(cos, sin) per flattened position, written from upstream's description with complex numbers."""
    n = head_dim // 4  # pairs per axis
    freqs = [1.0 / (base ** (2 * i / (head_dim // 2))) for i in range(n)]
    rows = [torch.zeros(head_dim // 2, 2, dtype=torch.float64) for _ in range(cls_token_num)]
    for r in range(grid):
        for c in range(grid):
            z = [complex(math.cos(r * f), math.sin(r * f)) for f in freqs] + [
                complex(math.cos(c * f), math.sin(c * f)) for f in freqs
            ]
            rows.append(torch.tensor([[v.real, v.imag] for v in z], dtype=torch.float64))
    return torch.stack(rows)


def naive_logits(model, cond, tokens, cond_mask=None):
    """Logits after every prefix of `tokens` (incl. the empty one) for ONE row, with explicit float64 math."""
    c = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    t = c.cls_token_num
    if c.model_type == "c2i":
        x = sd["cls_embedding.embedding_table.weight"][cond][None]
    else:
        f = cond.double()
        hidden = f @ sd["cls_embedding.cap_proj.fc1.weight"].T
        hidden = torch.nn.functional.gelu(hidden, approximate="tanh")
        x = hidden @ sd["cls_embedding.cap_proj.fc2.weight"].T
    x = torch.cat([x, sd["tok_embeddings.weight"][tokens]])
    n = x.shape[0]
    hd, nh, nkv = model.head_dim, c.n_head, c.n_kv_head or c.n_head
    table = upstream_rope_table(model.grid_size, hd, c.rope_base, t)[:n]
    valid = torch.ones(n, dtype=torch.bool)
    if cond_mask is not None:
        valid[:t] = cond_mask

    def rms(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + c.norm_eps) * w

    def rot(v):  # v: [n, heads, hd]
        vc = torch.view_as_complex(v.reshape(n, v.shape[1], hd // 2, 2).contiguous())
        tc = torch.view_as_complex(table.contiguous())[:, None]
        return torch.view_as_real(vc * tc).reshape(n, v.shape[1], hd)

    for i in range(c.n_layer):
        p = f"layers.{i}."
        hn = rms(x, sd[p + "attention_norm.weight"])
        qkv = hn @ sd[p + "attention.wqkv.weight"].T
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
        q, k, v = rot(q.view(n, nh, hd)), rot(k.view(n, nkv, hd)), v.view(n, nkv, hd)
        out = torch.zeros(n, nh, hd, dtype=torch.float64)
        for head in range(nh):
            kh = head // (nh // nkv)
            for qi in range(n):
                keys = [j for j in range(qi + 1) if valid[j] or j == qi]
                s = torch.stack([q[qi, head] @ k[j, kh] for j in keys]) / math.sqrt(hd)
                w = torch.softmax(s, 0)
                out[qi, head] = sum(w[a] * v[j, kh] for a, j in enumerate(keys))
        x = x + out.reshape(n, -1) @ sd[p + "attention.wo.weight"].T
        hn = rms(x, sd[p + "ffn_norm.weight"])
        a = torch.nn.functional.silu(hn @ sd[p + "feed_forward.w1.weight"].T) * (
            hn @ sd[p + "feed_forward.w3.weight"].T
        )
        x = x + a @ sd[p + "feed_forward.w2.weight"].T
    return (rms(x, sd["norm.weight"]) @ sd["output.weight"].T)[t - 1 :]


def step_by_step(model, cond, seqs, cond_mask=None):
    """Reference: prefill then ONE token per forward. Returns per-row lists of logits after each prefix."""
    rows = len(seqs)
    cache = model.setup_cache(rows, model.config.cls_token_num + max(len(s) for s in seqs) + 2)
    out = [[x] for x in model.prefill(cond, cache, cond_mask=cond_mask).logits[:, 0]]
    for j in range(max(len(s) for s in seqs)):
        ids = torch.tensor([[s[j] if j < len(s) else 0] for s in seqs])
        logits = model(ids, cache).logits[:, 0]
        cache.commit(torch.tensor([1 if j < len(s) else 0 for s in seqs]))
        for r, s in enumerate(seqs):
            if j < len(s):
                out[r].append(logits[r])
    return [torch.stack(o) for o in out]


# ---------------------------------------------------------------------- tests
def test_ffn_hidden_dim_matches_upstream_sizes():
    assert ffn_hidden_dim(768) == 2048  # GPT-B
    assert ffn_hidden_dim(1280) == 3584  # GPT-XL (the LANTERN drafter's FFN 3584)
    assert ffn_hidden_dim(256) == 768
    assert ffn_hidden_dim(32, 16, 1.5) == 128  # int(1.5 * int(2 * 128 / 3)) = 127 -> 128


@pytest.mark.parametrize("cls_token_num", [1, 3])
def test_rope_matches_upstream_table(cls_token_num):
    grid, hd = 4, 16
    table = upstream_rope_table(grid, hd, 10000.0, cls_token_num)
    pos = torch.arange(table.shape[0])
    got = rope_2d(pos, hd, 10000.0, cls_token_num, grid)
    torch.testing.assert_close(got.double(), table, atol=1e-6, rtol=0)
    assert got[:cls_token_num].abs().sum() == 0  # condition prefix: zero rows, as upstream


@pytest.mark.parametrize("model_type,n_kv_head", [("c2i", None), ("c2i", 2), ("t2i", None)])
def test_train_forward_matches_naive_reference(model_type, n_kv_head):
    model = tiny_gpt(1, model_type, n_kv_head)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 29, (2, 7), generator=gen)
    if model_type == "c2i":
        cond, cond_mask = torch.tensor([2, 5]), None
    else:
        cond = torch.randn(2, 4, 12, generator=gen)
        cond_mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    logits = model.forward_train(tokens, cond, cond_mask=cond_mask).logits
    assert logits.shape == (2, 7, 29)
    for r in range(2):
        ref = naive_logits(model, cond[r], tokens[r, :-1], None if cond_mask is None else cond_mask[r])
        torch.testing.assert_close(logits[r].double(), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_chain_with_cfg_rows_and_ragged_lengths_matches_step_by_step(model_type):
    model = tiny_gpt(2, model_type, n_kv_head=2)
    gen = torch.Generator().manual_seed(1)
    batch = 2
    if model_type == "c2i":
        cond = torch.cat([torch.tensor([0, 4]), model.null_condition(batch)])
        cond_mask = None
    else:
        text = torch.randn(batch, 4, 12, generator=gen)
        cond = torch.cat([text, model.null_condition(batch)]).detach()
        cond_mask = torch.tensor([[False, True, True, True], [True, True, True, True]]).repeat(2, 1)
    rows = 2 * batch
    seqs = [torch.randint(0, 29, (10,), generator=gen) for _ in range(batch)]
    seqs = seqs + seqs  # CFG rows share tokens
    committed = [3, 6, 3, 6]  # ragged
    ref = step_by_step(model, cond, [s.tolist() for s in seqs], cond_mask)

    cache = model.setup_cache(rows, model.config.cls_token_num + 20)
    first = model.prefill(cond, cache, cond_mask=cond_mask).logits[:, 0]
    for r in range(rows):
        torch.testing.assert_close(first[r], ref[r][0], atol=ATOL, rtol=0)
    # one chain forward of 6 tokens, commit a different number per row
    chunk = torch.stack([s[:6] for s in seqs])
    out = model(chunk, cache).logits
    for r in range(rows):
        torch.testing.assert_close(out[r], ref[r][1:7], atol=ATOL, rtol=0)
    cache.commit(torch.tensor(committed))
    # rows now at different lengths: score the next 4 tokens of each row together
    nxt = torch.stack([s[c : c + 4] for s, c in zip(seqs, committed)])
    out = model(nxt, cache).logits
    for r, c in enumerate(committed):
        torch.testing.assert_close(out[r], ref[r][c + 1 : c + 5], atol=ATOL, rtol=0)
    # CFG rows also agree with the cache-free training forward (null class / uncond embedding)
    if model_type == "c2i":
        train = model.forward_train(torch.stack(seqs), cond).logits
        for r in range(rows):
            torch.testing.assert_close(train[r], ref[r][:10], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_forward_matches_path_decoding(seed):
    model = tiny_gpt(3 + seed, "c2i", n_kv_head=2)
    gen = torch.Generator().manual_seed(seed)
    rows, m = 4, 8
    cond = torch.tensor([1, 3, 5, 5])  # rows 2, 3: null class
    prefix = [torch.randint(0, 29, (n,), generator=gen) for n in (2, 5, 0, 3)]
    cache = model.setup_cache(rows, 1 + 16 + m)
    model.prefill(cond, cache)
    width = max(len(p) for p in prefix)
    ids = torch.stack([torch.cat([p, torch.zeros(width - len(p), dtype=torch.long)]) for p in prefix])
    model(ids, cache)
    cache.commit(torch.tensor([len(p) for p in prefix]))

    parents = random_forest(rows, m, gen)
    tokens = torch.randint(0, 29, (rows, m), generator=gen)
    pos, slots, mask = tree_inputs(parents, cache.lengths)
    lengths_before = cache.lengths.clone()
    out = model(tokens, cache, pos, slots, mask, return_hidden=True)
    assert out.logits.shape == (rows, m, 29) and out.hidden.shape == (rows, m, 32)
    assert torch.equal(cache.lengths, lengths_before)  # scratch only
    for r in range(rows):
        for i in range(m):
            seq = torch.cat([prefix[r], tokens[r, root_path(parents[r], i)]])
            ref = step_by_step(model, cond[r : r + 1], [seq.tolist()])[0][-1]
            torch.testing.assert_close(out.logits[r, i], ref, atol=ATOL, rtol=0)
    # hidden is exactly what enters `output`
    torch.testing.assert_close(model.output(out.hidden).float(), out.logits, atol=1e-6, rtol=0)


def test_commit_tree_path_then_continue_equals_decoding_the_path():
    model = tiny_gpt(7, "c2i")
    gen = torch.Generator().manual_seed(3)
    rows, m = 4, 7
    cond = torch.tensor([0, 2, 5, 5])
    cache = model.setup_cache(rows, 1 + 16 + m)
    model.prefill(cond, cache)
    first = torch.randint(0, 29, (rows, 2), generator=gen)
    model(first, cache)
    cache.commit(torch.tensor([2, 1, 2, 0]))
    prefix = [first[0, :2], first[1, :1], first[2, :2], first[3, :0]]

    parents = random_forest(rows, m, gen)
    tokens = torch.randint(0, 29, (rows, m), generator=gen)
    model(tokens, cache, *tree_inputs(parents, cache.lengths))
    leaf = torch.tensor([m - 1, 3, 0, -1])  # row 3 is "finished": commits nothing
    path, path_len = path_to_leaf(parents, leaf)
    cache.commit_path(path, path_len)
    accepted = [tokens[r, path[r, : path_len[r]]] for r in range(rows)]
    assert cache.lengths.tolist() == [1 + len(p) + len(a) for p, a in zip(prefix, accepted)]

    cont = torch.randint(0, 29, (rows, 3), generator=gen)
    out = model(cont, cache).logits
    for r in range(rows):
        seq = torch.cat([prefix[r], accepted[r], cont[r]])
        ref = step_by_step(model, cond[r : r + 1], [seq.tolist()])[0]
        torch.testing.assert_close(out[r], ref[-3:], atol=ATOL, rtol=0)


def test_t2i_padded_text_is_ignored():
    model = tiny_gpt(8, "t2i")
    gen = torch.Generator().manual_seed(4)
    text = torch.randn(2, 4, 12, generator=gen)
    mask = torch.tensor([[False, False, True, True], [False, True, True, True]])
    other = text.clone()
    other[~mask] = torch.randn(int((~mask).sum()), 12, generator=gen)
    tokens = torch.randint(0, 29, (2, 5), generator=gen)
    outs = []
    for t in (text, other):
        cache = model.setup_cache(2, 12)
        first = model.prefill(t, cache, cond_mask=mask).logits
        outs.append(torch.cat([first, model(tokens, cache).logits], 1))
    torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=0)
    train = model.forward_train(torch.cat([tokens, tokens[:, :1]], 1), text, cond_mask=mask).logits
    torch.testing.assert_close(outs[0], train, atol=ATOL, rtol=0)


def test_class_dropout_uses_generator_and_null_class():
    model = tiny_gpt(9).train()
    model.config  # noqa: B018
    tokens = torch.randint(0, 29, (64, 4), generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(64, dtype=torch.long)
    a = model.forward_train(tokens, labels, generator=torch.Generator().manual_seed(5)).logits
    b = model.forward_train(tokens, labels, generator=torch.Generator().manual_seed(5)).logits
    torch.testing.assert_close(a, b)
    model.eval()
    drop = torch.rand(64, generator=torch.Generator().manual_seed(5)) < model.config.class_dropout_prob
    assert 0 < int(drop.sum()) < 64
    ref = model.forward_train(tokens, torch.where(drop, 5, labels)).logits
    torch.testing.assert_close(a, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_save_load_round_trip_through_zoo_loader(tmp_path, model_type):
    model = tiny_gpt(10, model_type)
    model.save_pretrained(tmp_path / "m")
    loaded = mmspec.models.load(tmp_path / "m")
    assert isinstance(loaded, LlamaGenGPT) and loaded.config.model_type == model_type
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    # float16 storage (zoo) loads back as float32
    model.to(torch.float16).save_pretrained(tmp_path / "h")
    half = mmspec.models.load(tmp_path / "h")
    assert half.tok_embeddings.weight.dtype == torch.float32


def test_bad_inputs_raise_value_error_naming_the_argument():
    model = tiny_gpt(11)
    cache = model.setup_cache(2, 24)
    with pytest.raises(ValueError, match="cond"):
        model.prefill(torch.tensor([0, 6]), cache)  # 5 = null is the largest valid id
    with pytest.raises(ValueError, match="cond"):
        model.prefill(torch.tensor([-1, 0]), cache)
    with pytest.raises(ValueError, match="cond"):
        model.prefill(torch.tensor([0.0, 1.0]), cache)
    with pytest.raises(ValueError, match="cond"):
        model.prefill(torch.tensor([0, 1, 2]), cache)
    model.prefill(torch.tensor([0, 1]), cache)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[0, 29], [1, 2]]), cache)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([0, 1]), cache)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(3, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="input_pos"):
        model(torch.zeros(2, 2, dtype=torch.long), cache, input_pos=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.zeros(2, 2, dtype=torch.long), cache, attention_mask=torch.ones(2, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="write_slots"):
        model(torch.zeros(2, 2, dtype=torch.long), cache, write_slots=torch.full((2, 2), 99))
    with pytest.raises(ValueError, match="input_ids"):
        model.forward_train(torch.zeros(2, 17, dtype=torch.long), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="cond"):
        model.forward_train(torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="model_type"):
        LlamaGenGPT(model_type="x2i")
    with pytest.raises(ValueError, match="block_size"):
        LlamaGenGPT(dim=32, n_head=4, n_layer=1, block_size=15)
    t2i = tiny_gpt(12, "t2i")
    with pytest.raises(ValueError, match="cond_mask"):
        t2i.prefill(torch.zeros(2, 4, 12), t2i.setup_cache(2, 24), cond_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="cond"):
        t2i.prefill(torch.zeros(2, 3, 12), t2i.setup_cache(2, 24))
