"""minfer's C++ kernel for GGUF blocks (minfer/cpu/gguf_matmul.py: int8 activations, integer dot
products) against the routes it replaced, on SmolLM2-135M's shapes (chapter 5 §5.3):

    python benchmarks/gguf_matmul_kernel.py [--threads 1] [--rows 1,8,64]

  blocks (vnni / avx2)  gguf_matmul on the file's Q4_1 (or Q8_0) bytes, each instruction set forced
  int4 op               torch's _weight_int4pack_mm_for_cpu, bfloat16 activations (the older Q4_1 route)
  int8-group kernel     minfer's float32 int8-group kernel (the older Q8_0 route)
  float32 sgemm         F.linear on the dequantized float32 weight (540 MB per token for the whole model)

Each route cycles through `--copies` different weight matrices (30 by default, one per layer, as a decode
step does), so the weights come from memory, not from a cache that a loop over one matrix would keep warm.
Writes assets/benchmarks/gguf_matmul_kernel_cpu.json. The machine may be shared: compare only within a row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [("qkv", 960, 576, "Q4_1"), ("gate_up", 3072, 576, "Q4_1"), ("down", 576, 1536, "Q4_1"),
          ("lm_head", 49152, 576, "Q8_0")]


def _raw(ggml_type: str, n: int, k: int, seed: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(quantize(w, GGMLQuantizationType[ggml_type])))


def _time(fns: list, x: torch.Tensor, repeats: int) -> float:
    """Median microseconds per call, cycling through `fns` (one per weight copy)."""
    for f in fns:
        f(x)
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for f in fns:
            f(x)
        runs.append((time.perf_counter() - t) / len(fns))
    return statistics.median(runs) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--copies", type=int, default=30, help="weight copies cycled through (head: 2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "assets" / "benchmarks" / "gguf_matmul_kernel_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from minfer.cpu.gguf_matmul import ISAS, best_isa, dequantize_blocks, gguf_matmul, repack_blocks
    from minfer.cpu.int8_group import int8_group_matmul
    from minfer.quantization.gguf import decode_int8_group_blocks, decode_q4_blocks
    from minfer.quantization.int4 import pack_int4

    isas = [i for i in ("vnni", "avx2") if ISAS[i] <= ISAS[best_isa()]]
    rows = []
    load = os.getloadavg()[0]
    for name, n, k, typ in SHAPES:
        copies = 2 if name == "lm_head" else args.copies
        raws = [_raw(typ, n, k, seed) for seed in range(copies)]
        planes = [repack_blocks(r, typ) for r in raws]
        routes = {f"blocks_{i}": [lambda x, p=p, i=i: gguf_matmul(x, *p, typ, isa=i) for p in planes] for i in isas}
        if typ == "Q4_1":
            ops = []
            for r in raws:
                c, s, z = decode_q4_blocks(r, typ)
                sz = torch.stack([s, z], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
                ops.append((pack_int4(c), sz))
            routes["int4_op_bf16"] = [lambda x, o=o: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), o[0], 32, o[1]) for o in ops]
        else:
            groups = [decode_int8_group_blocks(r, typ) for r in raws]
            routes["int8_group_kernel"] = [lambda x, g=g: int8_group_matmul(x, *g) for g in groups]
        ws = [dequantize_blocks(*p, typ) for p in planes]
        routes["float32_sgemm"] = [lambda x, w=w: F.linear(x, w) for w in ws]
        for t in (int(r) for r in args.rows.split(",")):
            x = torch.randn(t, k)
            row = {"shape": f"{n}x{k}", "layer": name, "type": typ, "rows": t}
            for route, fns in routes.items():
                row[f"{route}_us"] = _time(fns, x, args.repeats)
            rows.append(row)
            print(row, flush=True)
        del ws, routes
    out = {"threads": args.threads, "copies": args.copies, "best_isa": best_isa(), "load_average_1min": load,
           "load_average_1min_after": os.getloadavg()[0], "cpus": os.cpu_count(), "rows": rows,
           "command": "python benchmarks/gguf_matmul_kernel.py " + " ".join(argv or []),
           "note": "measured on a shared 2-core machine (see the load average): compare routes within a row"}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
