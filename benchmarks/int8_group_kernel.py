"""minfer's C++ int8-group matmul (GGUF Q8_0 / Q5_0 / Q6_K, minfer/cpu/int8_group.py) against torch's
routes, at batch 1 and 64, on SmolLM2-135M's shapes (chapter 5 §5.3).

    python benchmarks/int8_group_kernel.py            # about a minute on 2 cores

Per shape `[out, in]` and rows T, the median time of:
  kernel       int8_group_matmul (int8 codes, float32 group-of-32 scales, float32 activations)
  dequant      dequantize to float32 + F.linear (the route the method takes above its row threshold)
  float32      F.linear with the float32 weight already expanded (the float model's cost; 4 bytes/weight)
  int8pack     torch.ops.aten._weight_int8pack_mm, bf16 activations, one scale per ROW (what `int8` uses;
               it cannot hold Q8_0's group scales, shown for speed only)
Writes assets/benchmarks/int8_group_kernel_cpu.json. The machine is shared: compare only within a row.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "lm_head 49152x576": (49152, 576)}


def bench(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6  # us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--out", default=str(ROOT / "assets" / "benchmarks" / "int8_group_kernel_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from minfer.cpu.int8_group import dequantize_int8_group, int8_group_matmul

    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        s = torch.rand(n, k // 32, generator=g) * 0.01
        w = dequantize_int8_group(q, s)
        s_row = torch.rand(n, generator=g).to(torch.bfloat16)
        for t in rows:
            x = torch.randn(t, k, generator=g)
            xb = x.to(torch.bfloat16)
            rep = max(3, args.repeats // (4 if n > 10000 else 1))
            r = {"shape": name, "rows": t,
                 "kernel_us": bench(lambda: int8_group_matmul(x, q, s), rep),
                 "dequant_us": bench(lambda: F.linear(x, dequantize_int8_group(q, s)), rep),
                 "float32_us": bench(lambda: F.linear(x, w), rep),
                 "int8pack_bf16_us": bench(lambda: torch.ops.aten._weight_int8pack_mm(xb, q, s_row), rep)}
            r["kernel_vs_float32"] = r["float32_us"] / r["kernel_us"]
            r["kernel_vs_dequant"] = r["dequant_us"] / r["kernel_us"]
            results.append(r)
            print(json.dumps(r), flush=True)
    out = {"what": "int8 codes x group-of-32 float32 scales (GGUF Q8_0): minfer's C++ kernel vs torch routes",
           "command": "python benchmarks/int8_group_kernel.py",
           "threads": args.threads,
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, shared with other "
                      "jobs; each row's routes were timed back to back, compare within a row",
           "cpu_flags": sorted({f for f in open("/proc/cpuinfo").read().split() if f in
                                ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "fma")}),
           "results": results}
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
