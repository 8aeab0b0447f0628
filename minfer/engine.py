"""`LLMEngine`: requests in, tokens out, one scheduling step at a time (vLLM's engine, in small).

    add_request ─► Scheduler.schedule ─► ModelRunner.execute ─► Sampler ─► Sequence.append_token ─► step()
                   (who runs, which blocks)  (one forward over a flat batch)   (stop checks, detokenize)

The model runner turns a `ScheduledBatch` into flat `input_ids`/`positions` and one `ForwardContext`
(`cu_seqlens`, `slot_mapping`, `block_tables`, `context_lens`), built with tensor ops so the per-step cost
does not grow with a Python loop over tokens.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from dataclasses import dataclass

import torch

from minfer.block_manager import BlockManager
from minfer.config import EngineArgs
from minfer.kv_cache import KVCachePool, bytes_per_block, determine_num_blocks
from minfer.memory import physical_memory_bytes
from minfer.model.attention import ForwardContext, PagedTorchBackend
from minfer.model.loader import load_model, resolve_model
from minfer.outputs import RequestMetrics, RequestOutput
from minfer.sampling import Sampler
from minfer.sampling_params import SamplingParams
from minfer.scheduler import ScheduledBatch, Scheduler
from minfer.sequence import Sequence, validate_prompt
from minfer.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("minfer.engine")


@dataclass
class EngineStats:
    """A snapshot of the engine for monitoring (article §15): queues, KV pool, prefix cache, preemptions."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # fraction of blocks held by sequences, 0-1
    fragmentation: float  # allocated-but-unused slots / allocated slots (internal fragmentation)
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were cached
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_evicted_blocks: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_steps: int
    scheduler_time_s: float  # scheduling, building the batch tensors (block tables, slot mapping), outputs
    forward_time_s: float  # the model forward + sampling


@dataclass
class ModelConfigView:
    """What callers need to know of the loaded model (served name, length limit, dtype)."""

    max_model_len: int
    dtype: torch.dtype
    architecture: str


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], seqs: list[Sequence],
                 metrics: RequestMetrics):
        self.request_id, self.prompt, self.prompt_ids, self.seqs, self.metrics = (
            request_id, prompt, prompt_ids, seqs, metrics)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, [s.to_output() for s in self.seqs],
                             finished=self.finished, num_cached_tokens=self.seqs[0].num_cached_tokens,
                             metrics=self.metrics)


