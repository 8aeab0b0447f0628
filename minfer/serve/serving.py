"""One generation request, from the engine loop back to the client: a JSON answer or a server-sent-event stream.

Once a route has parsed its body into prompts and `SamplingParams`, both endpoints end the same way: submit
the prompts to the engine loop, then either wait for all of them to finish and answer with one JSON object,
or stream OpenAI's chunks as the tokens come out (`"stream": true`). vLLM does this per endpoint in
`OpenAIServingCompletion` and `OpenAIServingChat` (`vllm/entrypoints/openai/serving_completion.py`,
`serving_chat.py`); here the two differ only in the shapes `protocol` gives them, so one class serves both.

A client that disconnects mid-stream (or mid-wait) aborts its engine requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minfer.sampling_params import SamplingParams
from minfer.serve.engine_loop import EngineLoop, RequestGroup, RequestSnapshot
from minfer.serve.fallbacks import (
    TIMEOUT_FINISH_REASON,
    Deadline,
    FallbackConfig,
    GatedGroup,
    WaitingGate,
    cap_under_kv_pressure,
    events_until,
    request_timeout_setting,
    timed_out_snapshots,
    truncate_prompt_tokens_setting,
    truncate_prompts,
)
from minfer.serve.limits import ServerLimits
from minfer.serve.protocol import (
    SSE_DONE,
    APIError,
    StreamChunks,
    TokenText,
    check_stop_token_ids,
    completion_response,
    fit_max_tokens,
    sse,
)

logger = logging.getLogger("minfer.serve")

# Streamed answers are not to be cached or buffered by a proxy (nginx honours X-Accel-Buffering)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIServing:
    """What the route handlers share: the engine, its loop, the served model names, the limits and the
    token-text cache.

    Args:
        engine: the engine `engine_loop` owns (read here only for its tokenizer and model config).
        engine_loop: the `EngineLoop` that runs `engine`.
        served_model_names: names clients may put in "model"; the first one is reported by default.
        log_requests: log each request's id, prompt count and sampling parameters.
        limits: what one request may ask (`limits.ServerLimits`, its `max_prompt_chars` resolved).
        fallbacks: load shedding, time limit and the KV-pressure cap (`fallbacks.FallbackConfig`; default: off).
        tool_prompt, tool_prompt_max_tokens: when minfer writes its own tool prompt (`serve.tools`,
            `--tool-prompt`, `--tool-prompt-max-tokens`; default "template" and
            `tools.DEFAULT_TOOL_PROMPT_MAX_TOKENS`).

    `default_sampling_params` (vLLM's name) is the engine's: the generation-config values an omitted field
    gets (`minfer.config.diff_sampling_param`), `max_tokens` among them.

    Raises:
        ValueError: an unknown tool_prompt mode, a tool_prompt_max_tokens below 1.
    """

    def __init__(self, engine, engine_loop: EngineLoop, served_model_names: list[str], log_requests: bool,
                 limits: ServerLimits, fallbacks: FallbackConfig | None = None, tool_prompt: str = "template",
                 tool_prompt_max_tokens: int | None = None):
        from minfer.serve.tools import DEFAULT_TOOL_PROMPT_MAX_TOKENS, TOOL_PROMPT_MODES

        if tool_prompt not in TOOL_PROMPT_MODES:
            raise ValueError(f"tool_prompt must be one of {', '.join(TOOL_PROMPT_MODES)}, got {tool_prompt!r}")
        if tool_prompt_max_tokens is None:
            tool_prompt_max_tokens = DEFAULT_TOOL_PROMPT_MAX_TOKENS
        if not isinstance(tool_prompt_max_tokens, int) or isinstance(tool_prompt_max_tokens, bool) \
                or tool_prompt_max_tokens < 1:
            raise ValueError(f"tool_prompt_max_tokens must be an integer >= 1, got {tool_prompt_max_tokens!r}")
        self.tool_prompt, self.tool_prompt_max_tokens = tool_prompt, tool_prompt_max_tokens
        self.default_sampling_params = dict(getattr(engine, "default_sampling_params", None) or {})
        self.engine = engine
        self.limits = limits
        self.engine_loop = engine_loop
        self.served_model_names = served_model_names
        self.model_id = served_model_names[0]
        self.max_model_len = int(engine.model_config.max_model_len)
        self.vocab_size = (getattr(engine.model_config, "vocab_size", None)
                           or getattr(engine.tokenizer, "vocab_size", None))  # None: not checked here
        self.tok_text = TokenText(engine.tokenizer)
        self.started = time.time()
        self.log_requests = log_requests
        self.fallbacks = fallbacks or FallbackConfig()
        self.gate = WaitingGate(self.fallbacks.max_waiting_requests)

    async def generate(self, request: Request, body: dict, prompts: list[list[int]], params: SamplingParams, *,
                       chat: bool, model: str, id_prefix: str, default_max_tokens: int | None,
                       echo_prompts: list[str] | None = None, score_only: bool = False, tools=None):
        """Run `prompts` (token ids); answer a dict (JSON), an SSE stream, or 499 if the client left.

        `default_max_tokens` is the endpoint's default for an omitted max_tokens (None: up to max_model_len),
        unless the server has one (`default_sampling_params["max_tokens"]`, from the generation config's
        `max_new_tokens`), which replaces it; each prompt gets it capped to what is left after it
        (`protocol.fit_max_tokens`). `echo_prompts` and
        `score_only`: completions' echo (`protocol.completion_response`). `tools`: chat's `serve.tools.ToolRequest`
        (its calls are parsed out of the text into `tool_calls`). The fallbacks (`fallbacks.py`) apply
        here, in this order: `truncate_prompt_tokens`, the waiting-requests limit (503), the KV-pressure cap,
        the time limit.
        """
        req_id = f"{id_prefix}-{uuid.uuid4().hex}"
        arrival = time.perf_counter()
        keep = truncate_prompt_tokens_setting(body, self.max_model_len)
        timeout = request_timeout_setting(body, self.fallbacks)
        check_stop_token_ids(params, self.vocab_size)
        if keep is not None and any(len(p) > keep for p in prompts):
            prompts = truncate_prompts(prompts, keep)
            if self.engine_loop.metrics is not None:
                self.engine_loop.metrics.count_fallback("truncate_prompt_tokens")
            if echo_prompts is not None:  # the echo is of what ran
                echo_prompts = [self.engine.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        default_max_tokens = self.default_sampling_params.get("max_tokens", default_max_tokens)
        per_prompt = [fit_max_tokens(params, len(p), self.max_model_len, default_max_tokens) for p in prompts]
        per_prompt, fallback = cap_under_kv_pressure(
            per_prompt, self.engine_loop.latest_stats.get("kv_cache_usage"), self.fallbacks)
        try:
            self.gate.admit(len(prompts), _recent_ttft(self.engine_loop))
        except APIError as err:
            if err.status == 503 and self.engine_loop.metrics is not None:  # a 400 (can never fit) is not shedding
                self.engine_loop.metrics.count_fallback("shed")
            raise
        group = GatedGroup(self.engine_loop, req_id, len(prompts), self.gate)
        if self.log_requests:
            logger.info("request %s: %d prompt(s), %s", req_id, len(prompts), params)
        if fallback is not None:
            logger.info("request %s: KV pressure, %s", req_id, fallback)
            if self.engine_loop.metrics is not None:
                self.engine_loop.metrics.count_fallback("max_tokens_capped")
        await group.submit(prompts, per_prompt, arrival)
        metrics = self.engine_loop.metrics
        if metrics is not None:
            for p in per_prompt:
                metrics.observe_request_params(p.n, p.max_tokens)
        created = int(time.time())
        k = params.logprobs or 0
        deadline = Deadline(arrival, timeout)
        headers = {} if fallback is None else {"X-Max-Tokens-Capped": str(fallback["max_tokens_capped"]["granted"])}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            if tools is not None:
                from minfer.serve.tools import ToolStreamChunks

                chunks = ToolStreamChunks(req_id, created, model, group.index, params.n, k, self.tok_text, chat=chat,
                                          tool_request=tools)
            else:
                chunks = StreamChunks(req_id, created, model, group.index, params.n, k, self.tok_text, chat=chat)
            return _SSEResponse(_stream(group, chunks, include_usage, req_id, deadline, self.engine_loop.metrics),
                                media_type="text/event-stream", headers={**_SSE_HEADERS, **headers})
        final = await _collect_unless_disconnected(request, group, req_id, deadline)
        if final is None:  # answered with nginx's "client closed request", for the access log: nobody reads it
            return Response(status_code=499)
        if deadline.expired:
            snaps = timed_out_snapshots(group, final, prompts, params.n)
            _count_timeout(self.engine_loop.metrics)
        else:
            snaps = [final[rid] for rid in group.rids]
        if metrics is not None:
            for snap in snaps:
                metrics.observe_max_generation_tokens(max((len(o.token_ids) for o in snap.outputs), default=0))
        answer = completion_response(req_id, created, model, snaps, params.n, k,
                                     self.tok_text, chat=chat, echo_prompts=echo_prompts, score_only=score_only)
        if tools is not None:
            from minfer.serve.tools import rewrite_response

            answer = rewrite_response(answer, tools)
        if fallback is not None:
            answer["fallback"] = fallback
        return JSONResponse(answer, headers=headers) if headers else answer


def _recent_ttft(engine_loop) -> float | None:
    """Mean of the last few TTFTs (seconds), for a 503's Retry-After; None before any."""
    recent = [t for _, t in list(getattr(engine_loop, "recent_ttfts", ()))[-8:]]
    return sum(recent) / len(recent) if recent else None


def _count_timeout(metrics) -> None:
    if metrics is not None:
        metrics.count_fallback("timeout")


async def _collect(group: RequestGroup, deadline: Deadline, final: dict[str, RequestSnapshot]) -> dict[str, RequestSnapshot]:
    """The last snapshot of each request of `group` (into `final`), once all finished or the deadline passed
    (then the unfinished ones are aborted: their KV blocks freed)."""
    async for snap in events_until(group, deadline):
        final[snap.request_id] = snap
    if deadline.expired:
        group.abort()
    return final


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect_unless_disconnected(request: Request, group: RequestGroup, req_id: str,
                                       deadline: Deadline) -> dict[str, RequestSnapshot] | None:
    """`_collect(group)`, or None (its requests aborted) if the client disconnects first."""
    collect_task = asyncio.ensure_future(_collect(group, deadline, {}))
    disconnect_task = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({collect_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (collect_task, disconnect_task):
            if not t.done():
                t.cancel()
        group.abort()  # no-op unless the client left
    if collect_task not in done:
        logger.info("request %s: client disconnected, aborted", req_id)
        return None
    return collect_task.result()


async def _stream(group: RequestGroup, chunks: StreamChunks, include_usage: bool, req_id: str,
                  deadline: Deadline, metrics=None) -> AsyncIterator[str]:
    """The events of a streamed answer; an engine failure mid-stream is sent as an error event, then [DONE].
    At the deadline the unfinished choices end with one chunk each, `finish_reason: "timeout"`."""
    try:
        # Chat's role chunk goes out with the first generated token, as vLLM sends it, not at admission:
        # clients time the first chunk as TTFT, and before prefill nothing has been generated yet.
        first = chunks.first()
        try:
            async for snap in events_until(group, deadline):
                chunk = chunks.on_snapshot(snap)
                if chunk is not None:
                    if first is not None:
                        yield first
                        first = None
                    yield chunk
        except APIError as err:  # the status line is long gone: the error travels as an event
            if first is not None:
                yield first
                first = None
            yield sse(err.body())
        if first is not None:  # nothing was generated (e.g. aborted): the stream still opens with the role
            yield first
        if deadline.expired:
            group.abort()
            _count_timeout(metrics)
            last = chunks.finish_unfinished(group.rids, TIMEOUT_FINISH_REASON)
            if last is not None:
                yield last
        if include_usage:
            yield chunks.usage_chunk()
        yield SSE_DONE
    finally:
        if group.unfinished:
            logger.info("request %s: stream closed early, aborting", req_id)
        group.abort()
        if metrics is not None:
            for rid in group.rids:
                metrics.observe_max_generation_tokens(max(
                    (v for (r, _), v in chunks.completion_tokens.items() if r == rid), default=0))


class _SSEResponse(StreamingResponse):
    """A streaming response that also watches for the client going away.

    Whichever ends first, the stream or the client, cancels the other; the generator's `finally` then
    aborts whatever is still running in the engine.
    """

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def run_stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass
                tg.cancel_scope.cancel()

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                tg.cancel_scope.cancel()

            tg.start_soon(run_stream)
            tg.start_soon(watch_disconnect)
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()
