"""Host syncs of the decoding loop: per-phase timing (a CUDA sync on entry and exit of each timed phase) is opt-in, so
the hot loop keeps its one sync per round; with timing off the phase times are absent, not zeros.

Runs on CPU: the loop is handed a view of its state that reports a CUDA device (the only place the loop reads the
device is the timers'), and `torch.cuda.synchronize` is replaced by a counter."""

from types import SimpleNamespace

import factories
import pytest
import torch

from mmspec.decoding import Guidance, SequenceState, decode
from mmspec.drafters.model import ModelDrafter
from mmspec.models.llamagen.target import LlamaGenTarget
from mmspec.sampling import SamplingParams, sample
from mmspec.stats import SpecStats
from mmspec.verify import Exact


V, N, K = 16, 16, 3


class _OnCuda:
    """The loop's view of a `SequenceState` on a GPU: `tokens.device` says cuda, everything else is the state's."""

    def __init__(self, state):
        object.__setattr__(self, "_state", state)

    def __getattr__(self, name):
        return getattr(self._state, name)

    def __setattr__(self, name, value):
        setattr(self._state, name, value)

    @property
    def tokens(self):
        return SimpleNamespace(device=torch.device("cuda"))


def _gpt(seed):
    return factories.tiny_gpt(seed, vocab_size=V, n_layer=1, block_size=N)


def _decode_counting_syncs(monkeypatch, stats):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    labels = torch.tensor([0, 1])
    guidance = Guidance(SamplingParams(guidance_scale=1.0, do_sample=False))
    target_model, draft_model = _gpt(0), _gpt(1)
    target = LlamaGenTarget(target_model, guidance)
    cond = guidance.condition_rows(labels, target_model.null_condition(2))
    drafter = ModelDrafter(draft_model, guidance, K, cond)
    first = target.prefill(labels, N, scratch=K + 1)
    state = SequenceState(sample(first.p_target[:, 0], None), N)
    drafter.prefill(state, first)
    with torch.no_grad():
        decode(target, drafter, Exact(), _OnCuda(state), guidance, stats)
    stats.finalize()
    rounds = max(stats.rounds)
    assert rounds > 1  # several rounds ran (the draft is not the target: not everything is accepted)
    return len(syncs), rounds, state.full()


def test_phase_timing_is_off_by_default_no_timer_syncs_and_no_fake_times(monkeypatch):
    stats = SpecStats(2, K)
    syncs, rounds, _ = _decode_counting_syncs(monkeypatch, stats)
    assert syncs == 0, f"{syncs} CUDA syncs from the timers in {rounds} rounds with phase timing off"
    assert stats.time_draft_s is None and stats.time_verify_s is None  # absent, not zeros that look measured
    report = stats.to_dict()
    assert report["time_draft_s"] is None and report["time_verify_s"] is None and report["time_phases"] is False


def test_phase_timing_on_times_each_phase_with_its_syncs(monkeypatch):
    off, on = SpecStats(2, K), SpecStats(2, K, time_phases=True)
    _, rounds_off, tokens_off = _decode_counting_syncs(monkeypatch, off)
    syncs, rounds, tokens_on = _decode_counting_syncs(monkeypatch, on)
    # draft (propose), verify, draft (commit): a sync on entry and on exit of each, every round
    assert syncs == 6 * rounds
    assert on.time_draft_s > 0 and on.time_verify_s > 0
    assert rounds == rounds_off and torch.equal(tokens_on, tokens_off)  # timing changes nothing else


def test_time_phases_must_be_a_bool():
    with pytest.raises(TypeError, match="time_phases must be a bool"):
        SpecStats(1, time_phases="yes")


def test_the_ar_pipeline_times_phases_only_when_asked():
    """`pipe(..., time_phases=True)` reaches the stats: measured draft / verify times; by default they are absent."""
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_zoo()
    kw = dict(class_labels=[3], acceptance="jacobi", generator=torch.Generator().manual_seed(0), output_type="tokens")
    plain = pipe(**kw).stats
    assert plain.time_draft_s is None and plain.time_verify_s is None
    kw["generator"] = torch.Generator().manual_seed(0)
    timed = pipe(**kw, time_phases=True).stats
    assert timed.time_draft_s > 0 and timed.time_verify_s > 0
    assert timed.time_draft_s + timed.time_verify_s <= timed.time_total_s - timed.time_prefill_s
    with pytest.raises(TypeError, match="time_phases"):
        pipe(**kw, time_phases="yes")
