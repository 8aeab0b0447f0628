"""What a step and a request return: the worker's `ModelRunnerOutput` (vLLM v1's), and vLLM's `RequestOutput` /
`CompletionOutput` for callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    """What a worker returns for one step (vLLM v1's `ModelRunnerOutput`): the tokens of the rows that sampled.

    Every per-row field is indexed like `sampled_rows` (k-th entry: batch row `sampled_rows[k]`) and holds a
    list per row, one entry per emitted token: one token for an ordinary row, 1 to k + 1 for a row whose k
    speculative drafts were verified (the accepted drafts plus one token, chapter 7b). It is plain data, so
    the parallel executor pickles it from the output rank to the driver.

    Attributes:
        sampled_rows: indices into `ScheduledBatch.seqs` of the rows whose prompt is complete after this
            step, ascending; a row still in its prompt (chunked prefill) samples nothing.
        sampled_token_ids: per sampled row, its new token ids.
        logprobs: per sampled row, each new token's logprob under the raw logits (natural log, float); None
            when no row of the batch asked for logprobs.
        top_logprobs: per sampled row, each new token's {token id: logprob} of the `logprobs` most likely
            tokens plus the chosen one (None for a row that asked for none); None as `logprobs`.
        prompt_logprobs: {seq_id: that sequence's prompt logprobs so far} for the rows that asked for
            `prompt_logprobs` (the driver copies them onto its own `Sequence`s).
    """

    sampled_rows: list[int] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[dict[int, float] | None]] | None = None
    prompt_logprobs: dict[int, list] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    Attributes:
        index: which of the n completions this is.
        text: the generated text so far (stop string removed unless asked to keep it).
        token_ids: generated token ids so far.
        finish_reason: None while running, then "stop" (EOS, stop id or stop string), "length"
            (max_tokens or max_model_len reached) or "abort".
        stop_reason: the stop string or token id that matched, if any.
        logprobs: per generated token, a dict {token_id: logprob} of the top-`logprobs` tokens plus the
            chosen one (natural log), or None when not asked for.
        cumulative_logprob: sum of the chosen tokens' logprobs.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its `n` completions.

    `LLM.generate` returns finished ones; `LLMEngine.step` returns one per request that made progress, with
    the full text so far (streaming callers diff it against what they already sent).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: "RequestMetrics | None" = None
    # vLLM's prompt_logprobs: per prompt token, {token id: logprob, top alternatives...}; the first is None.
    prompt_logprobs: "list[dict[int, float] | None] | None" = None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps of one request (seconds, `time.perf_counter()` clock).

    TTFT = first_token_time - arrival_time; TPOT = (last_token_time - first_token_time) / (tokens - 1);
    ITL are the gaps between consecutive token times.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) / (len(t) - 1)

    @property
    def e2e(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's `BeamSearchSequence`).

    Attributes:
        tokens: prompt + generated token ids. output_token_ids: the generated ones (EOS included if it ended
            the beam). logprobs: per generated token, its log-probability (after temperature).
        cum_logprob: their sum. score: cum_logprob / len(output_token_ids) ** length_penalty (transformers'
            `sequences_scores`); beams are returned best score first.
        text: the generated text. finish_reason: "stop" (EOS) or "length".
    """

    tokens: list[int]
    output_token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (vLLM's `BeamSearchOutput`)."""

    sequences: list[BeamSearchSequence]


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


def engine_stats(engine) -> EngineStats:
    """`LLMEngine.stats()`: a snapshot of its scheduler, block manager, counters and extensions."""
    bm, sch = engine.block_manager, engine.scheduler
    held = list(sch.running)
    # Table entries released behind a sliding window hold nothing: count neither their slots nor tokens.
    alloc = sum(bm.num_live_blocks(s) for s in held) * bm.block_size
    used = sum(bm.num_live_tokens(s) for s in held)
    extra: dict = {}
    for ext in engine.extensions.values():
        extra.update(ext.stats())
    return EngineStats(
        num_running=len(sch.running), num_waiting=len(sch.waiting), num_swapped=len(getattr(sch.preemption, "swapped", ())),
        num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_total_blocks, kv_cache_usage=bm.usage(),
        fragmentation=(alloc - used) / alloc if alloc else 0.0,
        prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
        prefix_cache_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
        num_preemptions=sch.num_preemptions, num_evicted_blocks=bm.num_evicted_blocks,
        num_prompt_tokens_total=engine.num_prompt_tokens, num_generation_tokens_total=engine.num_generation_tokens,
        num_steps=engine.num_steps, scheduler_time_s=engine.scheduler_time_s + engine.worker.build_time_s,
        forward_time_s=engine.forward_time_s - engine.worker.build_time_s, cpu_kv_cache_usage=_cpu_usage(bm),
        **extra)


def _cpu_usage(bm) -> float:
    """Used fraction of the block manager's CPU swap blocks (0 without swap space)."""
    total = getattr(bm, "num_cpu_blocks", 0) or 0
    free = getattr(bm, "cpu_free", None)
    return 0.0 if not total or free is None else 1.0 - len(free) / total
