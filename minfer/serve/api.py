"""The OpenAI-compatible HTTP server (article §9: what vLLM's `vllm serve` does, in one file).

Two halves:

- `EngineLoop`: the engine is synchronous and not thread-safe, so one background thread owns it. Between two
  `engine.step()` calls the thread drains an inbound queue of commands (add a request, abort requests), then
  hands each step's outputs to the asyncio queue of the HTTP request that asked for them
  (`loop.call_soon_threadsafe`). A request the engine rejects (`ValueError` from `add_request`) gets its error
  back on its own queue; the loop goes on. The same thread updates the Prometheus metrics.
- `build_app`: a FastAPI app with OpenAI's routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`),
  server-sent-event streaming, OpenAI's error bodies, `/metrics` (Prometheus), `/v1/stats` (JSON for the
  demo page), `/health` and the demo page at `/`.

A client that disconnects mid-stream (or mid-wait) aborts its engine requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import re
import secrets
import threading
import time
import traceback
import uuid
from collections import deque
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from starlette.concurrency import run_in_threadpool
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minfer.sampling_params import SamplingParams
from minfer.serve.metrics import ServerMetrics

logger = logging.getLogger("minfer.serve")

STATIC_DIR = Path(__file__).parent / "static"


# ----------------------------------------------------------------------------------------------------------
# Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}
# ----------------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    _TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
              500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or self._TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _param_of(exc: Exception) -> str | None:
    """The field a SamplingParams/engine ValueError names ("SamplingParams.top_p must be ..." -> "top_p")."""
    m = re.search(r"SamplingParams\.(\w+)", str(exc))
    return m.group(1) if m else None


# ----------------------------------------------------------------------------------------------------------
# Engine loop: one thread owns the engine
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class OutputSnapshot:
    """A copy of one `CompletionOutput`, safe to read on the event loop while the engine goes on."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: Any


@dataclasses.dataclass
class RequestSnapshot:
    request_id: str
    num_prompt_tokens: int
    outputs: list[OutputSnapshot]
    finished: bool
    num_cached_tokens: int = 0


def _snapshot(out) -> RequestSnapshot:
    return RequestSnapshot(
        request_id=out.request_id,
        num_prompt_tokens=len(out.prompt_token_ids or []),
        outputs=[OutputSnapshot(o.index, o.text, list(o.token_ids),
                                list(o.logprobs) if o.logprobs is not None else None,
                                o.finish_reason, o.stop_reason) for o in out.outputs],
        finished=bool(out.finished),
        num_cached_tokens=getattr(out, "num_cached_tokens", 0) or 0,
    )


class _Route:
    """Where the outputs of one engine request go."""

    __slots__ = ("loop", "queue", "arrival", "first_token_seen")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, arrival: float):
        self.loop, self.queue, self.arrival, self.first_token_seen = loop, q, arrival, False


def _stats_dict(stats) -> dict:
    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


