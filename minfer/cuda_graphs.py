"""CUDA graphs for decode steps (vLLM's `CUDAGraphRunner`, nano-vllm's `capture_cudagraph`; chapter 4).

A decode step of a small model is a few hundred short kernels, and at batch 1 the GPU waits on the CPU that
launches them: Python and torch's dispatcher take longer per kernel than the kernel runs. A CUDA graph records
the step's kernels once and replays them with one launch. A graph replays the same kernels on the same
addresses, so:

- the step's inputs live in static buffers (`StaticInputs`): input ids, positions, slot mapping, block
  tables and context lengths are copied into them before each replay, and the graph reads them there;
- one graph per batch size, captured for a fixed set of sizes (`capture_batch_sizes`: 1, 2, 4, 8, then every
  8 up to `max_num_seqs`); a step of n sequences replays the graph of the smallest size >= n
  (`padded_batch_size`), its padding rows made harmless (slot -1: no K/V stored; context length 0: no key
  read, output 0);
- everything the kernels size on the host is fixed at capture: the block tables are `max_blocks_per_seq`
  wide, so the paged decode kernel's grid and its number of context splits are those of the longest
  sequence the engine admits;
- a step the graphs do not cover runs eagerly: any prefill token, more sequences than the largest size, a
  wider block table, another backend (`run` returns None and the caller runs the model).

Only the Triton backend's decode path is capturable: it reads lengths and tables on the device. The torch
reference reads context lengths on the host (`.tolist()`) to plan its gathers, so a graph would freeze one
step's lengths; `build` declines it (`capturable`).

    runner = CudaGraphRunner.build(model, backend, max_num_seqs=256, max_blocks_per_seq=128)
    hidden = runner.run(input_ids, ctx)          # [n, hidden] from a replay, or None: run the model eagerly
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from minfer.attention.base import AttentionBackend, ForwardContext

logger = logging.getLogger("minfer.cuda_graphs")

# Backends whose decode path reads every per-step value (lengths, tables, slots) on the device.
CAPTURABLE_BACKENDS = ("triton",)


def capture_batch_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """The batch sizes to capture, ascending: `sizes` if given (deduplicated, those <= max_num_seqs), else
    vLLM's 1, 2, 4 then multiples of 8, up to `max_num_seqs` (itself included, so every admissible batch
    is covered).

    Raises:
        ValueError: max_num_seqs < 1, or a size < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if sizes is None:
        sizes = [1, 2, 4, *range(8, max_num_seqs + 1, 8), max_num_seqs]
    if any(s < 1 for s in sizes):
        raise ValueError(f"capture sizes must be >= 1, got {sizes}")
    return sorted({s for s in sizes if s <= max_num_seqs})


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (`sizes` ascending), or None when n is above the largest one."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def covers(ctx: ForwardContext, num_tokens: int, max_size: int, max_blocks_per_seq: int) -> bool:
    """Whether a step is a pure decode step the graphs can replay: no prefill, one token per sequence, at
    most `max_size` sequences, a two-dimensional block table (not the hybrid cache's stacked groups) no wider
    than the static one."""
    bt = ctx.block_tables
    return (ctx.num_prefills == 0 and 0 < num_tokens <= max_size and bt is not None and bt.dim() == 2
            and bt.shape[0] == num_tokens and bt.shape[1] <= max_blocks_per_seq
            and ctx.context_lens is not None and ctx.context_lens.shape[0] == num_tokens)


