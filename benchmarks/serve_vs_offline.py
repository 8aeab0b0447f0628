"""Does the HTTP layer cost throughput? The same requests through the server (streaming, C concurrent clients)
and through the offline engine (`LLM.generate`, at most C sequences at once), measured in one run.

    python benchmarks/serve_vs_offline.py [--num-prompts 64] [--concurrency 32] [--input-len 128] [--output-len 64]

Target (issue: the server): server output-token throughput within 15% of the offline engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)

    from minfer import LLM, SamplingParams
    from minfer.bench.serve import run_benchmark, sample_requests

    engine_flags = dict(max_model_len=1024, max_num_seqs=args.concurrency, kv_cache_memory_bytes=512 << 20)
    port = free_port()
    cmd = [sys.executable, "-m", "minfer.serve", "--port", str(port), "--max-model-len", "1024",
           "--max-num-seqs", str(args.concurrency), "--kv-cache-memory-bytes", str(512 << 20),
           "--disable-log-requests", "--uvicorn-log-level", "warning"]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        run_benchmark(f"http://127.0.0.1:{port}", num_prompts=4, max_concurrency=4, input_len=16, output_len=4,
                      vocab_size=49152, disable_tqdm=True, poll_stats=False)  # warm-up
        served = run_benchmark(f"http://127.0.0.1:{port}", num_prompts=args.num_prompts,
                               max_concurrency=args.concurrency, input_len=args.input_len,
                               output_len=args.output_len, vocab_size=49152, poll_stats=False)
    finally:
        server.terminate()
        server.wait(timeout=30)

    llm = LLM(**engine_flags)
    reqs = sample_requests("random", args.num_prompts, args.input_len, args.output_len, vocab_size=49152)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([r.prompt for r in reqs[:4]], params)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    wall = time.perf_counter() - t
    offline_tps = sum(len(o.outputs[0].token_ids) for o in outs) / wall
    server_tps = served["output_throughput"]
    ratio = server_tps / offline_tps
    print(f"{args.num_prompts} requests, {args.input_len} prompt + {args.output_len} output tokens, "
          f"{args.concurrency} concurrent")
    print(f"  offline engine   {offline_tps:8.1f} output tok/s")
    print(f"  server (stream)  {server_tps:8.1f} output tok/s   (failed requests: {served.get('failed', 0)})")
    print(f"  server / offline = {ratio:.2f}   (target >= 0.85: "
          f"{'met' if ratio >= 0.85 else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"offline_output_tok_s": offline_tps, "server_output_tok_s": server_tps, "ratio": ratio,
                       "config": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
