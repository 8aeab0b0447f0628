"""What prefix caching costs when nothing hits: the same engine workload of unique prompts with caching on and off.

    flock /tmp/minfer-bench.lock python3 benchmarks/prefix_cache_cost.py --out assets/benchmarks/prefix_cache_cost.json \\
        [--model smollm2-135m-instruct] [--num-requests 64] [--input-len 192] [--output-len 48] [--rounds 3]

The server turns prefix caching on by default (`python -m minfer.serve`, as vLLM V1), so every request pays for it
even where no prompt shares a block with an earlier one: each full prompt block is hashed and looked up when the
request is admitted, and each block the request fills is named in the cache (`minfer.prefix_cache`); a free named
block waits in the LRU and is evicted when taken. This script measures that price alone.

Two engines (`LLM`) in this process, identical but for `enable_prefix_caching`, get the same workload each round:
`--num-requests` prompts of `--input-len` random token ids, all queued at once, `--output-len` tokens each (greedy,
ignore_eos), stepped until done, as `minfer.bench.engine.run_engine_batch` does. Every round draws new prompts (a
seed of its own), so the cache-on engine never sees a prompt twice; its counters (`prefix_cache` in each run: prompt
tokens looked up and found) show that nothing hit. Rounds alternate which engine goes first (on/off, off/on, ...),
so the slow drift of a shared machine falls on both; the medians over rounds are compared.

Per run: output tok/s (output tokens / wall time of the whole batch), mean TTFT and mean TPOT over the requests
(`RequestMetrics`: seconds, reported in ms), the process's CPU time (user + system, s) and its share of the wall
time, and the 1-minute load average before and after. Ratios are on / off: throughput below 1, TTFT and TPOT above
1 are the cost. The JSON (`--out`) holds every run, the medians, the ratios, the CPU model and the command.
A benchmark, never a test dependency (tests/test_bench_prefix_cache_cost.py runs it on a tiny random model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

MIB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model (an alias, HF directory or .gguf)")
    ap.add_argument("--quantization", default=None, help="as EngineArgs' (e.g. gguf; default: none)")
    ap.add_argument("--num-requests", type=int, default=64, help="prompts per run, all queued at once")
    ap.add_argument("--input-len", type=int, default=192, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=48, help="generated tokens per request (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each engine, alternated")
    ap.add_argument("--max-model-len", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="sequences per step (0: --num-requests)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30, help="KV pool of each engine (bytes)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--seed", type=int, default=0,
                    help="base of the prompts' seeds (round r uses seed + r, the warm-up seed + --rounds)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("num_requests", "input_len", "output_len", "rounds", "max_model_len", "block_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.input_len + args.output_len > args.max_model_len:
        ap.error("--input-len + --output-len exceed --max-model-len")
    args.max_num_seqs = args.max_num_seqs or args.num_requests
    return args


def unique_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` random token ids in [3, vocab_size) (ids 0-2 are often BOS/EOS/UNK).

    Raises ValueError when two prompts share their first token block's worth of ids (16 tokens): with random ids
    that never happens, and a shared block would be a hit, which this benchmark must not have."""
    rng = random.Random(f"prompts-{seed}")  # a string: random.Random(-n) would be random.Random(n)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(num)]
    heads = {tuple(p[:16]) for p in prompts}
    if length >= 16 and len(heads) != num:
        raise ValueError("two prompts share their first 16 tokens: use another --seed")
    return prompts


def make_llm(args, enable_prefix_caching: bool):
    from minfer import LLM

    return LLM(model=args.model, quantization=args.quantization, seed=0, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
               block_size=args.block_size, enable_prefix_caching=enable_prefix_caching)


