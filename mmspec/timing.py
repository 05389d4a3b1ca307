"""Fair wall-clock comparison of two ways to do the same work (plain vs speculative decoding): both sides warmed up
first, then timed interleaved, the median of each side reported.

A single cold run against a warm one measures start-up costs (kernel selection, lazy allocations, caches), not the
method: the first click of a demo reported 0.97x that way. `time_interleaved` runs every side `warmup` times
untimed, then `repeats` timed rounds in which the sides alternate who goes first (ABBA: A B, B A, A B, ...), so a
slow drift of the host (another process, CPU frequency) hits both sides alike. The speedup is the ratio of the
medians; it still depends on the host (its load, the torch thread count), so report it with `describe`.

Pure Python: `fns` are any callables, `clock` any monotonic clock (tests pass fakes).
"""

import statistics
import time
from dataclasses import dataclass, field


__all__ = ["FairTiming", "time_interleaved"]


@dataclass
class FairTiming:
    """`seconds[name]`: the timed runs of each side, in run order; `results[name]`: the last run's return value."""

    names: tuple[str, ...]
    warmup: int
    repeats: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    results: dict = field(default_factory=dict)

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
            timing.results[name] = fns[name]()
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = clock()
            timing.results[name] = fns[name]()
            timing.seconds[name].append(clock() - start)
    return timing
