"""The shipped VLM zoo end to end: the real SmolLM2-135M LLaVA (`assets/mnist-vlm`) with its trained draft LM and
EAGLE head. Greedy speculative answers are token-identical to plain decoding and to transformers' `generate` (one
answer alone and a ragged batch), and the trained drafters really draft (acceptance well above an untrained head's)."""

import pytest
import torch

from mmspec.data.canvases import held_out_canvases
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


QUESTIONS = ["Describe the image.", "Which digit is at the top left?", "How many digits are in the image?"]


@pytest.fixture(scope="module")
def pipe():
    pipe = SpeculativeVLMPipeline.from_zoo("assets")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.draft_model is not None and pipe.eagle_head is not None
    return pipe


def test_zoo_greedy_lossless_and_drafters_accept(pipe):
    images = held_out_canvases(3, seed=11)
    plain = pipe(images=images, prompt=QUESTIONS, max_new_tokens=48, acceptance="none", output_type="ids").sequences
    ids, _, extra = pipe.encode(images[:1], QUESTIONS[:1], None, "cpu")
    ref = pipe.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                              eos_token_id=pipe.eos_token_ids(), **extra)  # fmt: skip
    assert [t for t in plain[0].tolist() if t >= 0] == ref[0, ids.shape[1] :].tolist()
    for drafter, knobs, min_tau in (("model", dict(num_draft_tokens=4), 2.0), ("eagle", dict(tree_depth=6), 3.0)):
        out = pipe(images=images, prompt=QUESTIONS, max_new_tokens=48, acceptance="greedy", drafter=drafter, **knobs)
        assert torch.equal(out.sequences, plain), drafter
        assert out.stats.mean_accepted_length > min_tau, (drafter, out.stats.mean_accepted_length)
