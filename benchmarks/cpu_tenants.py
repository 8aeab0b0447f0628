"""CPU pinning and multi-tenant isolation on this machine (article §6-5), measured.

    flock /tmp/minfer-bench.lock python benchmarks/cpu_tenants.py --part a   # one engine: unpinned vs pinned
    flock /tmp/minfer-bench.lock python benchmarks/cpu_tenants.py --part b   # two engines on two cores
    flock /tmp/minfer-bench.lock python benchmarks/cpu_tenants.py --part c   # a latency tenant beside a batch tenant

Each part adds its results to `assets/benchmarks/cpu_tenants.json` (`--json`), with the machine's layout
(`lscpu`, `os.sched_getaffinity`, `/sys/devices/system/node`), the command, and the 1-minute load average
before and after. A benchmark, never a test dependency. The model is the default SmolLM2-135M-Instruct.

- **a**: one offline engine (`LLMEngine` stepped by hand) running one request at a time: a `--prompt-len`
  prompt, then `--output-len` greedy tokens. TTFT = add_request -> first token; TPOT = (last - first) /
  (tokens - 1); decode tok/s = 1000 / TPOT. Configurations: 2 threads unpinned; 2 threads with OpenMP binding
  (`OMP_PROC_BIND=close OMP_PLACES=cores`: each OpenMP thread stays on its own core); 1 thread under
  `taskset -c 0`.
- **b**: two such engines at once, started together: (i) both unpinned with 2 threads each (4 threads on 2
  cores, the OS spreads them); (ii) one per core, 1 thread each (`taskset -c 0` / `taskset -c 1`).
- **c**: two tenants through `python -m minfer.serve`: a batch tenant (`--batch-concurrency` streams of long
  prompts and outputs, closed loop) and a latency tenant (one stream of short requests, one after the other).
  (i) one server, default limits; (ii) one server with a smaller chunk budget (`--max-num-batched-tokens`:
  a step carries fewer prefill tokens, so it is shorter), and with that budget plus `--max-num-seqs` (fewer
  sequences run at once); (iii) two servers, one per tenant, each pinned to its own core (`taskset`, 1 thread).
  Reports the latency tenant's TTFT p50/p99 and TPOT, and the batch tenant's output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "assets" / "benchmarks" / "cpu_tenants.json"


# --- the machine --------------------------------------------------------------------------------------------
def machine_layout() -> dict:
    """What pinning can use here: the CPUs, the NUMA nodes and their CPUs, the tools."""
    node_dir = Path("/sys/devices/system/node")
    nodes = {}
    if node_dir.is_dir():
        for n in sorted(node_dir.glob("node[0-9]*")):
            cpulist = (n / "cpulist").read_text().strip() if (n / "cpulist").exists() else None
            meminfo = (n / "meminfo").read_text().splitlines() if (n / "meminfo").exists() else []
            total = next((ln.split()[-2] + " kB" for ln in meminfo if "MemTotal" in ln), None)
            nodes[n.name] = {"cpulist": cpulist, "mem_total": total}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        lscpu = ""
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node",
            "L2 cache", "L3 cache", "Hypervisor vendor")
    return {
        "os_cpu_count": os.cpu_count(),
        "sched_getaffinity": sorted(os.sched_getaffinity(0)),
        "numa_nodes": nodes,
        "lscpu": {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lscpu.splitlines())
                  if k.strip().startswith(keep)},
        "numactl": bool(subprocess.run(["sh", "-c", "command -v numactl"], capture_output=True).stdout),
        "taskset": bool(subprocess.run(["sh", "-c", "command -v taskset"], capture_output=True).stdout),
        "python": platform.python_version(),
    }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank, as `minfer.bench serve` reports p99."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values), "p50": statistics.median(values),
            "p99": percentile(values, 99), "max": max(values)} if values else {"n": 0}


# --- parts a and b: offline engines -------------------------------------------------------------------------
def worker(args) -> int:
    """One engine, one request at a time, until `--seconds` pass after `--start-at`; prints one JSON line."""
    import torch

    from minfer.config import EngineArgs
    from minfer.engine import LLMEngine
    from minfer.sampling_params import SamplingParams

    t_load = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype="float32", seed=0))
    load_s = time.perf_counter() - t_load
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def one(i: int) -> tuple[float, float]:
        prompt = [1000 + (i * 7919 + j * 104729) % (vocab - 1000) for j in range(args.prompt_len)]
        t0 = time.perf_counter()
        rid = engine.add_request(None, prompt, sp)
        times = []
        n_prev = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                if out.request_id == rid and n > n_prev:
                    times.extend([time.perf_counter()] * (n - n_prev))
                    n_prev = n
        return times[0] - t0, (times[-1] - times[0]) / (len(times) - 1)

    one(0)  # warm-up: first-call costs (allocations, the C++ kernels' first touch)
    if args.sync:  # tell the parent this engine is ready, then wait until every engine is
        Path(args.sync + ".ready." + str(os.getpid())).touch()
        while not Path(args.sync + ".go").exists():
            time.sleep(0.05)
    ttft, tpot = [], []
    t_end = time.perf_counter() + args.seconds
    i = 1
    while time.perf_counter() < t_end:
        a, b = one(i)
        ttft.append(a * 1000)
        tpot.append(b * 1000)
        i += 1
    print(json.dumps({"threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0)),
                      "OMP_PROC_BIND": os.environ.get("OMP_PROC_BIND"), "OMP_PLACES": os.environ.get("OMP_PLACES"),
                      "load_s": load_s, "requests": len(ttft), "ttft_ms": summary(ttft), "tpot_ms": summary(tpot),
                      "decode_tok_s": 1000 / statistics.median(tpot), "ttft_list_ms": ttft}))
    return 0


def worker_cmd(args, threads: int, cpus: str | None, bind: bool) -> tuple[list[str], dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for k in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        env.pop(k, None)
    if bind:
        env.update(OMP_PROC_BIND="close", OMP_PLACES="cores")
    cmd = [sys.executable, __file__, "--worker", "--seconds", str(args.seconds), "--prompt-len",
           str(args.prompt_len), "--output-len", str(args.output_len), "--model", args.model]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus] + cmd
    return cmd, env


def run_workers(args, specs: list[tuple[int, str | None, bool]]) -> list[dict]:
    """Start one worker per spec (threads, cpus, OpenMP binding), all measuring from the same moment."""
    import tempfile

    sync = os.path.join(tempfile.mkdtemp(prefix="cpu_tenants_"), "sync")
    procs = []
    for threads, cpus, bind in specs:
        cmd, env = worker_cmd(args, threads, cpus, bind)
        cmd += ["--sync", sync]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       cwd=ROOT), cmd, env))
    # All engines measure from the same moment, once every one has loaded and warmed up.
    deadline = time.time() + 600
    while len(list(Path(sync).parent.glob("sync.ready.*"))) < len(procs):
        if time.time() > deadline or any(p.poll() is not None for p, _, _ in procs):
            for p, _, _ in procs:
                p.kill()
            raise RuntimeError("a worker exited or did not get ready: " + procs[0][0].stderr.read()[-2000:])
        time.sleep(0.1)
    Path(sync + ".go").touch()
    results = []
    for p, cmd, env in procs:
        out, err = p.communicate(timeout=args.seconds + 300)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}): {shlex.join(cmd)}\n{err[-2000:]}")
        r = json.loads(out.strip().splitlines()[-1])
        env_shown = {k: env[k] for k in ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES") if k in env}
        r["command"] = " ".join(f"{k}={v}" for k, v in env_shown.items()) + " " + shlex.join(cmd[:-2])
        results.append(r)
    return results


def part_a(args) -> dict:
    configs = {
        "unpinned_2_threads": [(2, None, False)],
        "omp_bind_2_threads": [(2, None, True)],
        "taskset_core0_1_thread": [(1, "0", False)],
    }
    out = {}
    for rep in range(args.repeats):  # alternate the configurations, so a change in load hits all of them
        for name, spec in configs.items():
            print(f"[a] {name} (round {rep + 1})", file=sys.stderr, flush=True)
            out.setdefault(name, []).append(run_workers(args, spec)[0])
    return {name: {"runs": runs, "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                   "ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] for r in runs)}
            for name, runs in out.items()}


def part_b(args) -> dict:
    configs = {
        "shared_unpinned_2_threads_each": [(2, None, False), (2, None, False)],
        "pinned_core_each_1_thread": [(1, "0", False), (1, "1", False)],
    }
    out = {}
    for rep in range(args.repeats):
        for name, spec in configs.items():
            print(f"[b] {name} (round {rep + 1})", file=sys.stderr, flush=True)
            out.setdefault(name, []).append(run_workers(args, spec))
    res = {}
    for name, rounds in out.items():
        res[name] = {
            "rounds": rounds,
            "total_decode_tok_s": statistics.median(sum(e["decode_tok_s"] for e in r) for r in rounds),
            "per_engine_decode_tok_s": [statistics.median(r[i]["decode_tok_s"] for r in rounds) for i in range(2)],
            "per_engine_ttft_p50_ms": [statistics.median(r[i]["ttft_ms"]["p50"] for r in rounds) for i in range(2)],
            "per_engine_ttft_p99_ms": [statistics.median(r[i]["ttft_ms"]["p99"] for r in rounds) for i in range(2)],
            "per_engine_tpot_p50_ms": [statistics.median(r[i]["tpot_ms"]["p50"] for r in rounds) for i in range(2)],
        }
    return res


# --- part c: two tenants through the server -----------------------------------------------------------------
def start_server(extra: list[str], cpus: str | None, threads: int | None) -> tuple[subprocess.Popen, str, str]:
    from minfer.bench.serve import free_port, wait_until_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "minfer.serve", "--port", str(port), "--dtype", "float32",
           "--disable-log-requests", "--uvicorn-log-level", "warning"] + extra
    if cpus is not None:
        cmd = ["taskset", "-c", cpus] + cmd
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc, timeout_s=180)
    except RuntimeError as exc:
        proc.kill()
        raise RuntimeError(f"{exc}: {shlex.join(cmd)}") from None
    shown = (f"OMP_NUM_THREADS={threads} " if threads is not None else "") + shlex.join(
        [c if c != sys.executable else "python" for c in cmd])
    return proc, url, shown


def stop_server(proc: subprocess.Popen) -> None:
    from minfer.bench.serve import stop_server as stop

    stop(proc, grace_s=30)


async def tenants(batch_url: str, latency_url: str, args) -> dict:
    """The batch tenant (closed loop, `--batch-concurrency` streams) and, once it is running, the latency
    tenant (one short request at a time, `--latency-requests` of them, 0.2 s apart)."""
    from minfer.bench.serve import benchmark, sample_requests

    batch_reqs = sample_requests("random", args.batch_requests, args.batch_input_len, args.batch_output_len,
                                 seed=1, vocab_size=49152)
    lat_reqs = sample_requests("random", args.latency_requests, args.latency_input_len,
                               args.latency_output_len, seed=2, vocab_size=49152)
    stop_batch = asyncio.Event()

    async def batch():
        # A closed loop: refill the batch tenant's streams until the latency tenant is done.
        results = []
        t0 = time.perf_counter()
        while not stop_batch.is_set():
            r = await benchmark(batch_url, batch_reqs, max_concurrency=args.batch_concurrency, poll_stats=False,
                                disable_tqdm=True)
            results.append(r)
        dur = time.perf_counter() - t0
        return {"output_tok_s": sum(r["total_output_tokens"] for r in results) / dur,
                "completed": sum(r["completed"] for r in results), "failed": sum(r["failed"] for r in results),
                "ttft_p50_ms": statistics.median(t * 1000 for r in results for t in r["ttfts"])}

    async def latency():
        await asyncio.sleep(args.batch_head_start)  # the batch tenant's streams are in flight first
        res = await benchmark(latency_url, lat_reqs, request_rate=args.latency_rate, max_concurrency=1,
                              poll_stats=False, disable_tqdm=True)
        stop_batch.set()
        return res

    b, lat = await asyncio.gather(batch(), latency())
    ttfts = [t * 1000 for t in lat["ttfts"]]
    return {"latency_tenant": {"ttft_ms": summary(ttfts), "tpot_ms": summary([t * 1000 for t in lat["tpots"]]),
                               "completed": lat["completed"], "failed": lat["failed"], "ttft_list_ms": ttfts},
            "batch_tenant": b}


async def alone(url: str, args) -> dict:
    from minfer.bench.serve import benchmark, sample_requests

    reqs = sample_requests("random", args.latency_requests, args.latency_input_len, args.latency_output_len,
                           seed=2, vocab_size=49152)
    lat = await benchmark(url, reqs, request_rate=args.latency_rate, max_concurrency=1, poll_stats=False,
                          disable_tqdm=True)
    ttfts = [t * 1000 for t in lat["ttfts"]]
    return {"latency_tenant": {"ttft_ms": summary(ttfts), "tpot_ms": summary([t * 1000 for t in lat["tpots"]]),
                               "completed": lat["completed"], "failed": lat["failed"], "ttft_list_ms": ttfts}}


def part_c(args) -> dict:
    budget = ["--max-num-batched-tokens", str(args.limit_max_num_batched_tokens)]
    limits = ["--max-num-seqs", str(args.limit_max_num_seqs)] + budget
    out = {}

    def warm(url):
        asyncio.run(alone(url, argparse.Namespace(**{**vars(args), "latency_requests": 2})))

    # (0) the latency tenant alone on a default server: the baseline its TTFT is compared with.
    print("[c] alone", file=sys.stderr, flush=True)
    proc, url, cmd = start_server([], None, None)
    try:
        warm(url)
        out["alone_one_server"] = {"servers": [cmd], **asyncio.run(alone(url, args))}
    finally:
        stop_server(proc)
    for name, extra in (("shared_server_default", []), ("shared_server_budget", budget),
                        ("shared_server_limits", limits)):
        print(f"[c] {name}", file=sys.stderr, flush=True)
        proc, url, cmd = start_server(extra, None, None)
        try:
            warm(url)
            out[name] = {"servers": [cmd], **asyncio.run(tenants(url, url, args))}
        finally:
            stop_server(proc)
    print("[c] two_servers_pinned", file=sys.stderr, flush=True)
    pb, burl, bcmd = start_server([], "0", 1)
    try:
        pl, lurl, lcmd = start_server([], "1", 1)
        try:
            warm(burl)
            warm(lurl)
            out["two_servers_pinned"] = {"servers": [bcmd, lcmd], **asyncio.run(tenants(burl, lurl, args))}
        finally:
            stop_server(pl)
    finally:
        stop_server(pb)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["a", "b", "c"])
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seconds", type=float, default=20.0, help="measuring time per engine (parts a, b)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the configurations, alternated (a, b)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--batch-requests", type=int, default=8)
    ap.add_argument("--batch-concurrency", type=int, default=8)
    ap.add_argument("--batch-input-len", type=int, default=512)
    ap.add_argument("--batch-output-len", type=int, default=64)
    ap.add_argument("--batch-head-start", type=float, default=3.0)
    ap.add_argument("--latency-requests", type=int, default=30)
    ap.add_argument("--latency-rate", type=float, default=2.0, help="latency tenant's requests/s (Poisson)")
    ap.add_argument("--latency-input-len", type=int, default=32)
    ap.add_argument("--latency-output-len", type=int, default=8)
    ap.add_argument("--limit-max-num-seqs", type=int, default=4)
    ap.add_argument("--limit-max-num-batched-tokens", type=int, default=128)
    # worker mode (parts a and b start these)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sync", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.part is None:
        ap.error("--part a|b|c is required")
    load_before = os.getloadavg()
    t0 = time.time()
    result = {"a": part_a, "b": part_b, "c": part_c}[args.part](args)
    record = {"command": "flock /tmp/minfer-bench.lock python " + shlex.join(["benchmarks/cpu_tenants.py"]
                                                                            + (argv if argv is not None else sys.argv[1:])),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "wall_s": time.time() - t0, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "sync", "json", "part")},
              "results": result}
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    data["machine"] = machine_layout()
    data["note"] = ("benchmarks/cpu_tenants.py on a shared 2-core VM (1 NUMA node), each part under "
                    "flock /tmp/minfer-bench.lock; other helpers' jobs ran at nice 19")
    data.setdefault("parts", {})[args.part] = record
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "results"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
