"""The bridge between the asyncio server and the engine, which runs in a thread of its own (article §9).

`LLMEngine` is synchronous and not thread-safe, so one background thread owns it (`EngineLoop`). Between two
`engine.step()` calls the thread drains an inbound queue of commands (add a request, abort requests), then
hands each step's outputs to the asyncio queue of the HTTP request that asked for them
(`loop.call_soon_threadsafe`). A request the engine rejects (`ValueError` from `add_request`) gets its error
back on its own queue; the loop goes on. A failure that ends the engine (`WorkerDiedError`: a tensor- or
pipeline-parallel worker died, seen by a step or, while idle, by `engine.check_health()` once a second) ends
the loop: every request in flight, queued or sent later gets a 503 at once, and /health answers 503. A job
(`run_when_idle`: beam search, which steps the executor itself)
runs on the same thread once no request is unfinished; requests added while it waits wait behind it, so a
busy server drains for it instead of starving it. The same thread updates the Prometheus metrics. vLLM splits the same
job between `AsyncLLM` (the asyncio side) and its engine-core process (`vllm/v1/engine/`).

On the asyncio side, `RequestGroup` gathers the engine requests of one HTTP request (one per prompt) on one
queue; aborting it (a client that disconnects) frees their KV blocks. Nothing here knows about HTTP routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections import deque
from typing import Any, AsyncIterator

from minfer.sampling_params import SamplingParams
from minfer.serve.metrics import ServerMetrics, phase_times
from minfer.serve.protocol import APIError, engine_error

logger = logging.getLogger("minfer.serve")


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
    """A copy of one `RequestOutput` (what the HTTP side reads of it)."""

    request_id: str
    num_prompt_tokens: int
    outputs: list[OutputSnapshot]
    finished: bool
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] | None = None  # set on the final snapshot (echo)
    prompt_logprobs: list | None = None  # set on the final snapshot when asked for


def _snapshot(out) -> RequestSnapshot:
    return RequestSnapshot(
        request_id=out.request_id,
        num_prompt_tokens=len(out.prompt_token_ids or []),
        outputs=[OutputSnapshot(o.index, o.text, list(o.token_ids),
                                list(o.logprobs) if o.logprobs is not None else None,
                                o.finish_reason, o.stop_reason) for o in out.outputs],
        finished=bool(out.finished),
        num_cached_tokens=getattr(out, "num_cached_tokens", 0) or 0,
        # Copied once, when the request finishes: the prompt's lists are long, and only the answer reads them.
        prompt_token_ids=list(out.prompt_token_ids or []) if out.finished else None,
        prompt_logprobs=(list(out.prompt_logprobs) if out.finished and getattr(out, "prompt_logprobs", None)
                         else None),
    )


class _Route:
    """Where the outputs of one engine request go."""

    __slots__ = ("loop", "queue", "arrival", "first_token_seen")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, arrival: float):
        self.loop, self.queue, self.arrival, self.first_token_seen = loop, q, arrival, False


def _stats_dict(stats) -> dict:
    """`engine.stats()` (a dataclass or a plain object) as a JSON-ready dict, for /v1/stats."""
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
        self._jobs: deque = deque()  # (job_id, fn, route) waiting for an idle engine
        self._deferred: list = []  # "add" commands that arrived while a job waited
        self.exit_reason: str | None = None  # set when a failure ended the engine (a dead parallel worker)
        # Held while a command is queued and while the loop declares the engine dead: a command is either
        # queued before the death (and answered by the loop as it ends) or refused with a 503, never lost.
        self._dead_lock = threading.Lock()
        self._last_health_check = 0.0
        try:
            self.kv_pool_info = dict(engine.kv_pool_info())
        except Exception:  # noqa: BLE001 - optional
            self.kv_pool_info = {}
        self._refresh_stats(force=True)

    # --- called from the event loop ------------------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self.exit_reason is not None:  # the engine cannot run steps any more: nothing to restart
                return
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
        """Queue `engine.add_request`; the answer ("added" or "error") arrives on `q` (an `APIError(503)` once
        the engine has died)."""
        self.start()
        self._queue_or_refuse(("add", request_id, prompt, params, arrival, asyncio.get_running_loop(), q))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._commands.put(("abort", list(request_ids)))

    def run_when_idle(self, job_id: str, fn, q: asyncio.Queue) -> None:
        """Queue `fn(engine)` to run on the engine thread between two steps, once the engine has no unfinished
        request. Its result arrives on `q` as `(job_id, "done", value)`, or `(job_id, "error", exc)` if it
        raised (the loop goes on either way). Requests added meanwhile are held until the job ran."""
        self.start()
        self._queue_or_refuse(("job", job_id, fn, asyncio.get_running_loop(), q))

    def cancel_job(self, job_id: str) -> None:
        """Drop a job that has not started (its client left); one already running finishes."""
        self._commands.put(("cancel_job", job_id))

    def _queue_or_refuse(self, cmd) -> None:
        with self._dead_lock:
            if self.exit_reason is None:
                self._commands.put(cmd)
                return
        cmd[-1].put_nowait((cmd[1], "error", APIError(503, self.exit_reason)))  # on the event loop: no hop

    # --- engine thread -------------------------------------------------------------------------------------
    def _post(self, route: _Route, *event) -> None:
        try:
            route.loop.call_soon_threadsafe(route.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening any more
            pass

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add" and self._jobs:  # behind a waiting job: the running requests drain for it
            self._deferred.append(cmd)
        elif kind == "job":
            _, job_id, fn, loop, q = cmd
            self._jobs.append((job_id, fn, _Route(loop, q, time.perf_counter())))
        elif kind == "cancel_job":
            self._jobs = deque(j for j in self._jobs if j[0] != cmd[1])
            if not self._jobs:
                self._release_deferred()
        elif kind == "add":
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
            self._deferred = [c for c in self._deferred if c[1] not in cmd[1]]
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

    def _release_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for cmd in deferred:
            self._handle(cmd)

    def _run_jobs(self) -> None:
        """Run the waiting jobs (the engine is idle), then add the requests that waited behind them."""
        while self._jobs:
            job_id, fn, route = self._jobs.popleft()
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - a failed job answers its own request only
                if getattr(exc, "fatal", False):  # a dead worker ends the engine: `_end` answers this job 503 too
                    self._jobs.appendleft((job_id, fn, route))
                    raise
                logger.info("job %s failed: %s: %s", job_id, type(exc).__name__, exc)
                self._post(route, job_id, "error", exc)
            else:
                self._post(route, job_id, "done", result)
        self._release_deferred()
        self._refresh_stats(force=True)

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
                                                  m.tpot if m is not None else None, e2e, phase_times(m),
                                                  snap.num_prompt_tokens,
                                                  sum(len(o.token_ids) for o in snap.outputs))
            self._post(route, out.request_id, "output", snap)
        return any_finished

    def _fail_all(self, message) -> None:
        """Abort every request in flight and give each a "fatal" event with `message` (a str: 500; an
        APIError keeps its status)."""
        rids = list(self._routes)
        routes = [self._routes.pop(r) for r in rids]
        try:
            if rids:
                self.engine.abort_request(rids)
        except Exception:  # noqa: BLE001
            logger.exception("abort after a failed step failed too")
        for rid, route in zip(rids, routes):
            self._post(route, rid, "fatal", message)

    def _check_health_when_idle(self) -> None:
        """`engine.check_health()` at most once a second: an idle engine's dead worker is seen by /health too."""
        now = time.perf_counter()
        if now - self._last_health_check >= 1.0 and hasattr(self.engine, "check_health"):
            self._last_health_check = now
            self.engine.check_health()

    def _end(self, exc: Exception) -> None:
        """The engine cannot run steps any more: answer everything in flight, queued or waiting with a 503."""
        err = APIError(503, f"engine error: {type(exc).__name__}: {exc}; restart the server")
        with self._dead_lock:  # from here on `add` and `run_when_idle` refuse at once
            self.exit_reason = err.message
        logger.error("the engine loop ends: %s", err.message)
        self._fail_all(err)
        pending = [c for c in self._deferred] + [(j[0], j[2]) for j in self._jobs]
        self._deferred, self._jobs = [], deque()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "job"):
                pending.append(cmd)
        for cmd in pending:
            if len(cmd) == 2:  # a waiting job: (job_id, route)
                self._post(cmd[1], cmd[0], "error", err)
            else:
                self._post(_Route(cmd[-2], cmd[-1], 0.0), cmd[1], "error", err)
        self._refresh_stats(force=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.engine.has_unfinished_requests()
                ran = self._drain(block=not busy)
                if ran:
                    self._refresh_stats(force=True)
                if self._stop.is_set():
                    break
                if self._jobs and not self.engine.has_unfinished_requests():
                    self._run_jobs()
                    continue
                if not self.engine.has_unfinished_requests():
                    if not ran:
                        self._refresh_stats(force=True)
                    self._check_health_when_idle()
                    continue
                outputs = self.engine.step()
                self.num_steps += 1
                if self.metrics is not None:
                    self.metrics.observe_iteration(getattr(self.engine, "last_step_num_tokens", None))
                finished = self._dispatch(outputs)
                self._refresh_stats(force=finished)
            except Exception as exc:  # noqa: BLE001 - the loop must not die
                if getattr(exc, "fatal", False):  # a dead parallel worker: the loop ends, /health turns 503
                    self.num_step_errors += 1
                    if self.metrics is not None:
                        self.metrics.count_step_error()
                    self._end(exc)
                    break
                self.num_step_errors += 1
                if self.metrics is not None:
                    self.metrics.count_step_error()
                logger.error("engine step failed: %s\n%s", exc, traceback.format_exc())
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
                time.sleep(0.01)


# ----------------------------------------------------------------------------------------------------------
# One HTTP request = one or more engine requests
# ----------------------------------------------------------------------------------------------------------
class RequestGroup:
    """The engine requests of one HTTP request (one per prompt, ids `<base_id>-<i>`), fanned in to one queue."""

    def __init__(self, engine_loop: EngineLoop, base_id: str, n_prompts: int):
        self.engine_loop = engine_loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids = [f"{base_id}-{i}" for i in range(n_prompts)]
        self.index = {rid: i for i, rid in enumerate(self.rids)}
        self.unfinished: set[str] = set()
        self._early: deque = deque()  # events that arrived before every prompt was acknowledged

    async def submit(self, prompts: list, params: list[SamplingParams], arrival: float) -> None:
        """Add every prompt with its own `params`; raise APIError(400) (after aborting the accepted ones) if the
        engine rejects one."""
        for rid, prompt, p in zip(self.rids, prompts, params, strict=True):
            self.engine_loop.add(rid, prompt, p, self.queue, arrival)
        error = None
        pending = set(self.rids)
        while pending:  # an engine may run a step between two adds: keep what comes early for `events`
            event = await self.queue.get()
            rid, kind, payload = event
            if kind == "added":
                self.unfinished.add(rid)
                pending.discard(rid)
            elif kind == "error":
                error = error or payload
                pending.discard(rid)
            else:
                self._early.append(event)
        if error is not None:
            self.abort()
            if isinstance(error, APIError):  # e.g. 503 from a client whose engine process died
                raise error
            if isinstance(error, (ValueError, TypeError)):
                raise engine_error(error)
            raise APIError(500, f"{type(error).__name__}: {error}")

    async def events(self) -> AsyncIterator[RequestSnapshot]:
        """Output snapshots until every request finished; APIError(500) if the engine failed."""
        while self.unfinished:
            rid, kind, payload = self._early.popleft() if self._early else await self.queue.get()
            if rid not in self.unfinished:
                continue
            if kind == "fatal":
                self.unfinished.discard(rid)
                self.abort()
                # An APIError payload (503: the engine process died) keeps its status; a message is a 500.
                raise payload if isinstance(payload, APIError) else APIError(500, payload)
            if kind == "output":
                if payload.finished:
                    self.unfinished.discard(rid)
                yield payload

    def abort(self) -> None:
        """Abort the requests not finished yet (a no-op once all finished), freeing their KV blocks."""
        if self.unfinished:
            self.engine_loop.abort(sorted(self.unfinished))
            self.unfinished.clear()
