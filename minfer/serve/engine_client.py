"""Engine clients: what the HTTP side talks to, in-process (a thread) or across a process boundary (vLLM v1's
`EngineCoreClient` with its `InprocClient` and `MPClient`, `vllm/v1/engine/core_client.py`).

Both implementations have one interface, the one `RequestGroup` and the routes use:

    add(request_id, prompt_ids, params, queue, arrival)   answer ("added" | "error") arrives on `queue`
    abort([request_id, ...])                              frees their KV blocks; later outputs are dropped
    start() / stop() / alive                              alive False: /health answers 503
    metrics, latest_stats, kv_pool_info, recent_ttfts, num_steps, num_requests_added, num_step_errors

and put the same events on a request's asyncio queue: `(rid, "added", None)`, `(rid, "error", exc)`,
`(rid, "output", RequestSnapshot)`, `(rid, "fatal", message)` (`MPEngineClient`: an `APIError(503)` in place of
the message when the engine is gone).

- `InprocClient` is `engine_loop.EngineLoop`: the engine in a thread of the server's process (tests with a
  fake engine, `--no-engine-process`). Offline `LLM` does not use a client at all: it calls the engine.
- `MPEngineClient` starts `engine_core.core_main` in a spawned process and talks to it over two ZMQ
  sockets. A receiver thread turns each step message back into cumulative `RequestSnapshot`s and hands them
  to the event loop in one `call_soon_threadsafe` per message. The thread also watches the process, and tells
  a dead engine from a slow one:
  - death is seen at once: the thread polls the process's sentinel (a pipe that closes when it exits) beside
    the socket, so every in-flight request gets a "fatal" event and `alive` turns False as soon as it ends;
  - a stall needs two signs for `heartbeat_timeout` seconds: no message at all from the engine process (its
    heartbeat thread, `engine_core.Heartbeat`, beats every 0.5 s beside the step) and no CPU time used by the
    process (`/proc/<pid>/stat`). A stopped (SIGSTOP) or deadlocked process shows both; a process that is
    only slow (a long step on a starved host, a native call that holds the GIL and so silences the heartbeat
    thread) keeps using CPU and is left alone, with a warning in the log. Then `alive` turns False (/health
    answers 503) and the thread kills the process and fails its requests with a 503 like a death.
  After a death `on_death` is called once: the server (`python -m minfer.serve`) then exits non-zero so that
  its supervisor restarts it (chapter 15, "When the engine dies").

`router.DPEngineClient` holds one client per replica behind a routing policy (chapter 12b).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections import deque
from types import SimpleNamespace

import minfer.envs as envs
from minfer.serve.engine_loop import EngineLoop, OutputSnapshot, RequestSnapshot
from minfer.serve.metrics import ServerMetrics
from minfer.serve.protocol import APIError

logger = logging.getLogger("minfer.serve")

InprocClient = EngineLoop  # the in-process implementation (a thread owns the engine)

_EXC = {"ValueError": ValueError, "TypeError": TypeError}

# Seconds without any message from the engine process (its heartbeat comes every 0.5 s) and without any CPU
# time used by it before it counts as stalled: /health turns 503 and its requests end with a 503 within this
# bound plus one 0.2 s poll. On a 2-core machine at load 20-55 the heartbeat of a working engine went silent
# for 10.1 s, 14.7 s and 69.5 s (issue 40: long prefills, a first grammar), so silence alone is no stall;
# with the CPU condition a starved engine is not stalled while it gets any slice of a core (one 10 ms clock
# tick in the limit), and 30 s leaves room for a host that gives it none for a while (swap, a burst of
# higher-priority work). A client's own timeout (the openai client's is 600 s) is far longer.
ENGINE_HEARTBEAT_TIMEOUT = 30.0


def process_cpu(pid: int) -> tuple[str, int] | None:
    """(state letter, user + system CPU time in clock ticks) of process `pid`, from `/proc/<pid>/stat`
    (proc(5): fields 3, 14 and 15, all threads of the process together); None where there is no /proc (not
    Linux) or the process is gone. State "T" is stopped (SIGSTOP), "t" traced, "D" waiting for I/O."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces and ")"
        return fields[0].decode(), int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


class EngineView:
    """What the API process knows of the engine in the other process: what `build_app` reads of an engine."""

    def __init__(self, info: dict):
        self.model_name = info["model_name"]
        self.model_config = info["model_config"]
        self.tokenizer = info["tokenizer"]
        self._kv_pool_info = info["kv_pool_info"]
        self.default_sampling_params = dict(info.get("default_sampling_params") or {})

    def kv_pool_info(self) -> dict:
        return dict(self._kv_pool_info)


