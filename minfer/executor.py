"""The executor (vLLM's `executor/`): what runs the workers. The engine talks only to it.

`UniProcExecutor` is the one `Worker` in this process (so a step calls it directly). `MultiprocExecutor` runs tensor x pipeline parallelism
(chapter 12): one worker per rank, each in its own process, joined by torch.distributed (gloo on a CPU, NCCL on
CUDA) for the tensors of a step, and by one control connection per worker for the commands:

    engine (rank 0: the driver, and worker 0 in this process)
      |-- control connection (pickled ScheduledBatch in, ModelRunnerOutput out) --> worker rank 1 .. N-1
      '-- torch.distributed: all-reduce inside a stage, send/recv between stages, among all N ranks

The scheduler and block manager stay in the driver; every rank gets each step's batch and runs
`Worker.execute_parallel` on its shard; the output rank (TP rank 0 of the last stage) sends the result back.
Workers are started by the engine (`distributed_executor_backend="mp"`, subprocesses of this machine) or
by `torchrun` ("torchrun": every rank runs the same command; ranks > 0 turn into workers inside this
constructor and never return). A worker that dies fails the step with `WorkerDiedError` and every later
call at once: the engine fails its requests, the server reports unhealthy; nothing waits for it.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING

import minfer.envs as envs
from minfer.config import EngineArgs, verify_parallel_config
from minfer.parallel.worker import ParallelWorker
from minfer.worker import Worker

if TYPE_CHECKING:
    from minfer.outputs import ModelRunnerOutput
    from minfer.scheduler import ScheduledBatch

logger = logging.getLogger("minfer.executor")


class UniProcExecutor(Worker):
    """One worker, in the engine's process: the worker itself, so a step calls it directly. `driver_worker`
    is that worker (vLLM's name)."""

    def __init__(self, args: EngineArgs):
        from minfer.parallel.parallel_state import check_no_parallel_job

        check_no_parallel_job()  # a parallel engine still alive here would make this model one of its shards
        super().__init__(args)

    @property
    def driver_worker(self) -> Worker:
        return self

    def check_health(self) -> None:
        """Raise if the workers cannot run (never, with one worker in this process)."""

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives in this process."""


class WorkerDiedError(RuntimeError):
    """A worker process of a parallel job exited or stopped answering: the job cannot run a step any more."""

    fatal = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Seconds the driver waits for a worker to load the model and answer "ready".
STARTUP_TIMEOUT_S = envs.MINFER_WORKER_STARTUP_TIMEOUT_S


def make_executor(args: EngineArgs):
    """`UniProcExecutor` for one rank, `MultiprocExecutor` for more."""
    return MultiprocExecutor(args) if args.world_size > 1 else UniProcExecutor(args)


class MultiprocExecutor:
    """tensor_parallel_size x pipeline_parallel_size workers, rank 0 in this process (module docstring).

    Raises (constructor): ValueError when the model does not split over the ranks (before anything is loaded);
    WorkerDiedError when a worker exits during start-up.
    """

    def __init__(self, args: EngineArgs):
        from minfer.model.loader import read_model_config
        from minfer.model.sources import resolve_model
        from minfer.parallel.parallel_state import check_no_parallel_job, get_parallel_state, init_parallel

        check_no_parallel_job()
        verify_parallel_config(read_model_config(resolve_model(args.model)), args.tensor_parallel_size,
                               args.pipeline_parallel_size)
        self.args, self.world = args, args.world_size
        self._procs: dict[int, subprocess.Popen] = {}
        self._conns: dict[int, Connection] = {}
        self._failed: str | None = None
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        if (args.distributed_executor_backend or "mp") == "torchrun":
            rank, world = int(os.environ.get("RANK", "-1")), int(os.environ.get("WORLD_SIZE", "0"))
            if world != self.world or rank < 0:
                raise ValueError(f"distributed_executor_backend='torchrun' needs to run under torchrun with "
                                 f"--nproc-per-node x --nnodes = {self.world} ranks (tp {tp} x pp {pp}); "
                                 f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}")
            init_method = "env://"
            ctrl = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1)
            # The control connections carry pickles, so they are authenticated (HMAC) with a shared key. On one
            # machine a key derived from the port will do; across machines the user must give a secret one.
            key = envs.MINFER_DIST_AUTHKEY
            if key is None and int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:
                raise ValueError("a multi-node torchrun job needs the same secret on every node in the environment "
                                 "(envs.MINFER_DIST_AUTHKEY: it authenticates the driver's control connections)")
            authkey = (key or "minfer-" + os.environ["MASTER_PORT"]).encode()
            if rank != 0:
                worker_loop(args, rank, init_method, _connect(ctrl, authkey))
                sys.exit(0)  # a torchrun worker rank ends here, with the job
            try:
                listener = Listener(ctrl, authkey=authkey)  # MASTER_ADDR: where the other nodes reach rank 0
            except OSError as e:
                raise OSError(f"minfer's control listener needs port MASTER_PORT + 1 = {ctrl[1]} on {ctrl[0]}, "
                              f"which is not free ({e.strerror}): give torchrun another --master-port") from e
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            authkey = secrets.token_bytes(16)
            listener = Listener(("127.0.0.1", 0), authkey=authkey)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
                **envs.worker_control_environ(f"127.0.0.1:{listener.address[1]}", authkey))
            for rank in range(1, self.world):
                self._procs[rank] = subprocess.Popen(
                    [sys.executable, "-c", f"from minfer.executor import worker_main; worker_main({rank})"], env=env)
        try:
            self._accept(listener)
            for conn in self._conns.values():
                conn.send((args, init_method))
            init_parallel(tp, pp, 0, init_method, device=args.device)
            self.driver_worker = ParallelWorker(args)
            self._gather("ready")
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()
        self.state = get_parallel_state()

    # -- plumbing ------------------------------------------------------------------------------------------
    def _accept(self, listener: Listener) -> None:
        """Take one control connection per worker rank (each says its rank first)."""
        # Listener has no accept timeout; its socket's (a CPython internal) lets the loop notice a worker that
        # died before connecting instead of blocking in accept() for ever.
        listener._listener._socket.settimeout(1.0)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(self._conns) < self.world - 1:
            self._check_procs()
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"only {len(self._conns)} of {self.world - 1} workers connected within "
                                      f"{STARTUP_TIMEOUT_S:.0f} s")
            try:
                conn = listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            self._conns[conn.recv()] = conn

    def _check_procs(self) -> None:
        for rank, p in self._procs.items():
            if p.poll() is not None:
                self._fail(f"worker rank {rank} (pid {p.pid}) exited with code {p.returncode}")

    def _wait_for_a_dead_worker(self, timeout: float) -> None:
        """Raise WorkerDiedError naming the worker if one exits within `timeout` seconds. gloo's "connection
        closed" can reach rank 0 before the killed process is a zombie that `poll()` sees; the error then
        names the rank that died, not the collective that noticed it."""
        deadline = time.monotonic() + timeout
        while self._procs:
            self._check_procs()
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def _fail(self, why: str):
        self._failed = why
        self.shutdown()
        raise WorkerDiedError(f"{why}; the parallel engine cannot run any more steps")

    def _recv(self, rank: int, timeout: float | None = None):
        conn = self._conns[rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if conn.poll(0.2):
                    reply = conn.recv()
                    break
            except (EOFError, OSError):
                self._fail(f"worker rank {rank} closed its connection (it died)")
            self._check_procs()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"worker rank {rank} did not answer within {timeout:.0f} s")
        kind, value = reply
        if kind == "error":
            raise value
        return value

    def _gather(self, what: str, timeout: float | None = STARTUP_TIMEOUT_S) -> dict:
        return {rank: self._recv(rank, timeout) for rank in self._conns}

    def _run(self, method: str, *a):
        """Run `Worker.<method>(*a)` on every rank (rank 0 here); the output rank's result."""
        if self._failed:
            raise WorkerDiedError(f"{self._failed}; the parallel engine cannot run any more steps")
        msg = pickle.dumps((method, a), protocol=pickle.HIGHEST_PROTOCOL)  # pickled once for all ranks
        for rank, conn in self._conns.items():
            try:
                conn.send_bytes(msg)
            except OSError:
                self._fail(f"worker rank {rank} closed its connection (it died)")
        # Any failure mid-step leaves the ranks out of step with each other (some wait in a collective that
        # will never complete), so it ends the job: the error is raised now, and again by every later call.
        try:
            mine = getattr(self.driver_worker, method)(*a)
        except Exception as exc:  # noqa: BLE001 - e.g. gloo's "connection closed by peer" when a rank died
            self._wait_for_a_dead_worker(2.0)
            self._fail(f"rank 0 failed in {method} ({type(exc).__name__}: {exc})")
        try:
            results = self._gather(method, timeout=None)
        except WorkerDiedError:
            raise
        except Exception as exc:  # noqa: BLE001 - a worker's own error
            self._fail(f"a worker failed in {method} ({type(exc).__name__}: {exc})")
        out_rank = self.state.output_rank
        return mine if out_rank == 0 else results[out_rank]

    # -- the executor interface ----------------------------------------------------------------------------
    def profile_forward(self, num_tokens: int) -> None:
        self._run("profile_forward", num_tokens)

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self._run("init_kv_cache", num_blocks, num_cpu_blocks)

    def execute_model(self, batch: "ScheduledBatch") -> "ModelRunnerOutput":
        """One step on every rank; the output rank's `ModelRunnerOutput`."""
        output = self._run("execute_parallel", batch, True)
        self._restore_prompt_logprobs(batch, output.prompt_logprobs)
        return output

    def compute_logits(self, batch: "ScheduledBatch"):
        """One step without sampling: (rows, float32 `[rows, V]` logits), gathered on the output rank."""
        rows, logits, plp = self._run("execute_parallel", batch, False)
        self._restore_prompt_logprobs(batch, plp)
        return rows, logits

    @staticmethod
    def _restore_prompt_logprobs(batch, plp: dict) -> None:
        for s in batch.seqs:  # the output rank filled its copies of the sequences; these are the driver's
            if s.seq_id in plp:
                s.prompt_logprobs = plp[s.seq_id]

    def release(self, seq_ids: list[int]) -> None:
        if self._failed:  # the workers are gone with what they held; the driver still frees its blocks
            return
        self._run("release", seq_ids)

    def set_num_micro_batches(self, m: int) -> None:
        """Cut each later step into `m` micro-batches on every rank (pipeline_micro_batches, at run time)."""
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"micro-batches must be an integer >= 1, got {m!r}")
        self._run("set_num_micro_batches", m)

    def collect_timeline(self) -> list[dict]:
        """Every rank's recorded micro-batch forwards since the last call (`minfer.parallel.timeline`)."""
        if self._failed:
            raise WorkerDiedError(self._failed)
        events = self.driver_worker.timeline.drain()
        msg = pickle.dumps(("drain_timeline", ()))
        for conn in self._conns.values():
            conn.send_bytes(msg)
        for evs in self._gather("drain_timeline", timeout=None).values():
            events.extend(evs)
        return sorted(events, key=lambda e: (e["step"], e["stage"], e["tp_rank"], e["micro_batch"]))

    def comm_stats(self) -> list[dict]:
        """Each rank's all-reduce / all-gather counts, bytes and seconds (`CommStats`), rank order; reset."""
        from dataclasses import asdict

        mine = asdict(self.state.comm)
        self.state.comm.reset()
        msg = pickle.dumps(("comm_stats", ()))
        for conn in self._conns.values():
            conn.send_bytes(msg)
        others = self._gather("comm_stats", timeout=None)
        return [mine] + [others[r] for r in sorted(others)]

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker has exited (the server's /health asks this)."""
        if self._failed:
            raise WorkerDiedError(self._failed)
        self._check_procs()

    def shutdown(self) -> None:
        """Tell the workers to stop, then end the processes this executor started (by their pid)."""
        for conn in self._conns.values():
            try:
                conn.send_bytes(pickle.dumps(("shutdown", ())))
                conn.close()
            except OSError:
                pass
        self._conns = {}
        for p in self._procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self._procs = {}
        from minfer.parallel.parallel_state import destroy_parallel

        try:
            destroy_parallel()
        except Exception:  # noqa: BLE001 - a group broken by a dead rank cannot be torn down cleanly
            pass

    def __del__(self):
        if getattr(self, "_procs", None):
            self.shutdown()


def _connect(address: tuple[str, int], authkey: bytes, timeout: float = 120.0) -> Connection:
    """The control connection to the driver, retried while its listener is not up yet (torchrun starts all
    ranks at once)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def worker_main(rank: int) -> None:
    """Entry point of a worker process the "mp" backend started: connect to the driver, then `worker_loop`."""
    host, port = envs.MINFER_CTRL_ADDR.rsplit(":", 1)
    conn = _connect((host, int(port)), bytes.fromhex(envs.MINFER_CTRL_AUTHKEY))
    worker_loop(None, rank, None, conn)


def worker_loop(args: EngineArgs | None, rank: int, init_method: str | None, conn: Connection) -> None:
    """A worker rank: join the job, load this rank's shard, then run each command the driver sends
    (`Worker.<method>(*args)`, plus `drain_timeline`, `comm_stats`, `shutdown`) and answer
    `("ok", result)` or `("error", exception)`. Returns when told to shut down or the driver goes away."""
    import torch

    from minfer.parallel.parallel_state import destroy_parallel, get_parallel_state, init_parallel

    torch.set_num_threads(envs.MINFER_WORKER_THREADS)
    conn.send(rank)
    received_args, received_init = conn.recv()
    args, init_method = args or received_args, init_method or received_init
    try:
        init_parallel(args.tensor_parallel_size, args.pipeline_parallel_size, rank, init_method,
                      device=args.device)
        worker = ParallelWorker(args)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("error", exc))
        return
    conn.send(("ok", None))
    state = get_parallel_state()
    while True:
        try:
            method, a = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver is gone
        if method == "shutdown":
            break
        try:
            if method == "drain_timeline":
                result = worker.timeline.drain()
            elif method == "comm_stats":
                from dataclasses import asdict

                result = asdict(state.comm)
                state.comm.reset()
            else:
                result = getattr(worker, method)(*a)
                result = result if rank == state.output_rank else None
            reply = ("ok", result)
        except Exception as exc:  # noqa: BLE001 - the driver raises it
            reply = ("error", exc)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            break
    conn.close()
    try:
        destroy_parallel()
    except Exception:  # noqa: BLE001
        pass
