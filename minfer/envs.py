"""Every environment variable minfer reads or sets, in one place (vLLM's `vllm/envs.py`).

`MINFER_*` variables are read here and nowhere else: other modules write `envs.MINFER_X`, which reads the
variable when the attribute is asked for (never at import), so a test or a benchmark that sets one before
building an engine is seen. `ENVIRONMENT_VARIABLES` maps each name to its getter and its one-line doc
(`python -m minfer.serve --help` prints them).

Importing minfer sets nothing. The settings minfer writes are made where a process that runs the model
starts (`configure_process`), and where the Triton kernels are imported (`triton_interpreter_environ`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_FALSE = ("0", "false", "no", "off")


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or default


def _float(name: str, default: float) -> Callable[[], float]:
    return lambda: float(os.environ.get(name) or default)


def _flag(name: str, default: bool) -> Callable[[], bool]:
    """True / False from 1 / 0 (or true / false, yes / no, on / off); `default` when unset or empty."""
    def get() -> bool:
        value = os.environ.get(name, "").strip().lower()
        return default if not value else value not in _FALSE
    return get


def _choice(name: str, choices: Callable[[], tuple[str, ...]], default: str | None) -> Callable[[], str | None]:
    """The variable's value, which must be one of `choices()` (ValueError naming the variable otherwise)."""
    def get() -> str | None:
        value = os.environ.get(name) or default
        if value is not None and value not in choices():
            raise ValueError(f"{name}={value!r}: use one of {', '.join(choices())}")
        return value
    return get


# `minfer.cpu.linear.LINEAR_METHODS`'s names (tests/test_envs.py holds the two equal): this module imports no other.
LINEAR_LAYOUTS = ("hybrid", "onednn", "split", "panels", "nn")


def _device() -> Any:
    """`MINFER_DEVICE` as a `torch.device`, or None when unset."""
    value = os.environ.get("MINFER_DEVICE")
    if not value:
        return None
    import torch

    try:
        dev = torch.device(value)
    except RuntimeError as e:
        raise ValueError(f"MINFER_DEVICE={value!r} is not a device name ('cpu', 'cuda', 'cuda:N')") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"MINFER_DEVICE={value!r}, but this torch finds no CUDA device")
    return dev


# name -> (getter, doc). A getter reads the environment each time it is called.
ENVIRONMENT_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "MINFER_DEVICE": (
        _device,
        "device a model goes to when none is named: cpu, cuda, cuda:N (default: cuda when torch sees one, else cpu)"),
    "MINFER_CACHE": (
        lambda: Path(os.environ.get("MINFER_CACHE") or Path.home() / ".cache" / "minfer"),
        "directory of the GGUF dequantization and tokenizer cache (default: ~/.cache/minfer)"),
    "MINFER_NO_CACHE": (
        _flag("MINFER_NO_CACHE", False),
        "1: neither read nor write that cache (default: 0)"),
    "MINFER_API_KEY": (
        _str("MINFER_API_KEY"),
        "the server's API key when --api-key is not given (default: none, no key)"),
    "MINFER_LINEAR_LAYOUT": (
        _choice("MINFER_LINEAR_LAYOUT", lambda: LINEAR_LAYOUTS, None),
        "force a CPU Linear layout under kernels='auto': nn, split, onednn, hybrid, panels (tests, benchmarks)"),
    "MINFER_GGUF_ISA": (
        _choice("MINFER_GGUF_ISA", lambda: ("auto", "scalar", "avx2", "vnni"), "auto"),
        "force the integer GEMM's instruction set: auto, scalar, avx2, vnni (default: auto; benchmarks)"),
    "MINFER_MALLOC_TUNING": (
        _flag("MINFER_MALLOC_TUNING", True),
        "0: leave glibc's malloc thresholds alone in a CPU engine (default: 1, `minfer.cpu.malloc`)"),
    "MINFER_AUTOTUNE": (
        _flag("MINFER_AUTOTUNE", True),
        "0: GPU Triton launches use a fixed tile shape instead of autotuning (default: 1; the tests set 0)"),
    "MINFER_WORKER_THREADS": (
        lambda: int(os.environ.get("MINFER_WORKER_THREADS") or 1),
        "torch threads of each worker process of a tensor/pipeline-parallel job (default: 1)"),
    "MINFER_WORKER_STARTUP_TIMEOUT_S": (
        _float("MINFER_WORKER_STARTUP_TIMEOUT_S", 600.0),
        "seconds the driver waits for a worker process to load its shard (default: 600)"),
    "MINFER_DIST_TIMEOUT_S": (
        _float("MINFER_DIST_TIMEOUT_S", 120.0),
        "seconds a torch.distributed collective may wait before it fails (default: 120)"),
    "MINFER_DIST_AUTHKEY": (
        _str("MINFER_DIST_AUTHKEY"),
        "secret shared by every node of a multi-node torchrun job (authenticates the control connections)"),
    "MINFER_CTRL_ADDR": (
        _str("MINFER_CTRL_ADDR"),
        "internal: host:port of the driver's control listener, given to the worker processes it starts"),
    "MINFER_CTRL_AUTHKEY": (
        _str("MINFER_CTRL_AUTHKEY"),
        "internal: hex key of that listener, given to the worker processes it starts"),
    "MINFER_SAVE_FIGURES": (
        _flag("MINFER_SAVE_FIGURES", False),
        "1: the notebooks write their figures under assets/figures/ (default: 0, so running a notebook changes no "
        "tracked file; `minfer.course.save_figure`)"),
    "MINFER_OMP_DEFAULT": (
        _str("MINFER_OMP_DEFAULT"),
        "internal: the OpenMP variable configure_process chose, so that a process started from this one chooses again"),
}


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return ENVIRONMENT_VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(ENVIRONMENT_VARIABLES))


