"""Janus on the engine (`mmspec.models.janus.target.JanusTarget` through `SpeculativeJanusPipeline`) against transformers'
own image loop (`JanusForConditionalGeneration.generate(generation_mode="image")`) and against an independent
full-recompute reference (no cache at all), on tiny random Janus models: greedy token for token (batch 1 and a
ragged left-padded batch, with and without CFG), every lossless method equal to plain greedy, token trees scored and
committed like the chains they contain, and sampled marginals equal to the exact laws computed from the model's own
logits (chi-square through the code's own sampling)."""

import pytest
import torch
from janus_fixtures import prompt_ids, tiny_janus, tiny_processor

from mmspec.decoding import Guidance
from mmspec.models.janus.target import JanusTarget
from mmspec.pipelines import SpeculativeJanusPipeline
from mmspec.sampling import SamplingParams


LOSSLESS = [dict(acceptance="jacobi", coupling=True), dict(acceptance="jacobi", coupling=False),
            dict(acceptance="exact", drafter="jacobi"), dict(acceptance="jacobi", jacobi_window=8, jacobi_init="random"),
            dict(acceptance="jacobi", jacobi_tree_width=3, jacobi_tree_depth=3),  # SJD-PAC: a tree per round
            dict(acceptance="jacobi", jacobi_tree_width=2, jacobi_tree_depth=4, jacobi_init="random")]  # fmt: skip


def make_pipe(**kw):
    pipe = SpeculativeJanusPipeline(tiny_janus(**kw), tiny_processor())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def transformers_greedy(model, ids, mask, guidance_scale):
    return model.generate(ids, attention_mask=mask, generation_mode="image", do_sample=False,
                          guidance_scale=guidance_scale)  # fmt: skip


