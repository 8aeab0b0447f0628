"""Checks for notebook 15 (operations): the concurrency that meets a p99 TTFT target, the KV-pressure cap."""

from __future__ import annotations

import json

from minfer.course import ROOT, expect_equal, passed
from minfer.sampling_params import SamplingParams
from minfer.serve.fallbacks import FallbackConfig, cap_under_kv_pressure


def _max_sessions(levels: dict, target_ms: float) -> int:
    best = 0
    for s in sorted(levels, key=int):
        if levels[s]["p99_ttft_ms"] > target_ms:
            break
        best = int(s)
    return best


def check_max_sessions(answer) -> None:
    """`answer(levels, target_ms)`: the most concurrent sessions such that it and every smaller level tried
    kept p99 TTFT <= target_ms (0 when even 1 session misses). `levels` is the recorded run's
    `{"1": {"p99_ttft_ms": ..., "mean_ttft_ms": ...}, "4": ..., "16": ...}` (assets/benchmarks/ops_targets_cpu.json)."""
    recorded = json.loads((ROOT / "assets/benchmarks/ops_targets_cpu.json").read_text())["targets"]["levels"]
    synthetic = {"1": {"p99_ttft_ms": 100.0, "mean_ttft_ms": 90.0}, "2": {"p99_ttft_ms": 400.0, "mean_ttft_ms": 120.0},
                 "4": {"p99_ttft_ms": 150.0, "mean_ttft_ms": 140.0}, "8": {"p99_ttft_ms": 900.0, "mean_ttft_ms": 300.0}}
    for levels in (recorded, synthetic):
        for target in (50, 100, 150, 248, 300, 496, 500, 1000, 2000, 5000):
            expect_equal("Exercise 15.1", answer(levels, target), _max_sessions(levels, target),
                         what=f"sessions meeting p99 TTFT <= {target} ms (levels {sorted(levels, key=int)})")
    passed("Exercise 15.1")


def check_granted_max_tokens(answer) -> None:
    """`answer(requested, kv_usage, threshold, cap)`: the max_tokens a request gets, as
    `minfer.serve.fallbacks.cap_under_kv_pressure` grants it (requested may be None: "up to max_model_len";
    kv_usage may be None: no stats yet)."""
    for requested in (None, 4, 16, 17, 100):
        for usage in (None, 0.0, 0.49, 0.5, 0.71, 1.0):
            for threshold, cap in ((0.5, 16), (0.8, 8)):
                params, _ = cap_under_kv_pressure([SamplingParams(max_tokens=requested)], usage,
                                                  FallbackConfig(kv_pressure_threshold=threshold,
                                                                 kv_pressure_max_tokens=cap))
                expect_equal("Exercise 15.2", answer(requested, usage, threshold, cap), params[0].max_tokens,
                             what=f"max_tokens granted (requested {requested}, KV usage {usage}, "
                                  f"threshold {threshold}, cap {cap})")
    passed("Exercise 15.2")


WRONG_ANSWERS = {
    # reads the mean TTFT instead of the p99
    "check_max_sessions": lambda levels, target: max([int(s) for s, r in levels.items() if r["mean_ttft_ms"] <= target],
                                                     default=0),
    # "above the threshold" instead of "at or above", and forgets requested=None
    "check_granted_max_tokens": lambda req, u, t, c: min(req, c) if u is not None and u > t and req else req,
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
