"""Lossless proofs of the vision-aware drafters (`VisionEagleHead`: ViSpec, SpecVLM, MSD) through the pipeline on a
tiny random LLaVA: greedy = plain = transformers `generate` at batch 1 and on a ragged batch of 4 whose rows stop at
different times (chains and EAGLE-2 trees), every kept token at the target's RoPE position from prefill to the last
draft, the law of the first sampled tokens at T = 0.7 (chi-square against exact enumeration), the shared
speculative-pipeline tests (`tests/pipeline_mixin.py`), and the draft-side image tokens / gate choice in the stats.

The heads are tiny and random where the paper's parts are (policy, ViSpec's `img_fc` on the image vector), with the
`fc` and decoder layer of an EAGLE head fitted on the target's own answers (`train_tiny_head`): drafts then get
accepted, so multi-token commits after the compacted prefill are exercised."""

import pytest
import torch
from factories import assert_first_tokens_follow
from pipeline_mixin import SpeculativePipelineTesterMixin
from vision_seam_fixtures import check_positions, record_head_positions
from vlm_fixtures import IMAGE_TOKENS, hf_greedy, images, llava_pipe_with_heads, prompts, random_vision_head

from mmspec.drafters.vision_eagle import VISION_POLICIES
from mmspec.models.hf.inputs import capture_decoder_inputs
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


KNOBS = [{"tree_depth": 4}, {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}]  # chain, EAGLE-2 tree
NUM_QUERIES = 3  # ViSpec: 2 tokens + 1 global vector per image; SpecVLM's resampler expert: 2 tokens


@pytest.fixture(scope="module")
def base():
    return llava_pipe_with_heads()


def vision_head(text_head, target, policy, seed=0):
    return random_vision_head(text_head, target, policy, seed, num_queries=NUM_QUERIES, ratio=4, img_scale=0.05)


@pytest.fixture(scope="module", params=VISION_POLICIES)
def vpipe(request, base):
    head = vision_head(base.eagle_head, base.model, request.param)
    pipe = SpeculativeVLMPipeline(base.model, base.processor, draft_model=base.draft_model, eagle_head=head)
    pipe.set_progress_bar_config(disable=True)
    return request.param, pipe


def expected_image_tokens(policy):
    if policy == "msd":
        return IMAGE_TOKENS
    if policy == "vispec":
        return NUM_QUERIES - 1
    return None  # SpecVLM: the chosen expert's


def check_image_stats(policy, pipe, extra, batch):
    per_answer = extra["draft_image_tokens_per_answer"]
    assert len(per_answer) == batch and extra["draft_image_tokens"] == sum(per_answer) / batch
    if policy == "specvlm":
        names = pipe.eagle_head.vision.names
        assert len(extra["gate_choice"]) == batch and set(extra["gate_choice"]) <= set(names)
        assert all(0 <= n <= IMAGE_TOKENS for n in per_answer)
    else:
        assert "gate_choice" not in extra
        assert per_answer == [expected_image_tokens(policy)] * batch


@pytest.fixture(scope="module")
def hf_refs(base):
    """transformers' greedy `generate` of `base`'s target (every policy's pipeline decodes it; asserted below), once:
    `images(1)` / `prompts(1)` to 24 new tokens, and each row of `images(4)` / `prompts(4)` to 30."""
    ims, texts = images(4), prompts(4)
    one = hf_greedy(base.model, base.processor, images(1)[0], prompts(1)[0], 24)
    return one, [hf_greedy(base.model, base.processor, ims[r], texts[r], 30) for r in range(4)]


@pytest.mark.parametrize("knobs", KNOBS)
def test_greedy_batch1_equals_plain_and_transformers(vpipe, base, hf_refs, knobs):
    policy, p = vpipe
    ims, texts = images(1), prompts(1)
    assert p.model is base.model and p.processor is base.processor
    reference = hf_refs[0]
    plain = p(images=ims, prompt=texts, max_new_tokens=24, acceptance="none", output_type="ids").sequences[0]
    out = p(images=ims, prompt=texts, max_new_tokens=24, acceptance="greedy", drafter="eagle", **knobs)
    assert [t for t in plain.tolist() if t >= 0] == reference
    assert torch.equal(out.sequences[0], plain)
    assert out.text[0] == p.tokenizer.decode(reference, skip_special_tokens=True)
    assert out.stats.mean_accepted_length > 1.0  # drafts were accepted: multi-token commits were exercised
    check_image_stats(policy, p, out.stats.extra, 1)


