"""Where each server's CPU goes, and what its steps look like, on `peer_vllm_serve.py`'s workload (issue 18).

    python benchmarks/peer_vllm_serve_accounting.py [--servers vllm,minfer] [--minfer-args "..."] [--json PATH]
        (and peer_vllm_serve.py's --num-prompts/--input-len/--output-len/--concurrency/--model-dir/--vllm)

For each server in turn (started as `peer_vllm_serve.py` starts it, warmed up, then driven once by
`minfer.bench serve`):

- **CPU per thread.** Every task (thread) of every process in the server's process tree is read from
  `/proc/PID/task/TID/{stat,status,comm}` just before and just after the measured run: CPU seconds
  (utime + stime), voluntary and involuntary context switches, grouped by process and thread name
  (OpenMP workers of one team share their master's name). The client's own CPU (this process) is reported
  beside it: on 2 cores the client is a third competitor.
- **Step timeline, from the client.** Every streamed token's arrival time (request start + TTFT + the ITLs)
  is collected over all requests and clustered: tokens that arrive within `--cluster-ms` of each other came
  from one engine step. The gaps between clusters are step times; a cluster with first tokens in it ended a
  prefill. This needs no server cooperation, so it reads vLLM and minfer the same way.
- **Tokens per step, from the server.** The Prometheus histogram `*:iteration_tokens_total` (both servers
  export it, vLLM as `vllm:`, minfer as `minfer:`) before and after: steps run and tokens per step.

Numbers are from a shared 2-core machine; run it under the benchmark lock and compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_vllm_serve as pvs

TICK = os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (by /proc/*/stat's ppid)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d)] = int(fields[1])
    tree, frontier = [root], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        tree += kids
        frontier = kids
    return tree


def proc_name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    text = " ".join(a.decode(errors="replace") for a in argv[:4])
    return f"{comm} [{text[:80]}]"


def task_snapshot(pids: list[int]) -> dict:
    """(pid, tid) -> dict(proc, thread, cpu_s, vcsw, ivcsw) for every thread of `pids`."""
    snap = {}
    for pid in pids:
        pname = proc_name(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                stat = Path(base + "/stat").read_text().rsplit(")", 1)[1].split()
                status = Path(base + "/status").read_text()
                comm = Path(base + "/comm").read_text().strip()
            except OSError:
                continue
            cpu = (int(stat[11]) + int(stat[12])) / TICK  # utime, stime (fields 14, 15)
            v = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
            iv = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
            snap[(pid, int(tid))] = dict(proc=pname, thread=comm, cpu_s=cpu, vcsw=v, ivcsw=iv)
    return snap


def diff_snapshots(before: dict, after: dict, wall_s: float) -> list[dict]:
    """Per thread: CPU seconds, share of one core over the run, context switches. Python and OpenMP threads all
    read `python` in /proc, so each thread is its own row, `tid_rank` its creation order within its process
    (0 = the main thread)."""
    rows: dict = defaultdict(lambda: dict(cpu_s=0.0, vcsw=0, ivcsw=0, threads=0))
    for key, a in after.items():
        b = before.get(key, dict(cpu_s=0.0, vcsw=0, ivcsw=0))
        rank = sorted(t for p, t in after if p == key[0]).index(key[1])
        r = rows[(a["proc"], f"{a['thread']}#{rank}")]
        r["cpu_s"] += a["cpu_s"] - b["cpu_s"]
        r["vcsw"] += a["vcsw"] - b["vcsw"]
        r["ivcsw"] += a["ivcsw"] - b["ivcsw"]
        r["threads"] += 1
    out = [dict(process=p, thread=t, cpu_s=round(r["cpu_s"], 2), cores=round(r["cpu_s"] / wall_s, 3),
                voluntary_switches=r["vcsw"], involuntary_switches=r["ivcsw"], threads=r["threads"])
           for (p, t), r in rows.items()]
    return sorted(out, key=lambda r: -r["cpu_s"])


def iteration_histogram(url: str) -> dict:
    """count, sum and buckets of `*:iteration_tokens_total` from /metrics (vLLM's or minfer's prefix)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    per = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm|minfer):iteration_tokens_total_(count|sum|bucket)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if not m:
            continue
        out = per.setdefault(m.group(1), {"count": 0.0, "sum": 0.0, "buckets": {}})
        kind, labels, value = m.group(2), m.group(3) or "", float(m.group(4))
        if kind == "bucket":
            le = re.search(r'le="([^"]+)"', labels).group(1)
            out["buckets"][le] = out["buckets"].get(le, 0.0) + value
        else:
            out[kind] += value
    # minfer also exports every series under its vllm: name; read its own
    return per.get("minfer") or per.get("vllm") or {"count": 0.0, "sum": 0.0, "buckets": {}}


def hist_diff(a: dict, b: dict) -> dict:
    buckets = {le: b["buckets"][le] - a["buckets"].get(le, 0.0) for le in b["buckets"]}
    n = b["count"] - a["count"]
    return {"steps": n, "tokens": b["sum"] - a["sum"], "mean_tokens_per_step": (b["sum"] - a["sum"]) / n if n else None,
            "cumulative_buckets": buckets}


