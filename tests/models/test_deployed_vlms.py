"""The VLMs people deploy, as targets: Qwen2.5-VL and Qwen3-VL (M-RoPE, dynamic image grids, Qwen3-VL's deepstack;
`qwen_vl_fixtures`) and LLaVA-Next / LLaVA-OneVision (any-resolution tiles; `anyres_fixtures`), tiny random models
made here. Plain greedy equals transformers' `generate` token for token at batch 1 and on a ragged batch whose images
have different grids / tile counts, several images in one prompt, every lossless drafter (draft LM chain and tree,
EAGLE chain and tree) equals plain greedy on that ragged batch and at batch 1, and (Qwen, M-RoPE) the first sampled
tokens follow the target's exact law (chi-square against enumeration through transformers' own forwards)."""

import functools
from types import SimpleNamespace

import anyres_fixtures
import pytest
import qwen_vl_fixtures
import torch
from factories import assert_first_tokens_follow
from qwen_vl_fixtures import images
from vlm_fixtures import chat, prompts, train_tiny_head

from mmspec.models.hf.draft import truncated_draft
from mmspec.models.hf.mrope import MRopePositions, positions_for
from mmspec.models.hf.positions import Positions
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


QWEN = qwen_vl_fixtures.KINDS
KINDS = QWEN + anyres_fixtures.KINDS
# (h, w) pixels, four different grids: Qwen 2x2, 3x4, 4x2, 1x5 merged tokens; any-res 1, 2 (x2), 4 tiles + base
SIZES = {"qwen": [(16, 16), (24, 32), (32, 16), (8, 40)], "anyres": [(32, 32), (40, 72), (64, 48), (72, 40)]}
DRAFTERS = [  # (drafter, knobs)
    ("model", {"num_draft_tokens": 3}),
    ("model", {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}),
    ("eagle", {"tree_depth": 4}),
    ("eagle", {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}),
]


def _sizes(kind):
    return SIZES["qwen" if kind in QWEN else "anyres"]


@functools.cache  # shared with `test_deployed_vision_heads` (the fitted head takes seconds per class)
def _pipe(kind):
    family = qwen_vl_fixtures if kind in QWEN else anyres_fixtures
    target = family.tiny_qwen_vl(kind, seed=1) if kind in QWEN else family.tiny_anyres(kind, seed=1)
    pipe = SpeculativeVLMPipeline(target, family.processor(kind), draft_model=truncated_draft(target, 1))
    pipe.set_progress_bar_config(disable=True)
    pipe.kind = kind
    # fitted on the prompts the tests use (exercises multi-token commits, not generalisation)
    pipe.register_modules(eagle_head=train_tiny_head(pipe, images(_sizes(kind)), prompts(4)))
    return pipe


@pytest.fixture(scope="module", params=KINDS)
def pipe(request):
    return _pipe(request.param)


@functools.cache
def _plain_ragged(kind):
    """`_pipe(kind)`'s plain greedy on the ragged batch (four grids, `prompts(4)`), 24 new tokens: the reference of
    every lossless drafter here and of `test_deployed_vision_heads`, decoded once per process."""
    p = _pipe(kind)
    ims, texts = images(_sizes(kind)), prompts(4)
    return p(images=ims, prompt=texts, max_new_tokens=24, acceptance="none", output_type="ids").sequences


def plain_ragged(kind):
    return _plain_ragged(kind).clone()


def _generate(p, ims, text, max_new_tokens):
    """transformers' own greedy `generate` for one conversation (stops at EOS; the EOS is kept)."""
    content = [{"type": "image"} for _ in ims] + [{"type": "text", "text": text}]
    chat_text = p.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=False)  # fmt: skip
    enc = p.processor(images=ims, text=[chat_text], return_tensors="pt")
    out = p.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, enc["input_ids"].shape[1] :].tolist()


def _kept(row):
    return [t for t in row.tolist() if t >= 0]


def test_positions_provider_is_mrope_only_for_qwen_vl(pipe):
    from vlm_fixtures import tiny_lm

    assert isinstance(positions_for(pipe.model), MRopePositions) == (pipe.kind in QWEN)
    assert type(positions_for(tiny_lm())) is Positions


def test_plain_greedy_equals_transformers_batch1_and_ragged(pipe):
    ims, texts = images(_sizes(pipe.kind)), prompts(4)
    for r in range(2):
        single = pipe(images=[ims[r]], prompt=[texts[r]], max_new_tokens=20, acceptance="none", output_type="ids")
        assert _kept(single.sequences[0]) == _generate(pipe, [ims[r]], texts[r], 20)
    batch = pipe(images=ims, prompt=texts, max_new_tokens=20, acceptance="none", output_type="ids").sequences
    ids, lengths, _ = pipe.encode(ims, texts, None, "cpu")
    image_tokens = (ids == pipe.model.config.image_token_id).sum(1).tolist()
    assert len(set(image_tokens)) == 4, image_tokens  # four different image grids in one ragged batch
    for r in range(4):
        assert _kept(batch[r]) == _generate(pipe, [ims[r]], texts[r], 20), r


def test_several_images_in_one_prompt(pipe):
    ims = images(_sizes(pipe.kind)[1:3], seed=3)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "w3 w9"}]}]
    out = pipe(images=ims, messages=[messages], max_new_tokens=16, acceptance="none", output_type="ids")
    assert _kept(out.sequences[0]) == _generate(pipe, ims, "w3 w9", 16)