class _Route:
    __slots__ = ("loop", "queue", "arrival", "outputs", "added")

    def __init__(self, loop, q, arrival):
        self.loop, self.queue, self.arrival = loop, q, arrival
        self.outputs: dict[int, OutputSnapshot] = {}
        self.added = False  # "added" was posted: a later failure is "fatal"; before it (or a job), "error"


@contextlib.contextmanager
def _engine_core_environ():
    """os.environ while the engine process is spawned (spawn copies it at start; libgomp reads it when the
    child imports torch): the engine process's OpenMP wait policy (`envs.configure_process("engine_core")`),
    this process's own restored afterwards."""
    saved = {k: os.environ.get(k) for k in envs.OMP_VARIABLES}
    envs.configure_process("engine_core")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class MPEngineClient:
    """The engine core in its own process (`engine_core.core_main`), reached over ZMQ.

    Args:
        engine_args: the `EngineArgs` the engine process builds its `LLMEngine` from.
        metrics: `ServerMetrics` to update (in this process), or None.
        startup_timeout: seconds to wait for the model to load (seconds).
        heartbeat_timeout: seconds without a message from the engine process and without it using CPU before
            it is declared stalled (killed, its requests failed with 503); see the module docstring.
        test_slow_step_s: a test hook, 0 outside tests: the engine process holds the GIL while it spins on the
            CPU for this many seconds before its first step (`engine_core.EngineCore`), which silences its
            heartbeat thread: a slow engine that must not be declared stalled.
        on_death: called once (from the receiver thread, no arguments) after the engine process died or was
            killed as stalled; the server passes its own shutdown.

    Raises (from `start`):
        ValueError: the engine refused its settings (as `LLMEngine` would in-process).
        RuntimeError: the engine process failed to start or died while loading.
    """

    def __init__(self, engine_args, metrics: ServerMetrics | None = None, startup_timeout: float = 600.0,
                 heartbeat_timeout: float = ENGINE_HEARTBEAT_TIMEOUT, on_death=None, test_slow_step_s: float = 0.0):
        import msgpack
        import zmq

        self.engine_args = engine_args
        self.metrics = metrics
        self.startup_timeout = startup_timeout
        self.latest_stats: dict = {}
        self.kv_pool_info: dict = {}
        self.recent_ttfts: deque = deque(maxlen=64)
        self.num_steps = self.num_requests_added = self.num_step_errors = 0
        self.engine_view: EngineView | None = None
        self.engine_pid: int | None = None
        self.exit_reason: str | None = None
        self._fatal_reason: str | None = None  # the message of a "fatal" that ended the engine
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()  # routes are touched by the event loop and the receiver thread
        self._unpack = lambda b: msgpack.unpackb(b, raw=False, strict_map_key=False)
        self._ctx = zmq.Context(io_threads=1)
        self._dir = tempfile.mkdtemp(prefix="minfer-engine-")  # mode 0700: only this user can connect
        self._in_addr, self._out_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._send_sock = self._ctx.socket(zmq.PUSH)
        # No high-water mark: a send to the connected engine never blocks or fails for a full queue, so a
        # non-blocking send (`_send`) fails only when no engine is connected, i.e. its process is gone.
        self._send_sock.setsockopt(zmq.SNDHWM, 0)
        self._send_sock.setsockopt(zmq.LINGER, 0)
        self._send_sock.bind(self._in_addr)
        self._recv_sock = self._ctx.socket(zmq.PULL)
        self._recv_sock.bind(self._out_addr)
        self._send_lock = threading.Lock()  # a ZMQ socket is not thread-safe
        self._proc = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._dead = False
        self.heartbeat_timeout = heartbeat_timeout
        self.on_death = on_death
        self._last_heard = time.monotonic()  # when the last message (a heartbeat or any other) arrived
        self._cpu_ticks: int | None = None  # the engine's CPU time at the last sample of this silence
        self._busy_at = 0.0  # when this silence last saw the engine's CPU time grow
        self._warned_busy = False  # this silence was logged as busy, not stalled
        self._stall_reason: str | None = None  # set by the receiver thread when it declares a stall
        self.test_slow_step_s = test_slow_step_s

    # --- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine process and wait until its model is loaded (idempotent)."""
        if self._proc is not None:
            return
        from minfer.serve.engine_core import core_main

        ctx = multiprocessing.get_context("spawn")  # fork would copy this process's threads and torch state
        self._proc = ctx.Process(target=core_main, args=(self.engine_args, self._in_addr, self._out_addr),
                                 kwargs={"test_slow_step_s": self.test_slow_step_s} if self.test_slow_step_s else {},
                                 name="minfer-engine-core", daemon=True)
        with _engine_core_environ():
            self._proc.start()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._recv_sock.poll(250):
                msg = self._unpack(self._recv_sock.recv())
                if msg[0] == "ready":
                    break
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with {self._proc.exitcode} while loading")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the engine process did not load its model in {self.startup_timeout:g} s")
        info = pickle.loads(msg[1])
        if "error" in info:
            self._proc.join(10)
            raise (ValueError if info.get("value_error") else RuntimeError)(info["error"])
        self.engine_view = EngineView(info)
        self.kv_pool_info = info["kv_pool_info"]
        self.engine_pid = info["pid"]
        self._on_stats(info["stats"])
        self._last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._recv_loop, name="minfer-engine-client", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._proc is not None and self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
        self._send_sock.close(linger=0)
        self._recv_sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._dead and self._proc.is_alive() and not self.stalled

    @property
    def stalled(self) -> bool:
        """The receiver thread declared the engine process stalled (see the module docstring)."""
        return self._stall_reason is not None

    # --- called from the event loop ------------------------------------------------------------------------
    def add(self, request_id: str, prompt, params, q: asyncio.Queue, arrival: float) -> None:
        """Send `add_request` to the engine process; "added" or "error" arrives on `q`."""
        self._send_routed(request_id, _Route(asyncio.get_running_loop(), q, arrival),
                          ("add", request_id, prompt, params, arrival))

    def abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        with self._lock:
            gone = [r for r in request_ids if self._routes.pop(r, None) is not None]
        if self.alive:
            self._send(("abort", list(request_ids)))  # a dead engine freed its blocks with its process
        if self.metrics is not None:
            for _ in gone:
                self.metrics.observe_finished("abort", [], None, None)

    def run_when_idle(self, job_id: str, fn, q: asyncio.Queue) -> None:
        """Send `fn(engine)` (picklable: a module-level function or a partial of one) to the engine process,
        which runs it once its engine has no unfinished request, holding requests added meanwhile (as
        `EngineLoop.run_when_idle`). `(job_id, "done", result)` or `(job_id, "error", exc)` arrives on `q`."""
        self._send_routed(job_id, _Route(asyncio.get_running_loop(), q, time.perf_counter()), ("job", job_id, fn))

    def cancel_job(self, job_id: str) -> None:
        """Drop a job that has not started (its client left); one already running finishes unread."""
        with self._lock:
            self._routes.pop(job_id, None)
        if self.alive:
            self._send(("cancel_job", job_id))

    def _send_routed(self, rid: str, route: _Route, cmd) -> None:
        """Register `route` and send `cmd`, or answer 503 on its queue at once if the engine is gone.

        The check and the registration hold the lock `_on_death` takes: a route is either registered before
        death (and gets its "fatal" event from `_on_death`) or refused here; none is registered after
        `_on_death` cleared the routes (such a request would wait forever)."""
        with self._lock:
            ok = self.alive
            if ok:
                self._routes[rid] = route
        if not ok:
            route.queue.put_nowait((rid, "error", APIError(503, self._dead_message())))
            return
        if not self._send(cmd):
            # No engine connected: its process ended and the receiver thread has not seen it yet.
            self._on_death()
            with self._lock:
                route = self._routes.pop(rid, None)  # None: `_on_death` already gave it a "fatal" event
            if route is not None:
                route.queue.put_nowait((rid, "error", APIError(503, self._dead_message())))

    def _send(self, cmd) -> bool:
        """Send without blocking (this runs on the event loop); False when no engine process is connected."""
        import zmq

        with self._send_lock:
            try:
                self._send_sock.send(pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # Again: no peer (SNDHWM is 0); other errors: the socket is closed
                logger.error("could not send %r to the engine process: %s", cmd[0], exc)
                return False
        return True

    def _dead_message(self) -> str:
        if self.exit_reason is None and self._stall_reason is not None:
            return self._stall_reason
        return self.exit_reason or "the engine process is not running"

    # --- receiver thread -----------------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        import zmq

        sock = self._recv_sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)  # readable (closed) once the process has exited
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(200))
                if sock in ready:
                    msg = self._unpack(sock.recv())
                    self._heard()
                    if msg[0] != "heartbeat":
                        self._on_message(msg)
                    continue  # read what the engine sent before its exit, if it exited: its last outputs
                if self._proc.sentinel in ready or not self._proc.is_alive():
                    self._proc.join(1)  # reap it: its exit code goes into the 503s and /health
                    self._on_death()
                    return
                if self._check_stall():
                    self._kill_stalled()
                    return
            except Exception:  # noqa: BLE001 - a bad message must not kill the receiver
                if self._stop.is_set():
                    return
                logger.exception("engine client: could not handle a message")

    def _heard(self) -> None:
        self._last_heard = time.monotonic()
        self._cpu_ticks = None
        if self._warned_busy:
            self._warned_busy = False
            logger.info("the engine process answers again")

    def _check_stall(self) -> bool:
        """Called after a poll found nothing: True when the engine process has sent nothing and used no CPU for
        `heartbeat_timeout` seconds (then `_stall_reason` says so). Samples its CPU time once a silence passes
        two heartbeat intervals, so a process that works without beating is seen working."""
        now = time.monotonic()
        silent = now - self._last_heard
        if silent <= 1.0:  # two heartbeats
            return False
        cpu = process_cpu(self.engine_pid) if self.engine_pid else None
        if cpu is not None:
            if self._cpu_ticks is None:  # first sample of this silence: no CPU use is known after the last message
                self._busy_at = self._last_heard
            elif cpu[1] > self._cpu_ticks:
                self._busy_at = now
            self._cpu_ticks = cpu[1]
        if silent <= self.heartbeat_timeout:
            return False
        if self._recv_sock.poll(0):  # this thread was slow to run (the API process was busy): messages wait
            return False
        if cpu is not None and now - self._busy_at <= self.heartbeat_timeout:
            if not self._warned_busy:
                self._warned_busy = True
                logger.warning("no heartbeat from the engine process for %.1f s (limit %g s), but it is using CPU "
                               "(state %s): busy, not stalled", silent, self.heartbeat_timeout, cpu[0])
            return False
        state = "" if cpu is None else f", process state {cpu[0]}{' (stopped)' if cpu[0] in 'Tt' else ''}"
        used = "" if cpu is None else f" and no CPU time used for {now - self._busy_at:.1f} s"
        self._stall_reason = (f"the engine process stopped answering (no heartbeat for {silent:.1f} s{used}, "
                              f"limit {self.heartbeat_timeout:g} s{state})")
        return True

    def _kill_stalled(self) -> None:
        """A stalled engine process is killed (SIGKILL ends a stopped process too) and treated as dead: its
        requests get a 503 now rather than wait for a process that may never answer."""
        reason = self._stall_reason
        logger.error("%s; killing it (pid %s)", reason, self.engine_pid)
        self._fatal_reason = reason
        self._proc.kill()
        self._proc.join(5)
        self._on_death()

    def _on_death(self) -> None:
        """Mark the engine dead and answer every registered request and job with a 503 at once (idempotent:
        the receiver thread and a failed send may both call it)."""
        with self._lock:  # with `_send_routed`'s check: no route can be registered after this
            first = not self._dead
            self._dead = True
            code = self._proc.exitcode if self._proc is not None else None
            if first or code is not None:  # a failed send may come first; the exit code, once known, is told
                reason = (f"the engine process died (exit code {code}); restart the server" if code is not None
                          else "the engine process is gone (it stopped reading requests); restart the server")
                if self._fatal_reason:  # the engine said why before it ended (a dead parallel worker)
                    reason = f"{self._fatal_reason}; {reason}"
                if reason != self.exit_reason:
                    self.exit_reason = reason
                    logger.error(reason)
            routes = list(self._routes.items())
            self._routes.clear()
        err = APIError(503, self.exit_reason)  # the service is unavailable, not this request at fault
        # A request still waiting for "added" (`RequestGroup.submit`), or a job, waits for "error"; a "fatal"
        # event would be kept for later and the request would wait forever.
        self._post_many([(r, (rid, "fatal" if r.added else "error", err)) for rid, r in routes])
        # /v1/stats and /metrics stop counting the dead engine's requests: none of them runs any more.
        self._on_stats({**self.latest_stats, "num_running": 0, "num_waiting": 0, "num_swapped": 0})
        if first and self.on_death is not None:
            try:
                self.on_death()
            except Exception:  # noqa: BLE001 - the server's shutdown hook must not kill the receiver
                logger.exception("engine client: on_death failed")

    def _post_many(self, events) -> None:
        """Put (route, event) pairs on their queues with one hop per event loop."""
        by_loop: dict = {}
        for route, event in events:
            by_loop.setdefault(route.loop, []).append((route.queue, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (shutdown)
                pass

    def _on_stats(self, stats: dict | None) -> None:
        if not stats:
            return
        self.latest_stats = stats
        if self.metrics is not None:
            self.metrics.update_from_stats(SimpleNamespace(**stats))

    def _on_message(self, msg) -> None:
        kind = msg[0]
        if kind == "step":
            self.num_steps += 1
            self._on_outputs(msg[1])
            self._on_stats(msg[2])
            if self.metrics is not None and len(msg) > 3:
                self.metrics.observe_iteration(msg[3])
        elif kind == "stats":
            self._on_stats(msg[1])
        elif kind == "added":
            with self._lock:
                events = [(self._routes[r], (r, "added", None)) for r in msg[1] if r in self._routes]
                for route, _ in events:
                    route.added = True
            self.num_requests_added += len(msg[1])
            self._post_many(events)
        elif kind == "error":
            _, rid, typ, text = msg
            with self._lock:
                route = self._routes.pop(rid, None)
            if route is not None:
                exc = _EXC[typ](text) if typ in _EXC else RuntimeError(f"{typ}: {text}")
                self._post_many([(route, (rid, "error", exc))])
        elif kind == "job":
            _, job_id, status, payload = msg
            with self._lock:
                route = self._routes.pop(job_id, None)
            if route is not None:
                if status == "done":
                    event = (job_id, "done", pickle.loads(payload))
                else:
                    typ, text = payload[:2]
                    if len(payload) > 2 and payload[2] == 503:  # a dead worker ended the engine: not the job's fault
                        exc = APIError(503, f"engine error: {typ}: {text}")
                    else:
                        exc = _EXC[typ](text) if typ in _EXC else RuntimeError(f"{typ}: {text}")
                    event = (job_id, "error", exc)
                self._post_many([(route, event)])
        elif kind == "fatal":
            _, rids, text = msg[:3]
            if len(msg) > 3 and msg[3] == 503:  # the step's failure ends the engine (a dead worker)
                self._fatal_reason = text  # why the process is about to exit: later 503s and /health say it
                text = APIError(503, text)
            self.num_step_errors += 1
            if self.metrics is not None:
                self.metrics.count_step_error()
            with self._lock:
                routes = [(r, self._routes.pop(r)) for r in rids if r in self._routes]
            self._post_many([(route, (rid, "fatal", text)) for rid, route in routes])

    def _on_outputs(self, rows) -> None:
        now = time.perf_counter()
        events = []
        with self._lock:
            for rid, n_prompt, n_cached, finished, ttft, fin, comps in rows:
                route = self._routes.get(rid)
                if route is None:  # aborted meanwhile
                    continue
                outs = route.outputs
                for index, t0, new_ids, c0, new_text, new_lp, reason, stop_reason in comps:
                    old = outs.get(index)
                    if old is None:
                        old = OutputSnapshot(index, "", [], [] if new_lp is not None else None, None, None)
                    lp = None
                    if new_lp is not None:
                        lp = (old.logprobs or [])[:t0] + new_lp
                    outs[index] = OutputSnapshot(index, old.text[:c0] + new_text, old.token_ids[:t0] + new_ids,
                                                 lp, reason, stop_reason)
                snap = RequestSnapshot(rid, n_prompt, [outs[i] for i in sorted(outs)], finished, n_cached)
                if finished and fin:
                    snap.prompt_token_ids, snap.prompt_logprobs = fin[3], fin[4]
                if ttft is not None:
                    ttft = now - route.arrival if ttft < 0 else ttft
                    self.recent_ttfts.append((time.time(), ttft))
                    if self.metrics is not None:
                        self.metrics.observe_first_token(ttft)
                if finished:
                    self._routes.pop(rid, None)
                    if self.metrics is not None:
                        itl, tpot, e2e = fin[:3] if fin else ([], None, None)
                        reason = next((o.finish_reason for o in snap.outputs if o.finish_reason), None)
                        self.metrics.observe_finished(reason, itl, tpot, e2e if e2e is not None
                                                      else now - route.arrival,
                                                      fin[5] if fin and len(fin) > 5 else None, n_prompt,
                                                      sum(len(o.token_ids) for o in snap.outputs))
                events.append((route, (rid, "output", snap)))
        self._post_many(events)


def _put_all(items) -> None:
    for q, event in items:
        q.put_nowait(event)

