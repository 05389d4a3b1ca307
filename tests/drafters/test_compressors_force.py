"""`Elastic.force`: the per-compressor ablation sends every input with an image to one expert at inference."""

import pytest
import torch

from mmspec.compressors import build_policy, gather_images


def test_forced_expert_overrides_the_gate_at_inference_only():
    torch.manual_seed(0)
    policy = build_policy("elastic", 16, 4)
    policy.eval()
    embeds = torch.randn(3, 6, 16)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, 1:5] = True
    mask[1, 2:6] = True  # row 2: no image
    image, question = gather_images(embeds, mask), torch.randn(3, 16)
    for name in policy.names:
        out = policy.force(name)(image, question)
        assert out.choice.tolist() == [policy.names.index(name)] * 2 + [-1]
        alone = policy.experts[name].eval()(gather_images(embeds[:2], mask[:2]), question[:2])
        torch.testing.assert_close(out.tokens[:2, : alone.tokens.shape[1]], alone.tokens)
    policy.force(None)
    gate = policy.gate(question).argmax(1)
    assert policy(image, question).choice[:2].tolist() == gate[:2].tolist()
    policy.force("pool").train()  # training keeps the gate (and its Gumbel draw)
    choices = {tuple(policy(image, question, generator=torch.Generator().manual_seed(s)).choice.tolist())
               for s in range(20)}  # fmt: skip
    assert len(choices) > 1
    with pytest.raises(ValueError, match="name"):
        policy.force("medusa")
