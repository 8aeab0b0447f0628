"""`LLMEngine`: requests in, tokens out, one scheduling step at a time (vLLM's engine, in small).

    add_request ─► Scheduler.schedule ─► executor.execute_model ─► Sequence.append_token ─► OutputProcessor
     (tokenize)    (who runs, which blocks)   (worker: one forward       (stop ids, length)    (detokenize,
                                               + sampling: a                                     stop strings)
                                               ModelRunnerOutput)

The engine is the tokenizer, the scheduler (with its block manager) and an executor; the executor's worker
holds the model, the KV pool, the attention backend and the sampler (`minfer.worker`), and turns each
`ScheduledBatch` into one forward. Structured output and speculative decoding plug into the step through two
hooks (`minfer.step_hooks`): grammar masks before the forward, drafts before scheduling.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from dataclasses import dataclass

import torch

from minfer.attention.grouped import hybrid_layout
from minfer.block_manager import BlockManager
from minfer.config import EngineArgs, ModelConfig, default_max_num_batched_tokens, diff_sampling_param
from minfer.detokenizer import OutputProcessor
from minfer.executor import make_executor
from minfer.kv_cache import bytes_per_block, determine_num_blocks
from minfer.kv_cache_groups import hybrid_block_manager
from minfer.memory import physical_memory_bytes
from minfer.model.gguf import gguf_cache_path
from minfer.model.sources import resolve_model
from minfer.outputs import ModelRunnerOutput, RequestMetrics, RequestOutput
from minfer.sampling_params import SamplingParams
from minfer.scheduler import Scheduler
from minfer.sequence import Sequence, validate_prompt
from minfer.step_hooks import SpecDecodeHook, StructuredOutputHook
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
    forward_time_s: float  # the model forward + sampling (a draft model's proposals count as scheduling)
    # speculative decoding (vLLM's spec_decode_* counters); zeros without speculative_config
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple = ()
    cpu_kv_cache_usage: float = 0.0  # fraction of the CPU swap space's blocks holding swapped-out KV, 0-1


def _cpu_usage(bm) -> float:
    """Used fraction of the block manager's CPU swap blocks (0 without swap space)."""
    total = getattr(bm, "num_cpu_blocks", 0) or 0
    free = getattr(bm, "cpu_free", None)
    return 0.0 if not total or free is None else 1.0 - len(free) / total


@dataclass
class ModelConfigView:
    """What callers need to know of the loaded model: its length limit, dtype, and shape (`config`)."""

    max_model_len: int
    dtype: torch.dtype
    config: ModelConfig

    @property
    def architecture(self) -> str:
        return self.config.architecture

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


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
                             metrics=self.metrics, prompt_logprobs=self.seqs[0].prompt_logprobs)


