"""Pipeline parallelism (GPipe, Huang et al. 2019, arXiv:1811.06965; vLLM's `get_pp_indices`): the layers cut
into `pp` consecutive stages, one per rank group, and hidden states passed stage to stage.

    stage 0: embed, layers [0, L/p)  --send [2, T, hidden]-->  stage 1: layers [L/p, 2L/p)  -->  ...  last: norm, head

With one batch at a time only one stage works while the others wait: the bubble. Cutting the step's batch
into m micro-batches lets stage s run micro-batch i while stage s+1 runs micro-batch i-1; with p equal
stages the idle share of the step is (p - 1) / (m + p - 1) (GPipe's bubble). `Worker.execute_parallel`
runs this schedule; `minfer.parallel.timeline` records when each forward really ran.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minfer.parallel.parallel_state import get_parallel_state


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """The layer range `[start, end)` of stage `pp_rank`: `num_layers // pp_size` layers each, the first
    `num_layers % pp_size` stages one more (the last stage also runs the norm and the LM head).

    Raises:
        ValueError: more stages than layers (a stage with no layer), or pp_rank outside [0, pp_size).
    """
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) is larger than the model's {num_layers} layers: "
                         "every stage needs at least one layer")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside [0, {pp_size})")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def split_micro_batches(num_rows: int, num_micro_batches: int) -> list[tuple[int, int]]:
    """Row ranges `[(start, end), ...]` of at most `num_micro_batches` contiguous, nearly equal micro-batches
    of a step's `num_rows` sequences (never an empty one)."""
    m = max(1, min(num_micro_batches, num_rows))
    base, extra = divmod(num_rows, m)
    out, start = [], 0
    for i in range(m):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def send_to_next_stage(x: torch.Tensor):
    """Start sending `x` to the same TP rank of the next stage; returns the request to `wait()` on (the
    tensor must stay alive until then)."""
    st = get_parallel_state()
    return dist.isend(x.contiguous(), dst=st.global_rank(st.pp_rank + 1))


def recv_from_prev_stage(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Receive the `[2, T, hidden]` intermediate tensor of this micro-batch from the stage before."""
    st = get_parallel_state()
    x = torch.empty(shape, dtype=dtype, device=st.device)
    dist.recv(x, src=st.global_rank(st.pp_rank - 1))
    return x