def run_once(llm, prompts: list[list[int]], output_len: int) -> dict:
    """Queue every prompt at once, step the engine until all are done. Returns the run's measures (see the module
    docstring); `prefix_cache` is {"queries", "hits"} in prompt tokens during this run."""
    from minfer.sampling_params import SamplingParams

    engine = llm.llm_engine
    st0 = engine.stats()
    load_before = os.getloadavg()[0]
    cpu0, t0 = os.times(), time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for p in prompts:
        engine.add_request(None, p, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    wall = time.perf_counter() - t0
    cpu1 = os.times()
    st1 = engine.stats()
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    ttfts = [o.metrics.ttft for o in finished if o.metrics and o.metrics.ttft is not None]
    tpots = [o.metrics.tpot for o in finished if o.metrics and o.metrics.tpot is not None]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    return {"requests": len(finished), "output_tokens": out_tokens, "prompt_tokens": sum(map(len, prompts)),
            "wall_s": round(wall, 4), "output_throughput": out_tokens / wall,
            "mean_ttft_ms": 1000 * statistics.fmean(ttfts) if ttfts else None,
            "mean_tpot_ms": 1000 * statistics.fmean(tpots) if tpots else None,
            "cpu_s": round(cpu_s, 3), "cpu_per_wall": round(cpu_s / wall, 3),
            "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "prefix_cache": {"queries": st1.prefix_cache_queries - st0.prefix_cache_queries,
                             "hits": st1.prefix_cache_hits - st0.prefix_cache_hits},
            "all_blocks_free": engine.all_blocks_free()}


METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "cpu_s")


def summarize(runs: dict) -> dict:
    """{"medians": {"on"|"off": {metric: median}}, "ratios": {metric: on / off}, "hits": prompt tokens found}
    from `runs` = {"on": [run, ...], "off": [run, ...]}. A metric missing in some run is left out of its median."""
    med = {}
    for key, rs in runs.items():
        med[key] = {m: statistics.median(vals) for m in METRICS if (vals := [r[m] for r in rs if r.get(m) is not None])}
    ratios = {m: round(med["on"][m] / med["off"][m], 4) for m in METRICS
              if m in med.get("on", {}) and med.get("off", {}).get(m)}
    return {"medians": med, "ratios_on_over_off": ratios,
            "hits_with_cache_on": sum(r["prefix_cache"]["hits"] for r in runs.get("on", [])),
            "queries_with_cache_on": sum(r["prefix_cache"]["queries"] for r in runs.get("on", []))}


def environment() -> dict:
    from minfer.course import cpu_name

    cpu = cpu_name()
    import torch

    return {"cpu": cpu, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__}


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    llms = {"on": make_llm(args, True), "off": make_llm(args, False)}
    vocab = llms["on"].llm_engine.model_config.config.vocab_size
    warm = unique_prompts(2, min(args.input_len, 16), vocab, seed=args.seed + args.rounds)  # no round's seed
    for llm in llms.values():  # first-call allocations and kernel builds, outside the measurement
        run_once(llm, warm, 2)
    runs: dict = {"on": [], "off": []}
    for rnd in range(args.rounds):
        prompts = unique_prompts(args.num_requests, args.input_len, vocab, seed=args.seed + rnd)
        order = ("on", "off") if rnd % 2 == 0 else ("off", "on")
        for key in order:
            res = run_once(llms[key], prompts, args.output_len)
            res["round"], res["position_in_round"] = rnd, order.index(key)
            runs[key].append(res)
            print(f"round {rnd} cache {key:3s}: {res['output_throughput']:8.1f} out tok/s  TTFT "
                  f"{res['mean_ttft_ms']:9.1f} ms  TPOT {res['mean_tpot_ms'] or 0:7.1f} ms  CPU {res['cpu_s']:.1f} s"
                  f"  hits {res['prefix_cache']['hits']}/{res['prefix_cache']['queries']}", flush=True)
    summary = summarize(runs)
    print("on / off: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["ratios_on_over_off"].items()))
    if summary["hits_with_cache_on"]:
        print(f"WARNING: {summary['hits_with_cache_on']} prompt tokens hit: the workload was not all unique")
    result = {"command": shlex.join([sys.executable, *(sys.argv if argv is None else ["prefix_cache_cost.py", *argv])]),
              "note": "same unique-prompt workload through two engines differing only in enable_prefix_caching, "
                      "alternated; ratios are cache on / cache off",
              "config": vars(args), "environment": environment(), "wall_s": round(time.time() - started, 1),
              "runs": runs, "summary": summary}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if summary["hits_with_cache_on"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
