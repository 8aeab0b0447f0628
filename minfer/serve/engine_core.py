"""The engine core as a process of its own: scheduler + executor + output processing, behind two ZMQ sockets.

vLLM v1 runs its `EngineCore` in a separate process (`vllm/v1/engine/core.py`) so that the API server's
Python work (HTTP, JSON, tokenization, SSE) and the engine's (scheduling, the forward, detokenization) do not
share one GIL. This module is minfer's version, in small:

    API process (uvicorn)                               engine-core process (this module)
    MPEngineClient.add/abort ──PUSH─► input socket ──► commands drained between two steps
    asyncio queues ◄── MPEngineClient.recv ◄──PULL── output socket ◄── one message per step (deltas)

Wire format. Commands are pickled tuples (`("add", rid, prompt_ids, SamplingParams, arrival)`,
`("abort", [rid, ...])`): they are rare and carry a `SamplingParams` whose fields grow with every issue, so
pickle keeps them complete; both ends are this package on one machine, over an `ipc://` socket in a
private directory (mode 0700). Outputs are the hot path (one message per step, up to `max_num_seqs` requests
each) and are msgpack, a flat list per request holding only what is new since the last message: the new
token ids, the new text, the new logprobs (`encode_step` / `decode_step`). Sending whole snapshots would
cost O(tokens^2) bytes over a stream.

A message from the core is a msgpack list whose first item says what it is:

    ["ready", info]                 once, after the model loaded (info: pickled model view, see `core_main`)
    ["added", [rid, ...]]           the requests `add_request` accepted, after each batch of commands
    ["step", outputs, stats|None]   after a step that made progress; stats every `stats_interval` s
    ["stats", stats]                when idle, after commands (so /v1/stats and /metrics stay current)
    ["error", rid, type, message]   `add_request` refused that request (the engine goes on)
    ["fatal", [rid, ...], message, status]  a step raised; those requests were aborted (their blocks freed);
                                    status 503 when the engine cannot go on (a dead worker), else 500
    ["job", job_id, "done", pickled result] / ["job", job_id, "error", [type, message]]
                                    a job (`("job", job_id, fn)`: beam search) ran on the idle engine
    ["heartbeat"]                   every `HEARTBEAT_INTERVAL` s, from a thread of its own (`Heartbeat`)

The heartbeat is vLLM v1's engine-core liveness signal in small: the API process marks the engine unhealthy
and fails its requests with a 503 when no message came for `--engine-heartbeat-timeout` seconds and the
process used no CPU meanwhile (a stopped or deadlocked process; a slow one keeps using CPU:
`engine_client.MPEngineClient`). The same thread ends this process when its parent dies (checked every beat,
busy or idle), so a killed server leaves no engine behind, not even one in the middle of a long step.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import traceback

from minfer.serve.metrics import phase_times

logger = logging.getLogger("minfer.engine_core")

# Output row layout (a list, not a dict: msgpack writes no keys). One row per completion of a request.
#   [index, token_offset, new_token_ids, text_offset, new_text, new_logprobs|None, finish_reason, stop_reason]
# Request row: [request_id, num_prompt_tokens, num_cached_tokens, finished, ttft|None, fin|None, rows]
#   fin (on the last message of a request): [itl list, tpot|None, e2e|None, prompt ids, prompt logprobs|None,
#        phases|None ((queue, prefill, decode, inference) seconds, `metrics.phase_times`)]
# Step message: ["step", rows, stats|None, tokens in the step (prefill + decode)|None]


class _Sent:
    """How much of each completion of one request the API process already has (tokens, characters)."""

    __slots__ = ("tokens", "chars", "first_token_seen")

    def __init__(self, n: int):
        self.tokens = [0] * n
        self.chars = [0] * n
        self.first_token_seen = False


def encode_step(outputs, sent: dict[str, _Sent], now: float) -> list:
    """The wire rows of one `engine.step()` result: per request, only what is new since the last call.

    `sent` (request id -> `_Sent`) is updated; a finished request is dropped from it. Text is sent from the
    last offset when it only grew, else whole from offset 0 (an output processor that rewrites held-back
    text would still arrive right).
    """
    rows = []
    for out in outputs:
        s = sent.get(out.request_id)
        if s is None:
            s = sent[out.request_id] = _Sent(len(out.outputs))
        comps = []
        for o in out.outputs:
            i = o.index
            t0, c0 = s.tokens[i], s.chars[i]
            if len(o.text) < c0:
                c0 = 0
            comps.append([i, t0, list(o.token_ids[t0:]), c0, o.text[c0:],
                          list(o.logprobs[t0:]) if o.logprobs is not None else None,
                          o.finish_reason, o.stop_reason])
            s.tokens[i], s.chars[i] = len(o.token_ids), len(o.text)
        m = getattr(out, "metrics", None)
        ttft = None
        if not s.first_token_seen and any(o.token_ids for o in out.outputs):
            s.first_token_seen = True
            ttft = m.ttft if m is not None and m.ttft is not None else -1.0  # -1: client measures it
        fin = None
        if out.finished:
            sent.pop(out.request_id, None)
            # The prompt's ids and logprobs travel once, with the last row (echo and scoring read them).
            plp = getattr(out, "prompt_logprobs", None)
            fin = [list(m.itl) if m is not None else [], m.tpot if m is not None else None,
                   m.e2e if m is not None else None, list(out.prompt_token_ids or []),
                   list(plp) if plp else None, phase_times(m)]
        rows.append([out.request_id, len(out.prompt_token_ids or []), getattr(out, "num_cached_tokens", 0) or 0,
                     bool(out.finished), ttft, fin, comps])
    return rows


def stats_dict(stats) -> dict:
    """`engine.stats()` (a dataclass or a plain object) as a plain dict."""
    import dataclasses

    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


HEARTBEAT_INTERVAL = 0.5  # seconds between two heartbeats (and two checks that the parent is alive)
# Longest a request's grammar may take to compile (in the worker thread) before the request is refused (s).
GRAMMAR_COMPILE_TIMEOUT = 30.0


class Heartbeat(threading.Thread):
    """Send ["heartbeat"] every `interval` s on a PUSH socket of its own, and end the process (exit status 0)
    when its parent has exited.

    It runs beside the engine step: torch releases the GIL in its kernels and Python switches threads every
    5 ms otherwise, so beats keep coming during a long step; they stop when the whole process is stopped
    (SIGSTOP) or dead. A ZMQ socket belongs to one thread, hence the second socket on the same address.
    """

    def __init__(self, ctx, output_addr: str, parent: int, interval: float = HEARTBEAT_INTERVAL):
        super().__init__(name="minfer-engine-heartbeat", daemon=True)
        self.ctx, self.addr, self.parent, self.interval = ctx, output_addr, parent, interval
        self.stopped = threading.Event()

    def run(self) -> None:
        import msgpack
        import zmq

        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # beats that cannot be delivered are dropped, never queued up
        sock.connect(self.addr)
        beat = msgpack.packb(["heartbeat"])
        try:
            while not self.stopped.wait(self.interval):
                if os.getppid() != self.parent:  # the API process is gone: nobody reads our outputs
                    logger.info("parent process %d exited; engine core stops", self.parent)
                    os._exit(0)  # the main thread may be inside a step: end the process from here
                try:
                    sock.send(beat, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the API process is not reading (or gone): the parent check above ends us
        finally:
            sock.close(linger=0)


def hold_gil_busy(seconds: float) -> None:
    """A test hook: spin on the CPU for `seconds` without letting another thread of this process run Python.

    Raising the switch interval past `seconds` means a thread waiting for the GIL (the heartbeat thread, once
    its 0.5 s wait ends) does not ask for it before the spin ends, so the process burns CPU while its heartbeat
    is silent: what a native call that keeps the GIL, or a host that starves the process, looks like from the
    API process. Used only through `--test-hook-slow-step` (tests/test_engine_liveness.py).
    """
    import sys

    saved = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 5.0)
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    finally:
        sys.setswitchinterval(saved)


class EngineCore:
    """One `LLMEngine` driven by commands from a socket, its outputs written to another (the process body).

    Args:
        engine: the `LLMEngine` (built in this process).
        input_socket: a ZMQ PULL socket the commands arrive on.
        output_socket: a ZMQ PUSH socket for the messages above.
        stats_interval: seconds between stats while busy (seconds).
        test_slow_step_s: a test hook, 0 outside tests: the first step that runs requests first holds the GIL
            busy for this many seconds (`hold_gil_busy`).
    """

    def __init__(self, engine, input_socket, output_socket, stats_interval: float = 0.05,
                 test_slow_step_s: float = 0.0):
        import msgpack
        import zmq

        self.engine = engine
        self.inp, self.out = input_socket, output_socket
        self.poller = zmq.Poller()
        self.poller.register(self.inp, zmq.POLLIN)
        self.pack = msgpack.Packer(use_bin_type=True).pack
        self.stats_interval = stats_interval
        self.sent: dict[str, _Sent] = {}
        self.parent = os.getppid()
        self._last_stats = 0.0
        self._last_health_check = 0.0
        self._added: list[str] = []
        self._jobs: list = []  # (job_id, fn) waiting for an idle engine
        self._deferred: list = []  # "add" commands that arrived while a job waited
        # Guided "add" commands whose grammar compiles in a worker thread, off the engine step:
        # [future, cmd, started (perf_counter), aborted]; added in order once compiled (`_finish_compiles`).
        self._compiling: list = []
        self._compiler = None  # a one-thread ThreadPoolExecutor, made for the first guided request
        self.test_slow_step_s = test_slow_step_s

    def _send(self, msg) -> None:
        self.out.send(self.pack(msg), copy=False)

    def _stats(self) -> dict:
        self._last_stats = time.perf_counter()
        return stats_dict(self.engine.stats())

    def _handle(self, raw: bytes) -> None:
        self._run_command(pickle.loads(raw))

    def _run_command(self, cmd) -> None:
        if cmd[0] == "add" and self._jobs:  # behind a waiting job: the running requests drain for it
            self._deferred.append(cmd)
        elif cmd[0] == "job":
            self._jobs.append((cmd[1], cmd[2]))
        elif cmd[0] == "cancel_job":
            self._jobs = [j for j in self._jobs if j[0] != cmd[1]]
            if not self._jobs:
                self._release_deferred()
        elif cmd[0] == "add" and getattr(cmd[3], "guided_decoding", None) is not None and self._can_precompile():
            self._start_compile(cmd)
        elif cmd[0] in ("add", "add_compiled"):
            _, rid, prompt, params, arrival = cmd
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            except Exception as exc:  # noqa: BLE001 - a refusal goes back to that request only
                self._send(["error", rid, type(exc).__name__, str(exc)])
            else:
                self._added.append(rid)
        elif cmd[0] == "abort":
            gone = set(cmd[1])
            for entry in self._compiling:
                if entry[1][1] in gone:
                    entry[3] = True  # aborted while compiling: dropped when its compile ends
            rids = [r for r in cmd[1] if r in self.engine.requests]
            for r in cmd[1]:
                self.sent.pop(r, None)
            if rids:
                self.engine.abort_request(rids)

    def _can_precompile(self) -> bool:
        return hasattr(self.engine, "extension")

    def _start_compile(self, cmd) -> None:
        """Compile the request's grammar in the worker thread; the request is added when it is ready."""
        from concurrent.futures import ThreadPoolExecutor

        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="minfer-grammar")
        guided = cmd[3].guided_decoding
        manager = self.engine.extension("structured_output").get_manager()  # made here, in the engine's thread, not the compiler's
        future = self._compiler.submit(manager.precompile, guided)
        self._compiling.append([future, cmd, time.perf_counter(), False])

    def _finish_compiles(self) -> None:
        """Add, in arrival order, the guided requests whose grammar is compiled (the first still compiling
        holds those behind it); one past `GRAMMAR_COMPILE_TIMEOUT` is refused (the library's own limits bound
        a grammar's size; this bounds its time)."""
        while self._compiling:
            future, cmd, started, aborted = self._compiling[0]
            if not future.done():
                if aborted or time.perf_counter() - started <= GRAMMAR_COMPILE_TIMEOUT:
                    break
                self._compiling.pop(0)  # its thread runs on; what it makes is discarded below
                future.add_done_callback(lambda _f, g=cmd[3].guided_decoding: self._discard(g))
                self._send(["error", cmd[1], "ValueError", "invalid SamplingParams.guided_decoding: the grammar "
                            f"did not compile within {GRAMMAR_COMPILE_TIMEOUT:g} s"])
                continue
            self._compiling.pop(0)
            if aborted:
                self._discard(cmd[3].guided_decoding)
            else:
                self._run_command(("add_compiled", *cmd[1:]))
        if self._added:
            self._send(["added", self._added])
            self._added = []

    def _discard(self, guided) -> None:
        """Drop what compiling `guided` left in the structured-output manager (its request is gone)."""
        self.engine.extension("structured_output").get_manager().discard(guided)

    def _release_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for cmd in deferred:
            self._run_command(cmd)
        if self._added:
            self._send(["added", self._added])
            self._added = []

    def _run_jobs(self) -> None:
        """Run the waiting jobs on the idle engine, answer each, then add the requests held behind them."""
        while self._jobs:
            job_id, fn = self._jobs.pop(0)
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - a failed job answers its own request only
                logger.info("job %s failed: %s: %s", job_id, type(exc).__name__, exc)
                if getattr(exc, "fatal", False):  # a dead worker: the job gets a 503, /health too, this process ends
                    self._send(["job", job_id, "error", [type(exc).__name__, str(exc), 503]])
                    self._send(["fatal", [], f"engine error: {type(exc).__name__}: {exc}", 503])
                    raise
                self._send(["job", job_id, "error", [type(exc).__name__, str(exc)]])
            else:
                self._send(["job", job_id, "done", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)])
        self._release_deferred()
        self._send(["stats", self._stats()])

    def _drain(self, timeout_ms: int) -> bool:
        """Run every queued command, waiting up to `timeout_ms` for the first. True if any ran."""
        import zmq

        if not self.poller.poll(timeout_ms):
            return False
        while True:
            try:
                raw = self.inp.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._handle(raw)
        if self._added:  # one acknowledgement for the whole batch, before any output of those requests
            self._send(["added", self._added])
            self._added = []
        return True

    def _check_health_when_idle(self) -> None:
        """`engine.check_health()` at most once a second. A dead parallel worker seen while idle is told to the
        API process (a "fatal" for no request, 503: its /health then says why), and this process ends."""
        now = time.perf_counter()
        if now - self._last_health_check < 1.0 or not hasattr(self.engine, "check_health"):
            return
        self._last_health_check = now
        try:
            self.engine.check_health()
        except Exception as exc:
            if not getattr(exc, "fatal", False):
                raise
            logger.error("engine health check failed: %s", exc)
            self._send(["fatal", [], f"engine error: {type(exc).__name__}: {exc}", 503])
            raise

    def run(self) -> None:
        engine = self.engine
        while True:
            self._finish_compiles()
            busy = engine.has_unfinished_requests()
            ran = self._drain(0 if busy else (5 if self._compiling else 200))
            if not busy and not ran and not self._jobs:
                if os.getppid() != self.parent:  # the API process is gone: nobody will read our outputs
                    logger.info("parent process exited; engine core stops")
                    return
                self._check_health_when_idle()
                continue
            if ran:
                self._send(["stats", self._stats()])
            if self._jobs and not engine.has_unfinished_requests():
                self._run_jobs()
                continue
            if not engine.has_unfinished_requests():
                continue
            if self.test_slow_step_s:
                logger.warning("test hook: this step holds the GIL busy for %g s", self.test_slow_step_s)
                hold_gil_busy(self.test_slow_step_s)
                self.test_slow_step_s = 0.0
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the running requests, keep serving
                logger.error("engine step failed: %s\n%s", exc, traceback.format_exc())
                rids = list(engine.requests)
                try:
                    engine.abort_request(rids)
                except Exception:  # noqa: BLE001
                    logger.exception("abort after a failed step failed too")
                self.sent.clear()
                # 503 when this failure ends the engine (a dead worker): the service is gone, not the request bad
                self._send(["fatal", rids, f"engine error: {type(exc).__name__}: {exc}",
                            503 if getattr(exc, "fatal", False) else 500])
                self._send(["stats", self._stats()])
                if getattr(exc, "fatal", False):  # a dead parallel worker: this process ends, /health turns 503
                    raise
                continue
            now = time.perf_counter()
            rows = encode_step(outputs, self.sent, now)
            finished = any(r[3] for r in rows)
            stats = self._stats() if finished or now - self._last_stats >= self.stats_interval else None
            self._send(["step", rows, stats, getattr(engine, "last_step_num_tokens", None)])


