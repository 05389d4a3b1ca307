"""Fair wall-clock comparison of two callables, for the speedups the CLI prints (`mmspec generate`, `mmspec vlm`).

A speedup measured as one cold run against one warm run is mostly warm-up (first-call allocations, lazy imports,
kernel selection, caches): `mmspec vlm` once reported 0.62x where repeated runs gave 3.2-3.6x. `fair_speedup`
warms both sides first, then alternates them (A B, B A, A B, ...: drift in the host's load hits both alike) and
reports the median of each side over the repeats. The number still depends on the host: its load and the torch
thread count (`SPEEDUP_CAVEAT`); the benchmarks (`mmspec bench`) are the careful measurement.

Pure Python: no torch import, no global state; the clock is a parameter so that tests need no real timing.
"""

import statistics
import time
from collections.abc import Callable
from typing import Any


__all__ = ["SPEEDUP_CAVEAT", "fair_speedup", "speedup_line"]

SPEEDUP_CAVEAT = "depends on the host's load and the torch CPU threads; `mmspec bench` measures it carefully"


def fair_speedup(
    run_a: Callable[[], Any],
    run_b: Callable[[], Any],
    repeats: int = 3,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Time `run_a` (the baseline) against `run_b` fairly; `speedup` = median time of A / median time of B.

    Args:
        run_a, run_b: zero-argument callables doing the same work by two methods (e.g. plain / speculative decoding
            of one batch). Each is called `warmup + repeats` times; synchronise an accelerator inside them.
        repeats: timed calls of each (>= 1). Repeat i runs A then B for even i, B then A for odd i.
        warmup: untimed calls of each before the timed ones (>= 0), A then B.
        clock: seconds as a float (`time.perf_counter`).

    Returns:
        dict with `a_s` / `b_s` (the timed seconds, in call order), `a_median_s` / `b_median_s`, `speedup`
        (None when B's median is 0), `repeats`, `warmup`, `order` (the labels "a" / "b" of every call, warm-up
        included) and `a_result` / `b_result` (what the last timed call of each returned).
    """
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    runs = {"a": run_a, "b": run_b}
    times: dict[str, list[float]] = {"a": [], "b": []}
    results: dict[str, Any] = {}
    order = []
    for _ in range(warmup):
        for label in ("a", "b"):
            order.append(label)
            runs[label]()
    for i in range(repeats):
        for label in ("a", "b") if i % 2 == 0 else ("b", "a"):
            order.append(label)
            start = clock()
            results[label] = runs[label]()
            times[label].append(clock() - start)
    a, b = statistics.median(times["a"]), statistics.median(times["b"])
    return dict(a_s=times["a"], b_s=times["b"], a_median_s=a, b_median_s=b, speedup=a / b if b > 0 else None,
                repeats=repeats, warmup=warmup, order=order, a_result=results["a"], b_result=results["b"])  # fmt: skip


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
