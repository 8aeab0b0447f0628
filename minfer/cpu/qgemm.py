"""The CPU's integer GEMM for every weight-quantization method: `csrc/qgemm_cpu.cpp` (chapter 5 §5.3).

`y [T, N] = x [T, K] W^T` with W stored as 4- or 8-bit codes and 16-bit scales per (column, group), x float32:

    4-bit   w = (q - c) d + m     q in 0..15   GGUF Q4_1 (c = 0, m), Q4_0 (c = 8, no m), int4 (c = 8, m = zero)
    8-bit   w = q d               q in -128..127   GGUF Q8_0 (groups of 32), int8 (one group = the whole row)

Each activation row is quantized once per call to int8 in blocks of 32 (`quantize_activations`: dx =
max|x| / 127, q = round(x / dx), and the block's integer sum); a register tile of 6 rows x 32 columns (4 x 16
on AVX2; from `PANEL_ROWS` rows on over column tiles unpacked once per call) then sums integer products
(AVX-512 VNNI `dpbusd`, or AVX2 `maddubs` + `madd`, chosen at run time) and turns each 32-block's exact sum
into floats with the column's scale and the row's dx (the C++ header says how).

The weights are packed once at load (`pack`) into the layout the inner loop streams, the same bytes as the
codes: columns in tiles of 16, each 32-block of a tile as the 64-byte loads want it (`pack_codes`), scales as
`[N/16, groups, 16]` (`pack_scales`). `unpack_rows` reads chosen rows back (the tied embedding's rows).

Range: the per-block sums are float32, so activations must stay far below float32's limit: with max|x| above
~1e33 (int8, whose weight scale is applied once at the end) or ~1e36 (the other formats) a sum can overflow to
inf or NaN. A model never gets there (RMSNorm squares its input, which overflows float32 from |x| ~ 1.8e19).

Results are batch-invariant (a row's output does not depend on T, the tile it fell in or the thread count)
and the three instruction-set paths give the same bits (they do the same float operations); the one
approximation against a dequantize-then-matmul is the activations' rounding to 8 bits per block of 32
(`reference_matmul` is the same arithmetic in float64; tests/test_qgemm.py bounds both).

`envs.MINFER_GGUF_ISA` = `scalar`, `avx2` or `vnni` (read at each call, for tests and benchmarks) forces an
instruction set (a CPU lacking it gets the best it has).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import minfer.envs as envs
from minfer.cpu.build import I32, I64, PTR, CppLibrary, KernelUnavailable

# No -march=native: the AVX2 and VNNI functions carry their own target attributes and are chosen at run time.
# No -ffast-math and no FMA contraction: the float operations per output element are the ones written, the
# same on every path and every batch size.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
BLOCK = 32
TILE = 16  # output columns per register tile
PANEL_ROWS = 32  # from this many rows on, the C++ unpacks each column panel once per call (its kPanelRows)
ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "vnni": 3}
ISA_NAMES = {v: k for k, v in ISAS.items()}


class QGemmUnavailable(KernelUnavailable):
    """The C++ kernel could not be built or loaded here (the message says why)."""


LIBRARY = CppLibrary("minfer_qgemm_cpu", "qgemm_cpu.cpp", CFLAGS, {
    "minfer_qgemm": ([PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I64, I64, I64, I64, I32, I32], I32),
    "minfer_qgemm_best_isa": ([], I32),
}, QGemmUnavailable)
_library = LIBRARY.load
qgemm_available = LIBRARY.available


def best_isa() -> str:
    """The instruction set the kernel uses here by default: "vnni", "avx2" or "scalar"."""
    return ISA_NAMES[_library().minfer_qgemm_best_isa()]


def active_isa() -> str:
    """The instruction set a call runs here: `envs.MINFER_GGUF_ISA` when it forces one this CPU has, else the best
    (the kernel's own rule: a forced set the CPU lacks gets the best it has)."""
    forced, best = _isa_from_env(), _library().minfer_qgemm_best_isa()
    return ISA_NAMES[forced if 0 < forced <= best else best]


@dataclass
class PackedWeight:
    """A weight `[n, k]` in the kernel's layout.

    Attributes:
        qs: uint8 `[ceil(n/16), k/32, 256]` (4-bit) or `[ceil(n/16), k/32, 512]` (8-bit, codes + 128).
        d: int16 bits of float16 / bfloat16 scales `[ceil(n/16), groups, 16]`; m: the offsets, or None.
        bits: 4 or 8. offset: c of w = (q - c) d + m for 4-bit codes (0 or 8). bf16: scales are bfloat16.
        group: inputs per scale group (a multiple of 32 dividing k). n, k: the weight's shape.
    """

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bits: int
    offset: int
    bf16: bool
    group: int
    n: int
    k: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qg_qs": self.qs, "qg_d": self.d, **({"qg_m": self.m} if self.m is not None else {})}

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes `[n, k]` (uint8 0..15 for 4 bits, int8 for 8) -> the kernel's uint8 tiles (C++ header comment):
    4-bit `[P, k/32, 4, 16, 4]` with byte [p, g, i, j, b] = code(16p+j, 32g+8i+b) | code(16p+j, 32g+8i+4+b) << 4;
    8-bit `[P, k/32, 8, 16, 4]` with byte [p, g, i, j, b] = code(16p+j, 32g+4i+b) + 128; P = ceil(n/16), padded
    columns are code 0. Returned flattened to `[P, k/32, 256 | 512]`."""
    n, k = codes.shape
    p = -(-n // TILE)
    if bits == 8:
        u = (codes.to(torch.int16) + 128).to(torch.uint8)
    else:
        u = codes.to(torch.uint8)
    if p * TILE != n:
        u = torch.cat([u, torch.zeros(p * TILE - n, k, dtype=torch.uint8)])
    g = k // BLOCK
    if bits == 8:  # [p, 16 j, g, 8 i, 4 b] -> [p, g, i, j, b]
        t = u.view(p, TILE, g, 8, 4).permute(0, 2, 3, 1, 4)
        return t.reshape(p, g, 512).contiguous()
    t = u.view(p, TILE, g, 4, 2, 4)  # k = 32g + 8i + 4h + b
    t = t[:, :, :, :, 0] | (t[:, :, :, :, 1] << 4)  # [p, j, g, i, b]
    return t.permute(0, 2, 3, 1, 4).reshape(p, g, 256).contiguous()


def pack_scales(s: torch.Tensor) -> torch.Tensor:
    """`[n, groups]` float16 / bfloat16 -> `[ceil(n/16), groups, 16]` of the same dtype (padded columns 0)."""
    n, groups = s.shape
    p = -(-n // TILE)
    if p * TILE != n:
        s = torch.cat([s, torch.zeros(p * TILE - n, groups, dtype=s.dtype)])
    return s.view(p, TILE, groups).transpose(1, 2).contiguous()


def unpack_rows(w: PackedWeight, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows `ids` of a packed weight -> (codes `[len, k]` int16: 0..15 or -128..127, d `[len, groups]`,
    m or None), read from the tiles (only those rows are touched)."""
    p, j = ids // TILE, ids % TILE
    g = w.k // BLOCK
    if w.bits == 8:
        b = w.qs.view(-1, g, 8, TILE, 4)[p, :, :, j, :]  # [len, g, 8, 4]
        codes = b.reshape(len(ids), w.k).to(torch.int16) - 128
    else:
        b = w.qs.view(-1, g, 4, TILE, 4)[p, :, :, j, :]  # [len, g, 4 i, 4 b]
        codes = torch.stack([b & 15, b >> 4], dim=3).reshape(len(ids), w.k).to(torch.int16)  # k = 32g + 8i + 4h + b
    d = w.d[p, :, j]
    m = w.m[p, :, j] if w.m is not None else None
    return codes, d, m


def dequantize_rows(w: PackedWeight, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight rows `ids` (default: all) the packed codes stand for, `[len, k]` in `dtype` (computed in
    float32: (q - c) d + m)."""
    if ids is None:
        ids = torch.arange(w.n)
    codes, d, m = unpack_rows(w, ids)
    per = w.group
    q = codes.float().view(len(ids), -1, per)
    if w.bits == 4:
        q = q - w.offset
    out = q * d.float()[..., None]
    if m is not None:
        out = out + m.float()[..., None]
    return out.reshape(len(ids), w.k).to(dtype)


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, offset: int = 0) -> PackedWeight:
    """Codes and per-(row, group) parameters -> a PackedWeight.

    Args:
        codes: `[n, k]`, uint8 0..15 (bits 4) or int8 (bits 8); k a multiple of 32.
        scale: `[n, k / group]` float16 or bfloat16 (the group: a multiple of 32 dividing k; the whole row
            is one group for int8's per-channel scale).
        zero: the offset m `[n, k / group]` of the same dtype, or None.
        bits: 4 or 8. offset: c of w = (q - c) d + m (4-bit only: 0 or 8).
    Raises:
        ValueError: shapes, dtypes or groups the kernel cannot take (k not a multiple of 32, ...).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if codes.dim() != 2 or codes.shape[1] % BLOCK or codes.shape[1] == 0:
        raise ValueError(f"codes must be [n, k] with k a positive multiple of {BLOCK}, got {tuple(codes.shape)}")
    n, k = codes.shape
    if scale.dtype not in (torch.float16, torch.bfloat16) or scale.dim() != 2 or scale.shape[0] != n:
        raise ValueError(f"scale must be float16 or bfloat16 [{n}, groups], got {scale.dtype} {tuple(scale.shape)}")
    groups = scale.shape[1]
    if groups == 0 or k % groups or (k // groups) % BLOCK:
        raise ValueError(f"{groups} scale groups over k={k}: the group must be a multiple of {BLOCK} dividing k")
    if zero is not None and (zero.dtype != scale.dtype or zero.shape != scale.shape):
        raise ValueError(f"zero must be {scale.dtype} {tuple(scale.shape)}, got {zero.dtype} {tuple(zero.shape)}")
    if bits == 8 and (offset or zero is not None):
        raise ValueError("8-bit codes are symmetric: no offset and no zero")
    if bits == 4 and (codes.dtype != torch.uint8 or (codes.numel() and int(codes.max()) > 15)):
        raise ValueError(f"4-bit codes must be uint8 in 0..15, got {codes.dtype}"
                         + (f" with max {int(codes.max())}" if codes.numel() else "")
                         + " (a larger code would spill into its neighbour's nibble)")
    if bits == 8 and codes.dtype != torch.int8:
        raise ValueError(f"8-bit codes must be int8 (-128..127), got {codes.dtype} (another dtype would wrap)")
    return PackedWeight(pack_codes(codes, bits), pack_scales(scale.contiguous()),
                        pack_scales(zero.contiguous()) if zero is not None else None,
                        bits, offset, scale.dtype == torch.bfloat16, k // groups, n, k)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to x first, in torch: `x float32 [T, K]` -> (codes int8 [T, K/32, 32], scale float32
    [T, K/32]) with dx = max|x| / 127 per block of 32 and q = round(x / dx) (half to even)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    dx = xb.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(xb * inv[..., None]).to(torch.int8), dx


def reference_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The kernel's arithmetic in float64 torch (activations quantized the same way): `[T, N]` float64. The
    kernel must match it up to float32 rounding of the per-block sums."""
    qx, dx = quantize_activations(x)
    xd = (qx.double() * dx.double()[..., None]).reshape(x.shape[0], -1)
    return xd @ dequantize_rows(w, dtype=torch.float64).t()


def _isa_from_env() -> int:
    """The forced instruction set's number (0: auto): `envs.MINFER_GGUF_ISA` ("auto" when unset)."""
    name = envs.MINFER_GGUF_ISA
    if name not in ISAS:
        raise ValueError(f"the forced instruction set must be one of {sorted(ISAS)}, got {name!r}")
    return ISAS[name]


def qgemm(x: torch.Tensor, w: PackedWeight, isa: str | None = None) -> torch.Tensor:
    """`x [T, K]` times the packed weight `[N, K]`, transposed: float32 `[T, N]`.

    Args:
        x: float `[T, K]` on the CPU (converted to contiguous float32). isa: "auto" (default: `envs.MINFER_GGUF_ISA`,
            else the best this CPU has), "scalar", "avx2" or "vnni".
    Raises:
        QGemmUnavailable: the kernel cannot be built here. ValueError: x of another width or device, an
        unknown isa.
    """
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa must be one of {sorted(ISAS)}, got {isa!r}")
    if x.dim() != 2 or x.shape[1] != w.k or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU tensor [T, {w.k}], got {tuple(x.shape)} on {x.device}")
    return qgemm_unchecked(x, w, isa)


def qgemm_unchecked(x: torch.Tensor, w: PackedWeight, isa: str | None = None) -> torch.Tensor:
    """`qgemm` without its checks, for a weight packed at load and x of the layer's width (a decode step makes
    ~120 of these calls). Raises QGemmUnavailable."""
    lib = _library()
    x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    if x.shape[0] and w.n:
        lib.minfer_qgemm(y.data_ptr(), x.data_ptr(), w.qs.data_ptr(), w.d.data_ptr(),
                         w.m.data_ptr() if w.m is not None else None, w.bits, 128 if w.bits == 8 else w.offset,
                         int(w.bf16), w.group // BLOCK, x.shape[0], w.n, w.k,
                         ISAS[isa] if isa is not None else _isa_from_env(), torch.get_num_threads())
    return y
