"""The linears of one engine step, minfer's float32 "panels" kernel against oneDNN's (what torch runs),
on SmolLM2-135M's shapes with 30 distinct layers' weights, so that every weight streams from DRAM as in a real
step (a single matrix repeated would sit in cache and flatter both).

    python benchmarks/gemm_f32_cpu.py [--rows 1 2 4 8 16 24 32] [--repeats 10] [--threads 2] [--json PATH]

Prints per row count the milliseconds of a step's linears (q|k|v, o, gate|up, down for 30 layers, then the LM
head) for each kernel and their ratio, measured alternately in the same run (chapter 9 §9.2.6). Past 16 rows
the panels kernel is its AVX-512 many-row tile where the library has it (lab notes 9b §9b.17:
`--rows 16 32 64 128 256 512`), else the few-row passes of 16 (6 on AVX2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

from minfer.cpu.gemm_f32 import gemm_f32_unchecked, isa, pack_weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q|k|v, o, gate|up, down (N, K)
VOCAB, HIDDEN, LAYERS = 49152, 576, 30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES] for _ in range(LAYERS)]
    weights.append([torch.randn(VOCAB, HIDDEN, generator=g) * 0.05])
    panels = [[pack_weight(w) for w in ws] for ws in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws] for ws in weights]
    results = []
    for m in tqdm(args.rows, desc="row counts"):
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in SHAPES}}

        def step_panels():
            for ws, ps in zip(weights, panels):
                for w, p in zip(ws, ps):
                    gemm_f32_unchecked(xs[w.shape[1]], p, w.shape[0])

        def step_onednn():
            for ws, ps in zip(weights, onednn):
                for w, p in zip(ws, ps):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        times = {"panels": [], "onednn": []}
        for _ in range(args.repeats):
            for name, fn in (("panels", step_panels), ("onednn", step_onednn)):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v[1:] or v) for k, v in times.items()}  # the first of each: warm-up
        results.append({"rows": m, "panels_ms": med["panels"], "onednn_ms": med["onednn"],
                        "onednn_over_panels": med["onednn"] / med["panels"]})
    print(f"kernel ISA: {isa()}, {args.threads} threads; a decode step's linears (30 layers + LM head), ms, medians")
    print(f"{'rows':>5} {'panels':>8} {'oneDNN':>8} {'oneDNN / panels':>16}")
    for r in results:
        print(f"{r['rows']:>5} {r['panels_ms']:>8.1f} {r['onednn_ms']:>8.1f} {r['onednn_over_panels']:>16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa(), "threads": args.threads, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
