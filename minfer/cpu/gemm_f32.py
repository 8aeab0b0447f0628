"""y = x W^T in float32 on the CPU, built for a few rows of x: the "panels" weight layout and its C++ kernel
(`csrc/gemm_f32_cpu.cpp`; chapter 9 §9.2.6; many rows: lab notes 9b §9b.17).

A decode step multiplies every weight matrix by one row per running sequence. At 16 rows that product sits at
this CPU's balance point: each weight float feeds 16 FMAs, so the cores compute about as fast as DRAM delivers
the weights, and the time is lost wherever the two take turns. oneDNN's float32 kernel (what the "onednn" and
"hybrid" layouts of `minfer.model.layers` run) is tuned for many rows; on the 16-row decode step of
SmolLM2 it took ~42 ms for the linears, this kernel ~34 (`benchmarks/gemm_f32_cpu.py`, chapter 9 §9.2.6).

The layout: `pack_weight(w [N, K]) -> [ceil(N/16), K, 16]`, panels of 16 output features, one 64-byte line per
k, so each panel is one contiguous stream; the kernel keeps up to 16 rows' accumulators in registers and
feeds each weight line to all of them (AVX-512: 16 rows a pass; AVX2: 6; a scalar loop where neither
exists, chosen when the library is built for the machine, `-march=native`). More than 16 rows on AVX-512: tiles
of 8 rows x 3 panels (24 accumulators in registers; each weight line feeds 8 rows, each row value 3 panels),
which beat oneDNN on this course's Xeon up to 256 rows (`max_rows`), so a 64-stream decode step stays here.

Exactness: each output is one float32 fused-multiply-add chain over k in increasing order, so a row's result
does not depend on the other rows, on how many there are or on the thread split (batch-invariant); it differs
from oneDNN's and MKL's sums (other orders) by float32 rounding.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from minfer.cpu.build import I32, I64, PTR, CppLibrary, KernelUnavailable

CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
LANES = 16  # output features per panel


class GemmF32Unavailable(KernelUnavailable):
    """The C++ float32 GEMM could not be built or loaded here (the message says why)."""


LIBRARY = CppLibrary("minfer_gemm_f32_cpu", "gemm_f32_cpu.cpp", CFLAGS, {
    "minfer_gemm_f32": ([PTR, PTR, PTR, PTR, I64, I64, I64, I64, I64, PTR, I32], None),
    "minfer_gemm_f32_isa": ([], ctypes.c_char_p),
}, GemmF32Unavailable)
_library = LIBRARY.load
gemm_f32_available = LIBRARY.available


def isa() -> str:
    """The instruction set the library was built for here: "avx512", "avx2" or "scalar"."""
    return _library().minfer_gemm_f32_isa().decode()


FEW_ROWS = 16  # rows per pass of the few-row kernel (kMaxRows)
MANY_ROWS_AVX512 = 256  # up to here the many-row tile beat oneDNN on this course's Xeon (lab notes 9b §9b.17)


@functools.cache
def max_rows() -> int:
    """The most rows per call that the "panels" layout takes on this machine (more go to oneDNN under "hybrid"):
    `MANY_ROWS_AVX512` where the library has its AVX-512 many-row tile (8 rows x 48 features in registers), else
    `FEW_ROWS` (AVX2 and scalar builds have the few-row kernel only). 16 where the library does not build.
    Decided once per process: the hybrid layout asks on every projection call."""
    return MANY_ROWS_AVX512 if gemm_f32_available() and isa() == "avx512" else FEW_ROWS


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w: float32 `[N, K]` (a Linear's `[out, in]`) -> float32 `[ceil(N/16), K, 16]`, zero padded."""
    if w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"pack_weight wants a float32 [N, K] matrix, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    panels = -(-n // LANES)
    padded = torch.zeros(panels * LANES, k, dtype=torch.float32)
    padded[:n] = w
    return padded.view(panels, LANES, k).transpose(1, 2).contiguous()


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Rows `ids` (any shape; negative ones count from the end, as in indexing) of the `[n, K]` matrix `packed`
    came from: `[*ids.shape, K]` (a tied embedding's lookup). Raises IndexError for an id outside [-n, n)."""
    if ids.numel() and (int(ids.min()) < -n or int(ids.max()) >= n):
        raise IndexError(f"row ids must be in [-{n}, {n}), got {int(ids.min())}..{int(ids.max())}")
    ids = torch.where(ids < 0, ids + n, ids)
    return packed[ids // LANES, :, ids % LANES]


def gemm_f32(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x `[..., K]` @ W^T (+ bias) with W given as `pack_weight(W)`, W `[n, K]`: float32 `[..., n]`.

    Raises:
        ValueError: x is not a float32 CPU tensor, its last dim is not the packed K, or n does not fit the panels.
        GemmF32Unavailable: the kernel is not built here.
    """
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() == 0:
        raise ValueError(f"gemm_f32 wants a float32 CPU x [..., K], got {x.dtype} {tuple(x.shape)} on {x.device}")
    if (packed.dtype != torch.float32 or not packed.is_cpu or packed.dim() != 3 or packed.shape[2] != LANES
            or not packed.is_contiguous()):
        raise ValueError(f"packed must be pack_weight's contiguous float32 CPU [panels, K, {LANES}], got "
                         f"{packed.dtype} {tuple(packed.shape)} on {packed.device}")
    panels, k, _ = packed.shape
    if x.shape[-1] != k or not (panels - 1) * LANES < n <= panels * LANES:
        raise ValueError(f"x [..., {x.shape[-1]}] and n={n} do not fit panels [{panels}, {k}, {LANES}]")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()
                             or not bias.is_cpu):
        raise ValueError(f"bias must be a contiguous float32 CPU [{n}], got {bias.dtype} {tuple(bias.shape)} "
                         f"on {bias.device}")
    return gemm_f32_unchecked(x, packed, n, bias)


def gemm_f32_unchecked(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gemm_f32` without the checks: the engine's Linear calls it on tensors it made itself."""
    k = packed.shape[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    # the few-row passes' transposed rows; the many-row tiles (more than FEW_ROWS rows, AVX-512) read x in place
    scratch = torch.empty(0 if m > FEW_ROWS and max_rows() > FEW_ROWS else m * k, dtype=torch.float32)
    _library().minfer_gemm_f32(out.data_ptr(), x2.data_ptr(), packed.data_ptr(),
                               bias.data_ptr() if bias is not None else None, m, n, k, x2.stride(0), n,
                               scratch.data_ptr(), torch.get_num_threads())
    return out.view(*x.shape[:-1], n)
