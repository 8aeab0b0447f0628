"""Lesson 05's GPU section: does the W4A16 kernel turn 4-bit weights into fewer bytes read and less time?

For each shape it times, synchronized (`minfer.course.timed`), three ways to compute `y = x W^T` with W in
minfer's int4 storage (4-bit codes, a bfloat16 scale and zero per group of 128):

- `w4a16`: the Triton kernel `minfer.kernels.w4a16.w4a16_matmul`, which reads the packed codes and dequantizes
  in registers;
- `dequant+matmul`: `dequantize_int4` to a float16 weight, then `torch.matmul` (what a route without the kernel
  does: the float weight is written and read again on every call);
- `fp16`: `torch.matmul` with the float16 weight stored (the unquantized baseline).

It returns the times, the bytes of weight each route moves per call and the bandwidth that implies, and the
kernel's largest difference from `minfer.kernels.reference.w4a16_reference`. At decode sizes (small M) the
lesson's claim is that w4a16 approaches fp16's time x (0.5 + 4/G) / 2.

`run(device, small=True)` uses tiny shapes and fewer repeats so the same code path runs anywhere in seconds: on
a CPU the kernel runs under Triton's interpreter (set by `minfer.kernels` when there is no CUDA), which is
slow and says nothing about GPU speed, only that the section works.
"""

from __future__ import annotations

from typing import Any

GROUP = 128
FULL_SHAPES = [(4096, 4096), (14336, 4096)]          # (N, K): Llama-3-8B's o_proj-like and up_proj-like
FULL_ROWS = [1, 16, 64, 256]
SMALL_SHAPES = [(128, 256)]
SMALL_ROWS = [1]


def run(device: str = "cuda", small: bool = False) -> dict[str, Any]:
    """Time the W4A16 kernel, dequantize + matmul and a float16 matmul on `device`; returns a dict with `rows`
    (one per shape and M) and the machine note. `small=True`: tiny shapes, 1 repeat (any device, < 20 s)."""
    import torch

    from minfer.course import machine, timed
    from minfer.kernels.reference import w4a16_reference
    from minfer.kernels.w4a16 import w4a16_matmul
    from minfer.quantization.int4 import dequantize_int4, pack_int4_blocked, quantize_int4

    info = machine(device)
    dev = torch.device(device)
    shapes, ms = (SMALL_SHAPES, SMALL_ROWS) if small else (FULL_SHAPES, FULL_ROWS)
    group = 64 if small else GROUP
    repeat, warmup = (1, 0) if small else (20, 2)   # small: the call above already ran each path once
    half = torch.float16
    rows = []
    g = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        codes, scale, zero = quantize_int4(w, group)
        qweight = pack_int4_blocked(codes).to(dev)
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dev)
        codes_d, scale_d, zero_d = codes.to(dev), scale.to(dev), zero.to(dev)
        w16 = dequantize_int4(codes, scale, zero).to(half).to(dev)
        packed_bytes = qweight.numel() * qweight.element_size() + sz.numel() * sz.element_size()
        # the dequantize route reads minfer's unpacked codes (one byte per weight) and its scales and zeros
        unpacked_bytes = codes_d.numel() * codes_d.element_size() + 2 * scale_d.numel() * scale_d.element_size()
        for m in ms:
            x = torch.randn(m, k, generator=g).to(half).to(dev)
            y = w4a16_matmul(x, qweight, sz, group, blocked=True)
            ref = w4a16_reference(x.float().cpu(), codes, scale, zero).float()
            err = (y.float().cpu() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
            t_kernel = timed(lambda: w4a16_matmul(x, qweight, sz, group, blocked=True), dev, repeat=repeat, warmup=warmup)
            t_deq = timed(lambda: x @ dequantize_int4(codes_d, scale_d, zero_d, half).t(), dev, repeat=repeat, warmup=warmup)
            t_fp16 = timed(lambda: x @ w16.t(), dev, repeat=repeat, warmup=warmup)
            # weight bytes moved per call: the kernel reads the packed codes and scales once; dequantize reads
            # the unpacked codes and scales, writes a float16 weight and the matmul reads it back; fp16 reads its
            # float16 weight.
            bytes_ = {"w4a16": packed_bytes, "dequant+matmul": unpacked_bytes + 2 * 2 * n * k, "fp16": 2 * n * k}
            times = {"w4a16": t_kernel, "dequant+matmul": t_deq, "fp16": t_fp16}
            rows.append({
                "N": n, "K": k, "M": m, "group_size": group,
                "ms": {r: t * 1e3 for r, t in times.items()},
                "weight_bytes": bytes_,
                "weight_GBps": {r: bytes_[r] / times[r] / 1e9 for r in times},
                "w4a16_vs_fp16": t_fp16 / t_kernel,
                "w4a16_vs_dequant": t_deq / t_kernel,
                "max_rel_diff_vs_reference": err,
            })
    return {"device": str(dev), "machine": info, "small": small, "rows": rows}


def table(result: dict[str, Any]) -> str:
    """The rows of `run`'s result as a fixed-width text table."""
    lines = [f"{'N x K':>12} {'M':>4} {'w4a16 ms':>9} {'deq+mm ms':>10} {'fp16 ms':>8} {'vs fp16':>8} "
             f"{'w4a16 GB/s':>10} {'max rel diff':>12}"]
    for r in result["rows"]:
        lines.append(f"{r['N']:>5} x {r['K']:<5} {r['M']:>4} {r['ms']['w4a16']:9.3f} {r['ms']['dequant+matmul']:10.3f} "
                     f"{r['ms']['fp16']:8.3f} {r['w4a16_vs_fp16']:7.2f}x {r['weight_GBps']['w4a16']:10.1f} "
                     f"{r['max_rel_diff_vs_reference']:12.2e}")
    return "\n".join(lines)
