"""`quantization="int4"`: weight-only, group-wise asymmetric INT4, round to nearest (RTN; the baseline of
the GPTQ and AWQ papers; vLLM's W4A16).

Each row of `W [out, in]` is cut into groups of `group_size` consecutive inputs; a group g has a scale s and a
zero z (stored in bfloat16, the packed op's dtype) and 4-bit codes q in [0, 15]:

    s = (max(w_g) - min(w_g)) / 15     z = min(w_g) + 8 s     q = clamp(round((w - z) / s) + 8, 0, 15)
    w_hat = (q - 8) s + z              |w - w_hat| <= s / 2 inside [min, max]

This is exactly the convention of torch's `_weight_int4pack_mm_for_cpu(x, packed, group_size,
scales_and_zeros [in/G, out, 2])`, so the codes go to the op unchanged; GGUF's Q4_1 block (d, m, 32 codes:
w = q d + m) is the same thing with s = d and z = m + 8d (`minfer.quantization.gguf`).

Group sizes: 32, 64 (the default), 128 or 256 (what the op supports). Every quantized layer's `in_features`
must be a multiple of it, else loading stops with a ValueError that names the layer's width: SmolLM2-135M's
hidden size 576 is 4.5 groups of 128, so `group_size=128` is refused for it (64 and 32 work). No silent
fallback to another group size: the quality and the bytes per weight would not be what was asked for.

Stored on a CPU where the C++ kernel builds: the integer GEMM's tiles (`minfer.cpu.qgemm`: w =
(q - 8) s + z with s and z bfloat16 per group; 0.5 + 4/G bytes per weight), which every batch size runs
(activations quantized to int8 blocks of 32; `minfer.quantization.base`). Elsewhere: `qweight uint8 [out,
in/2]` in the op's packed layout (for `out % 64 == 0`: blocks of B rows, byte `[b, k, i]` = row Bb+i in
the low nibble, row Bb+B/2+i in the high one; B is 64 on a GPU and on an AVX-512 CPU, 32 on an AVX2 one,
since torch's CPU op sizes its blocks by the vector width: `int4pack_block`) and `scales_and_zeros bfloat16
[in/G, out, 2]`, for torch's packed op, the dequantize route or the GPU's Triton W4A16 kernel (`device_kernel`
rebuilds these from the tiles for a layer packed on the CPU).
"""

from __future__ import annotations

import functools

import torch

from minfer.config import INT4_GROUP_SIZES
from minfer.quantization.base import QuantizedLinearMethod, store

DEFAULT_GROUP_SIZE = 64