def guided(model, ids, mask, image_tokens, guidance_scale):
    """Generation-head logits after the prompt and `image_tokens [B, t]`, CFG applied: a full recompute without any
    cache (left padding masked, positions counted from each row's first token, as transformers does)."""
    uncond = torch.where((ids == 1) | (ids == 3), ids, 0)  # pad all but BOS / BOI
    rows = torch.cat([ids, uncond]) if guidance_scale != 1 else ids
    m = torch.cat([mask, mask]) if guidance_scale != 1 else mask
    tokens = image_tokens.repeat(rows.shape[0] // ids.shape[0], 1)
    embeds = torch.cat([model.get_input_embeddings()(rows), model.prepare_embeddings_for_image_generation(tokens)], 1)
    m = torch.cat([m, torch.ones_like(tokens)], 1)
    positions = (m.cumsum(1) - 1).clamp(min=0)
    hidden = model.model.language_model(
        inputs_embeds=embeds, attention_mask=m, position_ids=positions
    ).last_hidden_state
    logits = model.model.generation_head(hidden[:, -1]).float()
    if guidance_scale == 1:
        return logits
    cond, unc = logits.chunk(2)
    return unc + guidance_scale * (cond - unc)


@torch.no_grad()
def reference_greedy(model, ids, mask, guidance_scale, n):
    out = torch.zeros(ids.shape[0], 0, dtype=torch.long)
    for _ in range(n):
        out = torch.cat([out, guided(model, ids, mask, out, guidance_scale).argmax(-1, keepdim=True)], 1)
    return out


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("guidance_scale", [1.0, 2.0, 5.0])
def test_plain_greedy_equals_transformers_generate(batch, guidance_scale):
    pipe = make_pipe()
    ids, mask = prompt_ids(batch, seed=1)
    if batch > 1:
        assert bool((mask == 0).any())  # ragged: left padding is really exercised
    out = pipe(input_ids=ids, attention_mask=mask, guidance_scale=guidance_scale, do_sample=False, acceptance="none",
               output_type="tokens").images  # fmt: skip
    assert out.shape == (batch, 16)
    assert torch.equal(out, reference_greedy(pipe.model, ids, mask, guidance_scale, 16))
    if guidance_scale > 1:  # transformers' loop stacks both streams always and breaks at guidance_scale <= 1
        assert torch.equal(out, transformers_greedy(pipe.model, ids, mask, guidance_scale))
    if batch > 1:
        assert len(set(map(tuple, out.tolist()))) == batch


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_every_lossless_method_equals_transformers_greedy(guidance_scale):
    pipe = make_pipe(spread=0.1)  # image tokens weakly tied to their inputs: Jacobi drafts get accepted
    ids, mask = prompt_ids(3, seed=2)
    expected = reference_greedy(pipe.model, ids, mask, guidance_scale, 16)
    if guidance_scale > 1:
        assert torch.equal(expected, transformers_greedy(pipe.model, ids, mask, guidance_scale))
    forwards = []
    for method in LOSSLESS:
        out = pipe(input_ids=ids, attention_mask=mask, guidance_scale=guidance_scale, do_sample=False,
                   output_type="tokens", **method)  # fmt: skip
        assert torch.equal(out.images, expected), method
        forwards.append(out.stats.target_forwards)
    assert min(forwards) < 15  # drafts were accepted (plain decoding takes 16 forwards): not a vacuous equality


@torch.no_grad()
@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_trees_score_and_commit_like_their_chains(guidance_scale):
    """A token tree's nodes get the distributions of the chains along their paths; committing a path leaves the
    cache as committing that chain would (both CFG streams)."""
    model = tiny_janus(head_scale=1.0)
    ids, mask = prompt_ids(2, seed=3)
    guidance = Guidance(SamplingParams(guidance_scale=guidance_scale))

    def target():
        t = JanusTarget(model, guidance)
        t.prefill(ids, mask, 16, scratch=8)
        return t

    pending = torch.tensor([[5], [6]])
    # tree: root(0) -> a(1), b(2); a -> c(3); b -> d(4)
    tokens = torch.cat([pending, torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]])], 1)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * 2)
    tree_target, chain_target = target(), target()
    tree = tree_target.forward(tokens, parents).p_target
    for path in ([0, 1, 3], [0, 2, 4]):
        chain = chain_target.forward(tokens[:, path]).p_target
        torch.testing.assert_close(tree[:, path], chain, atol=1e-5, rtol=1e-5)
    path = torch.tensor([[0, 2, 4]] * 2)
    tree_target.commit(torch.tensor([3, 3]), path)
    chain_target.forward(tokens[:, [0, 2, 4]])
    chain_target.commit(torch.tensor([3, 3]))
    assert torch.equal(tree_target.lengths, chain_target.lengths)
    nxt = torch.tensor([[1, 2], [3, 4]])
    torch.testing.assert_close(tree_target.forward(nxt).p_target, chain_target.forward(nxt).p_target,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    # against the full recompute: the committed tree path is the prefix it should be
    expected = guided(model, ids, mask, torch.cat([tokens[:, [0, 2, 4]], nxt[:, :1]], 1), guidance_scale)
    torch.testing.assert_close(tree_target.forward(nxt).p_target[:, 0], expected.softmax(-1), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def exact_two_token_laws(model, ids, mask, guidance_scale, temperature, top_k):
    """The exact laws of image tokens 1 and 2 (`[V]` each, batch 1), from the model's own logits."""
    params = SamplingParams(guidance_scale=1.0, temperature=temperature, top_k=top_k)
    p1 = params.probs(guided(model, ids, mask, torch.zeros(1, 0, dtype=torch.long), guidance_scale))[0]
    vocab = p1.shape[0]
    firsts = torch.arange(vocab)[:, None]
    big_ids, big_mask = ids.expand(vocab, -1), mask.expand(vocab, -1)
    p2_given = params.probs(guided(model, big_ids, big_mask, firsts, guidance_scale))  # [V, V]
    return p1.double(), (p1[:, None].double() * p2_given.double()).sum(0)


@pytest.mark.parametrize("method", [dict(acceptance="none"), dict(acceptance="jacobi", coupling=True),
                                    dict(acceptance="jacobi", coupling=False), dict(acceptance="exact"),
                                    dict(acceptance="jacobi", jacobi_tree_width=3, jacobi_tree_depth=3)])  # fmt: skip
def test_sampled_marginals_equal_the_exact_laws(method, chi2_pvalue):
    """The first two image tokens of plain sampling, SJD and SCD follow the laws computed from the model's logits
    (CFG, temperature, top-k in transformers' order)."""
    pipe = make_pipe(head_scale=0.1, spread=0.1)
    ids, mask = prompt_ids(1, seed=4)
    gs, temperature, top_k = 3.0, 0.9, 20
    p1, p2 = exact_two_token_laws(pipe.model, ids, mask, gs, temperature, top_k)
    assert float(p1.max()) < 0.5 and float(p2.max()) < 0.5  # laws worth testing
    n = 1500
    out = pipe(input_ids=ids, attention_mask=mask, guidance_scale=gs, temperature=temperature, top_k=top_k,
               num_images_per_prompt=n, output_type="tokens", generator=torch.Generator().manual_seed(7), **method)  # fmt: skip
    tokens = out.images
    assert chi2_pvalue(tokens[:, 0], p1.numpy()) > 1e-3, method
    assert chi2_pvalue(tokens[:, 1], p2.numpy()) > 1e-3, method
    if method["acceptance"] != "none":  # the second token was often an accepted draft
        assert sum(out.stats.accepted_tokens) > n


def test_sampled_marginals_catch_a_wrong_law(chi2_pvalue):
    """The marginal test has power: the same samples against the law without guidance are rejected."""
    pipe = make_pipe(head_scale=0.1, spread=0.1)
    ids, mask = prompt_ids(1, seed=4)
    p1_unguided, _ = exact_two_token_laws(pipe.model, ids, mask, 1.0, 0.9, 20)
    out = pipe(input_ids=ids, attention_mask=mask, guidance_scale=3.0, temperature=0.9, top_k=20,
               num_images_per_prompt=1500, output_type="tokens", generator=torch.Generator().manual_seed(7),
               acceptance="none")  # fmt: skip
    assert chi2_pvalue(out.images[:, 0], p1_unguided.numpy()) < 1e-6