@pytest.mark.parametrize("drafter,knobs", DRAFTERS)
def test_lossless_drafters_equal_plain_greedy(pipe, drafter, knobs):
    ims, texts = images(_sizes(pipe.kind)), prompts(4)
    plain = plain_ragged(pipe.kind)
    out = pipe(images=ims, prompt=texts, max_new_tokens=24, acceptance="exact", drafter=drafter, **knobs)
    assert torch.equal(out.sequences, plain)
    one = pipe(images=ims[:1], prompt=texts[:1], max_new_tokens=24, acceptance="exact", drafter=drafter, **knobs)
    assert torch.equal(one.sequences[0], plain[0])
    if drafter == "eagle":  # the fitted head's drafts are accepted: multi-token commits were exercised
        assert out.stats.mean_accepted_length > 1.0


def _exact_marginals(p, image, text, temperature, eos):
    """Exact laws of the 2nd and 3rd generated tokens of one conversation through transformers' own forwards: the
    image prompt once, then every continuation on its KV cache (transformers' decode positions: `rope_deltas`), so
    a continuation that is a placeholder token is embedded as a token, as in `generate`. The vocabulary + one
    "ended" cell (index V: an earlier token was `eos`)."""
    chat_text = p.processor.apply_chat_template(chat(text), add_generation_prompt=True, tokenize=False)
    enc = p.processor(images=[image], text=[chat_text], return_tensors="pt")

    def probs(logits):
        return torch.softmax(logits[:, -1].double() / temperature, -1)

    with torch.no_grad():
        out = p.model(**enc, use_cache=True)
        p1, cache = probs(out.logits)[0], out.past_key_values
        v = p1.shape[0]
        cache.batch_repeat_interleave(v)
        out = p.model(input_ids=torch.arange(v)[:, None], past_key_values=cache, use_cache=True)
        p2_given, cache = probs(out.logits), out.past_key_values  # [V, V]
        cache.batch_repeat_interleave(v)
        p3_given = probs(p.model(input_ids=torch.arange(v).repeat(v)[:, None], past_key_values=cache).logits)
    joint12 = p1[:, None] * p2_given
    law2 = torch.cat([joint12[torch.arange(v) != eos].sum(0), joint12[eos].sum()[None]])
    joint123 = joint12.reshape(-1, 1) * p3_given  # [V * V, V], row x1 * V + x2
    ended = (torch.arange(v * v) // v == eos) | (torch.arange(v * v) % v == eos)
    law3 = torch.cat([joint123[~ended].sum(0), joint123[ended].sum()[None]])
    return law2, law3


@pytest.mark.slow
@pytest.mark.parametrize("kind", QWEN)
def test_sampled_first_tokens_follow_the_target_law(kind):
    """EAGLE chain at T = 1.5: tokens 2 and 3 (drafted, verified, resampled in the first round) follow the exact law
    of transformers' forward over the image prompt."""
    out, law2, law3, n = sampled_first_tokens(_pipe(kind), 20_000)
    assert out.stats.mean_accepted_drafts > 0.05
    assert_first_tokens_follow(out.sequences, law2, law3, n)


def sampled_first_tokens(p, seed, n=3000, temperature=1.5):
    """`n` sampled 3-token answers of pipeline `p`'s EAGLE chain (depth 3) to one image prompt, one generator per
    answer seeded from `seed`, and the exact laws of tokens 2 and 3: `(out, law2, law3, n)`."""
    image, text = _law_prompt()
    law2, law3 = (law.clone() for law in _laws(p.model, p.processor, temperature, p.eos_token_ids()[0]))
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    out = p(images=[image] * n, prompt=[text] * n, max_new_tokens=3, do_sample=True, temperature=temperature,
            acceptance="exact", drafter="eagle", tree_depth=3, generator=gens, output_type="ids")  # fmt: skip
    return out, law2, law3, n


def _law_prompt():
    """`sampled_first_tokens`' image prompt: (image, text)."""
    return images([(24, 32)], seed=7)[0], "w5 w6 w7"


@functools.cache
def _laws(model, processor, temperature, eos):
    """`sampled_first_tokens`' exact laws, once per process for each target (a vision head's pipeline shares its
    class's target and processor)."""
    return _exact_marginals(SimpleNamespace(model=model, processor=processor), *_law_prompt(), temperature, eos)


def test_saved_folder_loads_strictly(pipe, tmp_path):
    """`mmspec.models.load` (the pipeline's strict loader) reads a saved model of each class back, weight for weight."""
    from mmspec.models import load

    pipe.model.save_pretrained(tmp_path)
    loaded = load(tmp_path)
    assert type(loaded) is type(pipe.model)
    mine, theirs = pipe.model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("kind", KINDS)
def test_eagle3_head_on_each_class_equals_plain_greedy(kind):
    """An EAGLE-3 head (fused aux hidden states of a 4-layer target, reduced draft vocabulary) fitted on the target's
    answers drafts losslessly on each class: chain and tree equal plain greedy on the ragged batch."""
    from eagle3_fixtures import fit_eagle3_head

    family = qwen_vl_fixtures if kind in QWEN else anyres_fixtures
    target = family.tiny_qwen_vl(kind, seed=1, layers=4) if kind in QWEN else family.tiny_anyres(kind, 4, seed=1)
    pipe = SpeculativeVLMPipeline(target, family.processor(kind))
    pipe.set_progress_bar_config(disable=True)
    ims, texts = images(_sizes(kind)), prompts(4)
    pipe.register_modules(eagle_head=fit_eagle3_head(pipe, ims, texts, steps=60, aux_layers=(0, 1, 3)))
    plain = pipe(images=ims, prompt=texts, max_new_tokens=24, acceptance="none", output_type="ids").sequences
    for knobs in ({"tree_depth": 4}, {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}):
        out = pipe(images=ims, prompt=texts, max_new_tokens=24, acceptance="exact", drafter="eagle", **knobs)
        assert torch.equal(out.sequences, plain), knobs
        assert out.stats.mean_accepted_length > 1.0
