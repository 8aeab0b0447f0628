"""`python -m minfer.bench gemv`: why `minfer.model.layers.Linear` repacks its weights.

Batch-1 matrix-vector speed per weight layout. For each weight shape of SmolLM2-135M, `copies` matrices (30,
one per layer, so that they stream from memory rather than sit in a 32 MiB L3 cache) are multiplied by one
token's activations, in three layouts:

    nn.Linear    `[out, in]`, y = x @ W.T (F.linear)
    longer-side  the longer side contiguous: `[in, out]` when out >= in, else `[out, in]` (`splits=1`)
    split        the same, cut into torch.get_num_threads() column slices run by one batched matmul

Prints GB/s of weights streamed and each layout's speed-up over nn.Linear, all measured in this run.
Chapter 1 (§1.7) and its notebook (§7) use `run()`.
"""

from __future__ import annotations

import argparse
import json

import torch

from minfer.bench import best_time
from minfer.model.layers import Linear

SHAPES = {"q|k|v": (576, 960), "o_proj": (576, 576), "gate|up": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}


@torch.inference_mode()
def measure(in_f: int, out_f: int, splits: int, copies: int = 30, repeats: int = 7) -> float:
    """GB/s of float32 weight bytes streamed by `copies` matrix-vector products; `splits=0` is nn.Linear's
    layout, `splits>=1` the repacked one (see `Linear.process_weights_after_loading`)."""
    layers = []
    for _ in range(copies):
        lin = Linear(in_f, out_f)
        lin.weight.data.normal_()
        if splits:
            lin.process_weights_after_loading(splits)
        layers.append(lin)
    x = torch.randn(1, in_f)
    t = best_time(lambda: [lin(x) for lin in layers], repeats)
    return copies * in_f * out_f * 4 / t / 1e9


def run(threads: int | None = None, repeats: int = 7) -> dict:
    """Every shape in every layout. Returns {"threads": n, "shapes": {name: {in, out, *_GBps}}}."""
    if threads:
        torch.set_num_threads(threads)
    n = torch.get_num_threads()
    rows = {}
    for name, (i, o) in SHAPES.items():
        copies = 1 if name == "lm_head" else 30  # one lm_head is already 113 MB
        base, longer, split = (measure(i, o, s, copies, repeats) for s in (0, 1, n))
        rows[name] = {"in": i, "out": o, "nn_linear_GBps": base, "longer_side_GBps": longer, "split_GBps": split}
    return {"threads": n, "shapes": rows}


def format_table(res: dict) -> str:
    n = res["threads"]
    lines = [f"{n} threads; GB/s of float32 weights streamed by one token's matrix-vector products",
             f"{'matrix':10s} {'in->out':>12s} {'nn.Linear':>10s} {'longer-side':>12s} {'split x' + str(n):>10s}"
             "  speed-up (longer-side / split)"]
    for name, r in res["shapes"].items():
        b = r["nn_linear_GBps"]
        lines.append(f"{name:10s} {str(r['in']) + '->' + str(r['out']):>12s} {b:10.1f} {r['longer_side_GBps']:12.1f} "
                     f"{r['split_GBps']:10.1f}  {r['longer_side_GBps'] / b:.2f}x / {r['split_GBps'] / b:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.bench gemv", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    res = run(args.threads)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
