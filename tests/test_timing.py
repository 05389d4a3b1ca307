"""`mmspec.timing.time_interleaved`: warm-up, interleaving order and medians, with fake callables and a fake clock
(no real timing)."""

import math

import pytest

from mmspec.timing import time_interleaved


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
