"""W4A16 matmul: int4 weights dequantized in registers, bf16 `tl.dot`, fp32 accumulation (article §5).

`y [M, N] = x [M, K] @ W^T`, with W `[N, K]` stored as minfer's "int4" method stores it
(`minfer.quantization.int4`): 4-bit codes q in [0, 15], and per group of `group_size` consecutive inputs of
a row a bfloat16 scale s and zero z, w = (q - 8) s + z. The kernel never writes the float weight to memory:
each program loads a `[BLOCK_K, BLOCK_N]` tile of packed bytes (half a byte per weight), splits the nibbles,
applies the tile's one (scale, zero) per column, rounds to bf16 and feeds the tensor cores. At decode sizes
(M of 1-64) the product is bound by the bytes of W read, so 0.5 + 4/G bytes per weight instead of bf16's 2
is what it is paid for (Frantar et al., "GPTQ", 2022, §5 and its W4A16 CUDA kernel; vLLM's Marlin and
exllama kernels do the same with far more tuning). Re-derived for teaching, not copied.

The two byte layouts of `qweight uint8 [N, K/2]`, both read in place (no repacking for the GPU):

    blocked (N % 64 == 0, torch's `_convert_weight_to_int4pack_for_cpu` layout): rows in blocks of 64;
        byte [b, k, i] (flat offset b*32K + 32k + i) holds row 64b+i in its low nibble, row 64b+32+i in its
        high nibble. So W[n, k] is at byte (n // 64) * 32K + 32k + n % 32, nibble (n % 64) // 32.
    plain (other N): byte [n, k // 2], low nibble for even k, high for odd k.

`scales_and_zeros bfloat16 [K/G, N, 2]`: (s, z) of group k // G of row n at [k // G, n].

The tile's K extent divides the group size, so one (s, z) pair per column and K step: two vector loads, no
gather. Under Triton's CPU interpreter the dot runs in fp32 on the bf16-rounded operands (numpy has no bf16;
`flash_attention.dot_in_fp32`), which is the same product up to the order of the sums; the interpreter's
float32 -> bfloat16 cast truncates, so there the kernel rounds on the bits (`_round_to_bf16`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_attention import autotune_enabled, dot_in_fp32, interpreter_active

GROUP_SIZES = (32, 64, 128, 256)


@triton.jit
def _round_to_bf16(x, EMULATE_RTNE: tl.constexpr):
    """float32 -> bfloat16, rounding to nearest even. A GPU's cast does that; Triton's CPU interpreter
    truncates (seen with triton 3.x), so there the rounding is done on the bits: add 0x7FFF plus the lowest
    kept bit, drop the low 16 bits (exact for finite values; the tests' values are)."""
    if EMULATE_RTNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _w4a16_kernel(X, QW, SZ, Y, M, N, K,
                  stride_xm, stride_ym, M_BUCKET,
                  GROUP_SIZE: tl.constexpr, BLOCKED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_IN_FP32: tl.constexpr):
    """Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). Y[m, n] = sum_k bf16(X[m, k]) bf16(W[n, k]), fp32 sums.
    M_BUCKET is only the autotuner's key (M rounded up to a power of two)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    n64 = offs_n.to(tl.int64)
    if BLOCKED:
        col_base = (n64 // 64) * (32 * K) + n64 % 32  # [BLOCK_N]: byte of (n, k=0)
        shift = (((offs_n % 64) // 32) * 4).to(tl.uint8)[None, :]  # [1, BLOCK_N]: which nibble
    else:
        col_base = n64 * (K // 2)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # K is a whole number of groups and BLOCK_K divides the group: no K mask
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=mask_m[:, None], other=0.0)
        x = _round_to_bf16(x.to(tl.float32), DOT_IN_FP32)  # the "A16" of W4A16
        if BLOCKED:
            byte = tl.load(QW + col_base[None, :] + 32 * k[:, None], mask=mask_n[None, :], other=0)
            q = (byte >> shift) & 0xF
        else:
            byte = tl.load(QW + col_base[None, :] + (k // 2)[:, None], mask=mask_n[None, :], other=0)
            q = (byte >> ((k % 2) * 4).to(tl.uint8)[:, None]) & 0xF
        # One (scale, zero) per column for this K step: the tile lies inside one group.
        g = k0 // GROUP_SIZE
        s = tl.load(SZ + (g * N + offs_n) * 2, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(SZ + (g * N + offs_n) * 2 + 1, mask=mask_n, other=0.0).to(tl.float32)
        w = _round_to_bf16((q.to(tl.float32) - 8.0) * s[None, :] + z[None, :], DOT_IN_FP32)  # [BLOCK_K, BLOCK_N]
        if DOT_IN_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _gpu_configs():
    # Decode-sized M wants narrow M tiles and wide N; BLOCK_K <= 32 divides every supported group size.
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in [(16, 64, 32, 4, 4), (16, 128, 32, 4, 4), (32, 64, 32, 4, 4),
                                      (64, 64, 32, 4, 3), (64, 128, 32, 8, 3), (128, 128, 32, 8, 3),
                                      (16, 256, 32, 8, 3)]]


# Tuned once per (power-of-two bucket of M, N, K, G, layout): not once per batch size the engine happens to run.
_w4a16_autotuned = triton.autotune(configs=_gpu_configs(), key=["M_BUCKET", "N", "K", "GROUP_SIZE", "BLOCKED"])(
    _w4a16_kernel)

# Tiles under the CPU interpreter: small, so the tests' odd shapes cross tile edges in M and N.
INTERPRET_BLOCKS = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 blocked: bool, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x [M, K] @ W^T` with W stored as int4 codes (module docstring), computed as bf16 x bf16 -> fp32.

    Args:
        x: `[M, K]` float32 / float16 / bfloat16 (rounded to bfloat16 inside; unit stride along K).
        qweight: uint8 `[N, K/2]` in the `blocked` layout (N % 64 == 0) or the plain one.
        scales_and_zeros: bfloat16 `[K/G, N, 2]`.
        group_size: G, one of 32, 64, 128, 256; must divide K.
        blocked: which layout `qweight` is in (`layer.int4_packed` of `Int4LinearMethod`).
        out_dtype: dtype of the result (default x's).

    Returns:
        `[M, N]` in `out_dtype`.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, a group size that is not supported or does
            not divide K, `blocked` with N % 64 != 0, or CPU tensors without Triton's interpreter.
    """
    if x.dim() != 2 or qweight.dim() != 2 or scales_and_zeros.dim() != 3:
        raise ValueError(f"x must be [M, K], qweight [N, K/2], scales_and_zeros [K/G, N, 2]; got {tuple(x.shape)}, "
                         f"{tuple(qweight.shape)}, {tuple(scales_and_zeros.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if group_size not in GROUP_SIZES or k % group_size:
        raise ValueError(f"group_size must be one of {GROUP_SIZES} and divide K={k}, got {group_size}")
    if qweight.dtype != torch.uint8 or qweight.shape != (n, k // 2):
        raise ValueError(f"qweight must be uint8 [{n}, {k // 2}], got {qweight.dtype} {tuple(qweight.shape)}")
    if scales_and_zeros.dtype != torch.bfloat16 or scales_and_zeros.shape != (k // group_size, n, 2):
        raise ValueError(f"scales_and_zeros must be bfloat16 [{k // group_size}, {n}, 2], got "
                         f"{scales_and_zeros.dtype} {tuple(scales_and_zeros.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if blocked and n % 64:
        raise ValueError(f"the blocked layout needs N % 64 == 0, got N={n}")
    if not (x.device == qweight.device == scales_and_zeros.device):
        raise ValueError("x, qweight and scales_and_zeros must be on the same device")
    x = x if x.stride(-1) == 1 else x.contiguous()
    qweight, scales_and_zeros = qweight.contiguous(), scales_and_zeros.contiguous()
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    args = (x, qweight, scales_and_zeros, y, m, n, k, x.stride(0), y.stride(0), min(triton.next_power_of_2(m), 256))
    meta = dict(GROUP_SIZE=group_size, BLOCKED=blocked, DOT_IN_FP32=dot_in_fp32(torch.bfloat16))
    if interpreter_active():
        b = INTERPRET_BLOCKS
        _w4a16_kernel[(triton.cdiv(m, b["BLOCK_M"]), triton.cdiv(n, b["BLOCK_N"]))](*args, **b, **meta)
    elif not x.is_cuda:
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing minfer.kernels")
    elif autotune_enabled():
        grid = lambda META: (triton.cdiv(m, META["BLOCK_M"]), triton.cdiv(n, META["BLOCK_N"]))  # noqa: E731
        _w4a16_autotuned[grid](*args, **meta)
    else:
        bm = 16 if m <= 16 else 64
        _w4a16_kernel[(triton.cdiv(m, bm), triton.cdiv(n, 64))](*args, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=32,
                                                                  num_warps=4, num_stages=3, **meta)
    return y
