"""The compute ceiling of a serving benchmark on this machine: how many output tokens per second any server could
reach on `vllm bench serve`'s random workload if its float32 matmuls ran at the speed of one large oneDNN GEMM
(issue 32, lab notes 9b (chapters/lab/09b-cpu-performance.md) §9b.6).

    python benchmarks/serve_roofline.py [--model-dir /tmp/smollm2-hf] [--input-len 192] [--output-len 48]
        [--threads 2] [--json PATH]

Work of one request (`flops_per_request`): every prompt token and every fed-back output token goes through all
decoder layers (2 FLOPs per weight of q/k/v/o, gate/up/down, plus causal attention: 4 * position * heads * head_dim
per layer), and every output token through the LM head (the first from the prompt's last position). Nothing is
shared between requests: the random dataset's prompts have no common prefix.

Speed (`gemm_gflops`): `torch.nn.functional.linear` in float32 on `--threads` threads (oneDNN, as minfer's and
vLLM's CPU linears use), on the model's own projection shapes at M = 512 rows (a full chunked-prefill step) and
M = 64 (a decode step at 64 streams), each the median of repeated timings.

ceiling (output tok/s) = GEMM GFLOP/s * output_len / GFLOP per request. A server's measured throughput divided by
this ceiling is the fraction of the machine's matmul speed it turns into output; no server can pass 1.0 without
doing less arithmetic (it is a ceiling for the arithmetic, not for the bytes: a decode step also reads every
weight and K/V). A benchmark, never a test dependency; `flops_per_request` is unit-tested.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def flops_per_request(cfg, input_len: int, output_len: int) -> dict:
    """FLOPs (floats, not GFLOP) of one request of `input_len` prompt tokens and `output_len` generated tokens on a
    Llama-family `cfg` (`minfer.config.ModelConfig`): {"layers", "attention", "lm_head", "total"}.

    Raises ValueError for input_len < 1 or output_len < 1."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size  # weights of one decoder layer's matmuls
    fed = input_len + output_len - 1  # the last output token is never fed back
    layers = 2.0 * per_layer * cfg.num_hidden_layers * fed
    # token at position p attends to p + 1 keys: QK^T and PV, 2 FLOPs a multiply-add each, every query head
    attention = 4.0 * q * cfg.num_hidden_layers * sum(p + 1 for p in range(fed))
    lm_head = 2.0 * h * cfg.vocab_size * output_len
    return {"layers": layers, "attention": attention, "lm_head": lm_head, "total": layers + attention + lm_head}


def gemm_gflops(cfg, rows: int, threads: int, repeats: int = 7) -> float:
    """Median GFLOP/s of one decoder layer's float32 projections (q|k|v, o, gate|up, down) at `rows` rows."""
    import torch

    torch.set_num_threads(threads)
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    ws = [torch.randn(n, k) for n, k in shapes]
    xs = [torch.randn(rows, k) for _, k in shapes]
    flops = sum(2.0 * rows * n * k for n, k in shapes)
    with torch.inference_mode():
        for _ in range(3):
            for x, w in zip(xs, ws):
                torch.nn.functional.linear(x, w)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(10):
                for x, w in zip(xs, ws):
                    torch.nn.functional.linear(x, w)
            times.append((time.perf_counter() - t0) / 10)
    return flops / statistics.median(times) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-hf"), help="an HF directory (config.json)")
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from minfer.model.registry import config_from_hf

    cfg = config_from_hf(json.loads((args.model_dir / "config.json").read_text()))
    work = flops_per_request(cfg, args.input_len, args.output_len)
    load = os.getloadavg()[0]
    speed = {rows: gemm_gflops(cfg, rows, args.threads) for rows in (512, 64)}
    out = {"command": " ".join(["python", "benchmarks/serve_roofline.py", *(argv or sys.argv[1:])]),
           "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
           "gflop_per_request": {k: v / 1e9 for k, v in work.items()},
           "gemm_gflops": {f"rows_{r}": s for r, s in speed.items()},
           "ceiling_output_tok_s": {f"rows_{r}": s * 1e9 * args.output_len / work["total"] for r, s in speed.items()}}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
