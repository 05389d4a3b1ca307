"""`SpeculativeVLMPipeline` on tiny random transformers models (Llama causal LM and LLaVA): lossless greedy (equal to
plain decoding and to transformers' `generate`, batch 1 and ragged batch 4 with per-row EOS), the law of the first
sampled tokens (chi-square against exact enumeration), stats / trace, round trip, bad inputs."""

import math

import pytest
import torch
from factories import assert_first_tokens_follow, digest
from pipeline_mixin import SpeculativePipelineTesterMixin
from vlm_fixtures import (
    hf_greedy,
    images,
    prompts,
    tiny_llava,
    tiny_lm,
    tiny_processor,
    tiny_tokenizer,
    train_tiny_head,
)

from mmspec.models.hf.draft import truncated_draft
from mmspec.models.hf.eagle import TextEagleHead
from mmspec.pipelines.vlm import SpeculativeVLMPipeline


DRAFTERS = [  # (drafter, knobs)
    ("model", {"num_draft_tokens": 3}),
    ("model", {"num_draft_tokens": 5, "draft_confidence": 0.5}),  # chains stopped at unsure draft tokens
    ("model", {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}),  # draft-LM EAGLE-2 tree
    ("eagle", {"tree_depth": 4}),  # sampled / argmax chain
    ("eagle", {"tree_depth": 3, "tree_top_k": 3, "tree_nodes": 8}),  # EAGLE-2 tree
]


def make_pipe(kind):
    target = tiny_llava(4, seed=1) if kind == "llava" else tiny_lm(4, seed=1)
    processor = tiny_processor() if kind == "llava" else tiny_tokenizer()
    pipe = SpeculativeVLMPipeline(target, processor, draft_model=truncated_draft(target, 3))
    pipe.set_progress_bar_config(disable=True)
    # fitted on the prompts the tests use (the point is exercising multi-token commits, not generalisation)
    ims = images(8) + images(1, seed=5) if kind == "llava" else None
    pipe.register_modules(eagle_head=train_tiny_head(pipe, ims, prompts(8) + prompts(1, seed=5)))
    return pipe


@pytest.fixture(scope="module")
def lm_pipe():
    return make_pipe("lm")


@pytest.fixture(scope="module", params=["lm", "llava"])
def pipe(request, lm_pipe):
    return request.param, lm_pipe if request.param == "lm" else make_pipe(request.param)


def _ims(kind, n, seed=0):
    return images(n, seed) if kind == "llava" else None


@pytest.fixture(scope="module")
def greedy_refs(pipe):
    """Per kind, decoded once for every drafter below: transformers' greedy `generate` and the pipeline's plain greedy,
    on `prompts(1)` (24 new tokens) and on the ragged `prompts(4)` (30 new tokens, transformers row by row)."""
    kind, p = pipe
    refs = {}
    for n, max_new in ((1, 24), (4, 30)):
        ims, texts = _ims(kind, n), prompts(n)
        hf = [hf_greedy(p.model, p.processor, ims[r] if ims else None, texts[r], max_new) for r in range(n)]
        plain = p(images=ims, prompt=texts, max_new_tokens=max_new, acceptance="none", output_type="ids").sequences
        refs[n] = hf, plain
    return refs


@pytest.mark.parametrize("drafter,knobs", DRAFTERS)
def test_greedy_batch1_equals_plain_and_transformers(pipe, greedy_refs, drafter, knobs):
    kind, p = pipe
    ims, texts = _ims(kind, 1), prompts(1)
    (reference,), plain = greedy_refs[1][0], greedy_refs[1][1][0]
    out = p(images=ims, prompt=texts, max_new_tokens=24, acceptance="greedy", drafter=drafter, **knobs)
    assert [t for t in plain.tolist() if t >= 0] == reference
    assert torch.equal(out.sequences[0], plain)
    assert out.text[0] == p.tokenizer.decode(reference, skip_special_tokens=True)
    assert out.stats.mean_accepted_length > 1.0  # drafts were accepted: multi-token commits were exercised


