"""Chapter 15's measured targets, recorded quietly: the load test of notebook 15 §2 (TTFT, mean latency, cost per
token, concurrent sessions) against the server started with the article's §16 command as the notebook fits it,
the mean request phases of §3 (`vllm:request_{queue,prefill,decode}_time_seconds`), and §6's
`--max-parallel-loading-workers` load times.

    flock /tmp/minfer-bench.lock python benchmarks/ops_targets.py [--json assets/benchmarks/ops_targets_cpu.json]

The notebook runs the same measurements live at the same small settings (its cells are marked
NBVAL_IGNORE_OUTPUT); this script runs them alone under the benchmark lock and records the load average before
and after, so that the chapter quotes a quiet run. Cost per token is machine time: wall time x the cores held
/ output tokens, priced at an assumed $0.02 per core-hour (an assumption, recorded as such).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minfer.bench.serve import run_benchmark, stop_server, wait_until_healthy  # noqa: E402

PRICE_PER_CORE_HOUR = 0.02  # an assumption for the example ($), not a measurement
# notebook 15 §1: the article's command fitted to a 2-core CPU, plus the fallback flags
ARTICLE = ["--model", "smollm2-135m-instruct", "--served-model-name", "my-llm", "--host", "127.0.0.1",
           "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
           "--max-model-len", "512", "--gpu-memory-utilization", "0.9", "--dtype", "float32",
           "--kv-cache-dtype", "auto", "--enable-prefix-caching",
           "--max-num-batched-tokens", "8192", "--max-num-seqs", "16", "--swap-space", "1", "--enforce-eager",
           "--enable-chunked-prefill", "--disable-log-requests", "--seed", "42"]
FALLBACKS = ["--max-waiting-requests", "16", "--kv-pressure-threshold", "0.5", "--kv-pressure-max-tokens", "16",
             "--kv-cache-memory-bytes", "48M"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phase_means_ms(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    out = {}
    for p in ("queue", "prefill", "decode"):
        d = {s.name.rsplit("_", 1)[1]: s.value for s in fams[f"minfer:request_{p}_time_seconds"].samples
             if s.name.endswith(("_sum", "_count"))}
        out[p] = 1000 * d["sum"] / d["count"] if d["count"] else 0.0
    return out


def targets(concurrency: list[int]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ARTICLE + ["--port", str(port)] + FALLBACKS
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "minfer.serve", *argv], stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_until_healthy(url, proc, interval_s=0.1)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{open(log.name).read()[-3000:]}") from None
        startup = time.perf_counter() - t0
        cores = os.cpu_count()
        levels = {}
        for conc in concurrency:
            r = run_benchmark(url, num_prompts=max(4, conc), request_rate="inf", max_concurrency=conc,
                              input_len=32, output_len=8, seed=0, model="my-llm", disable_tqdm=True)
            core_ms = r["duration_s"] * cores * 1000 / r["total_output_tokens"]
            levels[str(conc)] = {
                "completed": r["completed"], "failed": r["failed"], "mean_ttft_ms": r["mean_ttft_ms"],
                "p99_ttft_ms": r["p99_ttft_ms"], "mean_e2el_ms": r["mean_e2el_ms"],
                "output_throughput": r["output_throughput"], "core_ms_per_token": core_ms,
                "dollars_per_1m_tokens": core_ms / 1000 / 3600 * PRICE_PER_CORE_HOUR * 1e6}
            print(conc, json.dumps(levels[str(conc)]), flush=True)
        phases = phase_means_ms(url)
    finally:
        stop_server(proc)
        os.unlink(log.name)
    target = 2 * levels[str(concurrency[0])]["p99_ttft_ms"]
    met = [c for c in concurrency if levels[str(c)]["p99_ttft_ms"] <= target]
    return {"server_argv": argv, "startup_health_s": startup, "levels": levels, "phase_means_ms": phases,
            "ttft_target": {"rule": "p99 TTFT within twice the unloaded one", "p99_ttft_ms": target,
                            "met_at_sessions": met}}


def loading(workers: tuple[int, ...], rounds: int) -> dict:
    from minfer.model.loader import load_model
    from minfer.platform import default_device

    load_model("smollm2-135m-instruct", device=default_device())  # the float32 cache, and the page cache warm
    times = {w: [] for w in workers}
    for _ in range(rounds):
        for w in workers:
            t = time.perf_counter()
            m = load_model("smollm2-135m-instruct", device=default_device(), max_parallel_loading_workers=w)
            times[w].append(time.perf_counter() - t)
            del m
            gc.collect()
    return {str(w): {"all_s": v, "best_s": min(v)} for w, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--load-rounds", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "assets/benchmarks/ops_targets_cpu.json"))
    args = ap.parse_args()
    before = os.getloadavg()
    t = time.perf_counter()
    result = {"command": "flock /tmp/minfer-bench.lock python benchmarks/ops_targets.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": os.cpu_count(),
              "price_per_core_hour_assumed": PRICE_PER_CORE_HOUR,
              "workload": "32-token random prompts, 8 output tokens, greedy, ignore_eos; max(4, sessions) requests",
              "targets": targets([int(c) for c in args.concurrency.split(",")]),
              "loading_workers": loading((1, 2, 4), args.load_rounds)}
    result["wall_s"] = time.perf_counter() - t
    result["load_average"] = {"before": before, "after": os.getloadavg()}
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("targets", "loading_workers", "load_average")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
