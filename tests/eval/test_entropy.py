"""`mmspec.eval.entropy`: the next-token statistics that place a zoo in a method's regime."""

import math

import pytest
import torch
from factories import tiny_gpt

from mmspec.eval.entropy import _summaries, next_token_stats


def test_summaries_of_known_distributions():
    v = 10
    uniform = torch.full((v,), 1 / v)
    onehot = torch.zeros(v).index_fill_(0, torch.tensor([3]), 1.0)
    skew = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (v - 4))
    out = _summaries(torch.stack([uniform, onehot, skew]))
    assert out["entropy"].tolist() == pytest.approx(
        [math.log(v), 0.0, -sum(p * math.log(p) for p in (0.5, 0.3, 0.15, 0.05))]
    )
    assert out["top1"].tolist() == pytest.approx([0.1, 1.0, 0.5])
    assert out["k90"].tolist() == [9.0, 1.0, 3.0]  # 9 of 10 uniform tokens cover 90 %; 0.5 + 0.3 + 0.15 >= 0.9


def test_stats_average_every_position_of_the_model():
    model = tiny_gpt(vocab_size=16, block_size=16, num_classes=4)
    codes = torch.randint(16, (5, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 3, 0])
    stats = next_token_stats(model, codes, labels, batch_size=2)
    assert stats["positions"] == 5 * 16 and stats["vocab"] == 16
    probs = model.forward_train(codes, labels, drop=torch.zeros(5, dtype=torch.bool)).logits.softmax(-1)
    assert stats["top1_prob"] == pytest.approx(float(probs.max(-1).values.mean()), rel=1e-5)
    assert 0 < stats["entropy_nats"] <= math.log(16) and stats["entropy_bits"] == pytest.approx(
        stats["entropy_nats"] / math.log(2)
    )
    with pytest.raises(ValueError, match="equal length"):
        next_token_stats(model, codes, labels[:3])


def test_stale_acceptance_is_one_for_a_context_free_model_and_matches_enumeration():
    import torch

    from mmspec.eval.entropy import stale_acceptance

    codes = torch.randint(16, (3, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2])
    free = tiny_gpt(vocab_size=16, block_size=16, num_classes=4)
    with torch.no_grad():  # no token embedding and no layer output: every position's p is the same (uniform)
        free.tok_embeddings.weight.zero_()
        for layer in free.layers:
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()
    assert stale_acceptance(free, codes, labels, torch.Generator().manual_seed(0)) == pytest.approx(1.0, abs=1e-6)

    model = tiny_gpt(vocab_size=16, block_size=16, num_classes=4, std=0.5)  # a context-dependent p
    drop = torch.zeros(1, dtype=torch.bool)
    exact = []  # E over j and x'_j ~ p(. | x_<j) of sum_v min(p(v | x_<=j), p(v | x_<j, x'_j)), by enumeration
    for n in range(len(codes)):
        x, y = codes[n : n + 1], labels[n : n + 1]
        p = model.forward_train(x, y, drop=drop).logits.softmax(-1)[0]
        for j in range(15):
            value = 0.0
            for v in range(16):
                stale = x.clone()
                stale[0, j] = v
                moved = model.forward_train(stale, y, drop=drop).logits.softmax(-1)[0, j + 1]
                value += float(p[j, v]) * float(torch.minimum(p[j + 1], moved).sum())
            exact.append(value)
    exact = sum(exact) / len(exact)
    sampled = stale_acceptance(model, codes, labels, torch.Generator().manual_seed(0), positions_per_row=600)
    assert exact < 0.97 and sampled == pytest.approx(exact, abs=0.02)


def test_neighbour_information_separates_copied_from_independent_grids():
    """Grids whose every token copies its left neighbour carry all of a token's entropy as left information and
    none from above (each row starts with a fresh token); independent tokens carry none either way. The pairs never
    cross a row's start (a left pair there would be the previous row's last token)."""
    from mmspec.eval.entropy import _pairs, neighbour_information

    g = torch.Generator().manual_seed(0)
    grid, vocab = 4, 8
    starts = torch.randint(0, vocab, (4000, grid, 1), generator=g)
    copied = starts.expand(-1, -1, grid).reshape(-1, grid * grid)  # each row: one token, repeated
    out = neighbour_information(copied[:3000], copied[3000:], grid, vocab)
    assert out["entropy"] == pytest.approx(math.log(vocab), abs=0.02)
    assert out["cond_entropy_left"] < 0.01 and out["info_left"] == pytest.approx(math.log(vocab), abs=0.03)
    assert abs(out["info_up"]) < 0.03  # rows are independent
    independent = torch.randint(0, vocab, (4000, grid * grid), generator=g)
    out = neighbour_information(independent[:3000], independent[3000:], grid, vocab)
    assert abs(out["info_left"]) < 0.02 and abs(out["info_up"]) < 0.02
    ctx, tok = _pairs(torch.arange(16)[None], grid, 1)
    assert len(tok) == grid * (grid - 1) and bool(((tok - ctx) == 1).all()) and not bool((tok % grid == 0).any())
    ctx, tok = _pairs(torch.arange(16)[None], grid, grid)
    assert bool(((tok - ctx) == grid).all()) and len(tok) == grid * (grid - 1)