@pytest.mark.parametrize("drafter,knobs", DRAFTERS)
def test_ragged_batch4_greedy_per_row_eos(pipe, greedy_refs, drafter, knobs):
    kind, p = pipe
    ims, texts = _ims(kind, 4), prompts(4)  # prompts of 2..8 words: ragged lengths
    refs, plain = greedy_refs[4]
    for r in range(4):  # every row equals transformers' generate on that row alone
        assert [t for t in plain[r].tolist() if t >= 0] == refs[r]
    out = p(images=ims, prompt=texts, max_new_tokens=30, acceptance="exact", drafter=drafter, **knobs)
    assert torch.equal(out.sequences, plain)
    if kind == "llava":  # seed 1's tiny LLaVA ends rows 0 and 1 early: per-row EOS is exercised
        assert (plain[:2] == -1).any(1).all() and (plain[2:] >= 0).all()


_LAWS = {}  # digest of (weights, prompt, temperature, eos) -> _exact_marginals' laws: once per process


def _exact_marginals(model, ids, temperature, eos):
    """Exact laws of the 2nd and 3rd generated tokens of one prompt (the 1st comes from the prefill), over the
    vocabulary + one "ended" cell (index V: an earlier token was `eos`).

    Computed once per process for each (model weights, prompt, temperature, eos): the sampled-law tests here, in
    `test_draft_length` and `test_compiled_hf` share a target (`tiny_lm(4, seed=1)`) and prompt."""
    key = digest(type(model).__name__, model.state_dict(), ids, temperature, eos)
    if key not in _LAWS:
        _LAWS[key] = _enumerate_marginals(model, ids, temperature, eos)
    law2, law3 = _LAWS[key]
    return law2.clone(), law3.clone()


