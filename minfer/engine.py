"""`LLMEngine`: requests in, tokens out, one scheduling step at a time (vLLM's engine, in small).

    add_request ─► Scheduler.schedule ─► executor.execute_model ─► Sequence.append_token ─► OutputProcessor
     (tokenize)    (who runs, which blocks)   (worker: one forward       (stop ids, length)    (detokenize,
                                               + sampling: a                                     stop strings)
                                               ModelRunnerOutput)

The engine is the tokenizer, the scheduler (with its block manager) and an executor; the executor's worker
holds the model, the KV pool, the attention backend and the sampler (`minfer.worker`), and turns each
`ScheduledBatch` into one forward. Features that act inside the step attach from outside as engine
extensions (`minfer.extensions`); with default settings there are none.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minfer.config import EngineArgs, ModelConfig, default_max_num_batched_tokens, diff_sampling_param
from minfer.detokenizer import OutputProcessor
from minfer.executor import make_executor
from minfer.extensions import EngineExtension, build_extension
from minfer.kv_cache_plan import plan_kv_cache
from minfer.model.gguf import gguf_cache_path
from minfer.model.sources import resolve_model
from minfer.outputs import EngineStats, ModelRunnerOutput, RequestMetrics, RequestOutput, engine_stats
from minfer.sampling_params import SamplingParams
from minfer.scheduler import Scheduler
from minfer.sequence import Sequence, validate_prompt
from minfer.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from minfer.worker import Worker

logger = logging.getLogger("minfer.engine")


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
        # The pool's size, its block manager (one block table per layer group) and the preemption mode.
        plan = plan_kv_cache(args, cfg, worker.dtype, self.device, getattr(worker, "model", None), max_len, mnbt)
        self.executor.init_kv_cache(plan.num_blocks, plan.num_cpu_blocks)
        self.block_manager = plan.block_manager
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, mnbt, args.enable_chunked_prefill,
                                   plan.preemption, sliding_window=plan.sliding_window)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = self.num_generation_tokens = self.num_steps = 0
        self.scheduler_time_s = self.forward_time_s = 0.0
        # What plugs into the step from outside (minfer/extensions.py): those the settings name now, and those
        # a request names when it arrives.
        self.extensions: dict[str, EngineExtension] = {}
        for name in args.extensions:
            self.extension(name)
        logger.info("loaded %s (%s) in %.1fs; KV pool %d blocks x %d tokens = %d tokens, %d bytes; attention %s",
                    args.model, worker.dtype, time.perf_counter() - t0, plan.num_blocks, args.block_size,
                    plan.num_blocks * args.block_size, worker.pool.nbytes, type(worker.backend).__name__)

    def extension(self, name: str) -> EngineExtension:
        """The engine extension called `name` (`minfer.extensions`), attached on first use."""
        ext = self.extensions.get(name)
        if ext is None:
            ext = self.extensions[name] = build_extension(name, self)
        return ext

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    @property
    def worker(self) -> "Worker":
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
        for name in params.extensions:  # e.g. a grammar, compiled now: a bad one raises before anything is queued
            self.extension(name).add_request(seqs, params)
        self.requests[request_id] = _Request(request_id, text, ids, seqs, metrics)
        for s in seqs:
            self.scheduler.add(s)
        return request_id

    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
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
        seq_ids = [s.seq_id for s in seqs]
        self.executor.release(seq_ids)
        for ext in self.extensions.values():
            ext.release(seq_ids)

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
        exts = self.extensions.values()
        # 1. schedule: who runs, how many tokens each, which blocks
        t0 = time.perf_counter()
        for ext in exts:
            ext.before_schedule(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
            return []
        for ext in exts:
            ext.before_forward(batch)
        # 2. execute: one forward and sampling on the workers
        t1 = time.perf_counter()
        output = self.executor.execute_model(batch)
        self.last_step_num_tokens = int(sum(batch.num_new_tokens))  # vLLM's iteration_tokens_total (server metric)
        t2 = time.perf_counter()
        # 3. update: computed counts and prefix-cache names, then the new tokens of each sampled row
        for ext in exts:
            ext.after_forward(batch)
        self.scheduler.finish_step(batch)
        now = time.perf_counter()
        touched = self._update(batch, output, t0, now)
        for ext in exts:
            ext.end_step(batch)
        # 4. output: a RequestOutput per request that made progress; finished ones are retired
        outputs = self._outputs(touched, now)
        self.num_steps += 1
        self.scheduler_time_s += (t1 - t0) + (time.perf_counter() - t2)
        self.forward_time_s += t2 - t1
        return outputs

    def _update(self, batch, output: ModelRunnerOutput, t0: float, now: float) -> dict[str, _Request]:
        """Append each sampled row's new tokens to its sequence and time the requests; count prompt tokens.
        Finished sequences leave the scheduler. Returns the requests that made progress, by id."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            req = self.requests.get(seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.num_prompt_tokens += n
        touched: dict[str, _Request] = {}
        logprobs, tops = output.logprobs, output.top_logprobs
        for k, j in enumerate(output.sampled_rows):
            seq = batch.seqs[j]
            emitted = self._append_tokens(seq, output.sampled_token_ids[k], logprobs[k] if logprobs else None,
                                          tops[k] if tops else None)
            for ext in self.extensions.values():
                ext.on_row(seq, emitted)
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
        sequence finishes (a stop token, a stop string, max_tokens, or an extension's rule); the extensions
        see each. Returns how many were appended."""
        for i, t in enumerate(tokens):
            seq.append_token(t, logprobs[i] if logprobs else 0.0, tops[i] if tops else None)
            self.output_processor.process(seq)
            self.num_generation_tokens += 1
            for ext in self.extensions.values():
                ext.on_token(seq, t)
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
        """Queues, KV pool, prefix cache, preemptions and timings (`minfer.outputs.EngineStats`)."""
        return engine_stats(self)

    def all_blocks_free(self) -> bool:
        """True when no sequence holds a block (what every test checks after a run)."""
        return self.block_manager.num_free_blocks == self.block_manager.num_total_blocks