class EngineLoop:
    """Runs `engine.step()` in a background thread and routes its outputs to asyncio queues.

    Events put on a request's queue are tuples `(request_id, kind, payload)`:
    `("added", None)` once the engine accepted it, `("error", exc)` if it did not,
    `("output", RequestSnapshot)` per step that made progress, `("fatal", message)` if a step crashed.

    Args:
        engine: an `LLMEngine` (or anything with its interface).
        metrics: `ServerMetrics` to update, or None.
        stats_interval: seconds between `engine.stats()` refreshes while busy (always refreshed when idle,
            after commands, and when a request finishes).
    """

    def __init__(self, engine, metrics: ServerMetrics | None = None, stats_interval: float = 0.05):
        self.engine = engine
        self.metrics = metrics
        self.stats_interval = stats_interval
        self._commands: queue.Queue = queue.Queue()
        self._routes: dict[str, _Route] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self._last_stats_time = 0.0
        self.latest_stats: dict = {}
        self.recent_ttfts: deque = deque(maxlen=64)  # (unix time, ttft seconds)
        self.num_steps = 0
        self.num_requests_added = 0
        self.num_step_errors = 0
        try:
            self.kv_pool_info = dict(engine.kv_pool_info())
        except Exception:  # noqa: BLE001 - optional
            self.kv_pool_info = {}
        self._refresh_stats(force=True)

    # --- called from the event loop ------------------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="minfer-engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add(self, request_id: str, prompt, params: SamplingParams, q: asyncio.Queue, arrival: float) -> None:
        """Queue `engine.add_request`; the answer ("added" or "error") arrives on `q`."""
        self.start()
        self._commands.put(("add", request_id, prompt, params, arrival, asyncio.get_running_loop(), q))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._commands.put(("abort", list(request_ids)))

    # --- engine thread -------------------------------------------------------------------------------------
    def _post(self, route: _Route, *event) -> None:
        try:
            route.loop.call_soon_threadsafe(route.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening any more
            pass

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, arrival, loop, q = cmd
            route = _Route(loop, q, arrival)
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            except Exception as exc:  # noqa: BLE001 - any rejection goes back to that request only
                self._post(route, rid, "error", exc)
                return
            self._routes[rid] = route
            self.num_requests_added += 1
            self._post(route, rid, "added", None)
        elif kind == "abort":
            rids = [r for r in cmd[1] if r in self._routes]
            for r in rids:
                self._routes.pop(r, None)
            if rids:
                try:
                    self.engine.abort_request(rids)
                except Exception:  # noqa: BLE001
                    logger.exception("abort_request(%s) failed", rids)
                if self.metrics is not None:
                    for _ in rids:
                        self.metrics.observe_finished("abort", [], None, None)

    def _drain(self, block: bool) -> bool:
        """Run queued commands; wait up to 0.25 s for one when `block`. True if any ran."""
        ran = False
        while True:
            try:
                cmd = self._commands.get(timeout=0.25) if block and not ran else self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if cmd[0] != "wake":
                self._handle(cmd)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_stats_time < self.stats_interval:
            return
        self._last_stats_time = now
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001
            logger.exception("engine.stats() failed")
            return
        self.latest_stats = _stats_dict(stats)
        if self.metrics is not None:
            self.metrics.update_from_stats(stats)

    def _dispatch(self, outputs) -> bool:
        any_finished = False
        now = time.perf_counter()
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted meanwhile
                continue
            m = getattr(out, "metrics", None)
            if not route.first_token_seen and any(o.token_ids for o in out.outputs):
                route.first_token_seen = True
                ttft = (m.ttft if m is not None and m.ttft is not None else now - route.arrival)
                self.recent_ttfts.append((time.time(), ttft))
                if self.metrics is not None:
                    self.metrics.observe_first_token(ttft)
            snap = _snapshot(out)
            if snap.finished:
                any_finished = True
                self._routes.pop(out.request_id, None)
                if self.metrics is not None:
                    e2e = m.e2e if m is not None and m.e2e is not None else now - route.arrival
                    reason = next((o.finish_reason for o in out.outputs if o.finish_reason), None)
                    self.metrics.observe_finished(reason, m.itl if m is not None else [],
                                                  m.tpot if m is not None else None, e2e)
            self._post(route, out.request_id, "output", snap)
        return any_finished

    def _fail_all(self, message: str) -> None:
        rids = list(self._routes)
        routes = [self._routes.pop(r) for r in rids]
        try:
            if rids:
                self.engine.abort_request(rids)
        except Exception:  # noqa: BLE001
            logger.exception("abort after a failed step failed too")
        for rid, route in zip(rids, routes):
            self._post(route, rid, "fatal", message)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.engine.has_unfinished_requests()
                ran = self._drain(block=not busy)
                if ran:
                    self._refresh_stats(force=True)
                if self._stop.is_set():
                    break
                if not self.engine.has_unfinished_requests():
                    if not ran:
                        self._refresh_stats(force=True)
                    continue
                outputs = self.engine.step()
                self.num_steps += 1
                finished = self._dispatch(outputs)
                self._refresh_stats(force=finished)
            except Exception as exc:  # noqa: BLE001 - the loop must not die
                self.num_step_errors += 1
                logger.error("engine step failed: %s\n%s", exc, traceback.format_exc())
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
                time.sleep(0.01)


# ----------------------------------------------------------------------------------------------------------
# One HTTP request = one or more engine requests
# ----------------------------------------------------------------------------------------------------------
class _Pending:
    """The engine requests of one HTTP request, sharing one asyncio queue."""

    def __init__(self, engine_loop: EngineLoop, base_id: str, n_prompts: int):
        self.engine_loop = engine_loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids = [f"{base_id}-{i}" for i in range(n_prompts)]
        self.index = {rid: i for i, rid in enumerate(self.rids)}
        self.unfinished: set[str] = set()

    async def submit(self, prompts: list, params: SamplingParams, arrival: float) -> None:
        """Add every prompt; raise APIError(400) (after aborting the accepted ones) if the engine rejects one."""
        for rid, prompt in zip(self.rids, prompts):
            self.engine_loop.add(rid, prompt, params, self.queue, arrival)
        error = None
        for _ in self.rids:
            rid, kind, payload = await self.queue.get()
            if kind == "added":
                self.unfinished.add(rid)
            elif kind == "error":
                error = error or payload
        if error is not None:
            self.abort()
            if isinstance(error, (ValueError, TypeError)):
                raise APIError(400, str(error), param=_param_of(error) or "prompt")
            raise APIError(500, f"{type(error).__name__}: {error}")

    async def events(self) -> AsyncIterator[RequestSnapshot]:
        """Output snapshots until every request finished; APIError(500) if the engine failed."""
        while self.unfinished:
            rid, kind, payload = await self.queue.get()
            if rid not in self.unfinished:
                continue
            if kind == "fatal":
                self.unfinished.discard(rid)
                self.abort()
                raise APIError(500, payload)
            if kind == "output":
                if payload.finished:
                    self.unfinished.discard(rid)
                yield payload

    def abort(self) -> None:
        if self.unfinished:
            self.engine_loop.abort(sorted(self.unfinished))
            self.unfinished.clear()


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


class _AuthMiddleware:
    """401 for /v1 routes without `Authorization: Bearer <api_key>`."""

    def __init__(self, app, api_key: str, on_error):
        self.app, self.key, self.on_error = app, api_key.encode(), on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                response = self.on_error(APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key given "
                         "to --api-key", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ----------------------------------------------------------------------------------------------------------
# Request parsing
# ----------------------------------------------------------------------------------------------------------
def _get(body: dict, name: str, default=None):
    value = body.get(name)
    return default if value is None else value


def _reject_unsupported(body: dict, chat: bool) -> None:
    """Refuse OpenAI options minfer does not implement, rather than silently ignoring them."""
    def nonzero(v):
        return v not in (None, 0, 0.0, False, {}, [], "")

    checks = {"presence_penalty": nonzero, "frequency_penalty": nonzero, "logit_bias": nonzero,
              "best_of": lambda v: v not in (None, 1) and v != body.get("n", 1)}
    if chat:
        checks.update({"tools": nonzero, "functions": nonzero,
                       "response_format": lambda v: v not in (None, {}) and not (isinstance(v, dict)
                                                                                   and v.get("type") == "text")})
    else:
        checks.update({"echo": nonzero, "suffix": nonzero})
    for name, is_set in checks.items():
        if name in body and is_set(body[name]):
            raise APIError(400, f"'{name}' is not supported by minfer", param=name)


def _sampling_params(body: dict, *, chat: bool) -> SamplingParams:
    _reject_unsupported(body, chat)
    if chat:
        max_tokens = _get(body, "max_completion_tokens", _get(body, "max_tokens"))
        want_logprobs = _get(body, "logprobs", False)
        top = _get(body, "top_logprobs")
        if top is not None and not want_logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
            raise APIError(400, f"top_logprobs must be an integer in [0, 20], got {top!r}", param="top_logprobs")
        if not isinstance(want_logprobs, bool):
            raise APIError(400, f"logprobs must be a boolean, got {want_logprobs!r}", param="logprobs")
        logprobs = (top or 0) if want_logprobs else None
    else:
        max_tokens = _get(body, "max_tokens", 16)
        logprobs = _get(body, "logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            raise APIError(400, f"logprobs must be an integer in [0, 20], got {logprobs!r}", param="logprobs")
    for name in ("stream",):
        if not isinstance(_get(body, name, False), bool):
            raise APIError(400, f"{name} must be a boolean", param=name)
    if body.get("stream_options") is not None and not body.get("stream"):
        raise APIError(400, "stream_options can only be set when stream=true", param="stream_options")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise APIError(400, "stream_options must be an object such as {\"include_usage\": true}",
                       param="stream_options")
    try:
        return SamplingParams(
            n=_get(body, "n", 1),
            temperature=_get(body, "temperature", 1.0),
            top_p=_get(body, "top_p", 1.0),
            top_k=_get(body, "top_k", -1),
            min_p=_get(body, "min_p", 0.0),
            seed=_get(body, "seed"),
            max_tokens=max_tokens,
            stop=_get(body, "stop"),
            stop_token_ids=_get(body, "stop_token_ids"),
            ignore_eos=bool(_get(body, "ignore_eos", False)),
            logprobs=logprobs,
            include_stop_str_in_output=bool(_get(body, "include_stop_str_in_output", False)),
            skip_special_tokens=bool(_get(body, "skip_special_tokens", True)),
        )
    except (ValueError, TypeError) as exc:
        param = _param_of(exc)
        msg = str(exc).replace("SamplingParams.", "") if param else f"invalid sampling parameters: {exc}"
        if param == "max_tokens" and chat and "max_completion_tokens" in body:
            param = "max_completion_tokens"
        raise APIError(400, msg, param=param) from None


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(body: dict) -> list:
    """`prompt` as a list of engine prompts: a string, a list of strings, token ids, or lists of token ids."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if _is_ids(p):
            return [p]
        if all(_is_ids(x) for x in p):
            return [list(x) for x in p]
    if p is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids (non-empty)", param="prompt")


def _normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


# ----------------------------------------------------------------------------------------------------------
# Shaping outputs
# ----------------------------------------------------------------------------------------------------------
class _TokenText:
    """token id -> its text, cached (for logprobs)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            try:
                s = self.tokenizer.decode([tid])
            except Exception:  # noqa: BLE001
                s = f"<{tid}>"
            if len(self.cache) < 200_000:
                self.cache[tid] = s
        return s


def _chosen_logprob(d: dict, tid: int) -> float:
    v = d.get(tid)
    return float(v) if v is not None else -9999.0


def _completion_logprobs(tok: _TokenText, token_ids: list[int], logprobs: list[dict], k: int,
                         offset: int = 0) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, logprobs):
        s = tok(tid)
        tokens.append(s)
        token_lps.append(_chosen_logprob(d, tid))
        top = sorted(d.items(), key=lambda kv: -kv[1])[: max(k, 1)]
        if tid not in dict(top) and tid in d:
            top.append((tid, d[tid]))
        tops.append({tok(t): float(lp) for t, lp in top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tok: _TokenText, token_ids: list[int], logprobs: list[dict], k: int) -> dict:
    content = []
    for tid, d in zip(token_ids, logprobs):
        s = tok(tid)
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
        content.append({"token": s, "logprob": _chosen_logprob(d, tid), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": tok(t), "logprob": float(lp),
                                          "bytes": list(tok(t).encode("utf-8"))} for t, lp in top]})
    return {"content": content}


def _stable_text(text: str, finished: bool) -> str:
    """Hold back a trailing replacement char (half a UTF-8 character) until the next token completes it."""
    if finished:
        return text
    return text.rstrip("\ufffd")


# ----------------------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------------------
def build_app(engine, served_model_names: list[str] | str | None = None, api_key: str | None = None,
              log_requests: bool = True, engine_loop: EngineLoop | None = None) -> FastAPI:
    """A FastAPI app serving `engine` with OpenAI's API.

    Args:
        engine: an `LLMEngine` (or a fake with its interface); owned by the app's engine-loop thread.
        served_model_names: names clients may put in "model" (the first one is reported); default:
            `engine.model_name`.
        api_key: when set, every /v1 route needs `Authorization: Bearer <api_key>`.
        log_requests: log each request's id, prompt length and sampling parameters.
        engine_loop: an existing `EngineLoop` for `engine` (default: a new one, with its own metrics).

    Returns:
        the app; its engine loop starts with the app (lifespan) or on the first request.
    """
    if isinstance(served_model_names, str):
        served_model_names = [served_model_names]
    names = list(served_model_names or [getattr(engine, "model_name", "minfer")])
    model_id = names[0]
    if engine_loop is None:
        engine_loop = EngineLoop(engine, ServerMetrics(model_id))
    metrics = engine_loop.metrics or ServerMetrics(model_id)
    max_model_len = int(engine.model_config.max_model_len)
    tok_text = _TokenText(engine.tokenizer)
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    app = FastAPI(title="minfer", version="0.1", lifespan=lifespan,
                  description="OpenAI-compatible server of minfer (a teaching LLM inference engine).")
    app.state.engine = engine
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.served_model_names = names

    # --- errors --------------------------------------------------------------------------------------------
    def error_response(err: APIError) -> JSONResponse:
        metrics.count_error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail),
                                       type="not_found_error" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    # --- auth (a plain ASGI middleware: BaseHTTPMiddleware would get in the way of streaming) ---------------
    if api_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key, on_error=error_response)

    # --- helpers -------------------------------------------------------------------------------------------
    async def read_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        except RecursionError:  # e.g. [[[[...]]]] thousands deep: valid JSON, but nothing a request needs
            raise APIError(400, "request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        return body

    def check_model(body: dict) -> str:
        model = body.get("model")
        if model is None:
            return model_id
        if model not in names:
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(names)}",
                           param="model", code="model_not_found")
        return model

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def run(request: Request, body: dict, prompts: list, params: SamplingParams, chat: bool,
                  model: str, id_prefix: str):
        req_id = f"{id_prefix}-{uuid.uuid4().hex}"
        arrival = time.perf_counter()
        pending = _Pending(engine_loop, req_id, len(prompts))
        if log_requests:
            logger.info("request %s: %d prompt(s), %s", req_id, len(prompts), params)
        await pending.submit(prompts, params, arrival)
        created = int(time.time())
        n = params.n
        k = params.logprobs or 0
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return _SSEResponse(stream(pending, req_id, created, model, n, k, chat, include_usage),
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect_task = asyncio.ensure_future(collect(pending))
        disconnect_task = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({collect_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (collect_task, disconnect_task):
                if not t.done():
                    t.cancel()
            pending.abort()  # no-op unless the client left
        if collect_task not in done:
            logger.info("request %s: client disconnected, aborted", req_id)
            return Response(status_code=499)
        final = collect_task.result()
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for rid in pending.rids:
            snap = final[rid]
            prompt_tokens += snap.num_prompt_tokens
            for o in snap.outputs:
                completion_tokens += len(o.token_ids)
                index = pending.index[rid] * n + o.index
                lp = None
                if o.logprobs is not None:
                    lp = (_chat_logprobs(tok_text, o.token_ids, o.logprobs, k) if chat
                          else _completion_logprobs(tok_text, o.token_ids, o.logprobs, k))
                if chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": o.text},
                                    "logprobs": lp, "finish_reason": o.finish_reason})
                else:
                    choices.append({"index": index, "text": o.text, "logprobs": lp,
                                    "finish_reason": o.finish_reason})
        choices.sort(key=lambda c: c["index"])
        return {"id": req_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def collect(pending: _Pending) -> dict[str, RequestSnapshot]:
        final: dict[str, RequestSnapshot] = {}
        async for snap in pending.events():
            final[snap.request_id] = snap
        return final

    async def stream(pending: _Pending, req_id: str, created: int, model: str, n: int, k: int, chat: bool,
                     include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent_text: dict[tuple, str] = {}
        sent_tokens: dict[tuple, int] = {}
        finished: set[tuple] = set()
        prompt_tokens: dict[str, int] = {}
        completion_tokens: dict[tuple, int] = {}

        def chunk(choices: list[dict], **extra) -> str:
            return _sse({"id": req_id, "object": obj, "created": created, "model": model, "choices": choices,
                         **extra})

        try:
            if chat:  # OpenAI's first chunk: the role
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(pending.rids) * n)])
            try:
                async for snap in pending.events():
                    prompt_tokens[snap.request_id] = snap.num_prompt_tokens
                    choices = []
                    for o in snap.outputs:
                        key = (snap.request_id, o.index)
                        if key in finished:
                            continue
                        index = pending.index[snap.request_id] * n + o.index
                        done = o.finish_reason is not None
                        text = _stable_text(o.text, done)
                        old = sent_text.get(key, "")
                        delta = text[len(old):] if text.startswith(old) else ""
                        if delta:
                            sent_text[key] = text
                        completion_tokens[key] = len(o.token_ids)
                        lp = None
                        if o.logprobs is not None and delta or (o.logprobs is not None and done):
                            start = sent_tokens.get(key, 0)
                            ids, lps = o.token_ids[start:], o.logprobs[start:]
                            sent_tokens[key] = len(o.token_ids)
                            if ids:
                                lp = (_chat_logprobs(tok_text, ids, lps, k) if chat
                                      else _completion_logprobs(tok_text, ids, lps, k, offset=len(old)))
                        if not delta and not done and lp is None:
                            continue
                        if done:
                            finished.add(key)
                        reason = o.finish_reason
                        if chat:
                            choices.append({"index": index, "delta": {"content": delta} if delta else {},
                                            "logprobs": lp, "finish_reason": reason})
                        else:
                            choices.append({"index": index, "text": delta, "logprobs": lp,
                                            "finish_reason": reason})
                    if choices:
                        yield chunk(choices)
            except APIError as err:
                yield _sse(err.body())
            if include_usage:
                yield chunk([], usage=usage(sum(prompt_tokens.values()), sum(completion_tokens.values())))
            yield "data: [DONE]\n\n"
        finally:
            if pending.unfinished:
                logger.info("request %s: stream closed early, aborting", req_id)
            pending.abort()

    # --- routes --------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            engine_loop.start()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(started), "owned_by": "minfer",
             "root": getattr(engine, "model_name", name), "parent": None, "max_model_len": max_model_len}
            for name in names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        model = check_model(body)
        params = _sampling_params(body, chat=False)
        prompts = _prompts(body)

        def tokenize() -> list:
            return [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]

        try:  # off the engine thread: a megabyte of prompt text must not stall everyone's decoding
            prompts = await run_in_threadpool(tokenize)
        except Exception as exc:  # e.g. lone surrogates the tokenizer cannot encode
            raise APIError(400, f"the prompt could not be tokenized: {exc}", param="prompt") from None
        return await run(request, body, prompts, params, chat=False, model=model, id_prefix="cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        model = check_model(body)
        params = _sampling_params(body, chat=True)
        messages = _normalize_messages(body.get("messages"))
        try:
            # Token ids, not text: the template already holds any BOS, and the engine would add another when
            # it tokenized a string. Rendering and tokenizing run off the event loop and the engine thread.
            prompt = await run_in_threadpool(engine.tokenizer.encode_chat, messages)
        except (ValueError, TypeError, KeyError) as exc:
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages") from None
        return await run(request, body, [prompt], params, chat=True, model=model, id_prefix="chatcmpl")

    @app.get("/v1/stats")
    async def stats():
        ttfts = list(engine_loop.recent_ttfts)
        recent = [t for _, t in ttfts[-16:]]
        return {"model": model_id, "time": time.time(), "uptime_s": time.time() - started,
                "max_model_len": max_model_len, "stats": engine_loop.latest_stats,
                "kv_pool": engine_loop.kv_pool_info,
                "recent_ttfts": [{"time": t, "ttft_s": v} for t, v in ttfts],
                "ttft_recent_mean_s": sum(recent) / len(recent) if recent else None,
                "num_requests_total": engine_loop.num_requests_added, "num_steps": engine_loop.num_steps,
                "num_step_errors": engine_loop.num_step_errors, "engine_loop_alive": engine_loop.alive}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/")
    async def index():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    return app