def _enumerate_marginals(model, ids, temperature, eos):
    with torch.no_grad():
        p1 = torch.softmax(model(ids).logits[0, -1].double() / temperature, -1)  # [V]
        v = p1.shape[0]
        seq = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], 1)
        p2_given = torch.softmax(model(seq).logits[:, -1].double() / temperature, -1)  # [V, V]
        seq3 = torch.cat([seq.repeat_interleave(v, 0), torch.arange(v).repeat(v)[:, None]], 1)
        p3_given = torch.cat([torch.softmax(model(chunk).logits[:, -1].double() / temperature, -1)
                              for chunk in seq3.split(1024)])  # fmt: skip
    joint12 = p1[:, None] * p2_given  # [V, V]
    law2 = torch.cat([joint12[torch.arange(v) != eos].sum(0), joint12[eos].sum()[None]])
    joint123 = joint12.reshape(-1, 1) * p3_given  # [V * V, V], row x1 * V + x2
    ended = (torch.arange(v * v) // v == eos) | (torch.arange(v * v) % v == eos)
    law3 = torch.cat([joint123[~ended].sum(0), joint123[ended].sum()[None]])
    return law2, law3


@pytest.mark.parametrize("drafter,knobs", DRAFTERS)
def test_sampled_first_tokens_follow_the_target_law(lm_pipe, drafter, knobs):
    """Tokens 2 and 3 (drafted, verified, resampled in the first round) follow the exact target law."""
    p = lm_pipe
    text = prompts(1, seed=5)
    ids, _, _ = p.encode(None, text, None, "cpu")
    temperature, n = 1.5, 3000
    eos = p.eos_token_ids()[0]
    law2, law3 = _exact_marginals(p.model, ids, temperature, eos)
    gens = [torch.Generator().manual_seed(10_000 + i) for i in range(n)]
    out = p(prompt=text * n, max_new_tokens=3, do_sample=True, temperature=temperature, acceptance="exact",
            drafter=drafter, generator=gens, output_type="ids", **knobs)  # fmt: skip
    assert out.stats.mean_accepted_drafts > 0.05  # the drafts matter (~0.1 for trees, deterministic children)
    assert_first_tokens_follow(out.sequences, law2, law3, n)


def test_per_row_generators_make_rows_batch_independent(pipe):
    kind, p = pipe
    ims, texts = _ims(kind, 3), prompts(3)
    kw = dict(max_new_tokens=12, do_sample=True, acceptance="exact", drafter="model", output_type="ids")
    batch = p(images=ims, prompt=texts, generator=[torch.Generator().manual_seed(i) for i in range(3)], **kw)
    alone = p(images=ims[2:] if ims else None, prompt=texts[2:], generator=[torch.Generator().manual_seed(2)], **kw)
    assert torch.equal(batch.sequences[2], alone.sequences[0])


def test_stats_and_trace(pipe):
    kind, p = pipe
    ims, texts = _ims(kind, 2), prompts(2)
    out = p(images=ims, prompt=texts, max_new_tokens=20, acceptance="greedy", drafter="eagle", tree_depth=4)
    s = out.stats
    generated = (out.sequences >= 0).sum().item()
    assert sum(s.generated_tokens) == generated
    assert s.mean_accepted_length == pytest.approx(s.mean_accepted_drafts + 1, abs=0.5)  # bonus: < 1 at EOS rows
    assert s.time_prefill_s > 0 and s.extra["decode_s"] > 0
    assert s.extra["tokens_per_s"] == pytest.approx(generated / s.extra["decode_s"])
    counts = {name: c.sum().item() for name, c in out.trace.counts().items()}
    assert sum(counts.values()) == generated
    assert counts["accepted"] == sum(s.accepted_tokens) and counts["prefill"] == 2


def test_save_and_load_round_trip(pipe, tmp_path):
    kind, p = pipe
    p.save_pretrained(tmp_path)
    loaded = SpeculativeVLMPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    ims, texts = _ims(kind, 2), prompts(2)
    a = p(images=ims, prompt=texts, max_new_tokens=10, acceptance="greedy", drafter="eagle").sequences
    b = loaded(images=ims, prompt=texts, max_new_tokens=10, acceptance="greedy", drafter="eagle").sequences
    assert torch.equal(a, b)


def test_messages_and_callback(pipe):
    kind, p = pipe
    ims, texts = _ims(kind, 1), prompts(1)
    content = [{"type": "image"}, {"type": "text", "text": texts[0]}] if ims else texts[0]
    seen = []
    out = p(images=ims, messages=[{"role": "user", "content": content}], max_new_tokens=8, acceptance="greedy",
            drafter="model", callback_on_step_end=lambda pipe, i, n, t: seen.append((i, n, t["tokens"].shape)))  # fmt: skip
    ref = p(images=ims, prompt=texts, max_new_tokens=8, acceptance="none").sequences
    assert torch.equal(out.sequences, ref)
    assert seen and seen[-1][1] == (ref >= 0).sum().item() and seen[-1][2] == (1, 8)


def test_bad_inputs_name_the_argument(pipe):
    kind, p = pipe
    ims, texts = _ims(kind, 2), prompts(2)
    cases = [
        (dict(acceptance="relaxed"), ValueError, "acceptance"),
        (dict(acceptance="exact", drafter="jacobi"), ValueError, "jacobi"),
        (dict(acceptance="greedy", do_sample=True), ValueError, "do_sample"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(output_type="pil"), ValueError, "output_type"),
        (dict(temperature=-1.0, do_sample=True), ValueError, "temperature"),
        (dict(callback_on_step_end=3), TypeError, "callback_on_step_end"),
        (dict(generator=[torch.Generator()]), ValueError, "generator"),
    ]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            p(images=ims, prompt=texts, **kwargs)
    with pytest.raises(ValueError, match="prompt"):
        p(images=ims, prompt=texts, messages=[{"role": "user", "content": "w1"}])
    with pytest.raises(TypeError, match="prompt"):
        p(images=ims, prompt=[3, 4])
    if kind == "llava":
        with pytest.raises(ValueError, match="images"):
            p(images=ims[:1], prompt=texts)
    else:
        with pytest.raises(ValueError, match="images"):
            p(images=images(2), prompt=texts)


def test_incompatible_drafters_are_refused():
    target = tiny_lm(2, seed=1)
    other = tiny_lm(1, seed=2)
    other.resize_token_embeddings(80)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeVLMPipeline(target, tiny_tokenizer(), draft_model=other)
    with pytest.raises(ValueError, match="hidden_size"):
        SpeculativeVLMPipeline(target, tiny_tokenizer(), eagle_head=TextEagleHead.from_target(target, hidden_size=32,
                                                                                           intermediate_size=64, head_dim=8))  # fmt: skip
    with pytest.raises(ValueError, match="num_layers"):
        truncated_draft(target, 2)


def test_nan_logits_raise():
    target = tiny_lm(2, seed=1)
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
    p = SpeculativeVLMPipeline(target, tiny_tokenizer())
    p.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="target"):
        p(prompt=prompts(1), max_new_tokens=4, acceptance="none")


