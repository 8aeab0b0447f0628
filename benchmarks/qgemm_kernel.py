"""The register-tiled integer GEMM (minfer/cpu/qgemm.py) against oneDNN's float32 sgemm (`F.linear`)
and the older GEMV-style GGUF kernel (minfer/cpu/gguf_matmul.py), on SmolLM2-135M's shapes, at
T = 1, 16, 64, 256, 2048 rows (chapter 5 §5.3):

    python benchmarks/qgemm_kernel.py [--threads 2] [--rows 1,16,64,256,2048] [--head]

  qgemm_<fmt>_<isa>   the tiled kernel on Q4_1 and Q4_0 (the GGUF's blocks; each ISA forced), int4 g64 and int8 codes
  gemv_q4_1           the older kernel on the same Q4_1 bytes (rows <= 256: it is slow above)
  float32             F.linear on a float32 weight (oneDNN sgemm)

At 1 row each route cycles through `--copies` weight matrices (one per layer, as a decode step does) so the
weights come from memory; at more rows the product is compute-bound and one matrix is reused. GFLOP/s =
2 T N K / time. Writes assets/benchmarks/qgemm_kernel_cpu.json. The machine may be shared: compare only
within a row (the routes of one row run interleaved, in the same minute).

Against the machine's peaks (`--peak`: a JSON of benchmarks/peak_idiom.py, measured just before on the same
machine), each qgemm route of a row gains `<route>_of_idiom` (its fraction of the multiply-add idiom's peak of
its path: vpdpbusd on VNNI, maddubs + madd on AVX2) and `<route>_of_ceiling` (of the rate of qgemm's own block,
the idiom plus its format's per-block float work: the ceiling), and float32 sgemm `float32_of_fma` (of the FMA
peak); `--before` adds the rows of an earlier run of this script (its numbers as they were), with their
fractions of the peaks measured with them, under "before":

    python benchmarks/qgemm_kernel.py --rows 64,256,512 --peak assets/benchmarks/peak_idiom_cpu.json \\
        --before OLD.json:OLD_PEAK.json --out assets/benchmarks/qgemm_kernel_cpu_vs_idiom_peak.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64 (q|k|v = 960 rows), MLP 1536.
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]


def _time(fns: list, x: torch.Tensor, repeats: int, min_s: float = 0.05) -> float:
    """Median microseconds per call, cycling through `fns` (one per weight copy)."""
    for f in fns:
        f(x)
    runs = []
    for _ in range(repeats):
        t, calls = time.perf_counter(), 0
        while True:
            for f in fns:
                f(x)
            calls += len(fns)
            if time.perf_counter() - t >= min_s:
                break
        runs.append((time.perf_counter() - t) / calls)
    return statistics.median(runs) * 1e6


# the block ceiling (peak_idiom.py's BLOCK_EPILOGUES) whose epilogue each route's format runs
CEILING_OF = {"int8": "int8", "q4_0": "q4_0", "q4_1": "q4_1", "int4_g64": "q4_1"}
PATH_OF = {"vnni": "avx512_vnni", "avx2": "avx2"}


def add_fractions(row: dict, peak: dict) -> dict:
    """`row` with `<route>_of_idiom` for each qgemm route, `<route>_of_ceiling` where the peak_idiom.py JSON `peak`
    has the block ceilings (older ones have only the idiom's peaks), and `float32_of_fma` (sgemm's fraction of
    the float32 FMA peak)."""
    out = dict(row)
    if "float32_gflops" in row and peak.get("fma_gflops"):  # sgemm against the float32 FMA peak
        out["float32_of_fma"] = round(row["float32_gflops"] / peak["fma_gflops"], 3)
    for key, gops in row.items():
        m = re.fullmatch(r"qgemm_(\w+?)_(vnni|avx2)_gflops", key)
        if not m:
            continue
        path, route = PATH_OF[m[2]], key[:-len("_gflops")]
        ceiling = peak.get("qgemm_ceiling", {}).get(path)
        idiom = ceiling["idiom_gops"] if ceiling else peak.get("int8_idiom_gops_by_isa", {}).get(path)
        if idiom:
            out[f"{route}_of_idiom"] = round(gops / idiom, 3)
        if ceiling:
            out[f"{route}_of_ceiling"] = round(gops / ceiling[f"{CEILING_OF[m[1]]}_gops"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--copies", type=int, default=30, help="weight copies cycled through at 1 row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--head", action="store_true",
                    help="also the tied LM head 49152x576 at 1 and 64 rows (2 copies): would routing it pay?")
    ap.add_argument("--out", default=str(ROOT / "assets" / "benchmarks" / "qgemm_kernel_cpu.json"))
    ap.add_argument("--peak", default=None, help="a peak_idiom.py JSON: add each route's fraction of the peaks")
    ap.add_argument("--before", action="append", default=[], metavar="JSON[:PEAK_JSON]",
                    help="an earlier run of this script (repeatable): its rows with their fractions of PEAK_JSON's "
                         "peaks (default: --peak's), under 'before'")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from minfer.cpu.gguf_matmul import gguf_matmul, pack_gguf, repack_blocks
    from minfer.cpu.qgemm import ISAS, best_isa, pack, qgemm_unchecked
    from minfer.quantization.int4 import quantize_int4
    from minfer.quantization.int8 import quantize_int8

    isas = [i for i in ("vnni", "avx2") if ISAS[i] <= ISAS[best_isa()]]
    peak = json.loads(Path(args.peak).read_text()) if args.peak else None
    out_rows = []
    load = os.getloadavg()[0]
    shapes = SHAPES + ([("lm_head", 49152, 576)] if args.head else [])
    for name, n, k in shapes:
        max_copies = 2 if name == "lm_head" else args.copies
        ws = [torch.randn(n, k, generator=torch.Generator().manual_seed(s)) * 0.05 for s in range(max_copies)]
        raws = [torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), GGMLQuantizationType.Q4_1))) for w in ws]
        planes = [repack_blocks(r, "Q4_1") for r in raws]
        q41 = [pack_gguf([p], "Q4_1") for p in planes]
        raws0 = [torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), GGMLQuantizationType.Q4_0))) for w in ws]
        q40 = [pack_gguf([repack_blocks(r, "Q4_0")], "Q4_0") for r in raws0]
        i4 = [pack(*quantize_int4(w, 64), 4, offset=8) for w in ws]
        i8 = []
        for w in ws:
            q, s = quantize_int8(w)
            i8.append(pack(q, s[:, None], None, 8))
        for t in [1, 64] if name == "lm_head" else [int(r) for r in args.rows.split(",")]:
            c = max_copies if t == 1 else 1
            x = torch.randn(t, k)
            routes = {}
            for isa in isas:
                routes[f"qgemm_q4_1_{isa}"] = [lambda x, w=w, isa=isa: qgemm_unchecked(x, w, isa) for w in q41[:c]]
                routes[f"qgemm_q4_0_{isa}"] = [lambda x, w=w, isa=isa: qgemm_unchecked(x, w, isa) for w in q40[:c]]
            routes[f"qgemm_int4_g64_{isas[0]}"] = [lambda x, w=w: qgemm_unchecked(x, w) for w in i4[:c]]
            routes[f"qgemm_int8_{isas[0]}"] = [lambda x, w=w: qgemm_unchecked(x, w) for w in i8[:c]]
            if t <= 256:
                routes["gemv_q4_1"] = [lambda x, p=p: gguf_matmul(x, *p, "Q4_1") for p in planes[:c]]
            routes["float32"] = [lambda x, w=w: F.linear(x, w) for w in ws[:c]]
            row = {"layer": name, "shape": f"{k}->{n}", "rows": t}
            for route, fns in routes.items():
                us = _time(fns, x, args.repeats)
                row[f"{route}_us"] = round(us, 1)
                row[f"{route}_gflops"] = round(2 * t * n * k / us / 1e3, 2)
            row["speedup_q4_1_vs_float32"] = round(row["float32_us"] / row[f"qgemm_q4_1_{isas[0]}_us"], 2)
            row["speedup_int8_vs_float32"] = round(row["float32_us"] / row[f"qgemm_int8_{isas[0]}_us"], 2)
            if "gemv_q4_1_us" in row:
                row["speedup_q4_1_vs_gemv"] = round(row["gemv_q4_1_us"] / row[f"qgemm_q4_1_{isas[0]}_us"], 2)
            if args.peak:
                row = add_fractions(row, peak)
            print(json.dumps(row), flush=True)
            out_rows.append(row)
    result = {"threads": args.threads, "copies_at_1_row": args.copies, "best_isa": best_isa(),
              "load_average_1min": load, "load_average_1min_after": os.getloadavg()[0],
              "cpus": os.cpu_count(), "torch": torch.__version__,
              "note": "the load average before and after says what else ran; compare routes within a row",
              "rows": out_rows}
    if peak:
        result["peak"] = {"source": Path(args.peak).name, "fma_gflops": peak["fma_gflops"],
                          "int8_idiom_gops": peak["int8_idiom_gops"], "qgemm_ceiling": peak["qgemm_ceiling"],
                          "load_average_before_after": peak.get("load_average_before_after")}
    result["before"] = []
    for spec in args.before:
        path, _, peak_path = spec.partition(":")
        their_peak = json.loads(Path(peak_path).read_text()) if peak_path else peak
        rows = json.loads(Path(path).read_text())["rows"]
        result["before"].append({"source": Path(path).name, "peak": Path(peak_path or args.peak or "").name or None,
                                 "peak_int8_idiom_gops": their_peak["int8_idiom_gops"] if their_peak else None,
                                 "rows": [add_fractions(r, their_peak) if their_peak else r for r in rows]})
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
