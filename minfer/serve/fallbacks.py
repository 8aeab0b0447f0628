"""Fallbacks: what the server does when it cannot give a request everything it asked for (article §15).

The article's checklist ends with "fallbacks: lower the token cap, answer short on a timeout, retry
policy". Each is a server feature here, off unless asked for, and each says so in the answer; none is a
silent change of a request:

| fallback | asked for by | what the client sees |
| --- | --- | --- |
| shed load | `--max-waiting-requests N` (N >= 1) | 503 with `Retry-After` when N requests already wait for their first token; 400 for more than N prompts in one request (never admissible) |
| time limit | `--request-timeout S` or the body's `request_timeout` | what was generated so far, `finish_reason: "timeout"` |
| keep the prompt's tail | the body's `truncate_prompt_tokens: N` (vLLM's) | only the last N prompt tokens run; `usage.prompt_tokens` says N |
| lower the token cap | `--kv-pressure-threshold F --kv-pressure-max-tokens M` | max_tokens cut to M while KV usage >= F; the answer's `fallback` and the `X-Max-Tokens-Capped` header say so |

"Waiting" means accepted by the server and no token generated yet (queued in the engine or in prefill):
what grows without bound when requests arrive faster than they are served. Requests already admitted are
never dropped by the shedding: only new ones are refused, before any work is done for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator

from minfer.sampling_params import SamplingParams
from minfer.serve.engine_loop import OutputSnapshot, RequestGroup, RequestSnapshot
from minfer.serve.protocol import APIError, echo

TIMEOUT_FINISH_REASON = "timeout"  # finish_reason of a choice ended by the time limit


@dataclass(frozen=True)
class FallbackConfig:
    """The fallbacks' settings; each is a flag of `python -m minfer.serve` (None: off).

    Args:
        max_waiting_requests: most requests waiting for their first token; one more is a 503
            (`--max-waiting-requests`, requests).
        request_timeout: default time limit of a request, arrival to last token (seconds; `--request-timeout`);
            a request's own `request_timeout` field may only lower it.
        kv_pressure_threshold: KV-cache usage (0-1) from which new requests get the lower cap
            (`--kv-pressure-threshold`).
        kv_pressure_max_tokens: the cap on max_tokens of a request admitted under KV pressure
            (`--kv-pressure-max-tokens`, tokens).

    Raises:
        ValueError: a value out of range, or only one of the two KV-pressure settings.
    """

    max_waiting_requests: int | None = None
    request_timeout: float | None = None
    kv_pressure_threshold: float | None = None
    kv_pressure_max_tokens: int | None = None

    def __post_init__(self) -> None:
        def whole(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if self.max_waiting_requests is not None and (not whole(self.max_waiting_requests)
                                                      or self.max_waiting_requests < 1):
            # 0 is refused rather than read as "off" (vLLM has no such flag to follow): a limit of 0 would
            # answer every request 503; leave the flag out for no limit.
            raise ValueError(f"max_waiting_requests must be an integer >= 1 (leave it out for no limit), "
                             f"got {self.max_waiting_requests!r}")
        if self.request_timeout is not None and not (isinstance(self.request_timeout, (int, float))
                                                     and math.isfinite(self.request_timeout)
                                                     and self.request_timeout > 0):
            raise ValueError(f"request_timeout must be a positive number of seconds, got {self.request_timeout!r}")
        if (self.kv_pressure_threshold is None) != (self.kv_pressure_max_tokens is None):
            raise ValueError("--kv-pressure-threshold and --kv-pressure-max-tokens go together: give both")
        if self.kv_pressure_threshold is not None and not 0 <= self.kv_pressure_threshold <= 1:
            raise ValueError(f"kv_pressure_threshold must be in [0, 1], got {self.kv_pressure_threshold!r}")
        if self.kv_pressure_max_tokens is not None and (not whole(self.kv_pressure_max_tokens)
                                                        or self.kv_pressure_max_tokens < 1):
            raise ValueError(f"kv_pressure_max_tokens must be an integer >= 1, got {self.kv_pressure_max_tokens!r}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------
# Request fields
# ----------------------------------------------------------------------------------------------------------
def truncate_prompt_tokens_setting(body: dict, max_model_len: int) -> int | None:
    """The body's `truncate_prompt_tokens` (vLLM's): None (off), or how many prompt tokens to keep, from the
    end. -1 means max_model_len, as in vLLM. APIError(400) for anything else: 0, a negative number, a
    float, a boolean, or more than max_model_len."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or 1 <= value <= max_model_len):
        raise APIError(400, f"truncate_prompt_tokens must be an integer in [1, max_model_len={max_model_len}] "
                            f"or -1 (= max_model_len), got {echo(repr(value))}", param="truncate_prompt_tokens")
    return max_model_len if value == -1 else value


def truncate_prompts(prompts: list[list[int]], keep: int | None) -> list[list[int]]:
    """Each prompt's last `keep` token ids (all of a shorter prompt); `prompts` unchanged when `keep` is None."""
    if keep is None:
        return prompts
    return [p[-keep:] for p in prompts]


def request_timeout_setting(body: dict, config: FallbackConfig) -> float | None:
    """The time limit of this request (seconds): the body's `request_timeout`, never above the server's
    `--request-timeout`; None when neither is set. APIError(400) for a value that is not a positive number."""
    value = body.get("request_timeout")
    if value is None:
        return config.request_timeout
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        # repr: "5" (a string) must not read as the number 5
        raise APIError(400, f"request_timeout must be a positive number of seconds, got {echo(repr(value))}",
                       param="request_timeout")
    return float(value) if config.request_timeout is None else min(float(value), config.request_timeout)


