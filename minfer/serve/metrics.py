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

Counters are exported with the `_total` suffix (`minfer:prompt_tokens_total`), as prometheus-client does.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets as vLLM's (seconds), extended down for a small model on a fast machine.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)

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


class ServerMetrics:
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
        self._last: dict[str, float] = {}

    # --- updates -------------------------------------------------------------------------------------------
    def update_from_stats(self, stats) -> None:
        """Set gauges and advance counters from one `engine.stats()` snapshot (any object with its fields)."""
        g = lambda name, default=0: getattr(stats, name, default) or 0  # noqa: E731
        self.num_running.set(g("num_running"))
        self.num_waiting.set(g("num_waiting"))
        self.num_swapped.set(g("num_swapped"))
        self.kv_usage.set(g("kv_cache_usage"))
        self.kv_fragmentation.set(g("fragmentation"))
        self.free_blocks.set(g("num_free_blocks"))
        self.total_blocks.set(g("num_total_blocks"))
        for field, attr in _COUNTER_FIELDS.items():
            value = g(field)
            delta = value - self._last.get(field, 0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last[field] = max(value, self._last.get(field, 0))
        for pos, value in enumerate(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", ()) or ()):
            key = f"spec_per_pos_{pos}"
            delta = value - self._last.get(key, 0)
            if delta > 0:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(delta)
            self._last[key] = max(value, self._last.get(key, 0))

    def observe_first_token(self, ttft: float) -> None:
        self.ttft.observe(max(0.0, ttft))

    def observe_finished(self, finish_reason: str | None, itl: list[float], tpot: float | None,
                         e2e: float | None) -> None:
        for gap in itl:
            self.itl.observe(max(0.0, gap))
        if tpot is not None:
            self.tpot.observe(max(0.0, tpot))
        if e2e is not None:
            self.e2e.observe(max(0.0, e2e))
        self._success.labels(self.model_name, finish_reason or "abort").inc()

    def count_error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    # --- export --------------------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
