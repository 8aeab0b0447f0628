"""`python -m minfer.bench gemv`: why `minfer.model.layers.Linear` repacks its weights (`minfer.model.layers`).

Part 1, one row (batch-1 decode). For each weight shape of SmolLM2-135M, `copies` matrices (30, one per
layer, so that they stream from memory rather than sit in a 32 MiB L3 cache) are multiplied by one token's
activations, in four layouts:

    nn.Linear    `[out, in]`, y = x @ W.T (F.linear, MKL)
    longer-side  the longer side contiguous: `[in, out]` when out >= in, else `[out, in]` (`splits=1`)
    split        the same, cut into torch.get_num_threads() column slices run by one batched matmul
    onednn       oneDNN's packed layout (torch.ops.mkldnn._linear_pointwise), where torch has oneDNN

Prints GB/s of weights streamed and each layout's speed-up over nn.Linear, all measured in this run.

Part 2, many rows (`--rows`, batched decode and prefill): the whole stack of SmolLM2's 30 layers' weights
times `rows` tokens in the "nn", "split" and "onednn" layouts, in GFLOP/s. "hybrid", the default, runs
"split" for one row and "onednn" for more. Chapter 1 (§1.7) and its notebook (§7) use `run()`.
"""

from __future__ import annotations

import argparse
import json

import torch

from minfer.bench import best_time
from minfer.cpu.linear import SplitLinearMethod, onednn_available
from minfer.model.layers import Linear
from minfer.platform import get_linear_method

MAX_ROWS = 4096  # a 4096-row step of SmolLM2's whole weight stack already needs ~3 GB of activations
SHAPES = {"q|k|v": (576, 960), "o_proj": (576, 576), "gate|up": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}


def _layer(in_f: int, out_f: int, splits: int, layout: str) -> Linear:
    method = SplitLinearMethod(splits) if layout == "split" else get_linear_method(layout)
    lin = Linear(in_f, out_f, method=method)
    lin.weight.data.normal_()
    lin.process_weights_after_loading()
    return lin


@torch.inference_mode()
def measure(in_f: int, out_f: int, layout: str, splits: int = 1, copies: int = 30, repeats: int = 7) -> float:
    """GB/s of float32 weight bytes streamed by `copies` matrix-vector products in `layout` ("nn", "split"
    with `splits` column slices, "onednn"; see `minfer.model.layers`)."""
    layers = [_layer(in_f, out_f, splits, layout) for _ in range(copies)]
    x = torch.randn(1, in_f)
    t = best_time(lambda: [lin(x) for lin in layers], repeats)
    return copies * in_f * out_f * 4 / t / 1e9


@torch.inference_mode()
def measure_rows(rows: int, layout: str, splits: int, copies: int = 30, repeats: int = 3) -> float:
    """GFLOP/s of `rows` tokens through `copies` layers' worth of SmolLM2's weight shapes and one lm_head."""
    layers = [_layer(i, o, splits, layout) for _ in range(copies) for name, (i, o) in SHAPES.items()
              if name != "lm_head"]
    layers.append(_layer(*SHAPES["lm_head"], splits, layout))
    xs = {i: torch.randn(rows, i) for i, _ in SHAPES.values()}
    t = best_time(lambda: [lin(xs[lin.in_features]) for lin in layers], repeats)
    return sum(2 * rows * lin.in_features * lin.out_features for lin in layers) / t / 1e9


def run(threads: int | None = None, repeats: int = 7, rows: tuple[int, ...] = ()) -> dict:
    """Every shape in every layout at one row, and the whole stack at each of `rows`. Returns
    {"threads": n, "shapes": {name: {in, out, *_GBps}}, "rows": {str(rows): {layout: GFLOP/s}}}."""
    if threads:
        torch.set_num_threads(threads)
    n = torch.get_num_threads()
    onednn = onednn_available()
    shapes = {}
    for name, (i, o) in SHAPES.items():
        copies = 1 if name == "lm_head" else 30  # one lm_head is already 113 MB
        base, longer, split = (measure(i, o, lay, s, copies, repeats)
                               for lay, s in (("nn", 1), ("split", 1), ("split", n)))
        shapes[name] = {"in": i, "out": o, "nn_linear_GBps": base, "longer_side_GBps": longer, "split_GBps": split}
        if onednn:
            shapes[name]["onednn_GBps"] = measure(i, o, "onednn", copies=copies, repeats=repeats)
    layouts = ("nn", "split") + (("onednn",) if onednn else ())
    by_rows = {str(r): {lay: measure_rows(r, lay, n) for lay in layouts} for r in rows}
    return {"threads": n, "shapes": shapes, "rows": by_rows}


def format_table(res: dict) -> str:
    n = res["threads"]
    lines = [f"{n} threads; GB/s of float32 weights streamed by one token's matrix-vector products",
             f"{'matrix':10s} {'in->out':>12s} {'nn.Linear':>10s} {'longer-side':>12s} {'split x' + str(n):>10s}"
             "  speed-up (longer-side / split)"]
    for name, r in res["shapes"].items():
        b = r["nn_linear_GBps"]
        lines.append(f"{name:10s} {str(r['in']) + '->' + str(r['out']):>12s} {b:10.1f} {r['longer_side_GBps']:12.1f} "
                     f"{r['split_GBps']:10.1f}  {r['longer_side_GBps'] / b:.2f}x / {r['split_GBps'] / b:.2f}x"
                     + (f"   onednn {r['onednn_GBps']:.1f} ({r['onednn_GBps'] / b:.2f}x)" if "onednn_GBps" in r else ""))
    if res.get("rows"):
        layouts = list(next(iter(res["rows"].values())))
        lines += ["", "GFLOP/s of the 30 layers' weights + lm_head times `rows` tokens",
                  f"{'rows':>6s} " + " ".join(f"{lay:>8s}" for lay in layouts) + "   best"]
        for r, by in res["rows"].items():
            best = max(by, key=by.get)
            lines.append(f"{r:>6s} " + " ".join(f"{by[lay]:8.1f}" for lay in layouts) + f"   {best}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.bench gemv", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rows", default="", metavar="N,N,...",
                    help="also time the whole weight stack at these row counts (e.g. 1,2,8,64,512)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    try:
        rows = tuple(int(r) for r in args.rows.split(",") if r.strip())
    except ValueError:
        ap.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    if any(r < 1 or r > MAX_ROWS for r in rows):
        ap.error(f"--rows must be between 1 and {MAX_ROWS}")
    res = run(args.threads, rows=rows)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
