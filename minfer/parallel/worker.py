"""A rank of a tensor- and/or pipeline-parallel job (chapter 12): `Worker` with its shard of the model and of
the KV pool, and `execute_parallel`, one step of micro-batches through this rank's pipeline stage.

The model is the single-device one with its shard applied from outside (`minfer.parallel.apply`, by the
loader); the pool holds this rank's KV heads (tensor parallelism) of its stage's layers (pipeline).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from minfer.attention import ContiguousBackend, ForwardContext
from minfer.config import EngineArgs, ModelConfig
from minfer.parallel.parallel_state import get_parallel_state
from minfer.parallel.pipeline import recv_from_prev_stage, send_to_next_stage, split_micro_batches, stage_layers
from minfer.parallel.timeline import TimelineRecorder, device_clock
from minfer.worker import Worker

if TYPE_CHECKING:
    from minfer.scheduler import ScheduledBatch


@dataclasses.dataclass
class MicroBatch:
    """A slice of a step's rows (what `prepare_inputs` reads of a `ScheduledBatch`)."""

    seqs: list
    num_new_tokens: list


class ParallelWorker(Worker):
    """One rank's worker. Attributes beyond `Worker`'s: parallel (`ParallelState`), num_micro_batches,
    timeline (`TimelineRecorder`: when each micro-batch's forward ran)."""

    def __init__(self, args: EngineArgs):
        self.parallel = get_parallel_state()
        super().__init__(args)
        self.num_micro_batches = args.pipeline_micro_batches or self.parallel.pp_size
        self.timeline = TimelineRecorder()
        self.step_runner = None  # a stage runs its layers op by op (no one-call decode, no graphs)

    def kv_cache_config(self, cfg: ModelConfig) -> ModelConfig:
        """This rank's part of the KV pool: its KV heads (tensor parallelism) of its stage's layers (pipeline)."""
        st = self.parallel
        start, end = stage_layers(cfg.num_hidden_layers, st.pp_size, st.pp_rank)
        kvh = cfg.num_key_value_heads
        return dataclasses.replace(cfg, num_hidden_layers=end - start,
                                   num_key_value_heads=kvh // st.tp_size if kvh >= st.tp_size else 1,
                                   layer_windows=cfg.layer_windows[start:end])

    def build_graph_runner(self) -> None:
        """No CUDA graphs across ranks."""

    def profile_forward(self, num_tokens: int) -> None:
        """`Worker.profile_forward` on this stage: a later stage profiles on zeros in place of the hidden
        states it would receive."""
        cfg = self.kv_config
        cache = ContiguousBackend(cfg.num_hidden_layers, num_tokens, cfg.num_key_value_heads, cfg.head_dim,
                                  self.dtype, self.device)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            inter = (None if self.parallel.is_first_stage else
                     torch.zeros(2, num_tokens, cfg.hidden_size, dtype=self.dtype, device=self.device))
            ctx = ForwardContext(cache, positions=torch.arange(num_tokens, device=self.device))
            self.model(ids, ctx) if inter is None else self.model(ids, ctx, inter)
        del cache
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def set_num_micro_batches(self, m: int) -> None:
        """Micro-batches per pipeline step from now on (the benchmark sweeps it on one running job)."""
        self.num_micro_batches = int(m)

    @torch.inference_mode()
    def execute_parallel(self, batch: "ScheduledBatch", sample: bool = True):
        """One step on this rank of a tensor- and/or pipeline-parallel job (every rank runs it on the same batch).

        The batch's rows are cut into micro-batches (`num_micro_batches`, default one per stage; one without
        pipeline parallelism), each run through this stage's layers as soon as its input is here: the first
        stage embeds the ids, a later one receives `[2, T, hidden]` from the stage before, and all but the
        last send theirs on without waiting, so stage s runs micro-batch i while stage s+1 runs i-1. Each
        forward's start and end go to `timeline`. The last stage computes the logits of all micro-batches at
        once, in the batch's row order, so sampling sees exactly what one process would.

        Returns, on the output rank (TP rank 0 of the last stage): with `sample`, a `ModelRunnerOutput` as
        `execute_model` (its `prompt_logprobs` matter here: the driver's sequences are other objects);
        without, `(rows, logits, {seq_id: prompt_logprobs})`. None on every other rank.
        """
        st = self.parallel
        self.pool.before_forward(batch)
        n_mb = self.num_micro_batches if st.pp_size > 1 else 1
        hidden_parts, rows, sends = [], [], []
        step = self.timeline.next_step()
        for i, (a, b) in enumerate(split_micro_batches(len(batch.seqs), n_mb)):
            mb = MicroBatch(batch.seqs[a:b], batch.num_new_tokens[a:b])
            ids, ctx, mb_rows = self.prepare_inputs(mb)
            inter = None
            if not st.is_first_stage:
                inter = recv_from_prev_stage((2, ids.numel(), self.config.hidden_size), self.dtype)
            t0 = device_clock(self.device)  # synchronizes on CUDA: the interval is the kernels' execution
            out = self.model(ids, ctx) if inter is None else self.model(ids, ctx, inter)
            self.timeline.record(step, st.pp_rank, st.tp_rank, i, t0, device_clock(self.device), ids.numel())
            if not st.is_last_stage:
                sends.append((send_to_next_stage(out), out))  # keep `out` alive until the send is done
                continue
            if any(s.prompt_logprobs is not None for s in mb.seqs):
                self._prompt_logprobs(mb, out)
            hidden_parts.append(out[ctx.logits_indices])
            rows.extend(a + j for j in mb_rows)
        for work, _ in sends:
            work.wait()
        if not st.is_last_stage:
            return None
        # Every TP rank of the last stage joins the head's all-gather; only the output rank samples.
        logits = self.model.compute_logits(torch.cat(hidden_parts)).float() if rows else None
        if st.tp_rank != 0:
            return None
        if not sample:
            return rows, logits, {s.seq_id: s.prompt_logprobs for s in batch.seqs if s.prompt_logprobs is not None}
        # The same grammar masks as one process (structured output under TP/PP is constrained too).
        mask = None if batch.token_bitmask is None or not rows else batch.token_bitmask[rows]
        return self._sample(batch, rows, logits, mask, batch.verify_token_bitmasks)
