"""The best float32 matmul speed torch reaches on this CPU: square products of 1,024 to 3,072 through `torch.mm`
(MKL / oneDNN) and oneDNN's packed linear, 2 threads, best of 5 (GFLOP/s = 2 n^3 / time). Lab notes 9b §9b.13.1
uses it beside `serve_roofline.py`'s projection-shape speed: together they say how close the served workload's
ceiling is to what this CPU's float32 units give.

    flock /tmp/minfer-bench.lock python3 benchmarks/peak_gemm.py [--json PATH]
"""
import argparse
import json
import os

import torch

from minfer.bench import best_time


def measure(sizes=(1024, 2048, 3072), threads: int = 2, repeats: int = 5) -> dict:
    """{"mm_N_gflops", "onednn_N_gflops" for each N, load averages}: best of `repeats` float32 products N x N x N."""
    torch.set_num_threads(threads)
    res = {"threads": threads, "load_before": os.getloadavg()[0]}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, n), n)
        for name, fn in (("mm", lambda: torch.mm(a, b)),
                         ("onednn", lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))):
            res[f"{name}_{n}_gflops"] = 2 * n**3 / best_time(fn, repeats) / 1e9
    res["load_after"] = os.getloadavg()[0]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    res = measure()
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
