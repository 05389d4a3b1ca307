"""The vision-token seam: the target's prefill hands drafters the decoder's merged input embeddings and the image mask
(only when asked), `EagleDrafter` drives a head with `prefill_prompt` (a vision-token policy applied once at prefill)
losslessly, every draft token sits at the target's RoPE position although the head keeps fewer cache slots, and the
pipeline reports the draft-side image tokens. The policy here is the minimal one of `tests/vision_seam_fixtures.py`;
the real ViSpec / SpecVLM / MSD heads are in `tests/drafters/test_vision_drafters.py`."""

import pytest
import torch
from vision_seam_fixtures import StrideImageHead, check_positions, record_head_positions, stride_head_from
from vlm_fixtures import (
    IMAGE_TOKENS,
    hf_greedy,
    images,
    llava_pipe_with_heads,
    prompts,
    tiny_llava,
    tiny_lm,
    tiny_processor,
)

from mmspec.decoding import Guidance
from mmspec.models.hf.target import HFTarget
from mmspec.pipelines.vlm import SpeculativeVLMPipeline
from mmspec.sampling import SamplingParams


def _target(model):
    return HFTarget(model, Guidance(SamplingParams(1.0, 1.0, None, None, False)))


def test_prefill_hands_over_the_projected_image_features_and_the_image_mask():
    model, processor = tiny_llava(2, seed=1), tiny_processor()
    pipe = SpeculativeVLMPipeline(model, processor)
    ims, texts = images(2), ["w1", "w2 w3 w4 w5 w6 w7"]  # ragged: row 0 is right-padded
    ids, lengths, extra = pipe.encode(ims, texts, None, "cpu")
    assert int(lengths[0]) < ids.shape[1]
    out = _target(model).prefill(ids, lengths, 8, 1, return_hidden=True, return_vision=True, **extra)
    mask = out.image_mask
    assert mask.dtype == torch.bool and tuple(mask.shape) == tuple(ids.shape)
    assert mask.sum(1).tolist() == [IMAGE_TOKENS, IMAGE_TOKENS]
    assert not mask[0, int(lengths[0]) :].any()  # never at padding
    projected = model.model.get_image_features(pixel_values=extra["pixel_values"]).pooler_output
    torch.testing.assert_close(out.inputs_embeds[mask], torch.cat(list(projected)))  # the projector's output
    words = model.get_input_embeddings()(ids)
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    torch.testing.assert_close(out.inputs_embeds[~mask & valid], words[~mask & valid])
    # not asked: nothing recorded (plain decoding pays nothing), the same distribution
    plain = _target(model).prefill(ids, lengths, 8, 1, **extra)
    assert plain.inputs_embeds is None and plain.image_mask is None
    torch.testing.assert_close(plain.p_target, out.p_target)
    assert not model.model.language_model._forward_pre_hooks  # the recording hook is gone


def test_prefill_of_a_causal_lm_hands_over_token_embeddings_and_an_empty_mask():
    model = tiny_lm(2, seed=1)
    ids, lengths = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]), torch.tensor([4, 2])
    out = _target(model).prefill(ids, lengths, 4, 1, return_vision=True)
    torch.testing.assert_close(out.inputs_embeds, model.get_input_embeddings()(ids))
    assert tuple(out.image_mask.shape) == (2, 4) and not out.image_mask.any()


@pytest.fixture(scope="module")
def llava_pipe():
    return llava_pipe_with_heads()