def core_main(engine_args, input_addr: str, output_addr: str, test_slow_step_s: float = 0.0) -> None:
    """The engine-core process: build the engine, say "ready" (or why not), then serve commands forever.
    `test_slow_step_s` is `EngineCore`'s test hook (0 outside tests).

    The "ready" info is a pickled dict: `model_name`, `model_config` (`ModelConfigView`), `tokenizer` (the
    API process tokenizes and renders chat templates with it), `kv_pool_info`, `pid`, `default_sampling_params`
    (the generation-config defaults, `minfer.config.diff_sampling_param`); or `{"error": str}`
    when the engine could not be built (the client raises it as a RuntimeError/ValueError).
    """
    import msgpack
    import zmq

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context(io_threads=1)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    pack = msgpack.Packer(use_bin_type=True).pack
    # From the start: a parent that dies while the model loads ends this process too (beats before "ready"
    # are ignored by the client's start-up wait).
    heartbeat = Heartbeat(ctx, output_addr, os.getppid())
    heartbeat.start()
    try:
        from minfer.engine import LLMEngine

        engine = LLMEngine.from_engine_args(engine_args)
    except Exception as exc:  # noqa: BLE001 - reported to the API process, which exits with it
        out.send(pack(["ready", pickle.dumps({"error": f"{type(exc).__name__}: {exc}",
                                              "value_error": isinstance(exc, ValueError)})]))
        heartbeat.stopped.set()
        heartbeat.join(2)
        out.close()
        ctx.term()
        return
    info = dict(model_name=getattr(engine, "model_name", None), model_config=engine.model_config,
                tokenizer=engine.tokenizer, kv_pool_info=dict(engine.kv_pool_info()), pid=os.getpid(),
                stats=stats_dict(engine.stats()), default_sampling_params=engine.default_sampling_params)
    out.send(pack(["ready", pickle.dumps(info)]))
    # The loop runs in this thread, the one that built the engine, so that the process has one OpenMP team.
    # libgomp keeps a pool of workers per thread that starts parallel regions; a loop in a second thread would
    # make two (more threads than the cores), and when it manages more threads than there are CPUs libgomp
    # spins only 100 iterations before a waiting worker sleeps, whatever GOMP_SPINCOUNT says: the worker
    # would sleep and be woken hundreds of times per step (lab notes 9b (chapters/lab/09b-cpu-performance.md) §9b.11 has the measurements).
    EngineCore(engine, inp, out, test_slow_step_s=test_slow_step_s).run()
