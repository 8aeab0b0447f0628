"""Does `--enforce-eager` lower first-token latency? Start-up time, TTFT and TPOT of the server with and without
it, and on the reference path, for the default model on this CPU (chapter 15 §15.8; issue 30).

    python benchmarks/enforce_eager.py [--starts 2] [--requests 10] [--long-len 500] [--output-len 16]
                                       [--modes default,eager,reference] [--no-offline] [--json PATH]

The article's §16 command carries `--enforce-eager` with the note "eager mode: useful to reduce first-token
latency". In vLLM the flag turns off torch.compile and CUDA-graph capture, which are done once at start-up, so
it saves start-up time; the first token of a request is a prefill, which vLLM runs without graphs either way.
In minfer the flag turns off the platform's step runner: on a CPU the one-call C++ decode step
(`minfer/cpu/decode_step.py`), so decode runs the PyTorch model op by op; prefill is the same path both ways.

Modes (each `python -m minfer.serve --model smollm2-135m-instruct` plus):
    default     nothing (the one-call decode step)
    eager       --enforce-eager
    reference   --kernels reference (the plain path the chapters teach: no C++ at all)

Each mode's server is started `--starts` times, the modes alternating (default, eager, reference, default, ...).
For each start: process start -> /health 200 (`startup_health_s`) and -> the first completion of one token
(`startup_first_completion_s`); then `--requests` single requests (one at a time) of a short prompt (8 random
token ids) and of a `--long-len` one, `--output-len` greedy tokens each, streamed: TTFT = request sent -> first
streamed text, TPOT = (latency - TTFT) / (tokens - 1) (`minfer.bench.serve`). The JSON keeps every sample
and each mode's medians over all its starts. With offline on (the default), `LLM(...)` is also built in a
fresh process per mode: process start -> engine ready, and the time of a `max_tokens=1` generate (prefill +
one sampled token, the offline TTFT) on both prompts.

Timings: run under `flock /tmp/minfer-bench.lock`; the load average before and after is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's minfer, in the offline children too

MODEL = "smollm2-135m-instruct"
VOCAB = 49152  # SmolLM2's vocabulary: prompts are random ids in [1000, VOCAB)
MODES = {"default": [], "eager": ["--enforce-eager"], "reference": ["--kernels", "reference"]}


def one_start(mode: str, args: argparse.Namespace, seed: int) -> dict:
    """Start one server in `mode`, time its start-up, run the single requests, stop it."""
    from minfer.bench.serve import free_port, run_benchmark, stop_server, wait_until_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minfer.serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "2048", *MODES[mode]]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:  # polled every 50 ms: the start-up time is what this script measures
            wait_until_healthy(url, proc, timeout_s=600, interval_s=0.05)
        except RuntimeError as exc:
            raise RuntimeError(f"{mode}: {exc}\n{open(log.name).read()[-3000:]}") from None
        health = time.perf_counter() - t0
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1},
                       timeout=600)
        r.raise_for_status()
        first = time.perf_counter() - t0
        out = {"mode": mode, "command": " ".join(cmd[1:]), "startup_health_s": health,
               "startup_first_completion_s": first}
        for name, length in (("short", args.short_len), ("long", args.long_len)):
            res = run_benchmark(url, num_prompts=args.requests, max_concurrency=1, input_len=length,
                                output_len=args.output_len, seed=seed + length, vocab_size=VOCAB, model=MODEL,
                                poll_stats=False, disable_tqdm=True)
            if res["failed"]:
                raise RuntimeError(f"{mode}: {res['failed']} requests failed: {res['errors'][:2]}")
            out[name] = {"prompt_tokens": length, "ttft_s": res["ttfts"], "tpot_s": res["tpots"]}
        return out
    finally:
        stop_server(proc)
        os.unlink(log.name)


def offline_child(mode: str, short_len: int, long_len: int, repeats: int) -> None:
    """In a fresh process: build `LLM` in `mode` and time it and a one-token generate; print a JSON line.
    `t_start` is the parent's clock at Popen, passed in the environment."""
    from minfer import LLM, SamplingParams

    kw = {"default": {}, "eager": {"enforce_eager": True}, "reference": {"kernels": "reference"}}[mode]
    llm = LLM(model=MODEL, max_model_len=2048, **kw)
    ready = time.time() - float(os.environ["ENFORCE_EAGER_T0"])
    import random

    rng = random.Random(0)
    res = {"mode": mode, "llm_ready_s": ready}
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for name, n in (("short", short_len), ("long", long_len)):
        times = []
        for _ in range(repeats):
            ids = [rng.randrange(1000, VOCAB) for _ in range(n)]
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
            times.append(time.perf_counter() - t)
        res[f"{name}_first_token_s"] = times
    print("RESULT " + json.dumps(res), flush=True)