@pytest.mark.parametrize("knobs", [{"num_draft_tokens": 3}, {"tree_top_k": 2, "tree_depth": 3, "tree_nodes": 4}])
def test_nan_draft_logits_name_the_draft_model(knobs):
    target = tiny_lm(2, seed=1)
    draft = truncated_draft(target, 1)
    with torch.no_grad():
        draft.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    p = SpeculativeVLMPipeline(target, tiny_tokenizer(), draft_model=draft)
    p.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="draft"):
        p(prompt=prompts(1), max_new_tokens=6, acceptance="exact", drafter="model", **knobs)


def test_draft_vocabulary_keeps_decoding_lossless(lm_pipe):
    """An EAGLE head scoring only half the vocabulary (FR-Spec): q_draft is 0 elsewhere, greedy output unchanged,
    sampled tokens still follow the target law."""
    # a pipeline of its own around lm_pipe's models: it registers another head (lm_pipe keeps its own)
    p = SpeculativeVLMPipeline(lm_pipe.model, lm_pipe.processor, draft_model=lm_pipe.draft_model,
                               eagle_head=lm_pipe.eagle_head)  # fmt: skip
    p.set_progress_bar_config(disable=True)
    full = p.eagle_head
    head = TextEagleHead.from_target(p.model, draft_vocab_size=32)
    head.load_state_dict({k: v for k, v in full.state_dict().items() if k != "draft_vocab"}, strict=False)
    ids = torch.arange(0, 64, 2)
    head.set_draft_vocab(ids)
    logits = head.eval().compute_logits(p.model, torch.randn(3, 64))
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()
    p.register_modules(eagle_head=head)
    texts = prompts(4)
    plain = p(prompt=texts, max_new_tokens=24, acceptance="none").sequences
    assert torch.equal(p(prompt=texts, max_new_tokens=24, acceptance="greedy", drafter="eagle").sequences, plain)
    text, n, temperature = prompts(1, seed=5), 3000, 1.5
    law2, law3 = _exact_marginals(p.model, p.encode(None, text, None, "cpu")[0], temperature, p.eos_token_ids()[0])
    out = p(prompt=text * n, max_new_tokens=3, do_sample=True, temperature=temperature, acceptance="exact",
            drafter="eagle", tree_depth=3, generator=[torch.Generator().manual_seed(i) for i in range(n)])  # fmt: skip
    assert out.stats.mean_accepted_drafts > 0.05
    assert law2.shape[0] == 65  # 64 tokens + "the row had ended"
    assert_first_tokens_follow(out.sequences, law2, law3, n)
    with pytest.raises(ValueError, match="distinct"):
        head.set_draft_vocab(torch.zeros(32, dtype=torch.long))


