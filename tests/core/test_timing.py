"""Issue 31: `mmspec.timing.fair_speedup`, the fair speedup behind `mmspec generate` / `mmspec vlm` (no real
timing: fake callables record the call order, a fake clock gives each call its duration)."""

import json
import math

import pytest

from mmspec.timing import fair_speedup, speedup_line, time_interleaved


class _Host:
    """A fake clock and two fake methods: every call of a method advances the clock by its next duration."""

    def __init__(self, durations):
        self.now, self.calls, self.durations = 0.0, [], {k: list(v) for k, v in durations.items()}

    def clock(self):
        return self.now

    def method(self, label):
        def run():
            self.calls.append(label)
            self.now += self.durations[label].pop(0)
            return f"{label}{len(self.calls)}"

        return run


def test_warms_both_first_then_interleaves():
    host = _Host({"a": [9.0, 2, 2, 2], "b": [9.0, 1, 1, 1]})
    timing = fair_speedup(host.method("a"), host.method("b"), repeats=3, warmup=1, clock=host.clock)
    assert host.calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up A B, then A B / B A / A B
    assert timing["order"] == host.calls
    assert timing["a_s"] == [2, 2, 2] and timing["b_s"] == [1, 1, 1]  # the cold calls (9 s) are not timed
    assert timing["speedup"] == 2.0
    assert timing["a_result"] == "a7" and timing["b_result"] == "b8"  # the last timed call of each


def test_reports_the_median_not_the_mean_or_the_first():
    """One slow outlier (a host hiccup) on B's side does not move the speedup."""
    host = _Host({"a": [4, 4, 4], "b": [1, 50, 1]})
    timing = fair_speedup(host.method("a"), host.method("b"), repeats=3, warmup=0, clock=host.clock)
    assert timing["a_median_s"] == 4 and timing["b_median_s"] == 1 and timing["speedup"] == 4.0


def test_a_cold_side_does_not_decide_the_speedup():
    """The 0.62x of issue 31: a cold speculative call against a warm plain one. With a warm-up the cold call is
    not timed, and the speedup is the warm one."""
    durations = {"a": [3.0, 3.0, 3.0, 3.0], "b": [5.0, 1.0, 1.0, 1.0]}  # B is cold once (5 s), then 1 s
    host = _Host(durations)
    assert fair_speedup(host.method("a"), host.method("b"), warmup=1, clock=host.clock)["speedup"] == 3.0


@pytest.mark.parametrize("kwargs", [dict(repeats=0), dict(warmup=-1), dict(repeats=2.0), dict(repeats=True)])
def test_bad_counts_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        fair_speedup(lambda: None, lambda: None, **kwargs)


def test_zero_time_gives_no_speedup():
    timing = fair_speedup(lambda: None, lambda: None, repeats=1, warmup=0, clock=lambda: 0.0)
    assert timing["speedup"] is None


def test_line_says_what_the_number_is_and_what_it_depends_on():
    host = _Host({"a": [2, 2, 2], "b": [1, 1, 1]})
    timing = fair_speedup(host.method("a"), host.method("b"), repeats=3, warmup=0, clock=host.clock)
    line = speedup_line(timing, "one answer", threads=4, warmed_by="the grid runs")
    assert "\n" not in line
    for part in ("2.00x", "median of 3 interleaved", "one answer", "the grid runs", "load", "threads here: 4"):
        assert part in line, line


# ----------------------------------------------------------------------------------------------------------------
# the CLI's speedups come from fair_speedup: both methods ran (warm) before the timed calls, which interleave


def _recording_pipe(calls, vlm=False):
    from types import SimpleNamespace

    import torch

    class Pipe:
        _execution_device = torch.device("cpu")
        transformer = SimpleNamespace(config=SimpleNamespace(num_classes=10, block_size=4))

        def to(self, device):
            return self

        def set_progress_bar_config(self, **kwargs):
            pass

        def __call__(self, class_labels=None, acceptance="none", **kwargs):
            calls.append(acceptance)
            n = 1 if vlm else len(class_labels)
            stats = SimpleNamespace(target_forwards=4, step_compression=1.0, mean_accepted_length=1.0,
                                    time_total_s=1.0, time_prefill_s=0.1, extra={})  # fmt: skip
            return SimpleNamespace(images=[None] * n, stats=stats, text=["a 7"], sequences=torch.ones(1, 3))

    return Pipe()


