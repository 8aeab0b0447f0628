"""Benchmarks: each prints ratios against a baseline measured in the same run (never timed assertions)."""

import time


def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn()`, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
