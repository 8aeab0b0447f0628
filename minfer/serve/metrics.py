"""Prometheus metrics of the server (article §15: what to watch in production).

Names follow vLLM's `vllm:*` metrics with the prefix `minfer:`, so a vLLM Grafana dashboard needs only the
prefix changed. Each app gets its own `CollectorRegistry` (two servers in one process, e.g. in tests, do not
collide). Everything here is updated from the engine-loop thread; prometheus-client is thread-safe.

| metric | kind | source |
| --- | --- | --- |
| minfer:time_to_first_token_seconds | histogram | first token of each request |
| minfer:inter_token_latency_seconds | histogram | gaps between a request's tokens (`RequestMetrics.itl`) |
| minfer:request_time_per_output_token_seconds | histogram | TPOT of each finished request |
| minfer:e2e_request_latency_seconds | histogram | arrival to finish |
| minfer:num_requests_running / _waiting / _swapped | gauge | `engine.stats()` |
| minfer:kv_cache_usage_perc | gauge | used KV blocks / all KV blocks (0-1) |
| minfer:cpu_cache_usage_perc | gauge | used CPU swap-space KV blocks / all of them (0-1; 0 without swap space) |
| minfer:kv_cache_fragmentation_perc | gauge | unused slots inside allocated blocks (0-1) |
| minfer:num_free_kv_blocks / minfer:num_total_kv_blocks | gauge | the paged pool |
| minfer:prefix_cache_queries / _hits | counter | prompt tokens looked up / found in the prefix cache |
| minfer:num_preemptions | counter | sequences preempted (KV pool full) |
| minfer:num_evicted_blocks | counter | cached blocks evicted from the prefix cache |
| minfer:prompt_tokens / minfer:generation_tokens | counter | tokens prefilled / generated |
| minfer:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens | counter | speculative decoding: verification rounds, tokens proposed, accepted |
| minfer:spec_decode_num_accepted_tokens_per_pos | counter | accepted drafts by position (label position, 0-based) |
| minfer:request_success | counter | finished requests, label finished_reason (stop, length, abort) |
| minfer:request_errors | counter | rejected requests, label status (400, 401, 404, 500) |
| minfer:time_per_output_token_seconds | histogram | gaps between a request's tokens (vLLM's older name of the ITL) |
| minfer:request_queue_time_seconds | histogram | arrival to first scheduled (waiting) |
| minfer:request_prefill_time_seconds | histogram | first scheduled to first token |
| minfer:request_decode_time_seconds | histogram | first token to finish |
| minfer:request_inference_time_seconds | histogram | first scheduled to finish |
| minfer:request_prompt_tokens / minfer:request_generation_tokens | histogram | tokens per finished request |
| minfer:request_max_num_generation_tokens | histogram | per request: the most tokens any of its sequences generated |
| minfer:request_params_n / minfer:request_params_max_tokens | histogram | per request: its `n`, its `max_tokens` (as run, a default filled in) |
| minfer:iteration_tokens_total | histogram | tokens (prefill + decode) per engine step |
| minfer:cache_config_info | gauge (1) | the KV cache's settings, as labels (block_size, num_gpu_blocks, ...) |
| minfer:avg_prompt_throughput_toks_per_s / minfer:avg_generation_throughput_toks_per_s | gauge | tokens/s over the last ~10 s |
| minfer:engine_step_errors | counter | engine steps that raised (their requests failed, the loop went on) |
| minfer:request_fallbacks | counter | fallbacks applied, label kind (shed, timeout, truncate_prompt_tokens, max_tokens_capped), each exported from 0 |

Counters are exported with the `_total` suffix (`minfer:prompt_tokens_total`), as prometheus-client does and as
vLLM's are (its Counter "vllm:prefix_cache_hits" is scraped as `vllm:prefix_cache_hits_total`); a labelled
counter is exported only once a label set exists, so every `kind` of the fallbacks is created at 0.

Every series is exported twice: as `minfer:NAME` and as `vllm:NAME` (the same samples, renamed at export,
`render`, with vLLM's `engine` label, "0": one engine per server), so a dashboard built for vLLM works
unchanged; `vllm:gpu_cache_usage_perc` (vLLM's older name of `kv_cache_usage_perc`) is exported too.

The HTTP metrics of vLLM's front end (`http_requests_total`, `http_request_duration_seconds`,
`http_request_size_bytes`, ... by handler, method and status) come from prometheus-fastapi-instrumentator, as in
vLLM, registered in the same registry (`instrument_http`).
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

# Buckets as vLLM's (seconds), extended down for a small model on a fast machine.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)

# vLLM's buckets for token counts per request and per step
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's buckets of request_params_n
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
THROUGHPUT_WINDOW_S = 10.0  # the avg_*_throughput gauges average over this much time

# engine.stats() field -> counter attribute (cumulative in the engine; exported as increments)
_COUNTER_FIELDS = {
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "num_evicted_blocks": "num_evicted_blocks",
    "num_prompt_tokens_total": "prompt_tokens",
    "num_generation_tokens_total": "generation_tokens",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
}


# The `kind` label of minfer:request_fallbacks (chapter 15's fallbacks, `fallbacks.py`): a request refused by
# --max-waiting-requests, ended by its time limit, its prompt cut by truncate_prompt_tokens, its max_tokens
# capped under KV pressure
FALLBACK_KINDS = ("shed", "timeout", "truncate_prompt_tokens", "max_tokens_capped")

# Series the API server observes per request (not the engine): a data-parallel router keeps them itself
API_SERVER_SERIES = ("minfer:request_errors", "minfer:request_fallbacks", "minfer:request_params_n",
                     "minfer:request_params_max_tokens", "minfer:request_max_num_generation_tokens")


class RequestParamsMetrics:
    """The per-request series of vLLM's front end (`request_params_n`, `request_params_max_tokens`,
    `request_max_num_generation_tokens`) and the HTTP metrics; shared by `ServerMetrics` and the
    data-parallel router's `router.DPMetrics`."""

    def _init_request_params(self, registry: CollectorRegistry, model_name: str) -> None:
        def hist(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        self.request_max_generation_tokens = hist("minfer:request_max_num_generation_tokens",
                                                  "Most tokens generated by one sequence of a finished request.",
                                                  TOKEN_BUCKETS)
        self.request_params_n = hist("minfer:request_params_n", "The n of each request.", N_BUCKETS)
        self.request_params_max_tokens = hist("minfer:request_params_max_tokens", "The max_tokens of each request.",
                                              TOKEN_BUCKETS)

    def observe_request_params(self, n: int, max_tokens: int | None) -> None:
        """A request admitted with `n` sequences per prompt and `max_tokens` (None: not counted)."""
        self.request_params_n.observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)

    def observe_max_generation_tokens(self, num_tokens: int) -> None:
        """A finished request whose longest sequence generated `num_tokens` tokens."""
        self.request_max_generation_tokens.observe(num_tokens)

    def instrument_http(self, app) -> None:
        """Count `app`'s HTTP requests in this registry (prometheus-fastapi-instrumentator, as vLLM does):
        `http_requests_total`, `http_request_duration_seconds`, ... by handler, method and status (the
        scrape route itself left out)."""
        from prometheus_fastapi_instrumentator import Instrumentator

        Instrumentator(excluded_handlers=["/metrics"], registry=self.registry).instrument(app)


