"""Checks for notebook 09 (serving): latency metrics from a stream's token timestamps, and the max_tokens bound.

- `check_stream_metrics(fn)` (Exercise 9.2): `fn(start, token_times) -> (ttft, tpot, itls)` must agree with what
  minfer's load client (`minfer.bench.serve._send`, and the TPOT of `benchmark`) measures from the same stream.
- `check_max_new_tokens(fn)` (Exercise 9.1): `fn(prompt_len, max_model_len) -> int` must be the largest
  `max_tokens` that the engine's admission check (`minfer.sequence.validate_prompt`) accepts, 0 when none fits.
"""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Callable
from unittest import mock

from minfer.course import expect_close, expect_equal, passed


def _client_metrics(start: float, token_times: list[float]) -> tuple[float, float, list[float]]:
    """Run minfer's load client (`minfer.bench.serve._send`) on a fake SSE stream whose tokens arrive at
    `token_times` (seconds, on the client's clock), and return its (ttft, tpot, itls)."""
    import httpx

    from minfer.bench import serve as bench
    from minfer.bench.serve import BenchRequest

    n = len(token_times)
    events = [f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i} '}]})}\n\n" for i in range(n)]
    events.append(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n")
    events.append("data: [DONE]\n\n")

    def handler(request):
        return httpx.Response(200, content="".join(events).encode(), headers={"content-type": "text/event-stream"})

    # the client reads its clock once at the start, once per text chunk, once at the end of the stream
    clock = iter([start, *token_times, token_times[-1]])

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            req = BenchRequest(prompt=[1, 2, 3], prompt_len=3, output_len=n)
            with mock.patch.object(bench, "time", SimpleNamespace(perf_counter=lambda: next(clock))):
                return await bench._send(client, "http://test/v1/completions", "m", req, start, None)

    # in a thread of its own: a notebook's kernel already runs an event loop in this one
    with ThreadPoolExecutor(1) as pool:
        res = pool.submit(asyncio.run, run()).result()
    assert res.success, res.error
    tpot = (res.latency - res.ttft) / (res.output_tokens - 1)  # as `benchmark` computes it
    return res.ttft, tpot, list(res.itl)


def check_stream_metrics(stream_metrics: Callable) -> None:
    """Exercise 9.2: TTFT, TPOT and ITL from the arrival times of a stream's tokens."""
    rng = random.Random(9)
    for n in (2, 5, 16):
        start = rng.uniform(0, 10)
        t, times = start + rng.uniform(0.2, 2.0), []
        for _ in range(n):
            times.append(t)
            t += rng.uniform(0.01, 0.3)
        got = stream_metrics(start, list(times))
        if not (isinstance(got, tuple) and len(got) == 3):
            raise AssertionError("Exercise 9.2: return a tuple (ttft, tpot, itls)")
        ttft, tpot, itls = _client_metrics(start, times)
        expect_close("Exercise 9.2", got[0], ttft, atol=1e-9, what=f"TTFT ({n} tokens)")
        expect_close("Exercise 9.2", list(got[2]), itls, atol=1e-9, what=f"the ITL list ({n} tokens)")
        expect_close("Exercise 9.2", got[1], tpot, atol=1e-9, what=f"TPOT ({n} tokens)")
    passed("Exercise 9.2")


def _largest_accepted(prompt_len: int, max_model_len: int) -> int:
    """The largest max_tokens the engine's admission check accepts (0: none), found by asking it."""
    from minfer.sampling_params import SamplingParams
    from minfer.sequence import validate_prompt

    best = 0
    for m in range(1, max_model_len + 2):
        try:
            validate_prompt(list(range(prompt_len)), SamplingParams(max_tokens=m), max_model_len, 1 << 20)
        except ValueError:
            break
        best = m
    return best


def check_max_new_tokens(max_new_tokens: Callable) -> None:
    """Exercise 9.1: the largest max_tokens a request may ask for under max_model_len."""
    for prompt_len, max_model_len in [(10, 64), (63, 64), (64, 64), (100, 64), (1, 32), (500, 512)]:
        expect_equal("Exercise 9.1", max_new_tokens(prompt_len, max_model_len), _largest_accepted(prompt_len, max_model_len),
                     what=f"max_new_tokens(prompt_len={prompt_len}, max_model_len={max_model_len})")
    passed("Exercise 9.1")


def _wrong_stream_metrics(start, token_times):
    """Divides by every token instead of the tokens after the first."""
    ttft = token_times[0] - start
    itls = [b - a for a, b in zip(token_times, token_times[1:])]
    return ttft, (token_times[-1] - token_times[0]) / len(token_times), itls


WRONG_ANSWERS = {
    "check_stream_metrics": _wrong_stream_metrics,
    "check_max_new_tokens": lambda prompt_len, max_model_len: max_model_len - prompt_len,  # negative when it overflows
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