def test_generate_times_the_speedup_interleaved_after_both_ran(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    import mmspec.cli as cli
    import mmspec.eval.images
    import mmspec.pipelines

    calls = []
    monkeypatch.setattr(mmspec.pipelines.SpeculativeARImagePipeline, "from_zoo",
                        lambda *a, **k: _recording_pipe(calls))  # fmt: skip
    monkeypatch.setattr(mmspec.eval.images, "make_grid", lambda images, n: SimpleNamespace(save=lambda path: None))
    cli.main(["generate", "--classes", "0,1", "--num-per-class", "1", "--out", str(tmp_path / "g.png"), "--quiet"])
    grid = ["jacobi", "jacobi", "none", "none"]  # the grid, by each method: the warm-up of both
    assert calls == grid + ["none", "jacobi", "jacobi", "none", "none", "jacobi"]  # interleaved, 3 each
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["speedup_timing"]["repeats"] == 3 and "median of 3 interleaved" in captured.err
    assert "load" in report["speedup_timing"]["note"]


def test_vlm_times_the_speedup_interleaved_after_both_ran(monkeypatch, tmp_path, capsys):
    from PIL import Image

    import mmspec.cli as cli
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    calls = []
    monkeypatch.setattr(SpeculativeVLMPipeline, "from_zoo", lambda *a, **k: _recording_pipe(calls, vlm=True))
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    cli.main(["vlm", "--image", str(tmp_path / "x.png"), "--max-new-tokens", "4"])
    assert calls == ["exact", "none", "none", "exact", "exact", "none", "none", "exact"]
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["speedup_timing"]["repeats"] == 3 and "median of 3 interleaved" in captured.err


# ---------------------------------------------------------------- time_interleaved (the demo's view)
class FakeClock:
    """A clock that each fake call advances by its side's next duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _sides(clock, durations):
    """`{name: fn}` whose calls are logged (name, call number) and advance `clock` by `durations[name][i]`."""
    log = []

    def make(name):
        def fn():
            i = sum(1 for n, _ in log if n == name)
            log.append((name, i))
            clock.now += durations[name][i]
            return f"{name}-{i}"

        return fn

    return {name: make(name) for name in durations}, log


def test_warm_up_then_interleaved_abba_and_medians():
    clock = FakeClock()
    # call 0 of each side is the warm-up (cold: slow); the timed calls follow
    fns, log = _sides(clock, {"plain": [9.0, 1.0, 1.5, 5.0], "spec": [7.0, 0.5, 0.75, 0.25]})
    timing = time_interleaved(fns, repeats=3, warmup=1, clock=clock)
    assert [n for n, _ in log] == ["plain", "spec", "plain", "spec", "spec", "plain", "plain", "spec"]
    assert timing.seconds == {"plain": [1.0, 1.5, 5.0], "spec": [0.5, 0.75, 0.25]}  # the warm-ups are not timed
    assert timing.median("plain") == 1.5 and timing.median("spec") == 0.5  # the 5.0 outlier does not count
    assert timing.speedup("plain", "spec") == pytest.approx(3.0)
    assert timing.results == {"plain": "plain-3", "spec": "spec-3"}  # the last run of each side


def test_quick_run_and_no_warm_up():
    clock = FakeClock()
    fns, log = _sides(clock, {"a": [3.0, 1.0], "b": [3.0, 2.0]})
    timing = time_interleaved(fns, repeats=1, warmup=1, clock=clock)
    assert [n for n, _ in log] == ["a", "b", "a", "b"] and timing.seconds == {"a": [1.0], "b": [2.0]}
    assert "1 timed run, after 1 warm-up run of each" in timing.describe(threads=2)
    assert "host load and torch threads (2)" in timing.describe(threads=2)
    clock = FakeClock()
    fns, log = _sides(clock, {"a": [1.0, 1.0], "b": [0.0, 0.0]})
    timing = time_interleaved(fns, repeats=2, warmup=0, clock=clock)
    assert [n for n, _ in log] == ["a", "b", "b", "a"] and math.isnan(timing.speedup("a", "b"))
    assert "median of 2 interleaved runs, no warm-up" in timing.describe()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fns={"a": lambda: 0}), "at least two"),
        (dict(fns={"a": lambda: 0, "b": 3}), "fns['b'] must be callable"),
        (dict(fns={"a": lambda: 0, "b": lambda: 0}, repeats=0), "repeats must be an int >= 1"),
        (dict(fns={"a": lambda: 0, "b": lambda: 0}, warmup=-1), "warmup must be an int >= 0"),
        (dict(fns={"a": lambda: 0, "b": lambda: 0}, repeats=True), "repeats must be an int >= 1"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("]", r"\]")):
        time_interleaved(**kwargs)