class ModelRunner:
    """Runs one forward over a `ScheduledBatch` and samples where a sequence reached its end."""

    def __init__(self, model, pool: KVCachePool, block_size: int, sampler: Sampler, backend):
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.sampler = sampler
        self.backend = backend
        self.device = next(model.parameters()).device
        self.build_time_s = 0.0  # time spent turning batches into tensors (part of the scheduling overhead)

    def build_context(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardContext, list[int]]:
        """Flat input ids and the ForwardContext of a batch; also which batch rows sample this step."""
        dev = self.device
        seqs, counts = batch.seqs, batch.num_new_tokens
        ids: list[int] = []
        for s, n in zip(seqs, counts):
            a = s.num_computed_tokens
            if n == 1 and s.output_token_ids and a == len(s) - 1:
                ids.append(s.output_token_ids[-1])  # decode: no list concatenation
            else:
                ids.extend(s.all_token_ids[a:a + n])
        starts = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.long)
        n_t = torch.tensor(counts, dtype=torch.long)
        cu_q = torch.zeros(len(seqs) + 1, dtype=torch.long)
        torch.cumsum(n_t, 0, out=cu_q[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), n_t)
        positions = starts[seq_idx] + torch.arange(int(cu_q[-1])) - cu_q[:-1][seq_idx]
        context_lens = starts + n_t
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
                              dtype=torch.int32)
        slots = tables[seq_idx, positions // self.block_size].long() * self.block_size + positions % self.block_size
        num_prefills = sum(1 for n in counts if n > 1)
        n_pt = int(cu_q[num_prefills])
        sample_rows = [j for j, s in enumerate(seqs) if s.num_computed_tokens + counts[j] == len(s)]
        logits_indices = (cu_q[1:] - 1)[sample_rows]
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
    def execute(self, batch: ScheduledBatch):
        """Swap blocks, run the forward, sample. Returns (rows that sampled, tokens, logprobs, top dicts)."""
        self.pool.swap_out(batch.swap_out)
        self.pool.swap_in(batch.swap_in)
        t0 = time.perf_counter()
        input_ids, ctx, rows = self.build_context(batch)
        self.build_time_s += time.perf_counter() - t0
        hidden = self.model(input_ids, ctx)
        if not rows:
            return rows, None, None, None
        logits = self.model.compute_logits(hidden[ctx.logits_indices])
        tokens, chosen, tops = self.sampler(logits, [batch.seqs[j] for j in rows])
        return rows, tokens.tolist(), (None if chosen is None else chosen.tolist()), tops


class LLMEngine:
    """The serving engine: a scheduler over a paged KV pool, driving the model one step at a time.

    Use `from_engine_args(EngineArgs(...))`. Not thread-safe: one thread calls add_request/step/abort.
    """

    def __init__(self, args: EngineArgs):
        args.verify()
        self.args = args
        t0 = time.perf_counter()
        loaded = load_model(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        cfg = loaded.config
        self.hf_config = cfg
        self.model_name = args.model
        tok_source = resolve_model(args.tokenizer) if args.tokenizer else loaded.source
        self.tokenizer: Tokenizer = load_tokenizer(tok_source, loaded.eos_token_ids)
        max_len = args.max_model_len or cfg.max_position_embeddings
        self.model_config = ModelConfigView(max_model_len=max_len, dtype=loaded.dtype, architecture=cfg.architecture)
        self.max_model_len = max_len
        mnbt = args.max_num_batched_tokens or (2048 if args.enable_chunked_prefill else max(max_len, 2048))
        if not args.enable_chunked_prefill and mnbt < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({mnbt}) is smaller than max_model_len ({max_len}): without chunked "
                "prefill a long prompt could never be scheduled. Raise it or set enable_chunked_prefill=True.")
        self.max_num_batched_tokens = mnbt
        if self.device.type == "cuda":
            self._profile_forward(mnbt)
        num_blocks = determine_num_blocks(cfg, args.block_size, loaded.dtype, self.device, args.kv_cache_memory_bytes,
                                          args.gpu_memory_utilization, max_len)
        per_block = bytes_per_block(cfg, args.block_size, loaded.dtype)
        num_cpu_blocks = int(args.swap_space * (1 << 30)) // per_block
        ram = physical_memory_bytes()
        if args.swap_space * (1 << 30) > ram:
            raise ValueError(f"swap_space={args.swap_space} GiB is more than this machine's memory "
                             f"({ram / (1 << 30):.1f} GiB); lower swap_space")
        self.pool = KVCachePool(cfg, num_blocks, args.block_size, loaded.dtype, self.device, num_cpu_blocks)
        self.block_manager = BlockManager(num_blocks, args.block_size, num_cpu_blocks, args.enable_prefix_caching)
        mode = args.preemption_mode or ("swap" if num_cpu_blocks else "recompute")
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, mnbt, args.enable_chunked_prefill, mode)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(args.seed)
        backend = self._make_backend(args.attention_backend)
        if args.attention_backend == "triton":
            from minfer.kernels.backend import TritonSampler

            sampler = TritonSampler(self.generator)  # fused_sample where a batch allows it
        else:
            sampler = Sampler(self.generator)
        self.runner = ModelRunner(self.model, self.pool, args.block_size, sampler, backend)
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._prompt_tokens = self._gen_tokens = self._steps = 0
        self._sched_time = self._fwd_time = 0.0
        logger.info("loaded %s (%s) in %.1fs; KV pool %d blocks x %d tokens = %d tokens, %d bytes; attention %s",
                    args.model, loaded.dtype, time.perf_counter() - t0, num_blocks, args.block_size,
                    num_blocks * args.block_size, self.pool.nbytes, type(backend).__name__)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def _make_backend(self, name: str):
        """The attention backend for `attention_backend=name` (see EngineArgs); "auto" picks the C++ decode
        kernel for a float32 pool on the CPU and falls back to the torch reference, with a warning, when the
        kernel cannot be built. Raises ValueError for "cpu" where it cannot run."""
        if name == "triton":
            from minfer.kernels.backend import TritonBackend, install_fused_ops

            install_fused_ops(self.model)  # RMSNorm, SiLU-and-mul, RoPE -> fused kernels (this model only)
            return TritonBackend(self.pool.layers)
        cpu_f32 = self.device.type == "cpu" and self.model_config.dtype == torch.float32
        if name == "cpu" or (name == "auto" and cpu_f32):
            from minfer.model.paged_attention_cpu import CpuKernelUnavailable, CpuPagedBackend

            try:
                return CpuPagedBackend(self.pool.layers)
            except CpuKernelUnavailable as e:
                if name == "cpu":
                    raise ValueError(f"attention_backend='cpu' cannot run here: {e}") from e
                logger.warning("the C++ decode-attention kernel is unavailable (%s); using the torch reference", e)
        return PagedTorchBackend(self.pool.layers)

    def _profile_forward(self, num_tokens: int) -> None:
        """On CUDA, run one forward at the largest batch so the peak activation memory is measured before the
        KV pool takes the rest (vLLM's profile run)."""
        from minfer.model.attention import ContiguousKVCache

        cfg = self.hf_config
        n = min(num_tokens, self.max_model_len)
        cache = ContiguousKVCache(cfg.num_hidden_layers, n, cfg.num_key_value_heads, cfg.head_dim,
                                  self.model_config.dtype, self.device)
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            self.model(ids, ForwardContext(cache, positions=torch.arange(n, device=self.device)))
        del cache
        torch.cuda.synchronize()

    def kv_pool_info(self) -> dict:
        return dict(num_blocks=self.pool.num_blocks, block_size=self.pool.block_size,
                    num_tokens=self.pool.num_blocks * self.pool.block_size, bytes=self.pool.nbytes,
                    num_cpu_blocks=self.pool.num_cpu_blocks)

    # -- requests ------------------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request (a string or a list of token ids). Returns its id.

        Raises:
            ValueError: a duplicate id, an empty or too-long prompt, bad token ids, or a request that could
                never fit in the KV pool. Nothing is queued when it raises.
        """
        params = sampling_params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize_prompt(prompt)
        validate_prompt(ids, params, self.max_model_len, self.hf_config.vocab_size)
        total = len(ids) + (params.max_tokens or self.max_model_len - len(ids))
        need = self.block_manager.blocks_needed(min(total, self.max_model_len))
        if need > self.block_manager.num_total_blocks:
            raise ValueError(f"this request needs up to {need} KV blocks but the pool has "
                             f"{self.block_manager.num_total_blocks}; it could never run. Lower max_tokens or "
                             "enlarge the pool (kv_cache_memory_bytes / gpu_memory_utilization).")
        params = params.clone(_eos_token_ids=tuple(self.tokenizer.eos_token_ids))
        metrics = RequestMetrics(arrival_time=arrival_time or time.perf_counter())
        seqs = [Sequence(request_id, i, ids, params, self.tokenizer, self.max_model_len, self.device)
                for i in range(params.n)]
        self.requests[request_id] = _Request(request_id, text, ids, seqs, metrics)
        for s in seqs:
            self.scheduler.add(s)
        return request_id

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a string, a list of token ids, or vLLM's dict forms
        {"prompt": str} / {"prompt_token_ids": [int]} (with both, the ids are used and the text kept).
        Raises ValueError for anything else."""
        if isinstance(prompt, dict):
            if isinstance(prompt.get("prompt_token_ids"), (list, tuple)):
                text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
                return text, self.tokenize_prompt(prompt["prompt_token_ids"])[1]
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' (a string) or 'prompt_token_ids' (a list of ints)")
        if isinstance(prompt, str):
            try:
                return prompt, self.tokenizer.encode(prompt)
            except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
                raise ValueError(f"the prompt could not be tokenized: {e}") from None
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                     for t in prompt):
            return None, [int(t) for t in prompt]  # NumPy / torch integer scalars become plain ints
        raise ValueError("prompt must be a string, a list of integer token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids'; got {type(prompt).__name__}")

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free all their KV blocks. Unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for s in req.seqs:
                s.abort()
                self.scheduler.remove(s)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns a RequestOutput for every request that made progress (text so
        far; `finished` set on the last one). Finished requests are retired and their blocks freed."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
            return []
        t1 = time.perf_counter()
        rows, tokens, chosen, tops = self.runner.execute(batch)
        t2 = time.perf_counter()
        self.scheduler.finish_step(batch)
        now = time.perf_counter()
        touched: dict[str, _Request] = {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            req = self.requests.get(seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self._prompt_tokens += n
        for k, j in enumerate(rows):
            seq = batch.seqs[j]
            seq.append_token(tokens[k], chosen[k] if chosen else 0.0, tops[k] if tops else None)
            self._gen_tokens += 1
            req = self.requests[seq.request_id]
            if seq.index == 0:
                m = req.metrics
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
                m.token_times.append(now)
            touched[seq.request_id] = req
            if seq.is_finished:
                self.scheduler.remove(seq)
        outputs = []
        for rid, req in touched.items():
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[rid]
            outputs.append(req.output())
        self._steps += 1
        self._sched_time += (t1 - t0) + (time.perf_counter() - t2)
        self._fwd_time += t2 - t1
        return outputs

    # -- observability -------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        held = [s for s in sch.running]
        alloc = sum(len(s.block_table) for s in held) * bm.block_size
        used = sum(min(len(s), len(s.block_table) * bm.block_size) for s in held)
        return EngineStats(
            num_running=len(sch.running), num_waiting=len(sch.waiting), num_swapped=len(sch.swapped),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_total_blocks, kv_cache_usage=bm.usage(),
            fragmentation=(alloc - used) / alloc if alloc else 0.0,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            prefix_cache_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            num_preemptions=sch.num_preemptions, num_evicted_blocks=bm.num_evicted_blocks,
            num_prompt_tokens_total=self._prompt_tokens, num_generation_tokens_total=self._gen_tokens,
            num_steps=self._steps, scheduler_time_s=self._sched_time + self.runner.build_time_s,
            forward_time_s=self._fwd_time - self.runner.build_time_s)

    def all_blocks_free(self) -> bool:
        """True when no sequence holds a block (what every test checks after a run)."""
        return self.block_manager.num_free_blocks == self.block_manager.num_total_blocks