@pytest.mark.parametrize("knobs", KNOBS)
def test_ragged_batch4_greedy_rows_stop_at_different_times(vpipe, base, hf_refs, knobs):
    """Rows 0 and 1 end early and leave the batch (`select_rows` on the head cache's offsets / image vectors)."""
    policy, p = vpipe
    ims, texts = images(4), prompts(4)
    assert p.model is base.model and p.processor is base.processor
    plain = p(images=ims, prompt=texts, max_new_tokens=30, acceptance="none", output_type="ids").sequences
    for r in range(4):
        assert [t for t in plain[r].tolist() if t >= 0] == hf_refs[1][r]
    assert (plain[:2] == -1).any(1).all() and (plain[2:] >= 0).all()
    out = p(images=ims, prompt=texts, max_new_tokens=30, acceptance="exact", drafter="eagle", output_type="ids",
            **knobs)  # fmt: skip
    assert torch.equal(out.sequences, plain)
    assert out.stats.mean_accepted_length > 1.0
    check_image_stats(policy, p, out.stats.extra, 4)


@pytest.mark.parametrize("knobs", KNOBS)
def test_every_kept_token_sits_at_the_targets_position(vpipe, knobs):
    """Through the whole run (prefill, every round, rows leaving the batch): each position the head's layer gets is
    the target's position of that token."""
    policy, p = vpipe
    ims, texts = images(4), prompts(4)
    run = lambda: p(images=ims, prompt=texts, max_new_tokens=30, acceptance="greedy", drafter="eagle",  # noqa: E731
                    output_type="ids", **knobs)  # fmt: skip
    out, calls = record_head_positions(p, p.eagle_head, run)
    check_positions(calls)
    rows = [pos.shape[0] for kind, pos, _ in calls if kind == "round"]
    assert rows[0] == 4 and rows[-1] < 4  # finished rows left the head's forwards too
    assert out.stats.mean_accepted_length > 1.0


