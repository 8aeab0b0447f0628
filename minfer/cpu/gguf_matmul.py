"""GGUF's Q4_0 / Q4_1 / Q8_0 blocks times float32 activations, in their own bytes: the GEMV-style C++ kernel
of `csrc/gguf_matmul_cpu.cpp` (chapter 5 §5.3), llama.cpp's method written from scratch, and the planes
(`repack_blocks`) that `pack_gguf` turns into the tiles of the register-tiled integer GEMM
(`minfer.cpu.qgemm`), which is what the engine runs. This kernel stays as the chapter's first step
and the benchmarks' baseline: it loops over the weight rows and, per row, over up to 8 activation rows, so at
a batch of 64 each weight block is unpacked 8 times and each activation byte reloaded for every weight row;
the tiled GEMM keeps a 4 x 32 tile of sums in registers instead (chapter 5 measures both).

Each activation row is quantized once per call to int8 in blocks of 32 (`quantize_activations`: one float
scale dx = max|x| / 127 per block, q = round(x / dx), and the block's integer sum); every weight block then
meets it in an integer dot product (AVX2 `maddubs` + `madd`, or AVX-512 VNNI `dpbusd`, picked at run time)
and one float multiply-add per block:

    Q4_1  w = q d + m          (q 0..15)         block sum = d dx (q . qx) + m dx sum(qx)
    Q4_0  w = (q - 8) d        (m = -8 d)        the same
    Q8_0  w = q d              (q -128..127)     block sum = d dx (q . qx)

The weights are repacked at load into planes of the same size as the file's blocks (`repack_blocks`):
`qs uint8 [N, K/2]` (Q4; each block's 16 bytes as in the file, weight j in the low nibble, j + 16 in the high
one) or `int8 [N, K]` (Q8_0), and `d`, `m` float16 `[N, K/32]`: 20 bytes per 32 weights for Q4_1, 18 for
Q4_0, 34 for Q8_0, exactly what the GGUF holds.

The result is NOT gguf's dequantization times x bit for bit: the activations are rounded to 8 bits per block
of 32 first (the price of the integer product; `tests/test_gguf_matmul.py` bounds it, and checks the kernel
against `reference_matmul`, the same arithmetic in float64 torch). A row's result does not depend on how
many rows share the call or on the thread count (each row is computed by the same instructions in the same
order), so the engine's batched outputs equal its one-sequence ones.

Built like the other CPU kernels (`minfer.cpu.build`), called through ctypes.
`envs.MINFER_GGUF_ISA` = `scalar`, `avx2` or `vnni` forces an instruction set (a CPU lacking it gets the best it
has), for measuring one path against another on one machine.
"""

from __future__ import annotations

import torch

from minfer.cpu.build import I32, I64, PTR, CppLibrary, KernelUnavailable

# One instruction-set numbering and one CPU probe for both kernels (their C++ choose a set the same way).
from minfer.cpu.qgemm import ISAS, _isa_from_env, best_isa, quantize_activations  # noqa: F401

# No -march=native: the AVX2 and VNNI functions carry their own target attributes and are chosen at run
# time, so one build is right on an AVX2-only CPU and fast on an AVX-512 VNNI one. No -ffast-math: fixed
# order of the float sums (batch invariance).
CFLAGS = ["-O3", "-fopenmp"]
BLOCK = 32
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_TYPE_ID = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


class GGUFKernelUnavailable(KernelUnavailable):
    """The C++ kernel could not be built or loaded here (the message says why)."""


LIBRARY = CppLibrary("minfer_gguf_matmul_cpu", "gguf_matmul_cpu.cpp", CFLAGS, {
    "minfer_gguf_matmul": ([PTR, PTR, PTR, PTR, PTR, I32, I64, I64, I64, I32, I32], I32),
}, GGUFKernelUnavailable)
_library = LIBRARY.load
gguf_kernel_available = LIBRARY.available