def paired_child(modes: list[str], long_len: int, rounds: int) -> None:
    """In one process: an `LLM` per mode, side by side, and `rounds` rounds of a one-token generate of a
    `long_len` prompt through each in turn (a fresh prompt per round, the same for every mode): a paired
    comparison of the prefill time, each mode seeing the same machine load; print a JSON line."""
    import random

    from minfer import LLM, SamplingParams

    kw = {"default": {}, "eager": {"enforce_eager": True}, "reference": {"kernels": "reference"}}
    llms = {m: LLM(model=MODEL, max_model_len=1024, kv_cache_memory_bytes=64 << 20, **kw[m]) for m in modes}
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(1)
    times = {m: [] for m in modes}
    for m in modes:  # warm-up
        llms[m].generate([{"prompt_token_ids": [rng.randrange(1000, VOCAB) for _ in range(long_len)]}], one)
    for _ in range(rounds):
        ids = [rng.randrange(1000, VOCAB) for _ in range(long_len)]
        for m in modes:
            t = time.perf_counter()
            llms[m].generate([{"prompt_token_ids": ids}], one)
            times[m].append(time.perf_counter() - t)
    print("RESULT " + json.dumps({"prompt_tokens": long_len, "rounds": rounds, "first_token_s": times}), flush=True)


def offline(mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, ENFORCE_EAGER_T0=repr(time.time()))
    p = subprocess.run([sys.executable, __file__, "--offline-child", mode, "--short-len", str(args.short_len),
                        "--long-len", str(args.long_len), "--requests", str(args.requests)],
                       env=env, capture_output=True, text=True, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"offline {mode} failed:\n{p.stderr[-3000:]}")


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(runs: list[dict], offline_runs: list[dict]) -> dict:
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rs = [r for r in runs if r["mode"] == mode]
        s = {"starts": len(rs),
             "startup_health_s": med([r["startup_health_s"] for r in rs]),
             "startup_first_completion_s": med([r["startup_first_completion_s"] for r in rs])}
        for name in ("short", "long"):
            s[f"{name}_ttft_p50_ms"] = 1000 * med([x for r in rs for x in r[name]["ttft_s"]])
            s[f"{name}_tpot_p50_ms"] = 1000 * med([x for r in rs for x in r[name]["tpot_s"]])
        off = [o for o in offline_runs if o["mode"] == mode]
        if off:
            s["offline_llm_ready_s"] = med([o["llm_ready_s"] for o in off])
            for name in ("short", "long"):
                s[f"offline_{name}_first_token_p50_ms"] = 1000 * med([x for o in off for x in o[f"{name}_first_token_s"]])
        out[mode] = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="default,eager,reference")
    p.add_argument("--starts", type=int, default=2, help="server starts per mode, alternating (default: 2)")
    p.add_argument("--requests", type=int, default=10, help="single requests per prompt length per start")
    p.add_argument("--short-len", type=int, default=8)
    p.add_argument("--long-len", type=int, default=500)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                   help="also time the long prompt's first token offline, the modes' LLMs side by side in one "
                        "process, alternating, for ROUNDS rounds (a paired comparison)")
    p.add_argument("--offline-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--paired-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.paired_child:
        paired_child(args.paired_child.split(","), args.long_len, args.requests)
        return 0
    if args.offline_child:
        offline_child(args.offline_child, args.short_len, args.long_len, args.requests)
        return 0
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    load_before = os.getloadavg()
    t_all = time.perf_counter()
    runs = []
    for k in range(args.starts):
        for mode in modes:
            r = one_start(mode, args, seed=k)
            runs.append(r)
            print(f"{mode} start {k}: health {r['startup_health_s']:.2f} s, first completion "
                  f"{r['startup_first_completion_s']:.2f} s, TTFT p50 short "
                  f"{1000 * med(r['short']['ttft_s']):.0f} ms long {1000 * med(r['long']['ttft_s']):.0f} ms, "
                  f"TPOT p50 {1000 * med(r['short']['tpot_s']):.1f} ms", flush=True)
    offline_runs = []
    if not args.no_offline:
        for mode in modes:
            o = offline(mode, args)
            offline_runs.append(o)
            print(f"offline {mode}: ready {o['llm_ready_s']:.2f} s, first token short "
                  f"{1000 * med(o['short_first_token_s']):.0f} ms long {1000 * med(o['long_first_token_s']):.0f} ms",
                  flush=True)
    paired = None
    if args.paired:
        p2 = subprocess.run([sys.executable, __file__, "--paired-child", ",".join(modes), "--long-len",
                             str(args.long_len), "--requests", str(args.paired)], capture_output=True, text=True,
                            timeout=1800)
        line = next((ln for ln in p2.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"paired run failed:\n{p2.stderr[-3000:]}")
        paired = json.loads(line[7:])
        paired["p50_ms"] = {m: 1000 * med(v) for m, v in paired["first_token_s"].items()}
        base = paired["first_token_s"][modes[0]]
        paired["median_ratio_vs_" + modes[0]] = {m: med([a / b for a, b in zip(v, base)])
                                                 for m, v in paired["first_token_s"].items()}
        print("paired:", json.dumps({k: paired[k] for k in paired if k != "first_token_s"}), flush=True)
    result = {
        "command": "flock /tmp/minfer-bench.lock python "
                   + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "model": MODEL, "config": {k: v for k, v in vars(args).items() if not k.endswith("_child")},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": __import__("torch").__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "wall_s": time.perf_counter() - t_all,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "summary": summarize(runs, offline_runs),
        "runs": runs, "offline": offline_runs, "paired_offline": paired,
    }
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