@dataclass
class StaticInputs:
    """The buffers a captured decode step reads, `max_size` rows each (on the model's device):
    input_ids, positions, slot_mapping int64 `[max_size]`; block_tables int32 `[max_size, max_blocks]`;
    context_lens int32 `[max_size]`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    @classmethod
    def allocate(cls, max_size: int, max_blocks_per_seq: int, device) -> "StaticInputs":
        """Buffers for at most `max_size` sequences, set to the padding values (`pad`)."""
        z = dict(device=device)
        s = cls(input_ids=torch.zeros(max_size, dtype=torch.long, **z),
                positions=torch.zeros(max_size, dtype=torch.long, **z),
                slot_mapping=torch.full((max_size,), -1, dtype=torch.long, **z),
                block_tables=torch.zeros(max_size, max_blocks_per_seq, dtype=torch.int32, **z),
                context_lens=torch.zeros(max_size, dtype=torch.int32, **z))
        return s

    def fill(self, input_ids: torch.Tensor, ctx: ForwardContext, padded: int) -> None:
        """Copy one decode step of n = len(input_ids) sequences into rows [0, n) and pad rows [n, padded):
        slot -1 (the store skips it), context length 0 (nothing read), id and position 0. Columns of the
        block table past the step's width keep stale entries: the kernels read only the blocks inside
        each row's context length."""
        n, w = input_ids.shape[0], ctx.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(ctx.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(ctx.slot_mapping, non_blocking=True)
        self.block_tables[:n, :w].copy_(ctx.block_tables, non_blocking=True)
        self.context_lens[:n].copy_(ctx.context_lens, non_blocking=True)
        if padded > n:
            self.pad(n, padded)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        self.context_lens[start:end] = 0

    def context(self, backend: AttentionBackend, size: int) -> ForwardContext:
        """The ForwardContext of a decode step over the first `size` rows (views of the buffers)."""
        return ForwardContext(attn_backend=backend, positions=self.positions[:size],
                              slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                              context_lens=self.context_lens[:size],
                              logits_indices=torch.arange(size, device=self.positions.device))


def capturable(backend: AttentionBackend) -> bool:
    """Whether `backend`'s decode path can be captured (module docstring)."""
    return getattr(backend, "name", None) in CAPTURABLE_BACKENDS


class CudaGraphRunner:
    """The captured decode steps of one model over one KV pool. Build with `build`; `run` replays.

    Attributes:
        sizes: the captured batch sizes, ascending (empty: nothing captured, `run` always returns None).
        max_blocks_per_seq: the static block table's width.
        why_not: why nothing was captured (None when `sizes` is not empty).
    """

    def __init__(self, model, backend: AttentionBackend, static: StaticInputs | None, outputs: torch.Tensor | None,
                 graphs: dict[int, "torch.cuda.CUDAGraph"], max_blocks_per_seq: int, why_not: str | None = None):
        self.model, self.backend, self.static, self.outputs = model, backend, static, outputs
        self.graphs = graphs
        self.sizes = sorted(graphs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.why_not = why_not

    @classmethod
    def build(cls, model, backend: AttentionBackend, *, max_num_seqs: int, max_blocks_per_seq: int,
              sizes: list[int] | None = None, device=None) -> "CudaGraphRunner":
        """Capture `model`'s decode step for each of `capture_batch_sizes(max_num_seqs, sizes)` over `backend`
        (the engine's, holding the KV pool). The largest size first, so the smaller graphs reuse its memory
        pool (one pool for all, as vLLM). Each size runs once eagerly before its capture (Triton compiles and
        autotunes then, not inside the graph).

        Never raises for the model's sake: where the device is not CUDA, the backend is not capturable or a
        capture fails (an op that reads the device on the host), the runner covers nothing, says why in
        `why_not` and one warning, and every step runs eagerly.

        Args:
            max_blocks_per_seq: the widest block table a step may have (max_model_len / block_size, rounded up).
            device: the model's device (default: its first parameter's).
        """
        device = torch.device(device) if device is not None else next(model.parameters()).device
        why = None
        if device.type != "cuda":
            why = f"the model is on {device}, not CUDA"
        elif not capturable(backend):
            why = (f"the {getattr(backend, 'name', type(backend).__name__)!r} attention backend reads per-step "
                   f"values on the host; graphs capture {', '.join(CAPTURABLE_BACKENDS)}")
        if why is not None:
            return cls(model, backend, None, None, {}, max_blocks_per_seq, why_not=why)
        sizes = capture_batch_sizes(max_num_seqs, sizes)
        static = StaticInputs.allocate(sizes[-1], max_blocks_per_seq, device)
        graphs: dict[int, torch.cuda.CUDAGraph] = {}
        outputs = None
        pool = None
        try:
            with torch.inference_mode():
                for bs in reversed(sizes):
                    ctx = static.context(backend, bs)
                    out = model(static.input_ids[:bs], ctx)  # warm-up: compile and autotune outside the graph
                    if outputs is None:
                        outputs = torch.empty((sizes[-1], *out.shape[1:]), dtype=out.dtype, device=device)
                    torch.cuda.synchronize(device)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        outputs[:bs] = model(static.input_ids[:bs], ctx)
                    pool = g.pool() if pool is None else pool
                    graphs[bs] = g
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - a model that cannot be captured still runs, eagerly
            why = f"capture failed: {type(e).__name__}: {str(e)[:300]}"
            logger.warning("CUDA graphs are off, decode steps run eagerly (%s)", why)
            return cls(model, backend, None, None, {}, max_blocks_per_seq, why_not=why)
        return cls(model, backend, static, outputs, graphs, max_blocks_per_seq)

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """The hidden states `[n, hidden]` of a decode step of n sequences from a graph replay, or None when the
        graphs do not cover the step (`covers`, or another backend than the captured one): the caller runs
        the model eagerly. The result is a view of a static buffer, valid until the next `run`."""
        n = input_ids.shape[0]
        if not self.sizes or ctx.attn_backend is not self.backend or not covers(
                ctx, n, self.sizes[-1], self.max_blocks_per_seq):
            return None
        bs = padded_batch_size(n, self.sizes)
        self.static.fill(input_ids, ctx, bs)
        self.graphs[bs].replay()
        return self.outputs[:n]
