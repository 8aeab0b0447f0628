"""Who am I in the parallel job: rank, world, the tensor-parallel group (vLLM's `distributed/parallel_state.py`).

Ranks are laid out tensor-parallel first (vLLM's order): with `tp` ranks per stage and `pp` stages,

    rank = pp_rank * tp_size + tp_rank        TP=2 x PP=2:  stage 0 = ranks 0, 1   stage 1 = ranks 2, 3

so the ranks that all-reduce together (one stage's TP group) are neighbours, and a stage sends its hidden
states to the rank with the same `tp_rank` in the next stage.

Until `init_parallel` runs, the state is one process (tp = pp = 1) and every collective here is the
identity, so the parallel layers of `minfer.parallel.layers` are the plain layers in a single process.
Collectives go through torch.distributed: NCCL when this machine has a GPU per rank, else gloo on the CPU
(`place_rank`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

import minfer.envs as envs
from minfer.parallel.timeline import device_clock

logger = logging.getLogger("minfer.parallel")


@dataclass
class CommStats:
    """What the tensor-parallel collectives of this process cost, summed since the last `reset`
    (`python -m minfer.bench parallel` reads it). Seconds of wall clock, bytes of one rank's message. On
    CUDA the clock is read after a device synchronize on both sides (`device_clock`), so a collective's
    seconds are its execution, with the wait for the slowest rank, not the launch of an NCCL kernel; that
    costs two host-device round trips per collective, a price paid only with tp > 1."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_reduce_s: float = 0.0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    all_gather_s: float = 0.0

    def reset(self) -> None:
        self.__init__()


@dataclass
class ParallelState:
    """This process's place in the job. `tp_group` is the process group of its stage's TP ranks (None in a
    single process); `device` is where its tensors live."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: object = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    comm: CommStats = field(default_factory=CommStats)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def global_rank(self, pp_rank: int, tp_rank: int | None = None) -> int:
        """The rank of (stage `pp_rank`, `tp_rank`, default this process's tp_rank)."""
        return pp_rank * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    @property
    def output_rank(self) -> int:
        """The rank that samples and answers the driver: TP rank 0 of the last stage."""
        return self.global_rank(self.pp_size - 1, 0)


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def timeout_s() -> float:
    """Seconds a collective may wait before torch.distributed gives up (`envs.MINFER_DIST_TIMEOUT_S`, default
    120): a rank that died mid-step makes the others fail after at most this long instead of hanging."""
    return envs.MINFER_DIST_TIMEOUT_S


def place_rank(world: int, rank: int, backend: str | None = None, local_rank: int | None = None,
               device: str | None = None) -> tuple[str, torch.device]:
    """Which collective backend and which device rank `rank` of a `world`-rank job uses (vLLM's worker puts
    rank i on `cuda:local_rank`, NCCL between them).

    NCCL on `cuda:local_rank` only when CUDA has a device for every rank of this machine: `local_rank` defaults
    to env `LOCAL_RANK` (torchrun) else `rank`, the ranks of this machine to env `LOCAL_WORLD_SIZE` else
    `world`. Otherwise gloo with every rank on the CPU, said in one log line: two ranks sharing one GPU would
    each load the whole shard there and NCCL refuses two ranks on one device.

    Args:
        backend: "gloo", "nccl" or None (choose as above).
        device: what the user asked for (`EngineArgs.device`): None (choose), "cpu" (gloo on the CPU) or
            "cuda"/"cuda:N" (insist on NCCL; the rank's device is still `cuda:local_rank`).

    Raises:
        ValueError: CUDA asked for (backend "nccl" or a cuda `device`) where there is no CUDA device for this
            rank, naming the counts; or an unknown backend.
    """
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {backend!r}")
    local = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    wants_cuda = backend == "nccl" or (device is not None and str(device).startswith("cuda"))
    if backend == "gloo" or str(device) == "cpu":
        if wants_cuda:
            raise ValueError(f"backend={backend!r} with device={device!r}: NCCL and CUDA go together, gloo here "
                             "runs on the CPU")
        return "gloo", torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= local_world and local < count:
        return "nccl", torch.device("cuda", local)
    why = (f"{count} CUDA device(s) for {local_world} rank(s) on this machine (rank {rank} would use cuda:{local})"
           if count else "no CUDA device")
    if wants_cuda:
        raise ValueError(f"tensor/pipeline parallelism on CUDA needs one GPU per rank: {why}. Use fewer ranks "
                         "(tensor_parallel_size x pipeline_parallel_size), or device='cpu' to run them on the CPU")
    if count:  # there is CUDA, but not enough of it: say why the job runs on the CPU
        logger.warning("%s: the %d ranks use gloo on the CPU", why, world)
    return "gloo", torch.device("cpu")


def init_parallel(tp_size: int, pp_size: int, rank: int, init_method: str, backend: str | None = None,
                  local_rank: int | None = None, device: str | None = None) -> ParallelState:
    """Join the job: `torch.distributed.init_process_group` over `tp_size * pp_size` ranks at `init_method`
    ("tcp://host:port" or "env://"), then one TP group per stage (every rank creates every group, in the
    same order, as torch.distributed requires).

    Args:
        backend, local_rank, device: where this rank runs, see `place_rank` (default: NCCL on
            `cuda:local_rank` when this machine has a GPU per rank, else gloo on the CPU).

    Raises:
        ValueError: rank outside the world; CUDA asked for without a GPU per rank (`place_rank`).
        RuntimeError: from torch.distributed when the others never come.
    """
    global _STATE
    world = tp_size * pp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world} (tp {tp_size} x pp {pp_size})")
    backend, device = place_rank(world, rank, backend, local_rank, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                                timeout=timedelta(seconds=timeout_s()))
    tp_group = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        g = dist.new_group(ranks) if tp_size > 1 else None
        if rank in ranks:
            tp_group = g
    _STATE = ParallelState(tp_size=tp_size, tp_rank=rank % tp_size, pp_size=pp_size, pp_rank=rank // tp_size,
                           tp_group=tp_group, device=device)
    return _STATE


