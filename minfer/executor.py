"""The executor (vLLM's `executor/`): what runs the workers. The engine talks only to it.

`UniProcExecutor` holds one `Worker` in this process, the only kind minfer has today. A multiprocess
executor for tensor and pipeline parallelism (chapter 6) keeps the same calls and fans each out to one
worker per rank over torch.distributed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minfer.config import EngineArgs
from minfer.worker import Worker

if TYPE_CHECKING:
    from minfer.scheduler import ScheduledBatch


class UniProcExecutor:
    """One worker, in the engine's process. `driver_worker` is that worker (vLLM's name)."""

    def __init__(self, args: EngineArgs):
        self.driver_worker = Worker(args)

    def profile_forward(self, num_tokens: int) -> None:
        self.driver_worker.profile_forward(num_tokens)

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.driver_worker.init_kv_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, batch: "ScheduledBatch"):
        """One step's forward and sampling; see `Worker.execute_model`."""
        return self.driver_worker.execute_model(batch)

    def compute_logits(self, batch: "ScheduledBatch"):
        """One step's forward without sampling; see `Worker.compute_logits`."""
        return self.driver_worker.compute_logits(batch)

    def release(self, seq_ids: list[int]) -> None:
        self.driver_worker.release(seq_ids)
