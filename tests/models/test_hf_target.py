"""`mmspec.models.hf.target`: transformers models on mmspec's StaticKVCache (chain and tree forwards, ragged rows, row
selection) against no-cache forwards of the same model."""

import pytest
import torch
from vlm_fixtures import images, tiny_llava, tiny_lm, tiny_processor

from mmspec.decoding.guidance import Guidance
from mmspec.models.hf.target import HFTarget, Positions, StaticCache, right_align
from mmspec.sampling import SamplingParams


def reference_hidden(model, ids, **extra):
    with torch.no_grad():
        return model.model(input_ids=ids[None], **extra).last_hidden_state[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_chain_and_tree_match_no_cache_forwards(attn):
    model = tiny_lm(3, seed=1)
    model.config._attn_implementation = attn
    target = HFTarget(model, Guidance(SamplingParams(do_sample=False)))
    ids = torch.randint(4, 60, (3, 10))
    lengths = torch.tensor([10, 6, 8])
    out = target.prefill(torch.where(torch.arange(10) < lengths[:, None], ids, 0), lengths, 20, 8, return_hidden=True)
    for r in range(3):  # padded prompts give the unpadded prompt's states
        ref = reference_hidden(model, ids[r, : lengths[r]])
        torch.testing.assert_close(out.hidden[r, : lengths[r]], ref, atol=1e-5, rtol=1e-5)
    chain = torch.randint(4, 60, (3, 4))
    hidden = target.forward(chain, return_hidden=True).hidden
    for r in range(3):
        ref = reference_hidden(model, torch.cat([ids[r, : lengths[r]], chain[r]]))[-4:]
        torch.testing.assert_close(hidden[r], ref, atol=1e-5, rtol=1e-5)
    committed = torch.tensor([2, 4, 1])
    target.commit(committed)
    parents = torch.tensor([[-1, 0, 0, 1, 2]]).expand(3, 5)
    tree = torch.randint(4, 60, (3, 5))
    hidden = target.forward(tree, parents, return_hidden=True).hidden
    paths = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4]}
    for r in range(3):
        prefix = torch.cat([ids[r, : lengths[r]], chain[r, : committed[r]]])
        for node, path in paths.items():
            ref = reference_hidden(model, torch.cat([prefix, tree[r, path]]))[-1]
            torch.testing.assert_close(hidden[r, node], ref, atol=1e-5, rtol=1e-5)
    # commit the path 0 -> 2 -> 4 of row 0 only, drop row 1, and continue with a chain
    target.commit(torch.tensor([3, 0, 0]), torch.tensor([[0, 2, 4]] * 3))
    target.select_rows(torch.tensor([0, 2]))
    nxt = torch.randint(4, 60, (2, 2))
    hidden = target.forward(nxt, return_hidden=True).hidden
    prefix0 = torch.cat([ids[0], chain[0, :2], tree[0, [0, 2, 4]], nxt[0]])
    torch.testing.assert_close(hidden[0], reference_hidden(model, prefix0)[-2:], atol=1e-5, rtol=1e-5)
    prefix2 = torch.cat([ids[2, :8], chain[2, :1], nxt[1]])
    torch.testing.assert_close(hidden[1], reference_hidden(model, prefix2)[-2:], atol=1e-5, rtol=1e-5)


def test_llava_prefill_runs_the_vision_tower_once_and_matches():
    model, processor = tiny_llava(2, seed=0), tiny_processor()
    target = HFTarget(model, Guidance(SamplingParams(do_sample=False)))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w1 w2"}]}],
                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
    enc = processor(images=images(1), text=[text], return_tensors="pt")
    calls = []
    handle = model.model.vision_tower.register_forward_hook(lambda *a: calls.append(1))
    out = target.prefill(enc["input_ids"], torch.tensor([enc["input_ids"].shape[1]]), 8, 4, return_hidden=True,
                         pixel_values=enc["pixel_values"])  # fmt: skip
    target.forward(torch.tensor([[5, 6, 7]]))
    handle.remove()
    assert len(calls) == 1  # features are never re-sent after the prefill
    ref = reference_hidden(model, enc["input_ids"][0], pixel_values=enc["pixel_values"])
    torch.testing.assert_close(out.hidden[0], ref, atol=1e-5, rtol=1e-5)


def test_right_align_and_positions():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    aligned, lengths = right_align(ids, mask, pad_token_id=0)
    assert aligned.tolist() == [[5, 6, 0, 0], [7, 8, 9, 0]] and lengths.tolist() == [2, 3]
    with pytest.raises(ValueError, match="attention_mask"):
        right_align(ids, mask[:, :3])
    with pytest.raises(ValueError, match="at least one"):
        right_align(ids, torch.zeros_like(mask))
    pos = Positions(torch.tensor([1, 3]))
    assert pos(torch.tensor([[4, 5], [4, 5]])).tolist() == [[3, 4], [1, 2]]
    pos.select_rows(torch.tensor([1]))
    assert pos.offset.tolist() == [3]


def test_static_cache_reports_its_layout():
    model = tiny_lm(2)
    target = HFTarget(model, Guidance(SamplingParams(do_sample=False)))
    target.prefill(torch.tensor([[5, 6, 7]]), torch.tensor([3]), 4, 2)
    cache = StaticCache(target.cache)
    assert len(cache) == 2 and cache.get_seq_length() == 3 and cache.get_mask_sizes(1)[0] == target.cache.max_seq
    with pytest.raises(ValueError, match="guidance"):
        HFTarget(model, Guidance(SamplingParams(guidance_scale=2.0)))


def test_select_rows_keeps_the_position_offsets_in_step():
    """`HFTarget`'s per-row positions follow `CachedTarget.select_rows` (its `select_state_rows` hook)."""
    model = tiny_lm(2)
    target = HFTarget(model, Guidance(SamplingParams(do_sample=False)), positions=Positions(torch.tensor([1, 2, 3])))
    target.prefill(torch.randint(4, 60, (3, 5)), torch.tensor([5, 4, 3]), 4, 2)
    target.select_rows(torch.tensor([2, 0]))
    assert target.positions.offset.tolist() == [3, 1] and target.lengths.tolist() == [3, 5]
