"""EAGLE-3 heads (`mmspec.models.hf.eagle3.Eagle3Head`) on the VLM pipeline, with tiny random transformers models:
the target adapter returns the inputs of the aux layers (transformers' own `hidden_states[i]`), drafting is lossless
(greedy equality with plain decoding at batch 1 and on a ragged batch, chains and EAGLE-2 trees, both image-input
conventions; the law of sampled tokens by chi-square), `image_inputs="embeds"` feeds the target's image features at
image positions, heads made for another target are refused naming the field."""

import pytest
import torch
from eagle3_fixtures import AUX, eagle3_pipe, with_image_inputs
from factories import assert_first_tokens_follow
from test_pipeline_vlm import _exact_marginals
from vlm_fixtures import images, prompts, tiny_llava

from mmspec.decoding import Guidance
from mmspec.drafters.compat import check_vlm_eagle_head
from mmspec.models.hf.eagle3 import Eagle3Head
from mmspec.models.hf.target import HFTarget
from mmspec.pipelines.vlm import SpeculativeVLMPipeline
from mmspec.sampling import SamplingParams


KNOBS = [{"tree_depth": 4}, {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}]  # chain, EAGLE-2 tree


def pipe_with(image_inputs):
    pipe = eagle3_pipe()
    if image_inputs == "placeholder":
        return pipe
    twin = SpeculativeVLMPipeline(pipe.model, pipe.processor, eagle_head=with_image_inputs(pipe.eagle_head, "embeds"))
    twin.set_progress_bar_config(disable=True)
    return twin


def test_the_target_returns_the_inputs_of_the_aux_layers():
    pipe = eagle3_pipe()
    ids, lengths, extra = pipe.encode(images(2), prompts(2), None, "cpu")
    target = HFTarget(pipe.model, Guidance(SamplingParams()), hidden_layers=AUX)
    out = target.prefill(ids, lengths, 4, 1, return_hidden=True, **extra)
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        states = pipe.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **extra).hidden_states
    want = torch.cat([states[i] for i in AUX], -1)
    for r, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out.hidden[r, :n], want[r, :n], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="hidden_layers must be .* in \\[0, 4\\)"):
        HFTarget(pipe.model, Guidance(SamplingParams()), hidden_layers=(1, 4))


@pytest.mark.parametrize("image_inputs", ["placeholder", "embeds"])
@pytest.mark.parametrize("knobs", KNOBS, ids=["chain", "tree"])
def test_greedy_equals_plain_at_batch1_and_ragged(image_inputs, knobs):
    pipe = pipe_with(image_inputs)
    ims, texts = images(4), prompts(4)  # 2..8 words: ragged prompts; rows 0 and 1 end early (per-row EOS)
    plain = pipe(images=ims, prompt=texts, max_new_tokens=30, acceptance="none", output_type="ids").sequences
    out = pipe(images=ims, prompt=texts, max_new_tokens=30, acceptance="greedy", drafter="eagle", **knobs)
    assert torch.equal(out.sequences, plain)
    assert out.stats.mean_accepted_length > 1.2  # drafts were accepted: multi-token commits exercised
    one = pipe(images=ims[:1], prompt=texts[:1], max_new_tokens=30, acceptance="greedy", drafter="eagle", **knobs)
    assert torch.equal(one.sequences[0], plain[0])
    assert out.stats.extra["draft_image_tokens"] == 16  # every image token, in both conventions


def test_embeds_heads_read_the_targets_image_features_at_image_positions(monkeypatch):
    """`image_inputs="embeds"`: the prompt pairs enter with the decoder's merged input embeddings (the projected image
    features at the 16 image tokens), not the placeholder's embedding; `"placeholder"` heads never take that path."""
    seen = []
    real = Eagle3Head._embeds_step

    def spy(self, embeds, *args):
        seen.append(embeds.clone())
        return real(self, embeds, *args)

    monkeypatch.setattr(Eagle3Head, "_embeds_step", spy)
    ims, texts = images(1), prompts(1)
    pipe_with("placeholder")(images=ims, prompt=texts, max_new_tokens=4, acceptance="greedy", drafter="eagle")
    assert seen == []
    pipe = pipe_with("embeds")
    pipe(images=ims, prompt=texts, max_new_tokens=4, acceptance="greedy", drafter="eagle")
    assert len(seen) == 1
    ids, _, _ = pipe.encode(ims, texts, None, "cpu")
    image = ids[0, 1:] == pipe.model.config.image_token_id  # the embeds of x[t + 1], t = 0 .. L - 2
    placeholder = pipe.model.get_input_embeddings()(torch.tensor(pipe.model.config.image_token_id))
    assert image.sum() == 16 and not torch.allclose(seen[0][0, image], placeholder.expand(16, -1))
    torch.testing.assert_close(seen[0][0, ~image], pipe.model.get_input_embeddings()(ids[0, 1:][~image]))


@pytest.mark.slow  # statistical: 3,000 sampled answers
def test_sampled_tokens_follow_the_target_law():
    """Tokens 2 and 3 of sampled answers (drafted by the EAGLE-3 chain, verified, resampled) follow the exact law."""
    pipe = eagle3_pipe("lm")
    text = prompts(1)
    ids, _, _ = pipe.encode(None, text, None, "cpu")
    temperature, n = 1.5, 3000
    law2, law3 = _exact_marginals(pipe.model, ids, temperature, pipe.eos_token_ids()[0])
    gens = [torch.Generator().manual_seed(20_000 + i) for i in range(n)]
    out = pipe(prompt=text * n, max_new_tokens=3, do_sample=True, temperature=temperature, acceptance="exact",
               drafter="eagle", tree_depth=3, generator=gens, output_type="ids")  # fmt: skip
    assert out.stats.mean_accepted_drafts > 0.05  # the drafts matter
    assert_first_tokens_follow(out.sequences, law2, law3, n)


def test_heads_for_another_target_are_refused_naming_the_field():
    head = eagle3_pipe().eagle_head
    deeper = Eagle3Head(**{**{k: v for k, v in head.config.items() if not k.startswith("_")}, "aux_layers": [1, 2, 5]})
    with pytest.raises(ValueError, match=r"aux_layers \[1, 2, 5\] name layer\(s\) \[5\] of a target with 4"):
        check_vlm_eagle_head(deeper, tiny_llava(4, seed=1))
    narrow = Eagle3Head.from_target(tiny_llava(4), aux_layers=AUX, target_hidden_size=32)
    with pytest.raises(ValueError, match="hidden_size=64 does not match the EAGLE-3 head's target_hidden_size=32"):
        check_vlm_eagle_head(narrow, tiny_llava(4))
    with pytest.raises(ValueError, match="aux_layers must be a non-empty, strictly ascending"):
        Eagle3Head.from_target(tiny_llava(6))  # the engines' default (2, 3, 3) repeats a layer on 6 layers
    with pytest.raises(ValueError, match="image_inputs must be one of"):
        Eagle3Head.from_target(tiny_llava(4), aux_layers=AUX, image_inputs="pixels")
