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