def help_text() -> str:
    """One line per variable, `NAME  doc`, for `--help`."""
    width = max(map(len, ENVIRONMENT_VARIABLES))
    return "\n".join(f"  {name:<{width}}  {doc}" for name, (_, doc) in ENVIRONMENT_VARIABLES.items())


def worker_control_environ(addr: str, authkey: bytes) -> dict[str, str]:
    """The variables a worker process needs to reach its driver (`minfer.executor.worker_main` reads them)."""
    return {"MINFER_CTRL_ADDR": addr, "MINFER_CTRL_AUTHKEY": authkey.hex()}


# -- settings minfer writes ----------------------------------------------------------------------------------
# How an OpenMP thread waits at a barrier. libgomp reads these when torch loads it, so they must be in the
# environment before the process that runs the model imports torch; a user's own OMP_WAIT_POLICY or
# GOMP_SPINCOUNT wins.
#   offline (LLM): spin a short while (GOMP_SPINCOUNT=10000), then sleep. The threads of a decode step's split
#     matmuls stay awake across the short gaps between matmuls (sleeping and waking them costs more than a
#     small matmul), while libgomp's default (300000) wastes whole time slices when another process needs
#     the core.
#   api_server (`python -m minfer.serve`): its cores are shared with its HTTP threads and clients, so a
#     waiting thread sleeps at once (OMP_WAIT_POLICY=PASSIVE).
#   engine_core (the server's engine process): it runs the forward and little else, so its threads stay
#     awake across a whole step (libgomp's default, 300000), as vLLM's CPU workers do; a niced server is a
#     background job among others, where a spinning thread burns the slices its own threads need (100).
# Lab notes 9b (chapters/lab/09b-cpu-performance.md) §9b.11 has the measurements.
OFFLINE_SPINCOUNT = "10000"
ENGINE_CORE_SPINCOUNT = "300000"
ENGINE_CORE_SPINCOUNT_NICED = "100"
PROCESS_ROLES = ("offline", "api_server", "engine_core")
OMP_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "MINFER_OMP_DEFAULT")  # what configure_process may change


def configure_process(role: str = "offline") -> str | None:
    """Choose how the OpenMP threads of this process, and of the processes it starts, wait at a barrier.

    Call it before the process imports torch, or before it starts a process: `minfer.LLM` (offline, before
    `minfer.llm` imports torch), `python -m minfer.serve` (api_server, as it starts) and the server as it
    starts its engine process (engine_core, in the environment the child copies). A choice minfer made and
    marked (`MINFER_OMP_DEFAULT`) is made again; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept.

    Returns:
        The variable set ("GOMP_SPINCOUNT" or "OMP_WAIT_POLICY"), or None where the user's setting is kept.
    Raises:
        ValueError: `role` is not one of `PROCESS_ROLES`.
    """
    if role not in PROCESS_ROLES:
        raise ValueError(f"role must be one of {PROCESS_ROLES}, got {role!r}")
    inherited = os.environ.pop("MINFER_OMP_DEFAULT", None)
    if inherited:
        os.environ.pop(inherited, None)
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return None
    if role == "engine_core":  # unmarked: the engine process keeps it as given
        niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
        os.environ["GOMP_SPINCOUNT"] = ENGINE_CORE_SPINCOUNT_NICED if niced else ENGINE_CORE_SPINCOUNT
        return "GOMP_SPINCOUNT"
    name, value = ("OMP_WAIT_POLICY", "PASSIVE") if role == "api_server" else ("GOMP_SPINCOUNT", OFFLINE_SPINCOUNT)
    os.environ[name] = value
    os.environ["MINFER_OMP_DEFAULT"] = name
    return name


def started_as_server() -> bool:
    """True in the process `python -m minfer.serve` started (not in the processes it spawns)."""
    argv = getattr(sys, "orig_argv", ())
    return any(a == "minfer.serve" and i > 0 and argv[i - 1] == "-m" for i, a in enumerate(argv))


def triton_interpreter_environ() -> dict[str, str]:
    """{"TRITON_INTERPRET": "1"} on a machine without a CUDA device, where the user has not set it; else {}.

    `minfer.kernels` adds it to the environment before its modules import triton (triton reads the variable
    as each kernel is decorated), so that its kernels run in Triton's CPU interpreter there."""
    if "TRITON_INTERPRET" in os.environ:
        return {}
    import torch

    return {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}


def triton_interpreter() -> bool:
    """True when Triton runs kernels with its CPU interpreter (TRITON_INTERPRET set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