def check_group_size(in_features: int, group_size: int, what: str = "a Linear") -> None:
    """Raise ValueError unless `group_size` is supported and divides `in_features`."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if in_features % group_size:
        fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
        raise ValueError(f"int4 group_size={group_size} does not divide {what}'s input width {in_features} "
                         f"({in_features} = {in_features / group_size:g} groups); "
                         + (f"use one of {fits}" if fits else f"no supported group size ({INT4_GROUP_SIZES}) divides it, "
                            "so int4 cannot quantize this model (int8 can)")
                         + " (every quantized layer's width must be a whole number of groups)")


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`w [out, in]` -> (codes uint8 [out, in] in 0..15, scale bf16 [out, in/G], zero bf16 [out, in/G]).

    The scale and zero are rounded to bfloat16 before the codes are computed, so the codes are the best for
    the parameters actually stored. Raises ValueError for a group size that does not divide `in`."""
    out, k = w.shape
    check_group_size(k, group_size)
    wg = w.float().reshape(out, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((wg - zero.float()[..., None]) / scale.float()[..., None]) + 8
    return q.clamp_(0, 15).to(torch.uint8).reshape(out, k), scale, zero


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes [out, in] in 0..15, scale [out, in/G], zero [out, in/G]) -> `[out, in]` in `dtype`."""
    out, k = codes.shape
    groups = scale.shape[1]
    q = codes.reshape(out, groups, k // groups).to(dtype) - 8
    return (q * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]).reshape(out, k)


GPU_INT4PACK_BLOCK = 64  # rows per block of the layout the GPU's Triton W4A16 kernel reads


@functools.lru_cache(maxsize=None)
def _cpu_int4pack_block() -> int:
    codes = torch.randint(0, 16, (64, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    for block in (64, 32):
        if torch.equal(pack_int4_blocked(codes, block), packed):
            return block
    raise RuntimeError("torch's _convert_weight_to_int4pack_for_cpu packs in a layout minfer does not know")


def int4pack_block(device: torch.device | str) -> int:
    """Rows per block of the layout `pack_int4` writes on `device`: 64 on a GPU; on a CPU what torch's op uses
    there (4 float vectors: 64 with AVX-512, 32 with AVX2), found once by packing a known tensor.

    Raises:
        RuntimeError: the CPU op's layout is neither (a torch this code does not know)."""
    return _cpu_int4pack_block() if torch.device(device).type == "cpu" else GPU_INT4PACK_BLOCK


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [out, in] -> the packed `uint8 [out, in/2]` of `_convert_weight_to_int4pack_for_cpu`
    (on a CPU, the op itself, in blocks of `int4pack_block("cpu")` rows; elsewhere, for `out % 64 == 0`,
    `pack_int4_blocked` with 64-row blocks, which the GPU's Triton W4A16 kernel reads)."""
    if codes.device.type != "cpu":
        return pack_int4_blocked(codes)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def pack_int4_blocked(codes: torch.Tensor, block: int = GPU_INT4PACK_BLOCK) -> torch.Tensor:
    """codes uint8 [out, in] (out % block == 0) -> the op's layout (module docstring) in plain torch, on any
    device: byte [b, k, i] = row block*b+i | row block*b+block/2+i << 4. The inverse of `unpack_int4`."""
    out, k = codes.shape
    c = codes.to(torch.uint8).view(out // block, 2, block // 2, k)  # [blocks, low/high half, rows, in]
    return (c[:, 0] | (c[:, 1] << 4)).permute(0, 2, 1).reshape(out, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor, block: int = GPU_INT4PACK_BLOCK) -> torch.Tensor:
    """The inverse of `pack_int4_blocked(codes, block)` for `out % block == 0` (the layout in the module
    docstring; `pack_int4`'s on a device is `block=int4pack_block(device)`): `[out, in]` codes."""
    out, half = packed.shape
    b = packed.view(out // block, 2 * half, block // 2)  # [blocks, in, block/2 bytes]
    q = torch.cat([b & 15, b >> 4], dim=-1)  # [blocks, in, block rows]
    return q.permute(0, 2, 1).reshape(out, 2 * half)


class Int4LinearMethod(QuantizedLinearMethod):
    """Group-wise asymmetric INT4 RTN (module docstring).

    Args:
        group_size: inputs per scale/zero pair (32, 64, 128, 256). Other args: `QuantizedLinearMethod`.
    Raises:
        ValueError: an unsupported group size (here), or one that does not divide a layer (when loading).
    """

    name = "int4"
    unpacked_buffers = ("qweight", "scales_and_zeros", "qweight_op")

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, **kwargs):
        super().__init__(**kwargs)
        check_group_size(group_size, group_size)
        self.group_size = group_size

    def quantize(self, layer, w: torch.Tensor) -> None:
        out, k = w.shape
        check_group_size(k, self.group_size, f"a {out}x{k} Linear")
        codes, scale, zero = quantize_int4(w, self.group_size)
        self.store(layer, codes, scale, zero)

    def store(self, layer, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Keep (codes [out, in], scale/zero bf16 [out, in/G]) on `layer` in the op's layout."""
        out = codes.shape[0]
        layer.group_size = codes.shape[1] // scale.shape[1]
        store(layer, "scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())
        layer.int4_packed = out % 64 == 0  # the op's layout is read back by unpack_int4 only for these
        layer.int4_block = int4pack_block(codes.device)  # rows per block of that layout here
        layer.int4_kernel = out % 16 == 0 and codes.device.type == "cpu"  # the CPU op needs out % 16 == 0
        if layer.int4_packed:
            store(layer, "qweight", pack_int4(codes))
        else:  # own nibble layout for the dequantize route, and the op's copy where the op runs
            store(layer, "qweight", (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous())
            store(layer, "qweight_op", pack_int4(codes) if layer.int4_kernel else None)
        layer.pending_codes = codes  # read once by pack_for_cpu, then dropped
        self.maybe_pack(layer)
        layer.pending_codes = None

    def pack_for_cpu(self, layer):
        sz = layer.scales_and_zeros.transpose(0, 1)  # [out, in/G, 2]
        if layer.group_size % 32 or sz.dtype != torch.bfloat16:
            return None
        codes = layer.pending_codes if layer.pending_codes is not None else self.codes(layer)
        return self.cpu_kernel.pack(codes, sz[..., 0], sz[..., 1], 4, offset=8)

    def scales_and_zeros(self, layer) -> torch.Tensor:
        """`[in/G, out, 2]` bfloat16 (s, z) of either layout."""
        if getattr(layer, "qg_format", None) is None:
            return layer.scales_and_zeros
        w = self.cpu_kernel.packed(layer)
        ids = torch.arange(w.n)
        return torch.stack([w.d[ids // 16, :, ids % 16], w.m[ids // 16, :, ids % 16]], dim=-1).transpose(0, 1)

    def codes(self, layer) -> torch.Tensor:
        if getattr(layer, "qg_format", None) is not None:
            return self.cpu_kernel.unpack_rows(layer, torch.arange(layer.qg_format[4]))[0].to(torch.uint8)
        if layer.int4_packed:
            return unpack_int4(layer.qweight, layer.int4_block)
        q = layer.qweight
        return torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1)

    def dequantize(self, layer, dtype: torch.dtype) -> torch.Tensor:
        if getattr(layer, "qg_format", None) is not None:
            return self.cpu_kernel.dequantize_rows(layer, dtype=dtype)
        sz = layer.scales_and_zeros.transpose(0, 1)  # [out, in/G, 2]
        return dequantize_int4(self.codes(layer), sz[..., 0], sz[..., 1], dtype)

    def device_kernel(self, layer, x2: torch.Tensor) -> torch.Tensor:
        """On a GPU: the Triton W4A16 kernel (`minfer.kernels.w4a16`), dequantizing in registers, at every
        batch size (it reads the codes in either layout; the CPU's two routes do not apply there)."""
        from minfer.kernels.w4a16 import w4a16_matmul

        if getattr(layer, "qg_format", None) is not None or (
                layer.int4_packed and layer.int4_block != GPU_INT4PACK_BLOCK):
            # packed for the CPU's integer GEMM, or in the CPU op's 32-row (AVX2) blocks: the kernel's layout back
            codes = self.codes(layer)
            qweight = pack_int4_blocked(codes) if layer.int4_packed else (codes[:, 0::2] | (codes[:, 1::2] << 4))
            sz = self.scales_and_zeros(layer).contiguous()
            return w4a16_matmul(x2, qweight.to(x2.device), sz.to(x2.device), layer.group_size, layer.int4_packed,
                                out_dtype=x2.dtype)
        return w4a16_matmul(x2, layer.qweight, layer.scales_and_zeros, layer.group_size, layer.int4_packed,
                            out_dtype=x2.dtype)

    def kernel(self, layer, x2: torch.Tensor) -> torch.Tensor:
        if not layer.int4_kernel:
            return x2 @ self.dequantize(layer, x2.dtype).t()
        packed = layer.qweight if layer.int4_packed else layer.qweight_op
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), packed,
                                                         layer.group_size, layer.scales_and_zeros)