def step_timeline(r: dict, cluster_s: float) -> dict:
    """Cluster all token arrivals into steps (see the module doc); summary of step gaps and prefill steps."""
    events = []  # (time, is_first_token)
    for start, ttft, itl in zip(r["start_times"], r["ttfts"], r["itls"]):
        t = start + ttft
        events.append((t, True))
        for g in itl:
            t += g
            events.append((t, False))
    events.sort()
    steps = []  # [t_first, t_last, n_tokens, n_first]
    for t, first in events:
        if steps and t - steps[-1][1] <= cluster_s:
            s = steps[-1]
            s[1], s[2], s[3] = t, s[2] + 1, s[3] + first
        else:
            steps.append([t, t, 1, int(first)])
    gaps = [(b[0] - a[1]) for a, b in zip(steps, steps[1:])]
    prefill_gaps = [g for g, s in zip(gaps, steps[1:]) if s[3] > 0]
    decode_gaps = sorted(g for g, s in zip(gaps, steps[1:]) if s[3] == 0)
    med = decode_gaps[len(decode_gaps) // 2] if decode_gaps else None
    return {"clusters": len(steps), "ending_a_prefill": sum(1 for s in steps if s[3]),
            "first_tokens_per_prefill_cluster": [s[3] for s in steps if s[3]],
            "prefill_cluster_gaps_s": [round(g, 3) for g in prefill_gaps],
            "decode_gap_median_ms": round(med * 1e3, 1) if med is not None else None,
            "decode_gap_sum_s": round(sum(decode_gaps), 2), "prefill_gap_sum_s": round(sum(prefill_gaps), 2),
            "span_s": round(steps[-1][1] - steps[0][0], 2) if steps else 0.0}


def measure(which: str, args) -> dict:
    from minfer.bench.serve import run_benchmark

    port = pvs.free_port()
    cmd, env = pvs.server_cmd(which, args, port)
    log_path = f"{args.log_dir}/acct_{which}_{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        pvs.wait_healthy(url, proc)
        run_benchmark(url, num_prompts=4, max_concurrency=4, input_len=16, output_len=4, vocab_size=49152,
                      model=pvs.NAME, disable_tqdm=True, poll_stats=False)  # warm-up
        time.sleep(1.0)
        pids = process_tree(proc.pid)
        h0 = iteration_histogram(url)
        s0, c0, t0 = task_snapshot(pids), time.process_time(), time.perf_counter()
        load0 = os.getloadavg()[0]
        r = run_benchmark(url, num_prompts=args.num_prompts, max_concurrency=args.concurrency,
                          input_len=args.input_len, output_len=args.output_len, vocab_size=49152, model=pvs.NAME,
                          disable_tqdm=True, poll_stats=False)
        wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
        s1 = task_snapshot(process_tree(proc.pid))
        h1 = iteration_histogram(url)
        threads = diff_snapshots(s0, s1, wall)
        return {
            "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "wall_s": round(wall, 2),
            "output_throughput": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
            "mean_tpot_ms": r["mean_tpot_ms"], "completed": r["completed"],
            "server_cpu_s": round(sum(t["cpu_s"] for t in threads), 2),
            "client_cpu_s": round(client_cpu, 2),
            "threads": threads,
            "iteration_tokens": hist_diff(h0, h1),
            "client_step_timeline": step_timeline(r, args.cluster_ms / 1e3),
            "log": log_path,
        }
    finally:
        pvs.stop_server(proc, log)


def print_result(which: str, res: dict) -> None:
    print(f"== {which}: {res['output_throughput']:.1f} out tok/s, TTFT {res['mean_ttft_ms']:.0f} ms, "
          f"TPOT {res['mean_tpot_ms']:.1f} ms, wall {res['wall_s']} s, load {res['load_average_1min']}")
    print(f"   server CPU {res['server_cpu_s']} s ({res['server_cpu_s'] / res['wall_s']:.2f} cores), "
          f"client CPU {res['client_cpu_s']} s")
    for t in res["threads"][:12]:
        print(f"   {t['cpu_s']:7.2f} s {t['cores']:5.2f} cores  vcsw {t['voluntary_switches']:7d} "
              f"ivcsw {t['involuntary_switches']:6d}  x{t['threads']:<3d} {t['thread'][:18]:18s} {t['process'][:60]}")
    it, tl = res["iteration_tokens"], res["client_step_timeline"]
    print(f"   steps {it['steps']:.0f}, tokens {it['tokens']:.0f}, mean {it['mean_tokens_per_step']}")
    print(f"   client timeline: {tl['clusters']} clusters, {tl['ending_a_prefill']} with first tokens "
          f"{tl['first_tokens_per_prefill_cluster'][:20]}, decode gap median {tl['decode_gap_median_ms']} ms, "
          f"prefill gaps sum {tl['prefill_gap_sum_s']} s, decode gaps sum {tl['decode_gap_sum_s']} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default="vllm,minfer")
    ap.add_argument("--vllm", default="/tmp/vllm-venv/bin/vllm")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-hf"))
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--cluster-ms", type=float, default=5.0, help="token arrivals this close are one step (ms)")
    ap.add_argument("--old-log-flag", action="store_true")
    ap.add_argument("--log-dir", default=tempfile.gettempdir())
    ap.add_argument("--minfer-args", default="", help="extra flags for `python -m minfer.serve` (--minfer-args=\"--flag ...\")")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    pvs.ensure_vllm_metadata(args.vllm)
    result = {"note": "shared 2-core machine; per-thread CPU from /proc over the measured run; compare within a run",
              "config": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for which in args.servers.split(","):
        name = which if which != "minfer" or not args.minfer_args else f"minfer {args.minfer_args}"
        result["runs"][name] = res = measure(which, args)
        print_result(name, res)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
