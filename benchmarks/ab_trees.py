"""Two checkouts of minfer, the same benchmarks, alternated in one run: is a change free of speed loss?

    python benchmarks/ab_trees.py --before /path/to/old/checkout [--after .] [--rounds 2] [--json PATH]

Each round runs, for the "before" tree and then the "after" one, each in a fresh process whose `import minfer`
is that tree's (`PYTHONPATH`):

- batch-1 decode: `python -m minfer.bench decode --quantization gguf --no-transformers --no-llama-cpp`
  (float32 weights and the GGUF's own blocks, 2 threads);
- engine throughput: `bench engine`'s throughput workload (64 requests of 64-512 + 32-256 tokens) through
  `LLMEngine` alone (no transformers baseline);
- the server: `python -m minfer.serve` under `benchmarks/peer_vllm_serve.py`'s load (48 random prompts of 192
  tokens, 48 output tokens, 16 in flight, minfer's client).

It prints each figure's after/before ratio of the medians and writes a JSON with every run and the load average
before and after it. A verdict needs a quiet machine: hold the benchmark lock, nice everything else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE_SNIPPET = r"""
import json, sys
from minfer.bench.engine import Settings, make_llm, make_workload, run_engine_batch, kv_bytes_for
s = Settings.full()
llm = make_llm(max_model_len=1024, kv_cache_memory_bytes=1 << 30, **json.loads(sys.argv[1]))
prompts, outs = make_workload(s.num_requests, s.prompt_len, s.output_len,
                              llm.llm_engine.model_config.config.vocab_size, s.seed)
run_engine_batch(llm, prompts[:4], [4] * 4, progress=False)  # warm-up: builds, first-call costs
r = run_engine_batch(llm, prompts, outs, progress=False)
print("RESULT " + json.dumps(r))
"""


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_decode(tree: Path) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "decode.json"
        cmd = [sys.executable, "-m", "minfer.bench", "decode", "--threads", "2", "--repeats", "2", "--new-tokens", "64",
               "--quantization", "gguf", "--no-transformers", "--no-llama-cpp", "--json", str(out)]
        subprocess.run(cmd, cwd=tree, env=_env(tree), check=True, capture_output=True, text=True, timeout=1200)
        r = json.loads(out.read_text())
    quant = r.get("quantized") or r.get("quant") or {}
    gguf = quant.get("gguf", {}) if isinstance(quant, dict) else {}
    return {"float32_tok_s": r.get("minfer_tok_s"), "gguf_tok_s": gguf.get("minfer_tok_s", gguf.get("tok_s"))}


def run_engine(tree: Path, engine_args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", ENGINE_SNIPPET, engine_args], cwd=tree, env=_env(tree), check=True,
                       capture_output=True, text=True, timeout=1800)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT "):])
    return {"output_tok_s": r["output_tok_s"], "seconds": r["seconds"]}


def run_server(tree: Path, log_dir: str, minfer_args: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "serve.json"
        cmd = [sys.executable, str(Path(__file__).with_name("peer_vllm_serve.py")), "--servers", "minfer",
               "--repeats", "1", "--log-dir", log_dir, "--json", str(out), f"--minfer-args={minfer_args}"]
        subprocess.run(cmd, cwd=tree, env=_env(tree), check=True, capture_output=True, text=True, timeout=1800)
        r = json.loads(out.read_text())
    c = r["runs"]["minfer"][0]["client_minfer"]
    return {k: c[k] for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")}


# Both trees scheduled alike (a change of scheduling default is not a change of speed): whole prompts, 2,048
# tokens a step, the scheduler both trees had before chunked prefill became the default.
SAME_SCHEDULE_ENGINE = '{"enable_chunked_prefill": false, "max_num_batched_tokens": 2048}'
SAME_SCHEDULE_SERVER = "--no-enable-chunked-prefill --max-num-batched-tokens 2048"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the old checkout (its repository root)")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="decode,engine,server")
    ap.add_argument("--json", default=None)
    ap.add_argument("--engine-args", default=SAME_SCHEDULE_ENGINE, help="EngineArgs fields (JSON) for both trees")
    ap.add_argument("--minfer-args", default=SAME_SCHEDULE_SERVER, help="server flags for both trees")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    log_dir = tempfile.mkdtemp(prefix="ab-trees-")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict = {p: {"before": [], "after": []} for p in parts}
    for rnd in range(args.rounds):
        for part in parts:
            for which, tree in trees.items():
                l0, t0 = _load(), time.time()
                if part == "decode":
                    r = run_decode(tree)
                elif part == "engine":
                    r = run_engine(tree, args.engine_args)
                else:
                    r = run_server(tree, log_dir, args.minfer_args)
                r.update(load_average_1min=[l0, _load()], wall_s=round(time.time() - t0, 1), round=rnd)
                runs[part][which].append(r)
                print(part, which, json.dumps(r), flush=True)
    ratios = {}
    for part, sides in runs.items():
        keys = [k for k in sides["after"][0] if k not in ("load_average_1min", "wall_s", "round")
                and isinstance(sides["after"][0][k], (int, float))]
        for k in keys:
            a = statistics.median(r[k] for r in sides["after"] if r.get(k) is not None)
            b = statistics.median(r[k] for r in sides["before"] if r.get(k) is not None)
            ratios[f"{part}.{k}"] = {"before": b, "after": a, "after_over_before": a / b if b else None}
    for k, v in ratios.items():
        print(f"{k:32s} before {v['before']:10.2f}  after {v['after']:10.2f}  after/before {v['after_over_before']:.3f}")
    if args.json:
        from minfer.course import cpu_name

        res = {"what": "the same benchmarks on two checkouts, alternated in one run (benchmarks/ab_trees.py)",
               "command": " ".join(["python", "benchmarks/ab_trees.py", *(argv if argv is not None else sys.argv[1:])]),
               "engine_args": args.engine_args, "minfer_args": args.minfer_args,
               "trees": {k: str(v) for k, v in trees.items()}, "rounds": args.rounds, "runs": runs,
               "medians": ratios, "cpu": cpu_name(), "cores": os.cpu_count()}
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
