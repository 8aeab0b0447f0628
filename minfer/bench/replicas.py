"""`python -m minfer.bench replicas`: data-parallel replicas behind the router (chapter 12b).

    python -m minfer.bench replicas [--quick] [--json PATH] [--only hit_rate,throughput]

Two parts, each measured through `minfer.serve.router.DPEngineClient` (the client the server uses with
`--data-parallel-size N`, driven here without HTTP so that only the engines and the router are timed):

1. hit_rate - a workload with shared system prompts: `num_system_prompts` different system prompts, each
   request one of them (chosen at random) + its own user turn, a few output tokens. Each replica's KV pool
   (`kv_blocks_per_replica`) holds about half of all the system prompts' blocks, as a real deployment with
   more prefixes than cache. The prefix-cache hit rate (prompt tokens found in the cache / prompt tokens looked up, summed
   over the replicas' `engine.stats()`) for each routing policy, on fresh replicas each time.
   Target: prefix_aware >= 1.5x round_robin.
2. throughput - the same random requests (no shared prefixes) with 1 and with 2 replicas (least_outstanding),
   output tokens per second. On a machine with fewer cores than replicas x threads the replicas share the
   cores: the run also gives each of the 2 replicas half the threads, and says what it measured.

The replicas are engine processes (`engine_client.MPEngineClient`) of the real model by default; the
notebook passes `in_process=True` and a tiny random model (`tiny_random_model`) to run in seconds.
Every `run_*` function returns a plain dict; `main` prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from minfer.config import EngineArgs
from minfer.sampling_params import SamplingParams

DEFAULT_JSON = "assets/benchmarks/replicas_cpu.json"
PARTS = ("hit_rate", "throughput")
POLICIES = ("round_robin", "least_outstanding", "prefix_aware")
TARGETS = {"prefix_aware_over_round_robin_hit_rate": 1.5}


@dataclass
class Settings:
    """Sizes of one run; `quick()` is the notebook's and the test's."""

    num_replicas: int = 2
    # hit_rate
    num_system_prompts: int = 16
    num_requests: int = 96
    user_len: tuple[int, int] = (16, 48)
    system_len: int = 160
    max_tokens: int = 4
    concurrency: int = 8
    kv_blocks_per_replica: int = 100  # 16 x 10 system-prompt blocks in all: a replica holds about half
    # throughput
    tp_num_requests: int = 32
    tp_prompt_len: tuple[int, int] = (64, 128)
    tp_output_len: int = 32
    tp_concurrency: int = 16
    seed: int = 0

    @classmethod
    def quick(cls) -> "Settings":
        return cls(num_system_prompts=8, num_requests=48, system_len=96, kv_blocks_per_replica=40, tp_num_requests=16,
                   tp_output_len=16, tp_prompt_len=(32, 64))


# ----------------------------------------------------------------------------------------------------------
# Replicas: engine processes, or engines in threads of this process (notebook)
# ----------------------------------------------------------------------------------------------------------
def kv_bytes_per_block(engine_args: EngineArgs, in_process: bool = False) -> int:
    """Bytes of one KV block of `engine_args`' model: one replica started with an 8 MiB pool, its pool read."""
    dp = make_replicas(replace(engine_args, kv_cache_memory_bytes=8 << 20, max_model_len=engine_args.block_size),
                       1, "round_robin", in_process=in_process)
    try:
        pool = dp.kv_pool_info
    finally:
        dp.stop()
    return -(-pool["bytes"] // pool["num_blocks"])


def make_replicas(engine_args: EngineArgs, n: int, policy: str, in_process: bool = False, threads: int | None = None):
    """A started `DPEngineClient` over `n` replicas of `engine_args`.

    Args:
        in_process: engines in threads of this process (`EngineLoop`) instead of engine processes.
        threads: torch threads of each engine process (OMP_NUM_THREADS at its start; None: torch's default).
    """
    from minfer.serve.engine_client import MPEngineClient  # noqa: PLC0415
    from minfer.serve.engine_loop import EngineLoop  # noqa: PLC0415
    from minfer.serve.metrics import ServerMetrics  # noqa: PLC0415
    from minfer.serve.router import DPEngineClient  # noqa: PLC0415

    one = replace(engine_args, data_parallel_size=1)
    if in_process:
        from minfer.engine import LLMEngine  # noqa: PLC0415

        clients = [EngineLoop(LLMEngine.from_engine_args(one), ServerMetrics("bench")) for _ in range(n)]
    else:
        clients = [MPEngineClient(one, ServerMetrics("bench")) for _ in range(n)]
    dp = DPEngineClient(clients, policy, "bench", block_size=engine_args.block_size)
    with _env("OMP_NUM_THREADS", None if threads is None else str(threads)):
        dp.start()  # spawned processes read the environment as they start
    return dp


@contextmanager
def _env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


async def _drive(dp, prompts: list[list[int]], params: list[SamplingParams], concurrency: int) -> dict:
    """Run every prompt through `dp` with at most `concurrency` in flight; wall time and tokens."""
    sem = asyncio.Semaphore(concurrency)
    errors: list[str] = []
    out_tokens = 0

    async def one(k: int):
        nonlocal out_tokens
        async with sem:
            q: asyncio.Queue = asyncio.Queue()
            rid = f"bench-{k}"
            dp.add(rid, prompts[k], params[k], q, time.perf_counter())
            while True:
                _, kind, payload = await q.get()
                if kind in ("error", "fatal"):
                    errors.append(str(payload))
                    return
                if kind == "output" and payload.finished:
                    out_tokens += sum(len(o.token_ids) for o in payload.outputs)
                    return

    t0 = time.perf_counter()
    await asyncio.gather(*[one(k) for k in range(len(prompts))])
    return {"wall_s": time.perf_counter() - t0, "output_tokens": out_tokens, "errors": errors}


def _run(coro):
    """`asyncio.run(coro)`, in a thread of its own where an event loop already runs (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _settled_stats(dp, timeout: float = 5.0) -> list[dict]:
    """Each replica's latest stats once every replica is idle (the engines report after their last step)."""
    deadline = time.time() + timeout
    while True:
        per = [dict(c.latest_stats or {}) for c in dp.clients]
        if all(s.get("num_running", 0) == 0 and s.get("num_waiting", 0) == 0 for s in per) or time.time() > deadline:
            return per
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------------------
# 1. prefix-cache hit rate per policy
# ----------------------------------------------------------------------------------------------------------
def shared_prompt_workload(s: Settings, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) = one of `num_system_prompts` system prompts + a user turn; and which one each has."""
    rng = random.Random(s.seed)
    lo, hi = 3, vocab_size - 1
    systems = [[rng.randrange(lo, hi) for _ in range(s.system_len)] for _ in range(s.num_system_prompts)]
    which = [rng.randrange(s.num_system_prompts) for _ in range(s.num_requests)]
    prompts = [systems[w] + [rng.randrange(lo, hi) for _ in range(rng.randint(*s.user_len))] for w in which]
    return prompts, which


def run_hit_rate(engine_args: EngineArgs, s: Settings, policies=POLICIES, in_process: bool = False,
                 progress=print) -> dict:
    """Prefix-cache hit rate of the shared-system-prompt workload, one fresh set of replicas per policy."""
    block_bytes = kv_bytes_per_block(engine_args, in_process)
    args = replace(engine_args, enable_prefix_caching=True, kv_cache_memory_bytes=s.kv_blocks_per_replica * block_bytes,
                   max_num_seqs=max(s.concurrency, 1))
    rows = {}
    prompts = which = None
    for policy in policies:
        dp = make_replicas(args, s.num_replicas, policy, in_process=in_process)
        try:
            if prompts is None:
                prompts, which = shared_prompt_workload(s, dp.engine_view.model_config.vocab_size
                                                        if dp.engine_view else _vocab(dp))
            params = [SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True) for _ in prompts]
            res = _run(_drive(dp, prompts, params, s.concurrency))
            per = _settled_stats(dp)
            routed = _routed(dp)
            blocks = dp.kv_pool_info["replicas"][0].get("num_blocks")
        finally:
            dp.stop()
        queries = sum(p.get("prefix_cache_queries", 0) for p in per)
        hits = sum(p.get("prefix_cache_hits", 0) for p in per)
        rows[policy] = {
            "hit_rate": hits / queries if queries else 0.0, "prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "hit_rate_per_replica": [p.get("prefix_cache_hits", 0) / max(1, p.get("prefix_cache_queries", 0))
                                     for p in per],
            "requests_per_replica": routed, "evicted_blocks": sum(p.get("num_evicted_blocks", 0) for p in per),
            "wall_s": res["wall_s"], "errors": len(res["errors"]), "kv_blocks_per_replica": blocks}
        progress(f"  {policy:18s} hit rate {rows[policy]['hit_rate']:.3f}  requests per replica {routed}  "
                 f"{res['wall_s']:.1f} s")
    system_tokens = s.system_len * s.num_system_prompts
    out = {"settings": {"num_replicas": s.num_replicas, "num_system_prompts": s.num_system_prompts,
                        "system_len_tokens": s.system_len, "user_len_tokens": list(s.user_len),
                        "num_requests": s.num_requests, "max_tokens": s.max_tokens, "concurrency": s.concurrency,
                        "kv_blocks_per_replica": s.kv_blocks_per_replica, "block_size": args.block_size,
                        "system_prompt_blocks_all": system_tokens // args.block_size},
           "policies": rows}
    # the best any router can do: every request after the first of its system prompt finds the whole prompt
    n_first = len(set(which))
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    out["ideal_hit_rate"] = ((len(prompts) - n_first) * (s.system_len // args.block_size) * args.block_size
                             / (len(prompts) * mean_prompt))
    if "round_robin" in rows and "prefix_aware" in rows and rows["round_robin"]["hit_rate"] > 0:
        out["prefix_aware_over_round_robin"] = rows["prefix_aware"]["hit_rate"] / rows["round_robin"]["hit_rate"]
    return out


def _vocab(dp) -> int:
    return dp.clients[0].engine.model_config.vocab_size


def _routed(dp) -> list[int]:
    return [int(dp.metrics.routed.labels("bench", str(i))._value.get()) for i in range(len(dp.clients))]


# ----------------------------------------------------------------------------------------------------------
# 2. throughput with 1 and 2 replicas
# ----------------------------------------------------------------------------------------------------------
def run_throughput(engine_args: EngineArgs, s: Settings, in_process: bool = False, progress=print) -> dict:
    """Output tokens/s of the same requests with 1 replica and with 2 (each with all threads, then half)."""
    rng = random.Random(s.seed + 1)
    cores = os.cpu_count() or 1
    rows = []
    configs = [(1, None), (2, None)]
    if not in_process and cores >= 2:
        configs.append((2, max(1, cores // 2)))
    prompts = None
    for n, threads in configs:
        dp = make_replicas(replace(engine_args, max_num_seqs=max(s.tp_concurrency, 1)), n, "least_outstanding",
                           in_process=in_process, threads=threads)
        try:
            if prompts is None:
                vocab = dp.engine_view.model_config.vocab_size if dp.engine_view else _vocab(dp)
                prompts = [[rng.randrange(3, vocab - 1) for _ in range(rng.randint(*s.tp_prompt_len))]
                           for _ in range(s.tp_num_requests)]
            params = [SamplingParams(max_tokens=s.tp_output_len, temperature=0.0, ignore_eos=True) for _ in prompts]
            _run(_drive(dp, prompts[:2], params[:2], 2))  # warm-up
            res = _run(_drive(dp, prompts, params, s.tp_concurrency))
            routed = _routed(dp)
        finally:
            dp.stop()
        row = {"replicas": n, "threads_per_replica": threads or "default", "output_tokens": res["output_tokens"],
               "wall_s": res["wall_s"], "output_tok_per_s": res["output_tokens"] / res["wall_s"],
               "errors": len(res["errors"]), "requests_per_replica": routed}
        rows.append(row)
        progress(f"  {n} replica(s), threads {row['threads_per_replica']}: {row['output_tok_per_s']:.1f} output tok/s "
                 f"({res['wall_s']:.1f} s, {len(res['errors'])} errors)")
    base = rows[0]["output_tok_per_s"]
    for row in rows:
        row["speedup_vs_1"] = row["output_tok_per_s"] / base
    return {"settings": {"num_requests": s.tp_num_requests, "prompt_len": list(s.tp_prompt_len),
                         "output_len": s.tp_output_len, "concurrency": s.tp_concurrency, "cpu_count": cores},
            "runs": rows}


# ----------------------------------------------------------------------------------------------------------
# A tiny random model (notebook, tests)
# ----------------------------------------------------------------------------------------------------------
def tiny_random_model(path, vocab: int = 256, hidden: int = 64, layers: int = 2, seed: int = 0) -> str:
    """Save a random Llama and a word-level tokenizer (`vocab` words) as a Hugging Face directory; its path."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    path = Path(path)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    words = [f"w{i}" for i in range(vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[2]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=words[0], eos_token=words[1],
                                         unk_token=words[2]).save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minfer.bench replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=EngineArgs().model, help="model (default: the default model)")
    p.add_argument("--max-model-len", type=int, default=512, help="tokens per sequence (default: 512)")
    p.add_argument("--quick", action="store_true", help="small sizes (a minute)")
    p.add_argument("--only", default=",".join(PARTS), help=f"parts to run, of {','.join(PARTS)}")
    p.add_argument("--in-process", action="store_true", help="engines in threads of this process, not processes")
    p.add_argument("--json", default=DEFAULT_JSON, help=f"where to write the results (default: {DEFAULT_JSON})")
    a = p.parse_args(argv)
    parts = [x for x in a.only.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; choose from {','.join(PARTS)}")
    s = Settings.quick() if a.quick else Settings()
    args = EngineArgs(model=a.model, max_model_len=a.max_model_len)
    result = {"benchmark": "replicas", "model": a.model, "machine": platform.machine(), "cpu_count": os.cpu_count(),
              "note": "absolute times depend on the machine and what else runs on it (the 1-minute load average "
                      "before and after is recorded): compare ratios within this run",
              "targets": TARGETS, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "load_average_1min_before_after": [round(os.getloadavg()[0], 2)]}
    if "hit_rate" in parts:
        print("prefix-cache hit rate per routing policy (shared system prompts)")
        result["hit_rate"] = run_hit_rate(args, s, in_process=a.in_process)
        r = result["hit_rate"].get("prefix_aware_over_round_robin")
        if r is not None:
            print(f"  prefix_aware / round_robin = {r:.2f}x (target >= {TARGETS['prefix_aware_over_round_robin_hit_rate']}x)")
    if "throughput" in parts:
        print("throughput, 1 vs 2 replicas")
        result["throughput"] = run_throughput(args, s, in_process=a.in_process)
    result["load_average_1min_before_after"].append(round(os.getloadavg()[0], 2))
    if a.json:
        old = json.loads(Path(a.json).read_text()) if Path(a.json).is_file() else {}
        for part in PARTS:  # a part not run this time keeps its earlier result, with that run's time
            if part not in result and part in old:
                result[part] = old[part]
                result.setdefault("earlier_parts", {})[part] = old.get("time")
                result.setdefault("earlier_parts_load_average", {})[part] = old.get("load_average_1min_before_after")
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
