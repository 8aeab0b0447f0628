"""One device's worker (vLLM's `Worker` + `ModelRunner`): the model, the KV pool, the attention backend and the
sampler, and the forward of each scheduled step.

    Worker(args)                  pick the platform (`minfer.platform`), load the model with its layout and ops
    .profile_forward(n)           CUDA: measure the peak activation memory of an n-token forward
    .init_kv_cache(blocks, cpu)   allocate the paged pool and swap space; pick the attention backend
    .execute_model(batch)         swap/copy blocks, build one ForwardContext, run the model, sample:
                                  a `ModelRunnerOutput` (minfer/outputs.py)
    .run_model(ids, ctx)          the step runner the platform chose (one-call CPU decode), else the model
    .compute_logits(batch)        the same without sampling: the logits (beam search scores them itself)
    .release(seq_ids)             forget per-sequence state (seeded random streams) of retired sequences
    .execute_parallel(batch)      one rank's part of a tensor/pipeline-parallel step (micro-batches, stages)

The scheduler and block manager stay with the engine (the driver): a worker receives a step's sequences
with their block tables and returns the sampled tokens. With tensor or pipeline parallelism (chapter 12)
each rank has one worker holding its shard of the model (`minfer.parallel`) and of the pool (its KV heads
of its stage's layers), and runs `execute_parallel`: the step's micro-batches through its stage.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from minfer.attention import ContiguousBackend, ForwardContext, get_attn_backend
from minfer.attention.grouped import GroupedBackend, hybrid_layout, stacked_block_tables
from minfer.config import EngineArgs
from minfer.kv_cache import KVCachePool
from minfer.model.loader import load_model
from minfer.outputs import ModelRunnerOutput
from minfer.parallel.parallel_state import get_parallel_state
from minfer.parallel.pipeline import recv_from_prev_stage, send_to_next_stage, split_micro_batches, stage_layers
from minfer.parallel.timeline import TimelineRecorder, device_clock
from minfer.platform import get_platform
from minfer.sampling import Sampler

if TYPE_CHECKING:
    from minfer.scheduler import ScheduledBatch

logger = logging.getLogger("minfer.worker")


@dataclasses.dataclass
class MicroBatch:
    """A slice of a step's rows (what `prepare_inputs` reads of a `ScheduledBatch`)."""

    seqs: list
    num_new_tokens: list