def cap_under_kv_pressure(params: list[SamplingParams], kv_usage: float | None,
                          config: FallbackConfig) -> tuple[list[SamplingParams], dict | None]:
    """`params` with max_tokens lowered to `kv_pressure_max_tokens` when KV usage is at the threshold.

    Returns the (maybe new) params and what to report: None when nothing was capped, else
    `{"max_tokens_capped": {"requested": [...], "granted": M, "kv_cache_usage": u, "threshold": F}}`.
    """
    cap, threshold = config.kv_pressure_max_tokens, config.kv_pressure_threshold
    if cap is None or kv_usage is None or kv_usage < threshold:
        return params, None
    requested = [p.max_tokens for p in params]
    if all(m is not None and m <= cap for m in requested):
        return params, None
    out = [p if p.max_tokens is not None and p.max_tokens <= cap
           else p.clone(max_tokens=cap, min_tokens=min(p.min_tokens, cap)) for p in params]
    return out, {"max_tokens_capped": {"requested": requested, "granted": cap,
                                       "kv_cache_usage": round(float(kv_usage), 4), "threshold": threshold}}


# ----------------------------------------------------------------------------------------------------------
# Load shedding
# ----------------------------------------------------------------------------------------------------------
class WaitingGate:
    """Counts the requests waiting for their first token and refuses new ones beyond `max_waiting` (503).

    Lives on the event loop (no lock): `admit` before a request is submitted, `release` once per engine
    request when its first token (or its end, or its abort) arrives.
    """

    def __init__(self, max_waiting: int | None, retry_after: float = 1.0):
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.num_waiting = 0
        self.num_shed = 0

    def admit(self, n: int, recent_ttft: float | None = None) -> None:
        """Count `n` new engine requests in; APIError(503, Retry-After) if that would pass the limit, and
        APIError(400) for more than the limit itself: such a request would never be admitted, and a 503
        would have clients retry it forever."""
        if self.max_waiting is not None and n > self.max_waiting:
            raise APIError(400, f"this request has {n} prompts, more than can ever wait at once "
                                f"(--max-waiting-requests {self.max_waiting}): send at most {self.max_waiting} "
                                "prompts per request", param="prompt")
        if self.max_waiting is not None and self.num_waiting + n > self.max_waiting:
            self.num_shed += 1
            wait = max(1, math.ceil(recent_ttft if recent_ttft else self.retry_after))
            raise APIError(503, f"the server is overloaded: {self.num_waiting} request(s) wait for their first "
                                f"token (--max-waiting-requests {self.max_waiting}); retry after {wait} s",
                           code="server_overloaded", headers={"Retry-After": str(wait)})
        self.num_waiting += n

    def release(self, n: int = 1) -> None:
        self.num_waiting = max(0, self.num_waiting - n)


class GatedGroup(RequestGroup):
    """A `RequestGroup` that gives its requests' places in the `WaitingGate` back as their first tokens come."""

    def __init__(self, engine_loop, base_id: str, n_prompts: int, gate: WaitingGate):
        super().__init__(engine_loop, base_id, n_prompts)
        self.gate = gate
        self.queued = set(self.rids)

    def _release(self, rids) -> None:
        for rid in list(rids):
            if rid in self.queued:
                self.queued.discard(rid)
                self.gate.release()

    async def submit(self, prompts, params, arrival) -> None:
        try:
            await super().submit(prompts, params, arrival)
        except BaseException:
            self._release(self.rids)
            raise

    async def events(self) -> AsyncIterator[RequestSnapshot]:
        try:
            async for snap in super().events():
                if snap.finished or any(o.token_ids for o in snap.outputs):
                    self._release([snap.request_id])
                yield snap
        finally:
            if not self.unfinished:
                self._release(self.rids)

    def abort(self) -> None:
        super().abort()
        self._release(self.rids)


# ----------------------------------------------------------------------------------------------------------
# Time limit
# ----------------------------------------------------------------------------------------------------------
class Deadline:
    """A request's time limit on the `time.perf_counter()` clock; `expired` is set once it cut the request."""

    def __init__(self, arrival: float, timeout: float | None):
        self.at = None if timeout is None else arrival + timeout
        self.timeout = timeout
        self.expired = False


async def events_until(group: RequestGroup, deadline: Deadline) -> AsyncIterator[RequestSnapshot]:
    """`group.events()`, ended early (with `deadline.expired` set) when the deadline passes.

    Each wait is bounded by what is left (`asyncio.wait_for` on the next event), so the request ends at its
    deadline even if the engine is slow to make its next token. The caller aborts what is left.
    """
    agen = group.events()
    try:
        while True:
            left = None if deadline.at is None else deadline.at - time.perf_counter()
            if left is not None and left <= 0:
                deadline.expired = True
                return
            try:
                snap = await asyncio.wait_for(agen.__anext__(), left)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                deadline.expired = True
                return
            yield snap
    finally:
        await agen.aclose()


def timed_out_snapshots(group: RequestGroup, final: dict[str, RequestSnapshot], prompts: list[list[int]],
                        n: int) -> list[RequestSnapshot]:
    """The last snapshot of each request of `group` (in order), what is unfinished marked "timeout": a request
    that produced nothing yet gets `n` empty outputs."""
    out = []
    for rid, prompt in zip(group.rids, prompts):
        snap = final.get(rid)
        if snap is None:
            snap = RequestSnapshot(rid, len(prompt), [OutputSnapshot(j, "", [], None, None, None) for j in range(n)],
                                   False)
        outputs = [o if o.finish_reason is not None else dataclasses.replace(o, finish_reason=TIMEOUT_FINISH_REASON)
                   for o in snap.outputs]
        out.append(dataclasses.replace(snap, outputs=outputs, finished=True,
                                       prompt_token_ids=snap.prompt_token_ids or list(prompt)))
    return out
