"""The fused element-wise ops of the Llama layer on the CPU: RMSNorm (with the residual add), SiLU-and-mul
and RoPE, each one C++ loop (`csrc/fused_cpu.cpp`) instead of 3-6 torch ops (chapter 9, "where the time goes").

The functions have the signatures and contracts of the Triton kernels in `minfer.kernels.fused`, so the model's
layers take either module as their `BuildOptions.fused_ops` (`minfer.model.layers.FusedOps`):

    rms_norm(x, weight, eps)                     -> out                    (new memory)
    fused_add_rms_norm(x, residual, weight, eps) -> (out, x + residual)    (new memory; inputs untouched)
    silu_and_mul(x [..., 2I])                    -> silu(x[..., :I]) * x[..., I:]
    apply_rotary_(q, k, cos, sin)                -> (q, k) rotated in place (rotate-half layout)

float32 CPU tensors only (what the engine's CPU path runs); the loops are split over rows with OpenMP
(`torch.get_num_threads()` threads). They are built like every kernel of the wing (`minfer.cpu.build`: once per
checkout, source version and kind of CPU); `fused_cpu_available()` says whether that worked, and the platform
falls back to plain torch, silently, where it did not. They are on for every float32 CPU model loaded with
kernels="auto" (`minfer.platform.CpuPlatform.fused_ops` hands this module to `load_model`, whose "auto" is the
worker's too, so the engine's model and any other one compute alike); kernels="reference" leaves them out.
Results match the torch ops to a few float32 ulps, and are batch-invariant: a row's bits do not depend on how
many rows come with it, on its address or on the thread split (`tests/test_fused_cpu.py`; how, at the top of
`csrc/fused_cpu.cpp`).
"""

from __future__ import annotations

import torch

from minfer.cpu.build import F32, I32, I64, PTR, CppLibrary, KernelUnavailable

# No -ffast-math, and no fused multiply-adds: every row gets the same float operations in the same order,
# whatever its address or batch (batch invariance; the top of csrc/fused_cpu.cpp says how).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]


class FusedCpuUnavailable(KernelUnavailable):
    """The fused CPU ops could not be built or loaded here (the message says why)."""


LIBRARY = CppLibrary("minfer_fused_cpu", "fused_cpu.cpp", CFLAGS, {
    "minfer_rms_norm_f32": ([PTR, PTR, PTR, I64, I64, I64, I64, F32, I32], None),
    "minfer_fused_add_rms_norm_f32": ([PTR, PTR, PTR, PTR, PTR, I64, I64, I64, I64, F32, I32], None),
    "minfer_silu_and_mul_f32": ([PTR, PTR, I64, I64, I64, I32], None),
    "minfer_rotary_f32": ([PTR, PTR, PTR, PTR, I64, I64, I64, I64, I64, I64, I64, I64, I32], None),
}, FusedCpuUnavailable)
_library = LIBRARY.load
fused_cpu_available = LIBRARY.available


def _check(name: str, t: torch.Tensor) -> None:
    # `is_cpu` and a dtype comparison: cheap (`t.device.type` builds a device object per call).
    if t.dtype != torch.float32 or not t.is_cpu:
        raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if not t.dim():
        raise ValueError(f"{name} must have a last (hidden) dim, got a 0-d tensor")


def _rows(name: str, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x as rows of its last dim: (a tensor whose rows the kernel reads, rows, row stride in floats). A
    contiguous x (what the model passes) goes as it is; another one as a `[rows, last]` view where the
    strides allow it, else a contiguous copy."""
    _check(name, x)
    n = x.shape[-1]
    if x.is_contiguous():
        return x, (x.numel() // n if n else 0), n
    x2 = x.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    return x2, x2.shape[0], x2.stride(0)


def _check_weight(weight: torch.Tensor, n: int) -> torch.Tensor:
    _check("weight", weight)
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    return weight if weight.is_contiguous() else weight.contiguous()


# The per-call Python work is most of a batch-1 call (a 576-float row takes well under a microsecond in
# C++), so the wrappers below check cheaply, allocate one output each with `empty_like`-shaped calls and
# pass plain integers to ctypes (chapter 9 measures it).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (Zhang & Sennrich, 2019).

    x float32 `[..., hidden]`, weight float32 `[hidden]` -> a new contiguous tensor of x's shape.
    Raises ValueError on another dtype or device, or a weight of the wrong shape.
    """
    x2, rows, stride = _rows("x", x)
    n = x.shape[-1]
    w = _check_weight(weight, n)
    out = torch.empty(x.shape, dtype=torch.float32)
    if rows and n:
        _library().minfer_rms_norm_f32(out.data_ptr(), x2.data_ptr(), w.data_ptr(), rows, n, stride, n, float(eps),
                                       torch.get_num_threads())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) in one pass (vLLM's contract; inputs not modified).

    x, residual float32 `[..., hidden]` of one shape; weight float32 `[hidden]`. Returns two new contiguous
    tensors of that shape.
    Raises ValueError on a shape, dtype or device mismatch.
    """
    if x.shape != residual.shape:
        raise ValueError(f"x and residual must match, got {tuple(x.shape)} vs {tuple(residual.shape)}")
    (x2, rows, xs), (r2, _, rs) = _rows("x", x), _rows("residual", residual)
    n = x.shape[-1]
    w = _check_weight(weight, n)
    out, res_out = torch.empty(x.shape, dtype=torch.float32), torch.empty(x.shape, dtype=torch.float32)
    if rows and n:
        _library().minfer_fused_add_rms_norm_f32(out.data_ptr(), res_out.data_ptr(), x2.data_ptr(), r2.data_ptr(),
                                                 w.data_ptr(), rows, n, xs, rs, float(eps), torch.get_num_threads())
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer, 2020): x float32 `[..., 2I]` = gate|up -> silu(gate) * up `[..., I]`.
    Raises ValueError on an odd last dim, a 0-d x, another dtype or device."""
    _check("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even (gate and up halves), got {x.shape[-1]}")
    x2, rows, stride = _rows("x", x)
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=torch.float32)
    if rows and inter:
        _library().minfer_silu_and_mul_f32(out.data_ptr(), x2.data_ptr(), rows, inter, stride,
                                           torch.get_num_threads())
    return out


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in place, rotate-half layout (Su et al., 2021; HF Llama): x1, x2 = x[..., :D/2], x[..., D/2:] become
    x1 cos - x2 sin, x2 cos + x1 sin.

    q float32 `[T, H, D]`, k `[T, KVH, D]`, contiguous along the last dim (strided views, e.g. of the fused
    q|k|v output, are fine); cos, sin float32 `[T, D/2]`, gathered at each token's position. Returns (q, k),
    modified in place.
    Raises ValueError on other shapes, strides, dtypes or devices.
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check(name, t)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"q [T, H, D] and k [T, KVH, D] with an even D expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    t, h, d = q.shape
    if cos.shape != (t, d // 2) or sin.shape != (t, d // 2):
        raise ValueError(f"cos and sin must be [{t}, {d // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q and k must be contiguous along the last dim (in-place kernel), got strides "
                         f"{q.stride()} and {k.stride()}")
    cos = cos if cos.is_contiguous() else cos.contiguous()
    sin = sin if sin.is_contiguous() else sin.contiguous()
    if t:
        _library().minfer_rotary_f32(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, h, k.shape[1],
                                     d, q.stride(0), q.stride(1), k.stride(0), k.stride(1), torch.get_num_threads())
    return q, k
