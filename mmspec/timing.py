"""Fair wall-clock comparison of two ways to do the same work (plain vs speculative decoding): both sides warmed up
first, then timed interleaved, the median of each side reported.

A single cold run against a warm one measures start-up costs (kernel selection, lazy allocations, caches), not the
method: `mmspec vlm` once reported 0.62x and the demo's first click 0.97x that way, where repeated runs gave
3.2-3.6x. `time_interleaved` runs every side `warmup` times untimed, then `repeats` timed rounds in which the sides
alternate who goes first (A B, B A, A B, ...), so a slow drift of the host (another process, CPU frequency) hits
both sides alike. The speedup is the ratio of the medians; it still depends on the host (its load, the torch thread
count), so report it with `FairTiming.describe` (the demo) or `speedup_line` (the CLI); `mmspec bench` is the
careful measurement.

Pure Python: no torch import, no global state; `fns` are any callables, `clock` any monotonic clock (tests pass
fakes).
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


__all__ = ["SPEEDUP_CAVEAT", "FairTiming", "fair_speedup", "speedup_line", "time_interleaved"]

SPEEDUP_CAVEAT = "depends on the host's load and the torch CPU threads; `mmspec bench` measures it carefully"


@dataclass
class FairTiming:
    """`seconds[name]`: the timed runs of each side, in run order; `results[name]`: the last run's return value;
    `order`: the name of every call as it ran, warm-up included."""

    names: tuple[str, ...]
    warmup: int
    repeats: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    results: dict = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def median(self, name):
        """The median seconds of side `name`."""
        return statistics.median(self.seconds[name])

    def speedup(self, baseline, other):
        """median(`baseline`) / median(`other`): how many times faster `other` is (nan if it took no time)."""
        other_s = self.median(other)
        return self.median(baseline) / other_s if other_s > 0 else float("nan")

    def describe(self, threads=None):
        """One line: what the numbers are and what they depend on."""
        runs = "1 timed run" if self.repeats == 1 else f"median of {self.repeats} interleaved runs"
        warm = (
            f"after {self.warmup} warm-up run{'s' if self.warmup != 1 else ''} of each"
            if self.warmup
            else "no warm-up"
        )
        host = "host load" + (f" and torch threads ({threads})" if threads is not None else " and threads")
        return f"wall-clock per side: {runs}, {warm}; the speedup depends on {host}."


def time_interleaved(fns, repeats=3, warmup=1, clock=time.perf_counter):
    """Time each callable of `fns` (`{name: fn}`, two or more, called without arguments) fairly.

    Args:
        fns: `{name: callable}`; every callable is called `warmup + repeats` times.
        repeats: timed rounds (>= 1); in round r the sides run in `fns` order, reversed on odd rounds.
        warmup: untimed calls of each side before the first timed round (>= 0), in `fns` order.
        clock: a monotonic clock in seconds.

    Returns:
        FairTiming: the timed seconds per side and each side's last return value.
    """
    names = tuple(fns)
    if len(names) < 2:
        raise ValueError(f"fns must name at least two callables to compare, got {list(names)}")
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"fns[{name!r}] must be callable, got {type(fn).__name__}")
    for arg, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
    timing = FairTiming(names, warmup, repeats, {name: [] for name in names})
    for _ in range(warmup):
        for name in names:
            timing.order.append(name)
            timing.results[name] = fns[name]()
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            timing.order.append(name)
            start = clock()
            timing.results[name] = fns[name]()
            timing.seconds[name].append(clock() - start)
    return timing


def fair_speedup(
    run_a: Callable[[], Any],
    run_b: Callable[[], Any],
    repeats: int = 3,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """`time_interleaved({"a": run_a, "b": run_b})` as the dict the CLI reports; `speedup` = median of A (the
    baseline) / median of B.

    Returns:
        dict with `a_s` / `b_s` (the timed seconds, in call order), `a_median_s` / `b_median_s`, `speedup` (None
        when B's median is 0), `repeats`, `warmup`, `order` (the labels "a" / "b" of every call, warm-up included)
        and `a_result` / `b_result` (what the last timed call of each returned).
    """
    timing = time_interleaved({"a": run_a, "b": run_b}, repeats=repeats, warmup=warmup, clock=clock)
    a, b = timing.median("a"), timing.median("b")
    return dict(a_s=timing.seconds["a"], b_s=timing.seconds["b"], a_median_s=a, b_median_s=b,
                speedup=a / b if b > 0 else None, repeats=repeats, warmup=warmup, order=timing.order,
                a_result=timing.results["a"], b_result=timing.results["b"])  # fmt: skip


def speedup_line(timing: dict, what: str, threads: int | None = None, warmed_by: str | None = None) -> str:
    """One line saying what the speedup of `fair_speedup` is and what it depends on; `what` names the timed work,
    `warmed_by` what warmed both sides up when `fair_speedup` ran no warm-up calls itself."""
    speedup = timing["speedup"]
    value = "n/a" if speedup is None else f"{speedup:.2f}x"
    thread_note = "" if threads is None else f" (torch CPU threads here: {threads})"
    warm = f"{timing['warmup']} warm-up run(s) of each" if timing["warmup"] or not warmed_by else warmed_by
    return (
        f"speedup vs plain {value}: median of {timing['repeats']} interleaved timed runs of {what}, after {warm}; "
        f"{SPEEDUP_CAVEAT}{thread_note}"
    )