def repack_blocks(raw: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF rows `uint8 [N, bytes]` of Q4_0 / Q4_1 / Q8_0 -> the kernel's planes (qs, d, m): qs `uint8 [N, K/2]`
    (Q4) or `int8 [N, K]` (Q8_0), d float16 `[N, K/32]`, m float16 `[N, K/32]` (Q4_1) or None. Same bytes as
    the file. Raises ValueError for another type or a row that is not whole blocks."""
    if ggml_type not in KERNEL_TYPES:
        raise ValueError(f"repack_blocks: {ggml_type} is not one of {KERNEL_TYPES}")
    nbytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[ggml_type]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"{ggml_type} rows must be uint8 [N, a multiple of {nbytes}], got {raw.dtype} {tuple(raw.shape)}")
    n = raw.shape[0]
    b = raw.reshape(n, -1, nbytes)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    if ggml_type == "Q4_1":
        m, qs = b[..., 2:4].contiguous().view(torch.float16).reshape(n, -1), b[..., 4:]
    else:
        m, qs = None, b[..., 2:]
    qs = qs.reshape(n, -1).contiguous()
    return (qs.view(torch.int8) if ggml_type == "Q8_0" else qs), d.contiguous(), m.contiguous() if m is not None else None


def pack_gguf(planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], ggml_type: str):
    """The planes of one or more parts (`repack_blocks` each; stacked along the output rows) -> the integer
    GEMM's `PackedWeight` (`minfer.cpu.qgemm`, the engine's route): Q4_1 as w = q d + m, Q4_0 as
    (q - 8) d, Q8_0 as q d, groups of 32, float16 scales. The same bytes per weight as the file."""
    from minfer.cpu.qgemm import pack

    codes = []
    for qs, _, _ in planes:
        if ggml_type == "Q8_0":
            codes.append(qs)
        else:
            b = qs.view(qs.shape[0], -1, BLOCK // 2)
            codes.append(torch.cat([b & 15, b >> 4], dim=-1).reshape(qs.shape[0], -1))
    d = torch.cat([pl[1] for pl in planes])
    m = torch.cat([pl[2] for pl in planes]) if ggml_type == "Q4_1" else None
    return pack(torch.cat(codes), d, m, 8 if ggml_type == "Q8_0" else 4, offset=8 if ggml_type == "Q4_0" else 0)


def dequantize_blocks(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, ggml_type: str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernel's planes -> the weight `[N, K]` they stand for, in `dtype` (computed in float32; equal to
    gguf's own dequantization)."""
    n = qs.shape[0]
    if ggml_type == "Q8_0":
        q = qs.view(n, -1, BLOCK).float()
    else:
        b = qs.view(n, -1, BLOCK // 2)
        q = torch.cat([b & 15, b >> 4], dim=-1).float()  # weights 0..15, then 16..31 of each block
    df = d.float()[..., None]
    w = q * df
    if ggml_type == "Q4_1":
        w = w + m.float()[..., None]
    elif ggml_type == "Q4_0":
        w = w - 8 * df
    return w.reshape(n, -1).to(dtype)


def reference_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                     ggml_type: str) -> torch.Tensor:
    """The kernel's arithmetic in float64 torch (the activations quantized the same way): `[T, N]` float64.
    The kernel must match it up to float32 rounding of the sums."""
    qx, dx = quantize_activations(x)
    xd = (qx.double() * dx.double()[..., None]).reshape(x.shape[0], -1)
    return xd @ dequantize_blocks(qs, d, m, ggml_type, torch.float64).t()


def gguf_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, ggml_type: str,
                isa: str | None = None) -> torch.Tensor:
    """`x [T, K]` times the GGUF weight `[N, K]` that (qs, d, m) stand for, transposed: float32 `[T, N]`.

    Args:
        x: float `[T, K]` on the CPU (converted to contiguous float32), K a multiple of 32.
        qs, d, m: from `repack_blocks` (m None except for Q4_1). ggml_type: "Q4_0", "Q4_1" or "Q8_0".
        isa: "auto" (default: `envs.MINFER_GGUF_ISA`, else the best this CPU has), "scalar", "avx2", "vnni".

    Raises:
        GGUFKernelUnavailable: the kernel cannot be built here.
        ValueError: an unknown type or isa, wrong dtypes or shapes.
    """
    if ggml_type not in KERNEL_TYPES:
        raise ValueError(f"gguf_matmul: {ggml_type!r} is not one of {KERNEL_TYPES}")
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa must be one of {sorted(ISAS)}, got {isa!r}")
    n = qs.shape[0]
    k = qs.shape[1] * (1 if ggml_type == "Q8_0" else 2) if qs.dim() == 2 else -1
    want_q = torch.int8 if ggml_type == "Q8_0" else torch.uint8
    if qs.dtype != want_q or qs.dim() != 2 or not qs.is_contiguous() or k % BLOCK:
        raise ValueError(f"qs must be a contiguous {want_q} [N, K{'' if ggml_type == 'Q8_0' else '/2'}] tensor "
                         f"with K a multiple of {BLOCK}, got {qs.dtype} {tuple(qs.shape)}")
    for name, t in (("d", d), ("m", m)) if ggml_type == "Q4_1" else (("d", d),):
        if t is None or t.dtype != torch.float16 or tuple(t.shape) != (n, k // BLOCK) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float16 [{n}, {k // BLOCK}] tensor, got "
                             f"{None if t is None else (t.dtype, tuple(t.shape))}")
    if x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU tensor [T, {k}], got {tuple(x.shape)} on {x.device}")
    return matmul_unchecked(x, qs, d, m, ggml_type, isa)


def matmul_unchecked(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, ggml_type: str,
                     isa: str | None = None) -> torch.Tensor:
    """`gguf_matmul` without its checks, for planes checked once at load (`GGUFLinearMethod`) and x of the
    layer's width: a decode step makes ~120 of these calls, and the checks cost microseconds each. Raises
    GGUFKernelUnavailable."""
    lib = _library()
    x = x.to(torch.float32).contiguous()
    n, k = qs.shape[0], x.shape[1]
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0] and n:
        lib.minfer_gguf_matmul(y.data_ptr(), x.data_ptr(), qs.data_ptr(), d.data_ptr(),
                               m.data_ptr() if m is not None else None, _TYPE_ID[ggml_type], x.shape[0], n, k,
                               ISAS[isa] if isa is not None else _isa_from_env(), torch.get_num_threads())
    return y
