"""The decoding engine on its own: sequence state (max length, EOS, compaction, trace), guidance rows, the loop with
EOS stopping, and non-finite distributions."""

import factories
import pytest
import torch

from mmspec.decoding import ACCEPTED, BONUS, NONE, PREFILL, RESAMPLED, Guidance, SequenceState, decode
from mmspec.drafters.model import ModelDrafter
from mmspec.models.llamagen.target import LlamaGenTarget
from mmspec.sampling import SamplingParams, sample
from mmspec.stats import SpecStats
from mmspec.verify import Exact


V, N = 16, 16


def tiny_gpt(seed, std=0.3):
    return factories.tiny_gpt(seed, vocab_size=V, block_size=N, std=std)


def test_emit_cuts_at_max_length_and_eos_and_sets_origins():
    state = SequenceState(torch.tensor([1, 2, 3]), 5, eos_token_id=9)
    new = torch.tensor([[4, 5, 6, 7], [9, 5, 6, 7], [4, 9, 6, 7]])
    num = state.emit(new, torch.tensor([4, 3, 2]), bonus=torch.tensor([True, False, False]))
    assert num.tolist() == [4, 1, 2]  # row 0: max length; row 1: EOS first; row 2: EOS second
    assert state.finished.tolist() == [True, True, True]
    full = state.full()
    assert full.tolist() == [[1, 4, 5, 6, 7], [2, 9, -1, -1, -1], [3, 4, 9, -1, -1]]
    trace = state.full_trace()
    # row 0: 3 accepted + bonus (all 3 drafts accepted); row 1: the correction at index 2 (2 of 3 accepted), cut
    # after the first token (an accepted draft); row 2: 1 accepted draft + a resampled correction
    assert trace.origin.tolist() == [
        [PREFILL, ACCEPTED, ACCEPTED, ACCEPTED, BONUS],
        [PREFILL, ACCEPTED, NONE, NONE, NONE],
        [PREFILL, ACCEPTED, RESAMPLED, NONE, NONE],
    ]
    assert trace.round.tolist() == [[0, 1, 1, 1, 1], [0, 1, -1, -1, -1], [0, 1, 1, -1, -1]]


def test_bad_state_arguments_name_themselves():
    with pytest.raises(ValueError, match="max_length"):
        SequenceState(torch.tensor([1]), 0)
    with pytest.raises(TypeError, match="eos_token_id"):
        SequenceState(torch.tensor([1]), 4, eos_token_id=2.5)


def test_keep_compacts_rows_and_generators_but_full_keeps_the_grid():
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    state = SequenceState(torch.tensor([1, 2, 3]), 4, generator=gens)
    state.emit(torch.tensor([[5], [6], [7]]), torch.tensor([1, 1, 1]))
    state.keep(torch.tensor([0, 2]))
    assert state.generator == [gens[0], gens[2]] and state.ids.tolist() == [0, 2]
    state.emit(torch.tensor([[8, 8], [9, 9]]), torch.tensor([2, 2]))
    assert state.full().tolist() == [[1, 5, 8, 8], [2, 6, -1, -1], [3, 7, 9, 9]]
    assert state.num_generated().tolist() == [4, 2, 4]


def test_guidance_rows_and_single_stream():
    on, off = Guidance(SamplingParams(guidance_scale=2.0)), Guidance(SamplingParams(guidance_scale=1.0))
    x = torch.tensor([[1], [2]])
    assert on.rows(x).tolist() == [[1], [2], [1], [2]] and off.rows(x).tolist() == [[1], [2]]
    assert on.row_index(torch.tensor([1]), 2).tolist() == [1, 3] and off.row_index(torch.tensor([1]), 2).tolist() == [
        1
    ]
    logits = torch.randn(4, 3, V, generator=torch.Generator().manual_seed(0))
    cond, uncond = logits.chunk(2)
    torch.testing.assert_close(on.probs(logits), (uncond + 2 * (cond - uncond)).softmax(-1))
    torch.testing.assert_close(off.probs(cond), cond.softmax(-1))


def test_non_finite_distributions_raise_once_at_the_end_naming_the_source():
    g = Guidance(SamplingParams())
    g.probs(torch.zeros(2, V), "target")
    g.check()  # all finite: nothing raised
    g.probs(torch.full((2, V), float("nan")), "draft")
    with pytest.raises(ValueError, match="draft logits"):
        g.check()


def _engine(target_model, draft_model, eos, greedy, generator, labels, k=3):
    guidance = Guidance(SamplingParams(guidance_scale=2.0, do_sample=not greedy))
    target = LlamaGenTarget(target_model, guidance)
    cond_rows = guidance.condition_rows(labels, target_model.null_condition(labels.shape[0]))
    drafter = None if draft_model is None else ModelDrafter(draft_model, guidance, k, cond_rows)
    stats = SpecStats(labels.shape[0], k)
    first = target.prefill(labels, N, scratch=k + 1)
    stats.record_prefill(1)
    state = SequenceState(sample(first.p_target[:, 0], generator), N, eos_token_id=eos, generator=generator)
    if drafter is not None:
        drafter.prefill(state, first)
    decode(target, drafter, Exact(), state, guidance, stats)
    return state.full(), stats.finalize()


def test_eos_stops_rows_and_speculation_stays_lossless():
    """Rows stop at their first EOS (kept, then padding), other rows run on; greedy speculative decoding with a
    draft model equals plain greedy decoding with EOS too, and finished rows stop costing forwards."""
    target, draft = tiny_gpt(0), tiny_gpt(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    labels = torch.tensor([0, 1, 2, 3])
    free, _ = _engine(target, None, None, True, None, labels)
    in_rows = torch.stack([(free == t).any(1) for t in range(V)])  # [V, B]
    eos = int(((in_rows.sum(1) > 0) & (in_rows.sum(1) < 4)).nonzero()[0])  # ends some rows, not all
    expected = free.clone()
    for b in range(4):
        hits = (free[b] == eos).nonzero()
        if len(hits):
            expected[b, int(hits[0]) + 1 :] = -1
    assert (expected == -1).any() and (expected[:, -1] >= 0).any()  # some rows stop early, some run to the end
    plain, plain_stats = _engine(target, None, eos, True, None, labels)
    spec, spec_stats = _engine(target, draft, eos, True, None, labels)
    assert torch.equal(plain, expected) and torch.equal(spec, expected)
    assert plain_stats.generated_tokens == (expected >= 0).sum(1).tolist() == spec_stats.generated_tokens
    assert spec_stats.target_forwards < plain_stats.target_forwards