class TestSpeculativeVLMPipeline(SpeculativePipelineTesterMixin):
    """The shared speculative-pipeline tests (tests/pipeline_mixin.py) on the tiny causal LM."""

    pipeline_class = SpeculativeVLMPipeline
    lossless_methods = [dict(acceptance="exact", drafter=d, **k) for d, k in DRAFTERS]
    bad_inputs = [(dict(acceptance="fast"), ValueError, "acceptance"), (dict(prompt=[3]), TypeError, "prompt")]

    @pytest.fixture(autouse=True)
    def _pipe(self, lm_pipe):
        self.pipe = lm_pipe

    def get_pipeline(self):
        self.pipe.set_progress_bar_config(disable=True)
        return self.pipe

    def get_inputs(self, batch_size):
        return dict(prompt=prompts(batch_size), max_new_tokens=30, do_sample=True, output_type="ids")

    def output_tokens(self, out):
        return out.sequences

    def scored_model(self, pipe):
        return pipe.model.model


def test_draft_lm_vocabulary_keeps_decoding_lossless(lm_pipe):
    """The draft LM scoring only half the vocabulary (FR-Spec): greedy output unchanged, sampled tokens still follow
    the target law, bad vocabularies named."""
    p = lm_pipe
    vocab = torch.arange(0, 64, 2)
    texts = prompts(4)
    plain = p(prompt=texts, max_new_tokens=24, acceptance="none").sequences
    out = p(prompt=texts, max_new_tokens=24, acceptance="greedy", drafter="model", draft_vocab=vocab)
    assert torch.equal(out.sequences, plain)
    text, n, temperature = prompts(1, seed=5), 3000, 1.5
    law2, law3 = _exact_marginals(p.model, p.encode(None, text, None, "cpu")[0], temperature, p.eos_token_ids()[0])
    out = p(prompt=text * n, max_new_tokens=3, do_sample=True, temperature=temperature, acceptance="exact",
            drafter="model", draft_vocab=vocab, generator=[torch.Generator().manual_seed(i) for i in range(n)])  # fmt: skip
    assert out.stats.mean_accepted_drafts > 0.05
    assert law2.shape[0] == 65  # 64 tokens + "the row had ended"
    assert_first_tokens_follow(out.sequences, law2, law3, n)
    for bad in (torch.zeros(4, dtype=torch.long), torch.tensor([1, 99])):
        with pytest.raises(ValueError, match="draft_vocab"):
            p(prompt=texts[:1], max_new_tokens=4, acceptance="greedy", drafter="model", draft_vocab=bad)
    with pytest.raises(ValueError, match="draft_vocab"):
        p(prompt=texts[:1], max_new_tokens=4, acceptance="greedy", drafter="eagle", draft_vocab=vocab)


def test_draft_confidence_stops_chains_early(lm_pipe):
    kw = dict(prompt=prompts(2), max_new_tokens=16, acceptance="greedy", drafter="model", num_draft_tokens=6)
    full = lm_pipe(**kw)
    early = lm_pipe(**kw, draft_confidence=0.999)
    assert early.sequences.equal(full.sequences)
    assert early.stats.draft_forwards < full.stats.draft_forwards
    assert sum(early.stats.drafted_tokens) < sum(full.stats.drafted_tokens)
    for bad, match in (
        (dict(draft_confidence=1.5), "draft_confidence"),
        (dict(draft_confidence=0.5, tree_top_k=2, num_draft_tokens=None), "draft_confidence"),  # a tree: tree_nodes
        (dict(tree_top_k=2), "tree_nodes"),  # num_draft_tokens is a chain length, not a tree's node count
    ):
        with pytest.raises(ValueError, match=match):
            lm_pipe(**kw | bad)
    with pytest.raises(ValueError, match="draft_confidence"):  # an EAGLE-2 tree has no chain to stop
        lm_pipe(prompt=prompts(1), max_new_tokens=4, drafter="eagle", draft_confidence=0.5, tree_top_k=2)