class LLMEngine:
    """The serving engine: a scheduler over a paged KV pool, driving the model one step at a time.

    Use `from_engine_args(EngineArgs(...))`. Not thread-safe: one thread calls add_request/step/abort.
    """

    def __init__(self, args: EngineArgs):
        args.verify()
        if args.data_parallel_size != 1:  # one engine is one replica; N of them are the server's (chapter 12b)
            raise ValueError(f"data_parallel_size={args.data_parallel_size}: an LLMEngine (and LLM) is one replica; "
                             "run replicas with python -m minfer.serve --data-parallel-size N")
        self.args = args
        t0 = time.perf_counter()
        self.executor = make_executor(args)  # one worker here, or one per rank (chapter 12)
        worker = self.executor.driver_worker
        cfg, self.device = worker.config, worker.device
        self.model_name = args.model
        tok_source = resolve_model(args.tokenizer) if args.tokenizer else worker.source
        cache = gguf_cache_path(tok_source.path) / "tokenizer" if tok_source.kind == "gguf" else None
        self.tokenizer: Tokenizer = load_tokenizer(tok_source, worker.eos_token_ids, cache_dir=cache)
        # vLLM's `default_sampling_params`: what a request (or `LLM.generate`) that omits a field gets
        self.default_sampling_params = diff_sampling_param(worker.source.directory, args.generation_config,
                                                           args.override_generation_config)
        max_len = args.max_model_len or cfg.max_position_embeddings
        self.model_config = ModelConfigView(max_model_len=max_len, dtype=worker.dtype, config=cfg)
        self.max_model_len = max_len
        mnbt = args.max_num_batched_tokens or default_max_num_batched_tokens(self.device.type,
                                                                             args.enable_chunked_prefill, max_len)
        if not args.enable_chunked_prefill and mnbt < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({mnbt}) is smaller than max_model_len ({max_len}): without chunked "
                "prefill a long prompt could never be scheduled. Raise it or set enable_chunked_prefill=True.")
        self.max_num_batched_tokens = mnbt
        if self.device.type == "cuda":
            self.executor.profile_forward(min(mnbt, max_len))
        # Layers mixing sliding-window and full attention (Gemma 3) get a hybrid KV cache, whose block holds
        # one layer group's K/V, not every layer's (minfer/kv_cache_groups.py).
        layout = hybrid_layout(cfg)
        pool_cfg = cfg if layout is None else layout.pool_config(cfg)
        num_blocks = determine_num_blocks(pool_cfg, args.block_size, worker.dtype, self.device,
                                          args.kv_cache_memory_bytes, args.gpu_memory_utilization, max_len,
                                          args.kv_cache_dtype)
        per_block = bytes_per_block(pool_cfg, args.block_size, worker.dtype, args.kv_cache_dtype)
        if layout is not None and num_blocks < layout.max_blocks_per_seq(max_len, args.block_size, mnbt):
            need = layout.max_blocks_per_seq(max_len, args.block_size, mnbt)
            raise ValueError(f"the KV pool has room for {num_blocks} blocks, but one sequence of max_model_len="
                             f"{max_len} tokens needs {need} across the {layout.num_groups} layer groups of this "
                             "model's hybrid KV cache. Raise kv_cache_memory_bytes or lower max_model_len.")
        num_cpu_blocks = int(args.swap_space * (1 << 30)) // per_block
        ram = physical_memory_bytes()
        if args.swap_space * (1 << 30) > ram:
            raise ValueError(f"swap_space={args.swap_space} GiB is more than this machine's memory "
                             f"({ram / (1 << 30):.1f} GiB); lower swap_space")
        model = getattr(worker, "model", None)
        if self.device.type == "cpu" and model is not None:
            # The weights, the pool and its swap space share one memory: all must fit before the pool is taken.
            weights = sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
            pool, swap = num_blocks * per_block, num_cpu_blocks * per_block
            if weights + pool + swap > ram:
                gib = 1 << 30
                raise ValueError(f"the weights ({weights / gib:.2f} GiB), the KV pool ({pool / gib:.2f} GiB) and the "
                                 f"swap space ({swap / gib:.2f} GiB) need {(weights + pool + swap) / gib:.2f} GiB, "
                                 f"more than this machine's {ram / gib:.1f} GiB: lower kv_cache_memory_bytes or "
                                 "swap_space, or quantize the weights")
        self.executor.init_kv_cache(num_blocks, num_cpu_blocks)
        if layout is None:
            self.block_manager = BlockManager(num_blocks, args.block_size, num_cpu_blocks, args.enable_prefix_caching)
        else:
            self.block_manager = hybrid_block_manager(layout, num_blocks, args.block_size, num_cpu_blocks,
                                                      args.enable_prefix_caching)
        mode = args.preemption_mode or ("swap" if num_cpu_blocks else "recompute")
        # KV behind the window is freed per sequence when EVERY layer has one (a full-attention layer reads it
        # all), and per layer group by the hybrid block manager (which applies each group's own window).
        local = [w for w in cfg.layer_windows if w is not None]
        window = max(local) if local and (layout is not None or len(local) == len(cfg.layer_windows)) else None
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, mnbt, args.enable_chunked_prefill, mode,
                                   sliding_window=window)
        self.output_processor = OutputProcessor(self.tokenizer)
        # What plugs into the step (minfer/step_hooks.py): grammars, and speculative decoding if configured.
        self.structured_hook = StructuredOutputHook(self.tokenizer, self.model_config.vocab_size)
        self.spec_decoder = self._build_spec_decoder(args, num_blocks) if args.speculative_config else None
        self.spec_hook = None if self.spec_decoder is None else SpecDecodeHook(self.spec_decoder,
                                                                               self.structured_hook)
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._prompt_tokens = self._gen_tokens = self._steps = 0
        self._sched_time = self._fwd_time = 0.0
        logger.info("loaded %s (%s) in %.1fs; KV pool %d blocks x %d tokens = %d tokens, %d bytes; attention %s",
                    args.model, worker.dtype, time.perf_counter() - t0, num_blocks, args.block_size,
                    num_blocks * args.block_size, worker.pool.nbytes, type(worker.backend).__name__)

    def _build_spec_decoder(self, args: EngineArgs, num_blocks: int):
        """The proposer of `speculative_config` (chapter 7b). A draft model gets a worker and a KV pool of its
        own with as many token slots as the target's.

        Raises:
            ValueError: a draft whose vocabulary or tokenizer is not the target's, or that is shorter-lived
                (max_position_embeddings) than max_model_len.
        """
        import dataclasses

        from minfer.spec_decode.decoder import SpecDecoder
        from minfer.spec_decode.draft_model import DraftModelProposer
        from minfer.spec_decode.ngram import NgramProposer
        from minfer.worker import Worker

        spec = args.speculative_config
        k = spec.num_speculative_tokens
        if spec.method == "ngram":
            proposer = NgramProposer(k, spec.prompt_lookup_max, spec.prompt_lookup_min)
        else:
            # The draft's quantization is its own (speculative_config's), not the target's.
            draft = Worker(dataclasses.replace(args, model=spec.model, tokenizer=None, speculative_config=None,
                                               max_model_len=self.max_model_len, quantization=spec.quantization,
                                               quantization_config=spec.quantization_config))
            target_cfg = self.model_config.config
            if draft.config.vocab_size != target_cfg.vocab_size:
                raise ValueError(f"the draft {spec.model!r} has a vocabulary of {draft.config.vocab_size} tokens, "
                                 f"the target {target_cfg.vocab_size}: a draft must share the target's tokenizer")
            try:
                draft_tok = load_tokenizer(draft.source, draft.eos_token_ids,
                                           cache_dir=gguf_cache_path(draft.source.path) / "tokenizer"
                                           if draft.source.kind == "gguf" else None)
            except (OSError, ValueError):
                draft_tok = None  # a draft without tokenizer files: the vocabulary size was checked
            if draft_tok is not None and draft_tok.hf.get_vocab() != self.tokenizer.hf.get_vocab():
                raise ValueError(f"the draft {spec.model!r} has another tokenizer than the target (same size, "
                                 "different tokens): a draft must share the target's tokenizer")
            if draft.config.max_position_embeddings < self.max_model_len:
                raise ValueError(f"the draft {spec.model!r} handles {draft.config.max_position_embeddings} "
                                 f"positions, fewer than max_model_len={self.max_model_len}")
            draft.init_kv_cache(num_blocks, 0)
            proposer = DraftModelProposer(draft, BlockManager(num_blocks, args.block_size), k)
        return SpecDecoder(spec.method, proposer, self.block_manager, k, args.max_num_seqs)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    @property
    def structured_output(self):
        """The `StructuredOutputManager` (its matchers by seq_id), or None before the first guided request."""
        return self.structured_hook.manager

    @property
    def worker(self):
        """The executor's driver worker: the model (`.model`), KV pool (`.pool`), backend, sampler."""
        return self.executor.driver_worker

    def kv_pool_info(self) -> dict:
        pool = self.worker.pool
        return dict(num_blocks=pool.num_blocks, block_size=pool.block_size,
                    num_tokens=pool.num_blocks * pool.block_size, bytes=pool.nbytes,
                    num_cpu_blocks=pool.num_cpu_blocks)

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
        validate_prompt(ids, params, self.max_model_len, self.model_config.vocab_size)
        total = len(ids) + (params.max_tokens or self.max_model_len - len(ids))
        need = self.block_manager.blocks_needed(min(total, self.max_model_len))
        if need > self.block_manager.num_total_blocks:
            raise ValueError(f"this request needs up to {need} KV blocks but the pool has "
                             f"{self.block_manager.num_total_blocks}; it could never run. Lower max_tokens or "
                             "enlarge the pool (kv_cache_memory_bytes / gpu_memory_utilization).")
        params = params.clone(_eos_token_ids=tuple(self.tokenizer.eos_token_ids))
        metrics = RequestMetrics(arrival_time=arrival_time or time.perf_counter())
        seqs = [Sequence(request_id, i, ids, params, self.max_model_len) for i in range(params.n)]
        if params.guided_decoding is not None:  # compiled now: a bad grammar raises before anything is queued
            self.structured_hook.add([s.seq_id for s in seqs], params.guided_decoding)
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
            self._retire(req.seqs)

    def _retire(self, seqs: list[Sequence]) -> None:
        """Drop what the output processor and the worker keep for finished or aborted sequences."""
        for s in seqs:
            self.output_processor.free(s)
        self.executor.release([s.seq_id for s in seqs])
        self.structured_hook.release([s.seq_id for s in seqs])
        if self.spec_hook is not None:
            self.spec_hook.release([s.seq_id for s in seqs])

    def check_health(self) -> None:
        """Raise if the executor's workers cannot run a step (`WorkerDiedError`: a parallel worker exited);
        vLLM's `check_health`. The server calls it while idle, so a death is seen without a request."""
        self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns a RequestOutput for every request that made progress (text so
        far; `finished` set on the last one). Finished requests are retired and their blocks freed."""
        # 1. schedule: who runs, how many tokens each, which blocks (drafts first: they take slots)
        t0 = time.perf_counter()
        spec = self.spec_hook
        if spec is not None:
            spec.propose(self.scheduler.running)  # drafts to verify (a draft model's forward is scheduling time)
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
            return []
        self.structured_hook.prepare(batch, speculating=spec is not None)  # grammar bitmasks
        # 2. execute: one forward and sampling on the workers
        t1 = time.perf_counter()
        output = self.executor.execute_model(batch)
        self.last_step_num_tokens = int(sum(batch.num_new_tokens))  # vLLM's iteration_tokens_total (server metric)
        t2 = time.perf_counter()
        # 3. update: computed counts and prefix-cache names, then the new tokens of each sampled row
        if spec is not None:
            spec.on_executed(batch)
        self.scheduler.finish_step(batch)
        now = time.perf_counter()
        touched = self._update(batch, output, t0, now)
        if spec is not None:
            spec.end_step(batch)
        # 4. output: a RequestOutput per request that made progress; finished ones are retired
        outputs = self._outputs(touched, now)
        self._steps += 1
        self._sched_time += (t1 - t0) + (time.perf_counter() - t2)
        self._fwd_time += t2 - t1
        return outputs

    def _update(self, batch, output: ModelRunnerOutput, t0: float, now: float) -> dict[str, _Request]:
        """Append each sampled row's new tokens to its sequence and time the requests; count prompt tokens.
        Finished sequences leave the scheduler. Returns the requests that made progress, by id."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            req = self.requests.get(seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self._prompt_tokens += n
        touched: dict[str, _Request] = {}
        logprobs, tops = output.logprobs, output.top_logprobs
        for k, j in enumerate(output.sampled_rows):
            seq = batch.seqs[j]
            emitted = self._append_tokens(seq, output.sampled_token_ids[k], logprobs[k] if logprobs else None,
                                          tops[k] if tops else None)
            if seq.spec_token_ids:  # a verified speculation: its accepted drafts become computed
                self.spec_hook.on_emitted(seq, emitted)
            req = self.requests[seq.request_id]
            if seq.index == 0:
                m = req.metrics
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
                m.token_times.append(now)
            touched[seq.request_id] = req
            if seq.is_finished:
                self.scheduler.remove(seq)
        return touched

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[float] | None, tops) -> int:
        """Append a row's new tokens (one, or a verified speculation's several) one by one, stopping where the
        sequence finishes (a stop token, a stop string, max_tokens, a complete grammar); a guided row's
        grammar advances by each. Returns how many were appended."""
        for i, t in enumerate(tokens):
            seq.append_token(t, logprobs[i] if logprobs else 0.0, tops[i] if tops else None)
            self.output_processor.process(seq)
            self._gen_tokens += 1
            self.structured_hook.accept(seq, t)
            if seq.is_finished:
                return i + 1
        return len(tokens)

    def _outputs(self, touched: dict[str, _Request], now: float) -> list[RequestOutput]:
        """A RequestOutput per request that made progress; finished requests are retired."""
        outputs = []
        for rid, req in touched.items():
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[rid]
                self._retire(req.seqs)
            outputs.append(req.output())
        return outputs

    # -- observability -------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        held = [s for s in sch.running]
        # Table entries released behind a sliding window hold nothing: count neither their slots nor tokens.
        alloc = sum(bm.num_live_blocks(s) for s in held) * bm.block_size
        used = sum(bm.num_live_tokens(s) for s in held)
        return EngineStats(
            num_running=len(sch.running), num_waiting=len(sch.waiting), num_swapped=len(sch.swapped),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_total_blocks, kv_cache_usage=bm.usage(),
            fragmentation=(alloc - used) / alloc if alloc else 0.0,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            prefix_cache_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            num_preemptions=sch.num_preemptions, num_evicted_blocks=bm.num_evicted_blocks,
            num_prompt_tokens_total=self._prompt_tokens, num_generation_tokens_total=self._gen_tokens,
            num_steps=self._steps, scheduler_time_s=self._sched_time + self.worker.build_time_s,
            forward_time_s=self._fwd_time - self.worker.build_time_s, cpu_kv_cache_usage=_cpu_usage(bm),
            **self._spec_stats())

    def _spec_stats(self) -> dict:
        if self.spec_decoder is None:
            return {}
        m = self.spec_decoder.metrics
        return dict(spec_decode_num_drafts=m.num_drafts, spec_decode_num_draft_tokens=m.num_draft_tokens,
                    spec_decode_num_accepted_tokens=m.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=tuple(m.num_accepted_tokens_per_pos))

    def all_blocks_free(self) -> bool:
        """True when no sequence holds a block (what every test checks after a run)."""
        return self.block_manager.num_free_blocks == self.block_manager.num_total_blocks
