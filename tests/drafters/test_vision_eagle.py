"""`VisionEagleHead`: the draft's compacted view keeps the target's positions, inference equals training's view, and
a ViSpec head starts as the text EAGLE head it was initialised from."""

import pytest
import torch
from vlm_fixtures import IMAGE_TOKENS, images, tiny_llava, tiny_lm, tiny_processor

from mmspec.drafters.eagle import commit_accepted
from mmspec.drafters.vision_eagle import VisionDraftCache, VisionEagleHead
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.models.hf.inputs import capture_decoder_inputs, image_token_mask


POLICIES = ("vispec", "specvlm", "msd")


def _head(model, policy, seed=0):
    torch.manual_seed(seed)
    head = VisionEagleHead.from_target(model, vision_policy=policy, num_queries=3).eval()
    for p in head.parameters():  # random, non-trivial weights everywhere (img_fc too)
        p.data.normal_(0, 0.2)
    return head


def _prompts(model, processor, texts=("<image> a b c", "d <image> e")):
    enc = processor(
        images=images(len(texts)), text=list(texts), return_tensors="pt", padding=True, padding_side="right"
    )
    with capture_decoder_inputs(model) as seen:
        hidden = model.model(**enc).last_hidden_state
    ids, lengths = enc["input_ids"], enc["attention_mask"].sum(1)
    return ids, lengths, hidden, seen["inputs_embeds"], image_token_mask(model, ids)


def _record_positions(head):
    seen = []
    handle = head.rotary.register_forward_hook(lambda m, args, out: seen.append(args[1].clone()))
    return seen, handle


@pytest.mark.parametrize("policy", POLICIES)
def test_every_kept_token_sits_at_the_targets_position_at_prefill_and_after(policy):
    model, processor = tiny_llava(), tiny_processor()
    ids, lengths, hidden, embeds, mask = _prompts(model, processor)
    head = _head(model, policy)
    rows, length = ids.shape
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    first = torch.tensor([5, 6])
    nxt[torch.arange(rows), lengths - 1] = first
    cache = head.setup_cache(rows, length + 16)
    seen, handle = _record_positions(head)
    info = head.prefill_prompt(model, cache, hidden, nxt, lengths, embeds, mask)
    (prefill_pos,) = seen
    for r in range(rows):
        n = int(cache.lengths[r]) - 1  # entries written for row r
        pos = prefill_pos[r, :n].tolist()
        image_pos = set(torch.nonzero(mask[r])[:, 0].tolist())
        text_pos = [p for p in range(1, int(lengths[r])) if p not in image_pos]
        drafted_image = [p for p in pos if p in image_pos]
        assert [p for p in pos if p not in image_pos] == text_pos  # every text pair at position i + 1
        assert pos == sorted(pos) and len(set(pos)) == len(pos)
        assert len(drafted_image) == int(info["draft_image_tokens"][r])
        if policy == "msd":
            assert drafted_image == sorted(image_pos)  # every image token, at its own position
        if policy == "vispec":  # num_queries - 1 tokens at the last positions of the image span
            assert drafted_image == sorted(image_pos)[-2:]
    # the pending pair (h[L_r - 1], first token) and a drafted chain continue at the target's positions
    seen.clear()
    feat = commit_accepted(head, model, cache, hidden[torch.arange(rows), lengths - 1][:, None], first[:, None])
    assert seen[0][:, 0].tolist() == lengths.tolist()
    head(feat, first[:, None], model, cache)
    assert seen[1][:, 0].tolist() == (lengths + 1).tolist()
    handle.remove()


@pytest.mark.parametrize("policy", POLICIES)
def test_cached_inference_equals_the_training_view(policy):
    """prefill_prompt + commit_accepted through the cache give the feature `forward_unrolled` (step 0) computes for
    the same pairs in one pass: what the head is trained on is what it drafts with."""
    model, processor = tiny_llava(), tiny_processor()
    ids, lengths, hidden, embeds, mask = _prompts(model, processor)
    head = _head(model, policy)
    rows, length = ids.shape
    first = torch.tensor([5, 6])
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    nxt[torch.arange(rows), lengths - 1] = first
    cache = head.setup_cache(rows, length + 16)
    head.prefill_prompt(model, cache, hidden, nxt, lengths, embeds, mask)
    feat = commit_accepted(head, model, cache, hidden[torch.arange(rows), lengths - 1][:, None], first[:, None])
    valid = torch.arange(length)[None] < lengths[:, None]
    full_mask = torch.cat([mask, mask.new_zeros(rows, 1)], dim=1)
    full_embeds = torch.cat([embeds, embeds.new_zeros(rows, 1, embeds.shape[-1])], dim=1)
    (out,) = head.forward_unrolled(hidden, nxt, model, 1, valid, inputs_embeds=full_embeds, image_mask=full_mask,
                                   prompt_lengths=lengths)  # fmt: skip
    torch.testing.assert_close(feat[:, 0], out[torch.arange(rows), lengths - 1], atol=1e-5, rtol=1e-5)


def test_vispec_head_starts_as_its_text_head_on_text_and_carries_the_image_vector():
    model = tiny_lm()
    torch.manual_seed(1)
    text = TextEagleHead.from_target(model).eval()
    for p in text.parameters():
        p.data.normal_(0, 0.2)
    head = VisionEagleHead.from_target(model, vision_policy="vispec", tokens_per_image=IMAGE_TOKENS).eval()
    head.load_text_head(text)
    ids = torch.tensor([[1, 7, 9, 11, 13, 4]])
    hidden = model.model(input_ids=ids).last_hidden_state
    mask = torch.zeros_like(ids, dtype=torch.bool)
    embeds = model.get_input_embeddings()(ids)
    ours = head.forward_unrolled(hidden[:, :-1], ids[:, 1:], model, 2, inputs_embeds=embeds, image_mask=mask)
    theirs = text.forward_unrolled(hidden[:, :-1], ids[:, 1:], model, 2)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="intermediate_size"):
        VisionEagleHead.from_target(model, vision_policy="msd", intermediate_size=32).load_text_head(text)


def test_select_rows_keeps_offsets_and_image_vectors_in_step():
    cache = VisionDraftCache(1, 3, 1, 8, 4)
    cache.position_offset = torch.tensor([5, 7, 9])
    cache.global_vec = torch.arange(3.0)[:, None].expand(3, 2).clone()
    cache.select_rows(torch.tensor([2, 0]))
    assert cache.position_offset.tolist() == [9, 5]
    assert cache.global_vec[:, 0].tolist() == [2.0, 0.0]


def test_bad_policy_and_cache_are_named():
    model = tiny_llava()
    with pytest.raises(ValueError, match="vision_policy"):
        VisionEagleHead.from_target(model, vision_policy="medusa")
    head = _head(model, "msd")
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="VisionDraftCache"):
        head.prefill_prompt(model, TextEagleHead.from_target(model).setup_cache(1, 8), torch.zeros(1, 4, 64), ids,
                            torch.tensor([4]), torch.zeros(1, 4, 64), torch.zeros(1, 4, dtype=torch.bool))  # fmt: skip
