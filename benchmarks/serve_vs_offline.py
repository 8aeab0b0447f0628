"""Does the HTTP layer cost throughput? The same requests through the server (streaming, C concurrent clients)
and through the offline engine (`LLM.generate`, at most C sequences at once), measured in one run.

    python benchmarks/serve_vs_offline.py [--num-prompts 64] [--concurrency 32] [--input-len 128] [--output-len 64]
                                          [--modes process,thread] [--repeats 1] [--profile DIR] [--json PATH]

The server runs in each of its two shapes: `process` (the default `python -m minfer.serve`: the engine core
in a process of its own, chapter 9 §9.2) and `thread` (`--no-engine-process`: the engine in a thread of the
API server's process, as before). With `--repeats N` the modes and the offline engine are measured N times,
interleaved, and the median is reported, since on a shared machine one run is noisy. With `--profile DIR`
(needs `py-spy`) the last repeat of each server mode is sampled with py-spy in the API process and the
engine process, and the top functions by own time are written to the JSON (`profile`) and DIR.

Target (issue 18): the server's output-token throughput >= 0.95x the offline engine's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import httpx

TARGET = 0.95


def start_profiler(pid: int, path: str) -> subprocess.Popen | None:
    """py-spy sampling `pid` (all threads, native frames off, 100 Hz) into a collapsed-stack file."""
    if shutil.which("py-spy") is None:
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "100", "--format", "raw",
                             "--nonblocking", "--output", path, "--duration", "600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profiler(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# Where a sample's innermost frame is -> what the process was doing (first match wins).
CATEGORIES = [
    ("waiting (select/poll)", ("selectors.py", "zmq/sugar/poll.py", "threading.py", "queue.py")),
    ("model forward (torch ops, kernels, layers)", ("torch/", "minfer/model/", "minfer/attention/", "minfer/kernels/",
                                                    "minfer/sampling.py", "minfer/worker.py", "minfer/kv_cache.py")),
    ("engine Python (schedule, outputs, detokenize)", ("minfer/scheduler.py", "minfer/block_manager.py",
                                                       "minfer/engine.py", "minfer/detokenizer.py",
                                                       "minfer/sequence.py", "minfer/executor.py", "tokenizers")),
    ("IPC (ZMQ, msgpack, snapshots)", ("zmq/", "msgpack", "minfer/serve/engine_core.py",
                                       "minfer/serve/engine_client.py", "minfer/serve/engine_loop.py", "pickle")),
    ("HTTP, JSON, SSE (uvicorn, starlette, protocol)", ("uvicorn/", "h11/", "starlette/", "fastapi/", "anyio/",
                                                        "asyncio/", "json/", "minfer/serve/", "httptools")),
]


def categorize(where: str) -> str:
    for name, keys in CATEGORIES:
        if any(k in where for k in keys):
            return name
    return "other"


def summarize_profile(path: str, wall_s: float, rate: float = 100.0, top: int = 12) -> dict:
    """Collapsed stacks -> {busy cores, top leaf functions and categories by share of samples}.

    A line of py-spy's raw format is `frame;...;leaf count`; a frame is `function (file:line)`. py-spy
    samples Python threads only: torch's own worker threads are not in it, and a thread blocked in C with
    the GIL released is counted where it blocks (`waiting`).
    """
    leaf: collections.Counter = collections.Counter()
    cats: collections.Counter = collections.Counter()
    total = 0
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frame = stack.split(";")[-1]
            name, _, where = frame.partition(" (")
            where = where.rstrip(")").rsplit(":", 1)[0]
            leaf[f"{name} ({os.path.basename(where)})"] += n
            cats[categorize(where)] += n
            total += n
    return {"samples": total, "busy_cores": total / (wall_s * rate) if wall_s else None,
            "categories": {k: v / total for k, v in cats.most_common()} if total else {},
            "top_self": [{"function": k, "share": v / total} for k, v in leaf.most_common(top)] if total else []}


def run_server(mode: str, args, profile_dir: str | None) -> dict:
    from minfer.bench.serve import free_port, run_benchmark, stop_server, wait_until_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "minfer.serve", "--port", str(port), "--max-model-len", "1024",
           "--max-num-seqs", str(args.concurrency), "--kv-cache-memory-bytes", str(512 << 20),
           "--disable-log-requests", "--uvicorn-log-level", "warning"]
    if mode == "thread":
        cmd.append("--no-engine-process")
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    profilers = {}
    try:
        wait_until_healthy(url, server, timeout_s=300)
        run_benchmark(url, num_prompts=4, max_concurrency=4, input_len=16, output_len=4,
                      vocab_size=49152, disable_tqdm=True, poll_stats=False)  # warm-up
        if profile_dir:
            pids = httpx.get(url + "/v1/stats", timeout=5).json()
            api, eng = pids["api_server_pid"], pids["engine_pid"]
            profilers["api"] = (start_profiler(api, f"{profile_dir}/{mode}_api.txt"), f"{profile_dir}/{mode}_api.txt")
            if eng != api:
                profilers["engine"] = (start_profiler(eng, f"{profile_dir}/{mode}_engine.txt"),
                                       f"{profile_dir}/{mode}_engine.txt")
            time.sleep(1.0)  # py-spy attaches
        t = time.perf_counter()
        served = run_benchmark(url, num_prompts=args.num_prompts, max_concurrency=args.concurrency,
                               input_len=args.input_len, output_len=args.output_len, vocab_size=49152,
                               poll_stats=False, disable_tqdm=True)
        wall = time.perf_counter() - t
        for p, _ in profilers.values():
            stop_profiler(p)
    finally:
        stop_server(server, grace_s=30)
    out = {"output_tok_s": served["output_throughput"], "failed": served.get("failed", 0),
           "mean_ttft_ms": served.get("mean_ttft_ms"), "mean_tpot_ms": served.get("mean_tpot_ms")}
    if profilers:
        out["profile"] = {name: summarize_profile(path, wall) for name, (_, path) in profilers.items()}
    return out


def run_offline(llm, args) -> float:
    from minfer import SamplingParams
    from minfer.bench.serve import sample_requests

    reqs = sample_requests("random", args.num_prompts, args.input_len, args.output_len, vocab_size=49152)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([r.prompt for r in reqs[:4]], params)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    wall = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--modes", default="process,thread", help="server shapes to measure: process, thread")
    ap.add_argument("--repeats", type=int, default=1, help="measure everything N times, interleaved; report medians")
    ap.add_argument("--profile", default=None, metavar="DIR", help="py-spy both server processes (last repeat)")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)

    from minfer import LLM

    runs: dict[str, list] = {m: [] for m in modes}
    offline: list[float] = []
    for r in range(args.repeats):
        last = r == args.repeats - 1
        for m in modes:
            runs[m].append(run_server(m, args, args.profile if last else None))
        llm = LLM(max_model_len=1024, max_num_seqs=args.concurrency, kv_cache_memory_bytes=512 << 20)
        offline.append(run_offline(llm, args))
        del llm

    offline_tps = statistics.median(offline)
    print(f"{args.num_prompts} requests, {args.input_len} prompt + {args.output_len} output tokens, "
          f"{args.concurrency} concurrent, {args.repeats} repeat(s), medians (shared 2-core machine)")
    print(f"  offline engine           {offline_tps:8.1f} output tok/s   runs: {[round(x, 1) for x in offline]}")
    result = {"offline_output_tok_s": offline_tps, "offline_runs": offline, "servers": {},
              "note": "measured on a shared 2-core CPU machine; compare the ratios, which come from one run",
              "config": vars(args)}
    for m in modes:
        tps = statistics.median(x["output_tok_s"] for x in runs[m])
        ratio = tps / offline_tps
        label = {"process": "server, engine process", "thread": "server, engine thread"}.get(m, m)
        print(f"  {label:24s} {tps:8.1f} output tok/s   server / offline = {ratio:.2f}   "
              f"runs: {[round(x['output_tok_s'], 1) for x in runs[m]]}, failed: {sum(x['failed'] for x in runs[m])}")
        result["servers"][m] = {"output_tok_s": tps, "ratio": ratio, "runs": runs[m]}
    if "process" in result["servers"]:
        ratio = result["servers"]["process"]["ratio"]
        result["ratio"], result["server_output_tok_s"] = ratio, result["servers"]["process"]["output_tok_s"]
        print(f"  target: the default server (engine process) >= {TARGET}x offline: "
              f"{'met' if ratio >= TARGET else 'MISSED'} ({ratio:.2f})")
    for m in modes:
        prof = runs[m][-1].get("profile")
        for proc, p in (prof or {}).items():
            if p:
                print(f"  profile {m}/{proc}: {p['samples']} samples; " + ", ".join(
                    f"{k} {v:.0%}" for k, v in p["categories"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
