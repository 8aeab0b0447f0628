"""Data-parallel replicas behind one API server: a router over N engine clients (article §6-1 and §14).

A replica is a whole copy of the model in an engine process of its own (`engine_client.MPEngineClient`, the
same client a one-engine server uses; each replica may itself be tensor-parallel). Replicas share nothing:
each has its own KV pool, its own prefix cache and its own scheduler, so N replicas serve about N times the
requests when each has hardware of its own, and a request's KV lives on exactly one of them. vLLM calls this
data parallelism (`--data-parallel-size`); its `DPLBAsyncMPClient` balances in the API process, and the
`vllm-router` package does the same in front of several servers.

`DPEngineClient` has the interface of one engine client (`add`, `abort`, `start`, `stop`, `alive`, the
statistics; see `engine_client.py`), so the routes and `RequestGroup` do not know there are several. Each
`add` asks a routing policy for a replica:

| policy | picks | good for |
| --- | --- | --- |
| `round_robin` | replicas in turn | equal requests; the baseline |
| `least_outstanding` | the replica with the fewest unfinished requests (ties: the lowest index) | requests of very different lengths |
| `prefix_aware` | the replica that got the same first `num_prefix_blocks` blocks of prompt tokens before | shared system prompts: their KV blocks are cached on that replica |

`prefix_aware` is the idea of SGLang's cache-aware router and of vllm-router's `cache_aware`/`consistent_hash`
policies, in its simplest form: a hash of the prompt's first full KV blocks (the blocks the prefix cache
would find, chapter 11) keys a table of which replica had them; a key seen for the first time goes to the
least-loaded replica; a known key goes back to its replica unless that one has `max_imbalance` more
unfinished requests than the least-loaded one (then cache hits are worth less than the wait). A prompt
shorter than one block has nothing cacheable and is routed by load.

The outstanding count of a replica is kept here: a request counts from its `add` until its last output,
error, fatal event or abort, seen by a small tap on its event queue.

A replica that dies fails its requests in flight with an error event (its client sees the process exit),
`alive` turns False so /health answers 503, and new requests go only to the live replicas (503 when none
is left). `/metrics` is the replicas' metrics with a `replica="i"` label on every series.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from minfer.serve.metrics import API_SERVER_SERIES, FALLBACK_KINDS, RequestParamsMetrics, ServerMetrics, _WithVllmNames
from minfer.serve.protocol import APIError

logger = logging.getLogger("minfer.serve")

ROUTER_POLICIES = ("round_robin", "least_outstanding", "prefix_aware")


def num_replicas(num_gpus: int, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> int:
    """How many whole-model replicas `num_gpus` devices make when each replica uses TP x PP of them (§14).

    Raises:
        ValueError: a size < 1, or `num_gpus` not a multiple of TP x PP (devices would sit idle).
    """
    for name, v in (("num_gpus", num_gpus), ("tensor_parallel_size", tensor_parallel_size),
                    ("pipeline_parallel_size", pipeline_parallel_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    per_replica = tensor_parallel_size * pipeline_parallel_size
    if num_gpus % per_replica:
        raise ValueError(f"{num_gpus} GPUs do not split into replicas of TP x PP = {per_replica} GPUs")
    return num_gpus // per_replica


# ----------------------------------------------------------------------------------------------------------
# Routing policies: (prompt token ids, load per replica, live replicas) -> replica index
# ----------------------------------------------------------------------------------------------------------
class RoundRobinPolicy:
    """Replicas in turn, skipping dead ones."""

    name = "round_robin"

    def __init__(self):
        self._next = 0

    def choose(self, prompt, load: list[int], live: list[int]) -> int:
        n = len(load)
        for k in range(n):
            i = (self._next + k) % n
            if i in live:
                self._next = i + 1
                return i
        raise LookupError("no live replica")


class LeastOutstandingPolicy:
    """The live replica with the fewest unfinished requests; ties go to the lowest index."""

    name = "least_outstanding"

    def choose(self, prompt, load: list[int], live: list[int]) -> int:
        if not live:
            raise LookupError("no live replica")
        return min(live, key=lambda i: (load[i], i))


def prefix_key(prompt, block_size: int, num_prefix_blocks: int) -> bytes | None:
    """A digest of the prompt's first `min(num_prefix_blocks, full blocks)` blocks of token ids.

    Args:
        prompt: token ids (list of int); a string (not tokenized) gives None.
        block_size: tokens per KV block (the engine's `block_size`).
        num_prefix_blocks: most blocks to hash (>= 1).

    Returns:
        16 bytes (BLAKE2b), or None when the prompt has no full block (nothing the prefix cache could hold).
    """
    if isinstance(prompt, str):
        return None
    n = min(num_prefix_blocks, len(prompt) // block_size) * block_size
    if n == 0:
        return None
    try:
        data = array("q", prompt[:n]).tobytes()  # one C loop, not one per token
    except (OverflowError, TypeError):  # not token ids: routed by load, and the engine refuses it clearly
        return None
    return hashlib.blake2b(data, digest_size=16).digest()


class PrefixAwarePolicy:
    """Route a prompt to the replica that got its first blocks before (see the module docstring).

    Args:
        block_size: tokens per KV block (the engine's).
        num_prefix_blocks: blocks of the prompt the key covers (2 x 16 = 32 tokens by default: long enough to
            tell system prompts apart after the chat template's first tokens, short enough to end inside them).
        max_imbalance: unfinished requests a known key's replica may have beyond the least-loaded one before
            the request goes to the least-loaded one instead (the key keeps its replica).
        max_entries: keys remembered (least recently used ones are forgotten first).
    """

    name = "prefix_aware"

    def __init__(self, block_size: int = 16, num_prefix_blocks: int = 2, max_imbalance: int = 8,
                 max_entries: int = 1 << 16):
        if block_size < 1 or num_prefix_blocks < 1 or max_imbalance < 0 or max_entries < 1:
            raise ValueError("prefix_aware needs block_size >= 1, num_prefix_blocks >= 1, max_imbalance >= 0 "
                             "and max_entries >= 1")
        self.block_size, self.num_prefix_blocks = block_size, num_prefix_blocks
        self.max_imbalance, self.max_entries = max_imbalance, max_entries
        self._table: OrderedDict[bytes, int] = OrderedDict()
        self._keys_per_replica: dict[int, int] = {}

    def choose(self, prompt, load: list[int], live: list[int]) -> int:
        if not live:
            raise LookupError("no live replica")
        # least loaded; among equals the one holding fewest keys, so new prefixes spread over the replicas
        least = min(live, key=lambda i: (load[i], self._keys_per_replica.get(i, 0), i))
        key = prefix_key(prompt, self.block_size, self.num_prefix_blocks)
        if key is None:
            return least
        owner = self._table.get(key)
        if owner is None or owner not in live:
            self._assign(key, least)
            return least
        self._table.move_to_end(key)
        return least if load[owner] > load[least] + self.max_imbalance else owner

    def _assign(self, key: bytes, replica: int) -> None:
        old = self._table.pop(key, None)
        if old is not None:
            self._keys_per_replica[old] -= 1
        self._table[key] = replica
        self._keys_per_replica[replica] = self._keys_per_replica.get(replica, 0) + 1
        while len(self._table) > self.max_entries:
            _, gone = self._table.popitem(last=False)
            self._keys_per_replica[gone] -= 1


def make_policy(name: str, block_size: int = 16):
    """A policy object by name (one of `ROUTER_POLICIES`); ValueError for another name."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_outstanding":
        return LeastOutstandingPolicy()
    if name == "prefix_aware":
        return PrefixAwarePolicy(block_size=block_size)
    raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}; got {name!r}")


# ----------------------------------------------------------------------------------------------------------
# Metrics: every replica's series with a replica label, plus the router's own
# ----------------------------------------------------------------------------------------------------------
class _ReplicaCollector:
    """A prometheus-client collector: the families of each replica's registry, with `replica="i"` added."""

    def __init__(self, replicas: list[ServerMetrics]):
        self.replicas = replicas

    def collect(self):
        families: dict[str, Metric] = {}
        for i, metrics in enumerate(self.replicas):
            for fam in metrics.registry.collect():
                if fam.name in API_SERVER_SERIES:  # counted by the API server
                    continue
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples += [Sample(s.name, {**s.labels, "replica": str(i)}, s.value, s.timestamp, s.exemplar)
                                for s in fam.samples]
        return list(families.values())


class DPMetrics(RequestParamsMetrics):
    """What `build_app` and the routes read of a client's `metrics`: `render()` and `count_error(status)`.

    Args:
        model_name: the `model_name` label.
        replicas: each replica's `ServerMetrics` (updated by its own client).
    """

    def __init__(self, model_name: str, replicas: list[ServerMetrics]):
        self.model_name = model_name
        self.replicas = replicas
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaCollector(replicas))
        r, lbl = self.registry, ["model_name", "replica"]
        self._errors = Counter("minfer:request_errors", "Requests rejected with an error status.",
                               ["model_name", "status"], registry=r)
        self.routed = Counter("minfer:router_requests_routed", "Engine requests the router sent to each replica.",
                              lbl, registry=r)
        self.outstanding = Gauge("minfer:router_requests_outstanding",
                                 "Unfinished engine requests on each replica (the router's count).", lbl, registry=r)
        self.up = Gauge("minfer:replica_up", "1 while the replica's engine process runs, else 0.", lbl, registry=r)

        self._fallbacks = Counter("minfer:request_fallbacks", "Fallbacks applied by the API server (fallbacks.py), "
                                  "counted before any routing.", ["model_name", "kind"], registry=r)
        for kind in FALLBACK_KINDS:  # each exported from 0, as ServerMetrics does
            self._fallbacks.labels(model_name, kind)
        self._init_request_params(r, model_name)

    def count_error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def count_fallback(self, kind: str) -> None:
        """A fallback of the API server (`metrics.FALLBACK_KINDS`): counted here, before any routing."""
        self._fallbacks.labels(self.model_name, kind).inc()

    def set_cache_config(self, info: dict) -> None:
        """`cache_config_info` of every replica (each exports it with its `replica` label)."""
        for metrics in self.replicas:
            metrics.set_cache_config(info)

    def render(self) -> tuple[bytes, str]:
        """The exposition with `minfer:` and `vllm:` names, as one server's (`ServerMetrics.render`)."""
        return generate_latest(_WithVllmNames(self.registry)), CONTENT_TYPE_LATEST


# ----------------------------------------------------------------------------------------------------------
# The client over N replicas
# ----------------------------------------------------------------------------------------------------------
class _Tap:
    """Stands in for a request's event queue: passes every event on and tells the router when it ended."""

    __slots__ = ("queue", "on_end")

    def __init__(self, queue: asyncio.Queue, on_end):
        self.queue, self.on_end = queue, on_end

    def put_nowait(self, event) -> None:
        rid, kind, payload = event
        if kind in ("error", "fatal", "done") or (kind == "output" and payload.finished):  # "done": a job
            self.on_end(rid)
        self.queue.put_nowait(event)


class DPEngineClient:
    """N engine clients behind one routing policy, with the interface of one client (`engine_client.py`).

    Args:
        clients: one engine client per replica (`MPEngineClient`s; in tests, `EngineLoop`s), not started.
        policy: a routing policy object (`make_policy`), or its name.
        model_name: the `model_name` label of the metrics.
        block_size: tokens per KV block, for `prefix_aware` when `policy` is a name.

    Raises (from `start`): what a replica's `start` raises; the replicas already started are stopped.
    """

    def __init__(self, clients: list, policy="round_robin", model_name: str = "minfer", block_size: int = 16):
        if not clients:
            raise ValueError("a DPEngineClient needs at least one replica")
        self.clients = list(clients)
        self.policy = make_policy(policy, block_size) if isinstance(policy, str) else policy
        self.metrics = DPMetrics(model_name, [c.metrics or ServerMetrics(model_name) for c in self.clients])
        self._load = [0] * len(self.clients)
        self._owner: dict[str, int] = {}  # unfinished request id -> replica
        self._job_owner: dict[str, int] = {}  # job (beam search) not answered yet -> replica
        for i in range(len(self.clients)):
            self.metrics.outstanding.labels(model_name, str(i)).set(0)
            self.metrics.routed.labels(model_name, str(i))

    @classmethod
    def from_engine_args(cls, engine_args, model_name: str, policy: str = "round_robin",
                         startup_timeout: float = 600.0) -> "DPEngineClient":
        """`engine_args.data_parallel_size` replicas, each an `MPEngineClient` of `engine_args` (as one replica)."""
        from minfer.serve.engine_client import MPEngineClient  # noqa: PLC0415

        one = replace(engine_args, data_parallel_size=1)
        clients = [MPEngineClient(one, ServerMetrics(model_name), startup_timeout)
                   for _ in range(engine_args.data_parallel_size)]
        return cls(clients, policy, model_name, block_size=engine_args.block_size)

    # --- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every replica (the engine processes load their models at the same time)."""
        with ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [pool.submit(c.start) for c in self.clients]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            self.stop()
            raise failed[0]
        self._update_up()

    def stop(self, timeout: float = 5.0) -> None:
        for c in self.clients:
            try:
                c.stop(timeout)
            except Exception:  # noqa: BLE001 - stop the others whatever one does
                logger.exception("could not stop a replica")

    @property
    def alive(self) -> bool:
        """True while every replica runs: one dead replica makes /health answer 503."""
        self._update_up()
        return all(c.alive for c in self.clients)

    @property
    def exit_reason(self) -> str | None:
        dead = [f"replica {i}: {getattr(c, 'exit_reason', None) or 'not running'}"
                for i, c in enumerate(self.clients) if not c.alive and getattr(c, "exit_reason", None)]
        return "; ".join(dead) or None

    def _update_up(self) -> None:
        for i, c in enumerate(self.clients):
            self.metrics.up.labels(self.metrics.model_name, str(i)).set(1 if c.alive else 0)

    # --- called from the event loop ------------------------------------------------------------------------
    def add(self, request_id: str, prompt, params, q: asyncio.Queue, arrival: float) -> None:
        """Route one request to a live replica and add it there; "added" or "error" arrives on `q`."""
        live = [i for i, c in enumerate(self.clients) if c.alive]
        if not live:
            q.put_nowait((request_id, "error", APIError(503, self.exit_reason or "no replica is running")))
            return
        if request_id in self._owner:
            q.put_nowait((request_id, "error", ValueError(f"request id {request_id!r} is already running")))
            return
        i = self.policy.choose(prompt, self._load, live)
        self._owner[request_id] = i
        self._set_load(i, +1)
        self.metrics.routed.labels(self.metrics.model_name, str(i)).inc()
        self.clients[i].add(request_id, prompt, params, _Tap(q, self._on_end), arrival)

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._owner.get(rid)
            if i is not None:
                by_replica.setdefault(i, []).append(rid)
                self._on_end(rid)
        for i, rids in by_replica.items():
            self.clients[i].abort(rids)

    def run_when_idle(self, job_id: str, fn, q: asyncio.Queue) -> None:
        """Run a job (beam search) on one live replica, the least loaded; its answer arrives on `q` as with
        one client. A job is not a request: it does not count in the outstanding load."""
        live = [i for i, c in enumerate(self.clients) if c.alive]
        if not live:
            q.put_nowait((job_id, "error", APIError(503, self.exit_reason or "no replica is running")))
            return
        i = min(live, key=lambda k: (self._load[k], k))
        self._job_owner[job_id] = i
        self.clients[i].run_when_idle(job_id, fn, _Tap(q, lambda rid: self._job_owner.pop(rid, None)))

    def cancel_job(self, job_id: str) -> None:
        i = self._job_owner.pop(job_id, None)
        if i is not None:
            self.clients[i].cancel_job(job_id)

    def _on_end(self, rid: str) -> None:
        i = self._owner.pop(rid, None)
        if i is not None:
            self._set_load(i, -1)

    def _set_load(self, i: int, delta: int) -> None:
        self._load[i] += delta
        self.metrics.outstanding.labels(self.metrics.model_name, str(i)).set(self._load[i])

    @property
    def outstanding(self) -> list[int]:
        """Unfinished requests per replica (the router's count)."""
        return list(self._load)

    # --- what /v1/stats and the start-up log read ----------------------------------------------------------
    @property
    def engine_view(self):
        return getattr(self.clients[0], "engine_view", None)  # None for in-process `EngineLoop`s

    @property
    def engine_pid(self):
        return getattr(self.clients[0], "engine_pid", None)

    @property
    def engine_pids(self) -> list:
        return [getattr(c, "engine_pid", None) for c in self.clients]

    @property
    def latest_stats(self) -> dict:
        """The replicas' numeric statistics summed (ratios averaged), and each replica's under "replicas"."""
        per = [{**(c.latest_stats or {}), "engine_pid": getattr(c, "engine_pid", None)} for c in self.clients]
        total: dict = {}
        for stats in per:
            for k, v in stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "engine_pid":
                    total[k] = total.get(k, 0) + v
        for k in ("kv_cache_usage", "fragmentation"):
            if k in total:
                total[k] /= len(per)
        total["replicas"] = per
        return total

    @property
    def kv_pool_info(self) -> dict:
        pools = [dict(c.kv_pool_info or {}) for c in self.clients]
        total = {k: sum(p.get(k, 0) for p in pools) for k in ("num_blocks", "num_tokens", "bytes", "num_cpu_blocks")}
        total["block_size"] = pools[0].get("block_size", 0)
        total["replicas"] = pools
        return total

    @property
    def recent_ttfts(self) -> list:
        return sorted(t for c in self.clients for t in c.recent_ttfts)[-64:]

    @property
    def num_steps(self) -> int:
        return sum(c.num_steps for c in self.clients)

    @property
    def num_requests_added(self) -> int:
        return sum(c.num_requests_added for c in self.clients)

    @property
    def num_step_errors(self) -> int:
        return sum(c.num_step_errors for c in self.clients)