class ServerMetrics(RequestParamsMetrics):
    """The server's Prometheus metrics, in a registry of their own.

    Args:
        model_name: value of the `model_name` label on every metric.
        registry: where to register; a new `CollectorRegistry` when None.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, lbl = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, lbl, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, lbl, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, lbl, registry=r).labels(model_name)

        self.ttft = hist("minfer:time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS)
        self.itl = hist("minfer:inter_token_latency_seconds", "Time between consecutive tokens (s).", ITL_BUCKETS)
        self.tpot = hist("minfer:request_time_per_output_token_seconds",
                         "Mean time per output token of a finished request (s).", ITL_BUCKETS)
        self.e2e = hist("minfer:e2e_request_latency_seconds", "Request latency, arrival to finish (s).",
                        E2E_BUCKETS)
        self.num_running = gauge("minfer:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("minfer:num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("minfer:num_requests_swapped", "Requests swapped out to CPU memory.")
        self.kv_usage = gauge("minfer:kv_cache_usage_perc", "KV-cache usage, 0-1 (1 = all blocks in use).")
        self.cpu_kv_usage = gauge("minfer:cpu_cache_usage_perc",
                                  "CPU swap-space KV-cache usage, 0-1 (0 without swap space).")
        self.kv_fragmentation = gauge("minfer:kv_cache_fragmentation_perc",
                                      "Unused token slots inside allocated KV blocks, 0-1.")
        self.free_blocks = gauge("minfer:num_free_kv_blocks", "Free KV blocks.")
        self.total_blocks = gauge("minfer:num_total_kv_blocks", "KV blocks in the pool.")
        self.prefix_cache_queries = counter("minfer:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("minfer:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("minfer:num_preemptions", "Sequences preempted because the KV pool was full.")
        self.num_evicted_blocks = counter("minfer:num_evicted_blocks", "Cached KV blocks evicted.")
        self.prompt_tokens = counter("minfer:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("minfer:generation_tokens", "Tokens generated.")
        self.spec_decode_num_drafts = counter("minfer:spec_decode_num_drafts",
                                              "Speculative decoding: verification rounds (one per sequence and step).")
        self.spec_decode_num_draft_tokens = counter("minfer:spec_decode_num_draft_tokens",
                                                    "Speculative decoding: draft tokens proposed.")
        self.spec_decode_num_accepted_tokens = counter("minfer:spec_decode_num_accepted_tokens",
                                                       "Speculative decoding: draft tokens accepted.")
        self._spec_per_pos = Counter("minfer:spec_decode_num_accepted_tokens_per_pos",
                                     "Speculative decoding: accepted draft tokens by position (0-based).",
                                     ["model_name", "position"], registry=r)
        self._success = Counter("minfer:request_success", "Finished requests.", ["model_name", "finished_reason"],
                                registry=r)
        self._errors = Counter("minfer:request_errors", "Requests rejected with an error status.",
                               ["model_name", "status"], registry=r)
        self.tpot_legacy = hist("minfer:time_per_output_token_seconds",
                                "Time between consecutive tokens (s); vLLM's older name of the ITL.", ITL_BUCKETS)
        self.queue_time = hist("minfer:request_queue_time_seconds", "Arrival to first scheduled (s).", E2E_BUCKETS)
        self.prefill_time = hist("minfer:request_prefill_time_seconds", "First scheduled to first token (s).",
                                 E2E_BUCKETS)
        self.decode_time = hist("minfer:request_decode_time_seconds", "First token to finish (s).", E2E_BUCKETS)
        self.inference_time = hist("minfer:request_inference_time_seconds", "First scheduled to finish (s).",
                                   E2E_BUCKETS)
        self.request_prompt_tokens = hist("minfer:request_prompt_tokens", "Prompt tokens of a finished request.",
                                          TOKEN_BUCKETS)
        self.request_generation_tokens = hist("minfer:request_generation_tokens",
                                              "Generated tokens of a finished request.", TOKEN_BUCKETS)
        self._init_request_params(r, model_name)
        self.iteration_tokens = hist("minfer:iteration_tokens_total", "Tokens (prefill + decode) in one engine step.",
                                     ITERATION_BUCKETS)
        self.prompt_throughput = gauge("minfer:avg_prompt_throughput_toks_per_s",
                                       f"Prompt tokens prefilled per second, over the last {THROUGHPUT_WINDOW_S:g} s.")
        self.generation_throughput = gauge("minfer:avg_generation_throughput_toks_per_s",
                                           f"Tokens generated per second, over the last {THROUGHPUT_WINDOW_S:g} s.")
        self.step_errors = counter("minfer:engine_step_errors", "Engine steps that raised (their requests failed).")
        self._fallbacks = Counter("minfer:request_fallbacks", "Fallbacks applied (fallbacks.py).",
                                  ["model_name", "kind"], registry=r)
        for kind in FALLBACK_KINDS:  # exported at 0 from the start: a dashboard's series exists before the first
            self._fallbacks.labels(model_name, kind)
        self._cache_config: Gauge | None = None
        self._totals: deque = deque()  # (time, prompt tokens total, generation tokens total)
        self._last: dict[str, float] = {}

    # --- updates -------------------------------------------------------------------------------------------
    def update_from_stats(self, stats) -> None:
        """Set gauges and advance counters from one `engine.stats()` snapshot (any object with its fields)."""
        g = lambda name, default=0: getattr(stats, name, default) or 0  # noqa: E731
        self.num_running.set(g("num_running"))
        self.num_waiting.set(g("num_waiting"))
        self.num_swapped.set(g("num_swapped"))
        self.kv_usage.set(g("kv_cache_usage"))
        self.cpu_kv_usage.set(g("cpu_kv_cache_usage"))
        self.kv_fragmentation.set(g("fragmentation"))
        self.free_blocks.set(g("num_free_blocks"))
        self.total_blocks.set(g("num_total_blocks"))
        for field, attr in _COUNTER_FIELDS.items():
            value = g(field)
            delta = value - self._last.get(field, 0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last[field] = max(value, self._last.get(field, 0))
        self._update_throughput(g("num_prompt_tokens_total"), g("num_generation_tokens_total"))
        for pos, value in enumerate(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", ()) or ()):
            key = f"spec_per_pos_{pos}"
            delta = value - self._last.get(key, 0)
            if delta > 0:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(delta)
            self._last[key] = max(value, self._last.get(key, 0))

    def _update_throughput(self, prompt_total: float, gen_total: float) -> None:
        """The avg_*_throughput gauges: token counters' growth over the last THROUGHPUT_WINDOW_S seconds."""
        now = time.monotonic()
        self._totals.append((now, prompt_total, gen_total))
        while len(self._totals) > 2 and now - self._totals[1][0] >= THROUGHPUT_WINDOW_S:
            self._totals.popleft()
        t0, p0, g0 = self._totals[0]
        span = now - t0
        if span > 0:
            self.prompt_throughput.set(max(0.0, prompt_total - p0) / span)
            self.generation_throughput.set(max(0.0, gen_total - g0) / span)

    def observe_first_token(self, ttft: float) -> None:
        self.ttft.observe(max(0.0, ttft))

    def observe_iteration(self, num_tokens: int | None) -> None:
        """One engine step of `num_tokens` tokens (prefill + decode); None: unknown (not counted)."""
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)

    def count_step_error(self) -> None:
        self.step_errors.inc()

    def count_fallback(self, kind: str) -> None:
        self._fallbacks.labels(self.model_name, kind).inc()

    def set_cache_config(self, info: dict) -> None:
        """`minfer:cache_config_info` = 1 with the KV cache's settings as labels (vLLM's `cache_config_info`)."""
        labels = {k: str(v) for k, v in sorted(info.items()) if isinstance(v, (int, float, str, bool)) or v is None}
        if self._cache_config is None:
            self._cache_config = Gauge("minfer:cache_config_info", "The KV cache's settings (labels); value 1.",
                                       ["model_name", *labels], registry=self.registry)
        self._cache_config.labels(self.model_name, *labels.values()).set(1)

    def observe_finished(self, finish_reason: str | None, itl: list[float], tpot: float | None,
                         e2e: float | None, phases: list | tuple | None = None, num_prompt_tokens: int | None = None,
                         num_generation_tokens: int | None = None) -> None:
        """A request ended. `phases`: (queue, prefill, decode, inference) seconds (`phase_times`), or None."""
        for gap in itl:
            self.itl.observe(max(0.0, gap))
            self.tpot_legacy.observe(max(0.0, gap))
        if phases:
            for hist_, value in zip((self.queue_time, self.prefill_time, self.decode_time, self.inference_time),
                                    phases):
                if value is not None:
                    hist_.observe(max(0.0, value))
        if num_prompt_tokens is not None and finish_reason != "abort":
            self.request_prompt_tokens.observe(num_prompt_tokens)
        if num_generation_tokens is not None and finish_reason != "abort":
            self.request_generation_tokens.observe(num_generation_tokens)
        if tpot is not None:
            self.tpot.observe(max(0.0, tpot))
        if e2e is not None:
            self.e2e.observe(max(0.0, e2e))
        self._success.labels(self.model_name, finish_reason or "abort").inc()

    def count_error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    # --- export --------------------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition: every `minfer:` series, then the same as
        `vllm:`."""
        return generate_latest(_WithVllmNames(self.registry)), CONTENT_TYPE_LATEST


def phase_times(m) -> list | None:
    """(queue, prefill, decode, inference) seconds of a finished request's `RequestMetrics`, as vLLM splits a
    request: arrival -> first scheduled -> first token -> finished; None where a timestamp is missing."""
    if m is None:
        return None
    arrival, sched = m.arrival_time, getattr(m, "first_scheduled_time", None)
    first, end = m.first_token_time, m.finished_time or m.last_token_time

    def span(a, b):
        return None if a is None or b is None else b - a

    return [span(arrival, sched), span(sched, first), span(first, end), span(sched, end)]


_VLLM_EXTRA = {"minfer:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc"}  # vLLM's older names, also exported


def _renamed(family, name: str, old: str):
    """`family` as `name`, each sample with vLLM's `engine` label: the engine's index, its data-parallel rank
    (a router's `replica`), else "0". The labels are sorted, as prometheus-client writes its own."""
    out = Metric(name, family.documentation, family.type, family.unit)
    out.samples = [s._replace(name=name + s.name[len(old):],
                              labels=dict(sorted({**s.labels, "engine": s.labels.get("replica", "0")}.items())))
                   for s in family.samples]
    return out


class _WithVllmNames:
    """A registry view whose `collect` yields each family and then its `vllm:` copy."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        families = list(self.registry.collect())
        yield from families
        for fam in families:
            if fam.name.startswith("minfer:"):
                yield _renamed(fam, "vllm:" + fam.name[len("minfer:"):], fam.name)
                if fam.name in _VLLM_EXTRA:
                    yield _renamed(fam, _VLLM_EXTRA[fam.name], fam.name)