def destroy_parallel() -> None:
    """Leave the job and go back to the one-process state."""
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()


def check_no_parallel_job() -> None:
    """Refuse to build a second engine while this process is a rank of a tensor/pipeline-parallel one.

    The parallel state is per process (every layer reads it while it is built), so an `LLM` created while a
    parallel `LLM` is still alive would be built as that job's shard: wrong output, or a crash, without this.

    Raises:
        ValueError: this process is a rank of a parallel job (tp or pp > 1) that has not been shut down.
    """
    if _STATE.world_size > 1 or dist.is_initialized():
        raise ValueError(
            f"this process is still rank {_STATE.rank} of a tensor/pipeline-parallel engine (tp {_STATE.tp_size} "
            f"x pp {_STATE.pp_size}): shut it down before building another LLM (`del llm; gc.collect()`, or "
            "`llm.llm_engine.executor.shutdown()`); one process holds one parallel job at a time")


def set_parallel_state(state: ParallelState) -> ParallelState:
    """Replace the state (tests build one rank's shard in one process this way, without a process group).
    Returns the previous state."""
    global _STATE
    previous, _STATE = _STATE, state
    return previous


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over this stage's TP ranks, in place (the identity with one rank). Every TP rank must call it
    with a tensor of the same shape and dtype."""
    st = _STATE
    if st.tp_size == 1:
        return x
    t0 = device_clock(x.device)
    dist.all_reduce(x, group=st.tp_group)
    st.comm.all_reduce_s += device_clock(x.device) - t0
    st.comm.all_reduce_calls += 1
    st.comm.all_reduce_bytes += x.numel() * x.element_size()
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in rank order (the identity with one rank)."""
    st = _STATE
    if st.tp_size == 1:
        return x
    t0 = device_clock(x.device)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(st.tp_size)]
    dist.all_gather(parts, x, group=st.tp_group)
    st.comm.all_gather_s += device_clock(x.device) - t0
    st.comm.all_gather_calls += 1
    st.comm.all_gather_bytes += x.numel() * x.element_size()
    return torch.cat(parts, dim=dim)
