"""Lesson 04's GPU section: minfer's FlashAttention kernel against naive attention, time and peak memory.

The lesson claims two things a GPU can check: the tiled kernel never allocates the `[heads, L, L]` score matrix
(so its extra memory stays flat while naive attention's grows with L^2), and it moves fewer bytes through HBM (so
it is faster at long L). `run("cuda")` measures both for one causal sequence in bf16, head_dim 128, at a few
lengths: synchronized wall time (`minfer.course.timed`) and the peak memory each call allocates beyond its
inputs (`torch.cuda.max_memory_allocated`). `run(device, small=True)` runs the same code on tiny shapes: on a
CPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`, which `minfer.kernels` sets when there is
no CUDA), or, where Triton cannot run on that device, minfer's torch reference stands in for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence as three torch operations in the input dtype: S = Q K^T (written out),
    P = softmax(S) (written out), O = P V. q: [L, H, D]; k, v: [L, KVH, D]."""
    L, H, D = q.shape
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * (1.0 / math.sqrt(D))
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def _peak_mib(fn, device: torch.device) -> float | None:
    """MiB allocated at the peak of `fn()` beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def run(device: str = "cuda", small: bool = False) -> dict[str, Any]:
    """Time and peak memory of `flash_attn_varlen` and `naive_attention`, causal, at a few sequence lengths.

    Returns a dict: device, gpu (name or None), kernel (what ran as "flash"), dtype, heads, kv_heads, head_dim,
    and rows of {seq_len, flash_ms, naive_ms, naive_over_flash, flash_peak_mib, naive_peak_mib,
    score_matrix_mib, max_abs_err}; naive_ms is None where naive attention ran out of memory.
    """
    import minfer.kernels as K
    from minfer.course import machine, timed
    from minfer.kernels import reference as R

    dev = torch.device(device)
    info = machine(device)
    if small:
        lengths, heads, kv_heads, head_dim, dtype, repeat = [16, 48], 2, 1, 16, torch.float32, 1
    else:
        lengths, heads, kv_heads, head_dim, dtype, repeat = [1024, 2048, 4096, 8192, 16384], 16, 4, 128, torch.bfloat16, 5
    triton_here = dev.type == "cuda" or K.interpreter_active()
    flash_fn = K.flash_attn_varlen if triton_here else R.flash_attn_varlen_reference
    g = torch.Generator().manual_seed(0)
    rows = []
    for L in lengths:
        q = torch.randn(L, heads, head_dim, generator=g).to(dev, dtype)
        k = torch.randn(L, kv_heads, head_dim, generator=g).to(dev, dtype)
        v = torch.randn(L, kv_heads, head_dim, generator=g).to(dev, dtype)
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)

        def flash():
            return flash_fn(q, k, v, cu, cu, L, L, causal=True)

        def naive():
            return naive_attention(q, k, v)

        row: dict[str, Any] = {"seq_len": L, "score_matrix_mib": heads * L * L * torch.finfo(dtype).bits / 8 / 2**20}
        out = flash()
        row["flash_ms"] = 1e3 * timed(flash, dev, repeat=repeat, warmup=0 if small else 1)
        row["flash_peak_mib"] = _peak_mib(flash, dev)
        try:
            ref = naive()
            row["naive_ms"] = 1e3 * timed(naive, dev, repeat=repeat, warmup=0 if small else 1)
            row["naive_peak_mib"] = _peak_mib(naive, dev)
            row["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
            row["naive_over_flash"] = row["naive_ms"] / row["flash_ms"]
            del ref
        except torch.cuda.OutOfMemoryError:
            row.update(naive_ms=None, naive_peak_mib=None, max_abs_err=None, naive_over_flash=None)
        del out
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    return {"device": str(dev), "gpu": info.get("gpu"), "machine": info,
            "kernel": "flash_attn_varlen (Triton)" + (" under the interpreter" if dev.type != "cuda" else "")
            if triton_here else "flash_attn_varlen_reference (torch; no Triton on this device)",
            "dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rows": rows}


def table(result: dict[str, Any]) -> str:
    """The rows of `run`'s result as a text table."""
    lines = [f"{result['kernel']} vs naive attention on {result['gpu'] or result['device']}, {result['dtype']}, "
             f"{result['heads']} heads ({result['kv_heads']} K/V), head_dim {result['head_dim']}, causal",
             f"{'L':>6} {'flash ms':>9} {'naive ms':>9} {'naive/flash':>11} {'flash MiB':>10} {'naive MiB':>10} "
             f"{'S MiB':>8} {'max err':>8}"]

    def f(x, spec):
        return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))
    for r in result["rows"]:
        lines.append(f"{r['seq_len']:6d} {f(r['flash_ms'], '9.3f')} {f(r['naive_ms'], '9.3f')} "
                     f"{f(r['naive_over_flash'], '11.2f')} {f(r['flash_peak_mib'], '10.1f')} "
                     f"{f(r['naive_peak_mib'], '10.1f')} {r['score_matrix_mib']:8.1f} {f(r['max_abs_err'], '8.1e')}")
    return "\n".join(lines)