@pytest.fixture(scope="module")
def stride_pipe(llava_pipe):
    p = llava_pipe
    pipe = SpeculativeVLMPipeline(
        p.model, p.processor, draft_model=p.draft_model, eagle_head=stride_head_from(p.eagle_head)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


KNOBS = [{"tree_depth": 4}, {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}]  # chain, EAGLE-2 tree


@pytest.mark.parametrize("knobs", KNOBS)
def test_vision_head_greedy_equals_plain_and_transformers(stride_pipe, knobs):
    p = stride_pipe
    ims, texts = images(1), prompts(1)
    reference = hf_greedy(p.model, p.processor, ims[0], texts[0], 24)
    out = p(images=ims, prompt=texts, max_new_tokens=24, acceptance="greedy", drafter="eagle", output_type="ids",
            **knobs)  # fmt: skip
    assert [t for t in out.sequences[0].tolist() if t >= 0] == reference
    assert out.stats.mean_accepted_length > 1.0  # drafts were accepted: multi-token commits exercised
    assert out.stats.extra["draft_image_tokens"] == IMAGE_TOKENS // StrideImageHead.stride


@pytest.mark.parametrize("knobs", KNOBS)
def test_vision_head_ragged_batch4_rows_finishing_early(stride_pipe, knobs):
    """Rows 0 and 1 end early (EOS) and leave the batch: the head cache's per-row offsets follow `select_rows`."""
    p = stride_pipe
    ims, texts = images(4), prompts(4)
    plain = p(images=ims, prompt=texts, max_new_tokens=30, acceptance="none", output_type="ids").sequences
    assert (plain[:2] == -1).any(1).all() and (plain[2:] >= 0).all()
    out = p(images=ims, prompt=texts, max_new_tokens=30, acceptance="exact", drafter="eagle", output_type="ids",
            **knobs)  # fmt: skip
    assert torch.equal(out.sequences, plain)
    assert out.stats.mean_accepted_length > 1.0
    assert out.stats.extra["draft_image_tokens_per_answer"] == [IMAGE_TOKENS // StrideImageHead.stride] * 4


@pytest.mark.parametrize("knobs", KNOBS)
def test_every_kept_token_sits_at_the_targets_position(stride_pipe, knobs):
    p = stride_pipe
    ims, texts = images(4), prompts(4)  # ragged, rows 0 and 1 leave early
    out, calls = record_head_positions(p, p.eagle_head, lambda: p(images=ims, prompt=texts, max_new_tokens=30,
                                       acceptance="greedy", drafter="eagle", output_type="ids", **knobs))  # fmt: skip
    check_positions(calls)
    assert out.stats.mean_accepted_length > 1.0
    assert out.stats.extra["draft_image_tokens_per_answer"] == [IMAGE_TOKENS // StrideImageHead.stride] * 4


def test_draft_image_tokens_of_eagle_and_the_draft_lm(llava_pipe):
    """A TextEagleHead reads a pair at every image token, the LLaVA draft LM its own copy of every image token;
    plain decoding reports nothing."""
    p = llava_pipe
    ims, texts = images(2), prompts(2)
    kw = dict(images=ims, prompt=texts, max_new_tokens=6, acceptance="greedy", output_type="ids")
    for drafter in ("eagle", "model"):
        extra = p(drafter=drafter, **kw).stats.extra
        assert extra["draft_image_tokens_per_answer"] == [IMAGE_TOKENS] * 2, drafter
        assert extra["draft_image_tokens"] == IMAGE_TOKENS and "gate_choice" not in extra
    assert "draft_image_tokens" not in p(**kw | dict(acceptance="none")).stats.extra


def test_a_vision_head_without_the_targets_embeddings_is_refused(stride_pipe):
    from mmspec.drafters.eagle import EagleDrafter

    p = stride_pipe
    ids, lengths, extra = p.encode(images(1), prompts(1), None, "cpu")
    target = _target(p.model)
    drafter = EagleDrafter(p.eagle_head, p.model, target.guidance, depth=3)
    assert drafter.needs_vision
    out = target.prefill(ids, lengths, 4, 8, return_hidden=True, **extra)
    from mmspec.decoding import SequenceState

    state = SequenceState(out.p_target[:, 0].argmax(-1), 4)
    with pytest.raises(ValueError, match="return_vision"):
        drafter.prefill(state, out)