def _exact_marginals(model, processor, image, prompt, temperature, eos):
    """Exact laws of the 2nd and 3rd generated tokens of one LLaVA prompt (the 1st comes from the prefill), over the
    vocabulary + one "ended" cell (index V: an earlier token was `eos`). The image enters as the decoder's merged
    input embeddings of the prompt (recorded once), the generated tokens as their embeddings."""
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": prompt}]}], add_generation_prompt=True, tokenize=False)  # fmt: skip
    enc = processor(images=[image], text=[text], return_tensors="pt")
    with torch.no_grad():
        with capture_decoder_inputs(model) as seen:
            model(**enc)
        prefix, embed, decoder = seen["inputs_embeds"], model.get_input_embeddings(), model.model.language_model

        def next_law(tokens):  # [N, k] generated tokens -> [N, V] law of the next one
            out = []
            for chunk in tokens.split(512):
                x = torch.cat([prefix.expand(chunk.shape[0], -1, -1), embed(chunk)], dim=1)
                logits = model.lm_head(decoder(inputs_embeds=x).last_hidden_state[:, -1])
                out.append(torch.softmax(logits.double() / temperature, -1))
            return torch.cat(out)

        p1 = torch.softmax(model(**enc).logits[0, -1].double() / temperature, -1)
        v = p1.shape[0]
        p2_given = next_law(torch.arange(v)[:, None])  # [V, V]
        p3_given = next_law(torch.stack([torch.arange(v).repeat_interleave(v), torch.arange(v).repeat(v)], 1))
    joint12 = p1[:, None] * p2_given
    law2 = torch.cat([joint12[torch.arange(v) != eos].sum(0), joint12[eos].sum()[None]])
    joint123 = joint12.reshape(-1, 1) * p3_given  # row x1 * V + x2
    ended = (torch.arange(v * v) // v == eos) | (torch.arange(v * v) % v == eos)
    law3 = torch.cat([joint123[~ended].sum(0), joint123[ended].sum()[None]])
    return law2, law3


@pytest.fixture(scope="module")
def laws_at_t07(base):
    """The target's exact laws of tokens 2 and 3 at T = 0.7 on the sampled test's image prompt (once: every policy's
    pipeline decodes `base`'s target)."""
    image, text = images(1, seed=5)[0], prompts(1, seed=5)
    return _exact_marginals(base.model, base.processor, image, text[0], 0.7, base.eos_token_ids()[0])


def test_sampled_first_tokens_follow_the_target_law_at_t07(vpipe, base, laws_at_t07):
    """Tokens 2 and 3 (drafted from the compacted prefill, verified, resampled in the first round) follow the
    target's law at T = 0.7."""
    policy, p = vpipe
    image, text = images(1, seed=5)[0], prompts(1, seed=5)
    temperature, n = 0.7, 3000
    assert p.model is base.model and p.processor is base.processor  # the laws' target
    law2, law3 = laws_at_t07
    gens = [torch.Generator().manual_seed(20_000 + i) for i in range(n)]
    out = p(images=[image] * n, prompt=text * n, max_new_tokens=3, do_sample=True, temperature=temperature,
            acceptance="exact", drafter="eagle", tree_depth=3, generator=gens, output_type="ids")  # fmt: skip
    assert out.stats.mean_accepted_drafts > 0.02  # the drafts matter (random policy weights: about 5 % accepted)
    check_image_stats(policy, p, out.stats.extra, n)  # drafted from the policy's view of the image
    assert_first_tokens_follow(out.sequences, law2, law3, n, what=f"{policy}: ")


def test_gate_choice_names_the_expert_per_answer(base):
    """SpecVLM's gate picks per question: answers are reported with their expert's name, and the draft-side image
    tokens are that expert's (the text-only expert: none)."""
    head = vision_head(base.eagle_head, base.model, "specvlm")
    p = SpeculativeVLMPipeline(base.model, base.processor, eagle_head=head)
    p.set_progress_bar_config(disable=True)
    names = head.vision.names
    kw = dict(images=images(4), prompt=prompts(4), max_new_tokens=4, acceptance="greedy", drafter="eagle")
    with torch.no_grad():  # the gate made to pick expert i for every question
        for i, name in enumerate(names):
            gate = head.vision.gate
            gate.weight.zero_()
            gate.bias.fill_(0.0)
            gate.bias[i] = 1.0
            extra = p(**kw).stats.extra
            assert extra["gate_choice"] == [name] * 4
            tokens = set(extra["draft_image_tokens_per_answer"])
            assert len(tokens) == 1 and (tokens == {0}) == (name == "text-only"), (name, tokens)


class TestVisionDrafterPipeline(SpeculativePipelineTesterMixin):
    """The shared speculative-pipeline tests on the tiny LLaVA, with each vision-aware head."""

    pipeline_class = SpeculativeVLMPipeline
    lossless_methods = [dict(acceptance="exact", drafter="eagle", **k) for k in KNOBS]
    bad_inputs = [(dict(acceptance="fast"), ValueError, "acceptance"), (dict(prompt=[3]), TypeError, "prompt")]
    test_finished_rows_leave_the_batch = None  # LLaVA's decoder takes no positional input_ids (the mixin's hook);
    # rows leaving the head's forwards: test_every_kept_token_sits_at_the_targets_position

    @pytest.fixture(autouse=True)
    def _pipe(self, vpipe):
        self.pipe = vpipe[1]

    def get_pipeline(self):
        self.pipe.set_progress_bar_config(disable=True)
        return self.pipe

    def get_inputs(self, batch_size):
        return dict(images=images(batch_size), prompt=prompts(batch_size), max_new_tokens=30, do_sample=True,
                    output_type="ids")  # fmt: skip

    def output_tokens(self, out):
        return out.sequences

    def scored_model(self, pipe):
        return pipe.model.model.language_model

    def check_rounds(self, out, method):
        super().check_rounds(out, method)
        if method is not self.plain_method:  # the head drafted from its policy's view of the image
            policy = self.pipe.eagle_head.config.vision_policy
            check_image_stats(policy, self.pipe, out.stats.extra, out.sequences.shape[0])
