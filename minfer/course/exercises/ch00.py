"""Checks for notebook 00 (where a request's time goes): TTFT and TPOT from token timestamps, and the decode
speed ceiling of a memory-bound batch-1 step."""

from __future__ import annotations

import torch

from minfer.course import expect_close, passed
from minfer.memory import weight_bytes
from minfer.outputs import RequestMetrics


def _timestamp_cases() -> list[tuple[float, list[float]]]:
    g = torch.Generator().manual_seed(0)
    cases = []
    for n in (2, 5, 33):
        arrival = float(torch.rand(1, generator=g)) * 10
        gaps = (torch.rand(n, generator=g) * 0.05 + 0.01).tolist()
        gaps[0] += 0.3                                   # the first token waits for the prefill
        times, t = [], arrival
        for d in gaps:
            t += d
            times.append(t)
        cases.append((arrival, times))
    return cases


def check_ttft_tpot(ttft_tpot) -> None:
    """`ttft_tpot(arrival, token_times) -> (ttft, tpot)` against `minfer.outputs.RequestMetrics`."""
    for arrival, times in _timestamp_cases():
        m = RequestMetrics(arrival_time=arrival, first_token_time=times[0], last_token_time=times[-1],
                           token_times=list(times))
        got = ttft_tpot(arrival, list(times))
        if not isinstance(got, tuple) or len(got) != 2:
            raise AssertionError(f"Exercise 0.1: return a tuple (ttft, tpot), got {got!r}")
        expect_close("Exercise 0.1", got[0], m.ttft, what=f"TTFT for {len(times)} tokens")
        expect_close("Exercise 0.1", got[1], m.tpot,
                     what=f"TPOT for {len(times)} tokens (hint: {len(times)} tokens leave {len(times) - 1} gaps)")
    passed("Exercise 0.1")


def check_decode_ceiling(decode_ceiling_tok_s) -> None:
    """`decode_ceiling_tok_s(model, bandwidth) -> tok/s`: a batch-1 step reads every weight byte once."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 48), torch.nn.Linear(48, 16))
        model = model.to(dtype)
        for bw in (30.6e9, 4.8e12):
            expect_close("Exercise 0.2", decode_ceiling_tok_s(model, bw), bw / weight_bytes(model), rtol=1e-6,
                         what=f"the ceiling for {dtype} weights at {bw:.3g} B/s (hint: bytes, not parameters)")
    passed("Exercise 0.2")


WRONG_ANSWERS = {
    "check_ttft_tpot": lambda arrival, t: (t[0] - arrival, (t[-1] - t[0]) / len(t)),  # n gaps instead of n - 1
    "check_decode_ceiling": lambda model, bw: bw / sum(p.numel() for p in model.parameters()),  # counts parameters
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