class Worker:
    """The model and everything that holds device memory for it.

    Attributes:
        model, config (`ModelConfig`), source (`ModelSource`), eos_token_ids, dtype, device: the loaded model.
        pool (`KVCachePool`), backend (`AttentionBackend`), sampler: set by `init_kv_cache`.
        build_time_s: seconds spent turning batches into tensors (part of the scheduling overhead).
    """

    def __init__(self, args: EngineArgs):
        self.args = args
        loaded = load_model(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                            # Triton's fused element-wise kernels with its attention; else the platform's
                            # ("auto"), the same ops as any model `load_model` gives with these kernels (the
                            # simple path's, a saved directory's round trip).
                            fused_ops="triton" if args.attention_backend == "triton" else "auto",
                            quantization=args.quantization,
                            quantization_config=args.quantization_config,
                            max_parallel_loading_workers=getattr(args, "max_parallel_loading_workers", None),
                            kernels=args.kernels)
        self.model = loaded.model
        self.config, self.source, self.eos_token_ids, self.dtype = (
            loaded.config, loaded.source, loaded.eos_token_ids, loaded.dtype)
        self.device = next(self.model.parameters()).device
        # How this device runs a step (minfer/platform.py): allocator settings now, the step runner (built now,
        # with its C++ libraries, not during the first request), the attention backend and sampler in
        # init_kv_cache.
        self.platform = get_platform(args.kernels, self.device, self.dtype, args.enforce_eager)
        self.platform.configure_allocator()
        self.step_runner = self.platform.step_runner(self.model)
        self.cuda_graphs = None  # the CUDA-graph runner, once init_kv_cache has captured it (CudaPlatform)
        # This rank's part of the KV pool: its KV heads (tensor parallelism) of its stage's layers (pipeline).
        st = self.parallel = get_parallel_state()
        cfg = self.config
        start, end = stage_layers(cfg.num_hidden_layers, st.pp_size, st.pp_rank)
        kvh = cfg.num_key_value_heads
        self.kv_config = dataclasses.replace(cfg, num_hidden_layers=end - start,
                                             num_key_value_heads=kvh // st.tp_size if kvh >= st.tp_size else 1,
                                             layer_windows=cfg.layer_windows[start:end])
        self.num_micro_batches = args.pipeline_micro_batches or st.pp_size
        self.timeline = TimelineRecorder()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(args.seed)
        self.pool: KVCachePool | None = None
        self.backend = None
        self.sampler: Sampler | None = None
        self.block_size = args.block_size
        self.kv_layout = None  # the hybrid KV cache's layer groups, set by init_kv_cache
        self.build_time_s = 0.0

    def profile_forward(self, num_tokens: int) -> None:
        """Run one forward of `num_tokens` tokens so the peak activation memory is measured before the KV pool
        takes the rest of the device (vLLM's profile run). Only meaningful on CUDA."""
        cfg = self.kv_config
        cache = ContiguousBackend(cfg.num_hidden_layers, num_tokens, cfg.num_key_value_heads, cfg.head_dim,
                                  self.dtype, self.device)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            # A later pipeline stage profiles on zeros in place of the hidden states it would receive.
            inter = (None if self.parallel.is_first_stage else
                     torch.zeros(2, num_tokens, cfg.hidden_size, dtype=self.dtype, device=self.device))
            self.model(ids, ForwardContext(cache, positions=torch.arange(num_tokens, device=self.device)),
                       **({} if inter is None else {"intermediate": inter}))
        del cache
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the pool (and swap space), and choose the attention backend and the sampler for it.

        Raises:
            ValueError: attention_backend="cpu" where its kernel cannot run, or "triton" over a cast pool
                (16-bit K/V under a float32 model).
        """
        # A model mixing sliding-window and full layers gets a hybrid KV cache: one block table per layer group
        # over `group_size` shared tensors (minfer/kv_cache_groups.py); others one tensor per layer. `kv_config`
        # is this rank's share of the layers and KV heads (tensor/pipeline parallelism, chapter 12). A quantized
        # pool (chapter 5) has a scale tensor beside each K/V tensor, mapped to the layers the same way.
        self.kv_layout = layout = hybrid_layout(self.config)
        pool_cfg = self.kv_config if layout is None else layout.pool_config(self.kv_config)
        self.pool = KVCachePool(pool_cfg, num_blocks, self.block_size, self.dtype, self.device, num_cpu_blocks,
                                self.args.kv_cache_dtype)
        scales = self.pool.scales
        name = self.platform.attention_backend(self.args.attention_backend)
        if layout is None:
            self.backend = get_attn_backend(name, self.pool.layers, scales, self.pool.spec, self.dtype)
        else:
            inner = get_attn_backend(name, layout.layer_caches(self.pool.layers),
                                     None if scales is None else layout.layer_caches(scales), self.pool.spec,
                                     self.dtype)
            self.backend = GroupedBackend(inner, layout)
        # Triton's fused sampler with its backend, the C++ one on a CPU, else torch's (the platform decides).
        self.sampler = self.platform.sampler(self.generator, self.args.attention_backend)
        # CUDA graphs capture over the pool and the backend, so their runner is built now (one rank only).
        if self.parallel.world_size == 1:
            max_len = self.args.max_model_len or self.config.max_position_embeddings
            graphs = self.platform.graph_runner(self.model, self.backend, self.args.max_num_seqs,
                                                -(-max_len // self.block_size))
            if graphs is not None:
                self.step_runner = self.cuda_graphs = graphs

    def prepare_inputs(self, batch: "ScheduledBatch") -> tuple[torch.Tensor, ForwardContext, list[int]]:
        """Flat input ids `[num_tokens]` and the ForwardContext of a batch; also which batch rows sample this
        step (those whose prompt is complete). Built with tensor ops, so the per-step cost does not grow with a
        Python loop over tokens."""
        dev = self.device
        seqs, counts = batch.seqs, batch.num_new_tokens
        ids: list[int] = []
        for s, n in zip(seqs, counts):
            a = s.num_computed_tokens
            if n == 1 and s.output_token_ids and a == len(s) - 1:
                ids.append(s.output_token_ids[-1])  # decode: no list concatenation
            elif s.spec_token_ids:  # speculative verification: the last token and the k drafts
                ids.extend(s.all_token_ids[a:] + s.spec_token_ids)
            else:
                ids.extend(s.all_token_ids[a:a + n])
        starts = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.long)
        n_t = torch.tensor(counts, dtype=torch.long)
        cu_q = torch.zeros(len(seqs) + 1, dtype=torch.long)
        torch.cumsum(n_t, 0, out=cu_q[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), n_t)
        positions = starts[seq_idx] + torch.arange(int(cu_q[-1])) - cu_q[:-1][seq_idx]
        context_lens = starts + n_t
        if self.kv_layout is None:
            max_blocks = max(len(s.block_table) for s in seqs)
            tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
                                  dtype=torch.int32)
        else:  # hybrid KV cache: [G, B, max_blocks], and slots [G, T] below (GroupedBackend splits them)
            tables = stacked_block_tables(seqs)
        slots = (tables[..., seq_idx, positions // self.block_size].long() * self.block_size
                 + positions % self.block_size)
        num_prefills = sum(1 for n in counts if n > 1)
        n_pt = int(cu_q[num_prefills])
        spec = [len(s.spec_token_ids) for s in seqs]
        sample_rows = [j for j, s in enumerate(seqs) if s.num_computed_tokens + counts[j] == len(s) + spec[j]]
        # A speculating row needs the logits of its last k + 1 positions (verification), others of their last.
        n_logits = torch.tensor([1 + spec[j] for j in sample_rows], dtype=torch.long)
        ends = torch.repeat_interleave(cu_q[1:][sample_rows], n_logits)
        offsets = torch.arange(int(n_logits.sum())) - torch.repeat_interleave(torch.cumsum(n_logits, 0) - n_logits,
                                                                                n_logits)
        logits_indices = ends - n_logits.repeat_interleave(n_logits) + offsets
        ctx = ForwardContext(
            attn_backend=self.backend, positions=positions.to(dev), num_prefills=num_prefills,
            num_prefill_tokens=n_pt,
            cu_seqlens_q=cu_q[:num_prefills + 1].to(torch.int32).to(dev),
            cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(context_lens[:num_prefills], 0)]
                                   ).to(torch.int32).to(dev),
            max_seqlen_q=int(n_t[:num_prefills].max()) if num_prefills else 0,
            max_seqlen_k=int(context_lens[:num_prefills].max()) if num_prefills else 0,
            slot_mapping=slots.to(dev), block_tables=tables.to(dev), context_lens=context_lens.to(torch.int32).to(dev),
            logits_indices=logits_indices.to(dev))
        return torch.tensor(ids, dtype=torch.long, device=dev), ctx, sample_rows

    @torch.inference_mode()
    def execute_model(self, batch: "ScheduledBatch") -> ModelRunnerOutput:
        """Swap and copy blocks, run the forward, sample under the batch's grammar masks (`ModelRunnerOutput`)."""
        rows, logits = self.compute_logits(batch)
        mask = None if batch.grammar_bitmask is None or not rows else batch.grammar_bitmask[rows]
        return self._sample(batch, rows, logits, mask, batch.spec_grammar_bitmasks)

    def _sample(self, batch: "ScheduledBatch", rows: list[int], logits: torch.Tensor | None,
                mask: torch.Tensor | None = None, spec_masks: dict | None = None) -> ModelRunnerOutput:
        """The tokens of a step's sampling `rows` from their logits float32 `[n, V]` (n = len(rows), plus k per
        speculating row): the sampler, or `_verify` when a row carries drafts. `mask`: structured output's
        int32 `[len(rows), ceil(V/32)]`; `spec_masks`: {batch row: its verification masks}."""
        plp = {s.seq_id: s.prompt_logprobs for s in batch.seqs if s.prompt_logprobs is not None}
        if not rows:
            return ModelRunnerOutput(rows, [], prompt_logprobs=plp)
        seqs = [batch.seqs[j] for j in rows]
        if any(s.spec_token_ids for s in seqs):
            spec_masks = spec_masks or {}
            tokens, chosen, tops = self._verify(logits, seqs, mask, [spec_masks.get(j) for j in rows])
        else:
            t, c, tp = self.sampler(logits, seqs, mask)
            tokens = [[x] for x in t.tolist()]
            chosen = None if c is None else [[x] for x in c.tolist()]
            tops = None if tp is None else [[x] for x in tp]
        return ModelRunnerOutput(rows, tokens, chosen, tops, plp)

    @torch.inference_mode()
    def compute_logits(self, batch: "ScheduledBatch") -> tuple[list[int], torch.Tensor | None]:
        """The forward without sampling: (batch rows whose prompt is complete, their next-token logits
        float32 `[len(rows), V]`, or None when no row is). Beam search scores these itself.

        Also fills `seq.prompt_logprobs` of the rows that asked for them (vLLM's prompt_logprobs), from the
        hidden states of every prompt position this step computed."""
        self.pool.swap_out(batch.swap_out)
        self.pool.swap_in(batch.swap_in)
        self.pool.copy_blocks(batch.copy)
        t0 = time.perf_counter()
        input_ids, ctx, rows = self.prepare_inputs(batch)
        self.build_time_s += time.perf_counter() - t0
        hidden = self.run_model(input_ids, ctx)
        if any(s.prompt_logprobs is not None for s in batch.seqs):
            self._prompt_logprobs(batch, hidden)
        if not rows:
            return rows, None
        return rows, self.model.compute_logits(hidden[ctx.logits_indices]).float()

    def run_model(self, input_ids: torch.Tensor | None, ctx: ForwardContext,
                  intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """One forward of the step (nano-vllm's `ModelRunner.run_model`): the platform's step runner where it
        covers the step (on a CPU the one-call decode, `minfer.cpu.decode_step`; on CUDA, graph replay), else
        the model, op by op. Returns what the model returns (hidden states `[T, hidden]` on the last stage)."""
        if self.step_runner is not None and intermediate is None:
            hidden = self.step_runner.run(input_ids, ctx)
            if hidden is not None:
                return hidden
        if intermediate is None:
            return self.model(input_ids, ctx)
        return self.model(input_ids, ctx, intermediate)

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
        self.pool.swap_out(batch.swap_out)
        self.pool.swap_in(batch.swap_in)
        self.pool.copy_blocks(batch.copy)
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
            out = self.model(ids, ctx, inter)
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
        mask = None if batch.grammar_bitmask is None or not rows else batch.grammar_bitmask[rows]
        return self._sample(batch, rows, logits, mask, batch.spec_grammar_bitmasks)

    def _prompt_logprobs(self, batch: "ScheduledBatch", hidden: torch.Tensor) -> None:
        """For each row that wants prompt logprobs, the logprob of prompt token p+1 given tokens 0..p, for the
        prompt positions p of this step's chunk, plus the row's top-k alternatives (one log_softmax over the
        chunk: `[positions, V]`). Entries are written at their index, so a prompt computed again after a
        preemption (recompute) overwrites instead of appending twice."""
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, k = seq.num_computed_tokens, seq.params.prompt_logprobs
            m = min(n, seq.num_prompt_tokens - 1 - start)  # positions whose next token is a prompt token
            if seq.prompt_logprobs is not None and m > 0:
                logp = self.model.compute_logits(hidden[offset:offset + m]).float().log_softmax(dim=-1)
                nxt = torch.tensor(seq.prompt_token_ids[start + 1:start + 1 + m], device=logp.device)
                chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
                entries = [{t: c} for t, c in zip(nxt.tolist(), chosen)]
                if k:
                    vals, ids = logp.topk(k, dim=-1)
                    entries = [{**dict(zip(i, v)), **e} for i, v, e in zip(ids.tolist(), vals.tolist(), entries)]
                del seq.prompt_logprobs[start + 1:]
                seq.prompt_logprobs.extend(entries)
            offset += n

    def _verify(self, logits: torch.Tensor, seqs: list, mask: torch.Tensor | None = None,
                spec_masks: list | None = None) -> tuple[list[list[int]], list | None, list | None]:
        """A batch with speculating rows: ordinary rows go through the sampler (with their rows of the
        structured-output `mask`) and yield one token, each speculating row goes through `rejection_sample`
        over its k + 1 logits and yields 1 to k + 1. A guided speculating row's logits are masked first,
        position by position (`spec_masks[i]`, int32 `[k + 1, ceil(V/32)]`), so a draft the grammar refuses
        has p = 0 and every emitted token is one the grammar allows there; logprobs stay the raw model's.
        Returns `ModelRunnerOutput`'s (sampled_token_ids, logprobs, top_logprobs) for `seqs`."""
        from minfer.sampling import apply_token_bitmask
        from minfer.spec_decode.rejection import rejection_sample

        sizes = [1 + len(s.spec_token_ids) for s in seqs]
        last = torch.cumsum(torch.tensor(sizes), 0) - 1
        plain = [i for i, s in enumerate(seqs) if not s.spec_token_ids]
        tokens: list = [None] * len(seqs)
        chosen: list | None = None
        tops: list | None = None
        want_lp = any(s.params.logprobs is not None for s in seqs)
        if want_lp:
            chosen, tops = [None] * len(seqs), [None] * len(seqs)
        if plain:
            t, c, tp = self.sampler(logits[last[plain]], [seqs[i] for i in plain],
                                    None if mask is None else mask[plain])
            for r, i in enumerate(plain):
                tokens[i] = [int(t[r])]
                if want_lp:
                    chosen[i] = [float(c[r]) if c is not None else 0.0]
                    tops[i] = [tp[r] if tp is not None else None]
        start = 0
        for i, (s, n) in enumerate(zip(seqs, sizes)):
            if s.spec_token_ids:
                rows = logits[start:start + n].float()
                guided = spec_masks[i] if spec_masks else None
                out = rejection_sample(rows if guided is None else apply_token_bitmask(rows, guided),
                                       s.spec_token_ids, s.params, s.spec_draft_probs,
                                       self.sampler.generator_for(s, logits.device) or self.generator)
                tokens[i] = out
                if want_lp:
                    logp = rows[:len(out)].log_softmax(dim=-1)
                    ids = torch.tensor(out, device=logp.device)
                    lp = logp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
                    chosen[i] = lp
                    k = s.params.logprobs or 0
                    vals, top_ids = logp.topk(k, dim=-1) if k else (None, None)
                    tops[i] = [{**(dict(zip(top_ids[r].tolist(), vals[r].tolist())) if k else {}), out[r]: lp[r]}
                               for r in range(len(out))]
            start += n
        return tokens, chosen, tops

    def release(self, seq_ids: list[int]) -> None:
        """Drop the per-sequence state of retired sequences (their seeded random streams)."""
        if self.sampler is not None:
            self.sampler.release(seq_ids)
