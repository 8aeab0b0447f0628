"""Why `minfer.model.layers.Linear` repacks its weights: batch-1 matrix-vector speed per weight layout.

For each weight shape of SmolLM2-135M, 30 copies (one per layer, so that they stream from memory rather than
sit in the 32 MiB L3 cache) are multiplied by one token's activations, in three layouts:

    nn.Linear    `[out, in]`, y = x @ W.T (F.linear)
    longer-side  the longer side contiguous: `[in, out]` when out >= in, else `[out, in]` (`splits=1`)
    split        the same, cut into torch.get_num_threads() column slices run by one batched matmul

    python benchmarks/gemv_layouts.py [--threads N] [--json FILE]

Prints GB/s of weights streamed and each layout's speed-up over nn.Linear, all measured in this run.
"""

from __future__ import annotations

import argparse
import json
import time

import minfer  # noqa: F401  (sets the OpenMP spin policy before torch loads)
import torch

from minfer.model.layers import Linear

SHAPES = {"q|k|v": (576, 960), "o_proj": (576, 576), "gate|up": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}


def best_time(fn, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def measure(in_f: int, out_f: int, splits: int, copies: int) -> float:
    """GB/s of weight bytes streamed by `copies` matrix-vector products in the given layout."""
    layers = []
    for _ in range(copies):
        lin = Linear(in_f, out_f)
        lin.weight.data.normal_()
        if splits:
            lin.process_weights_after_loading(splits)
        layers.append(lin)
    x = torch.randn(1, in_f)
    t = best_time(lambda: [lin(x) for lin in layers])
    return copies * in_f * out_f * 4 / t / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n = torch.get_num_threads()
    print(f"{n} threads; GB/s of float32 weights streamed by one token's matrix-vector products")
    print(f"{'matrix':10s} {'in->out':>12s} {'nn.Linear':>10s} {'longer-side':>12s} {'split x' + str(n):>10s}  speed-up")
    rows = {}
    for name, (i, o) in SHAPES.items():
        copies = 1 if name == "lm_head" else 30
        base, longer, split = (measure(i, o, s, copies) for s in (0, 1, n))
        rows[name] = {"in": i, "out": o, "nn_linear_GBps": base, "longer_side_GBps": longer, "split_GBps": split}
        print(f"{name:10s} {f'{i}->{o}':>12s} {base:10.1f} {longer:12.1f} {split:10.1f}  "
              f"{longer / base:.2f}x / {split / base:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": n, "shapes": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
