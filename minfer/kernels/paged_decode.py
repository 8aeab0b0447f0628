"""Decode attention over a paged KV cache, split along the context (Flash-Decoding) (article §4).

Sources: Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference" (PyTorch blog, 2023);
the paged cache layout of vLLM (Kwon et al., "Efficient Memory Management for LLM Serving with
PagedAttention", 2023). Re-derived for teaching, not copied.

Why split. In decode each sequence has ONE query token. FlashAttention parallelizes over query tiles,
heads and batch; with one query the grid is only batch x heads programs, e.g. 4 x 8 = 32 programs on a
GPU with 132 SMs, each walking 32k keys alone: most of the chip idles while the memory system could
deliver far more. Flash-Decoding also splits the *keys*: program (b, h, s) reads only keys
[s * chunk, (s + 1) * chunk) and produces a partial result (row max m_s, sum l_s = sum exp(score - m_s),
unnormalized output acc_s = sum exp(score - m_s) v). A second tiny kernel merges the partials exactly,
because softmax over a union of sets can be reassembled from per-set maxima and sums:

    M = max_s m_s,   L = sum_s l_s * exp(m_s - M),   out = sum_s acc_s * exp(m_s - M) / L.

(This is the log-sum-exp merge: lse_s = m_s + log l_s, and weight_s = exp(lse_s - lse_total).)

GQA: the query heads that share one K/V head are processed by the same program, so each K/V tile is read
from memory once for the whole group instead of once per query head; decode is memory-bound, so that is
where GQA's speed-up comes from, not only its smaller cache.

Paged cache: the keys of a sequence are not contiguous. Token t lives in physical block
block_table[b, t // block_size] at offset t % block_size. The kernel looks the block up per token, so the
key tile size is independent of the cache block size and the block table may be in any order.

Quantized cache (`kv_cache_dtype` int8 / fp8_e4m3 / fp8_e5m2, `minfer.attention.kv_quant`): the pool holds
8-bit codes and one float32 scale per token and K/V head, `k_scale / v_scale [num_blocks, block_size, KVH]`.
The kernel loads the codes (1 byte per element instead of 2 or 4: what decode, bound by memory, is paid for),
and dequantizes them in registers, `k = code * scale`, rounded to the query's dtype exactly as the torch
reference's `dequantize_kv`, before the same dots.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .flash_attention import _UNBOUNDED, autotune_enabled, check_kv_scales, dot_in_fp32, interpreter_active


@triton.jit
def _paged_decode_split_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLE, CONTEXT_LENS, SLOPES, M_OUT, L_OUT, ACC_OUT, K_SCALE, V_SCALE,
    stride_qb, stride_qh,
    stride_kblk, stride_kslot, stride_kh, stride_vblk, stride_vslot, stride_vh,
    stride_bt, stride_sblk, stride_sslot, stride_sh,
    sm_scale, window_left, num_splits, block_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Grid: (batch, num_kv_heads, num_splits). Writes partial m, l [B, H, S] and acc [B, H, S, D] (fp32).
    KV_QUANT: the caches hold int8/fp8 codes, dequantized on load with K_SCALE / V_SCALE (strides s*)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(CONTEXT_LENS + seq)
    pos = context_len - 1  # the query is the newest token
    first_key = tl.maximum(pos - window_left, 0)  # sliding window: older keys are never read
    # Each split gets an equal, BLOCK_N-aligned share of this sequence's visible keys.
    per_split = tl.cdiv(tl.cdiv(context_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    lo = first_key + split * per_split
    hi = tl.minimum(lo + per_split, context_len)

    offs_g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    # The GROUP query heads of this K/V head, padded to GROUP_PAD rows (tl.dot wants >= 16 rows).
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(SLOPES + heads, mask=mask_g, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        mask_n = tok < hi
        # Paged lookup: logical token -> (physical block, offset inside the block).
        block = tl.load(BLOCK_TABLE + seq * stride_bt + tok // block_size, mask=mask_n, other=0).to(tl.int64)
        slot = tok % block_size
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_CACHE + block[:, None] * stride_kblk + slot[:, None] * stride_kslot + kv_head * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_CACHE + block[:, None] * stride_vblk + slot[:, None] * stride_vslot + kv_head * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:  # codes -> values in registers: one scale per (token, K/V head)
            s_off = block * stride_sblk + slot * stride_sslot + kv_head * stride_sh
            k_s = tl.load(K_SCALE + s_off, mask=mask_n, other=0.0)
            v_s = tl.load(V_SCALE + s_off, mask=mask_n, other=0.0)
            k = (k.to(tl.float32) * k_s[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [GROUP_PAD, BLOCK_N]
        if HAS_ALIBI:
            s = s - slopes[:, None] * (pos - tok)[None, :].to(tl.float32)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Online softmax, as in flash_attention.py (natural exp here: this kernel is memory-bound).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Partials are [batch, num_heads, num_splits(, head_dim)], contiguous. An empty split (its range lies
    # past the end of a short sequence) stores m = -inf, l = 0, acc = 0 and drops out of the merge.
    row = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
    tl.store(M_OUT + row, m_i, mask=mask_g)
    tl.store(L_OUT + row, l_i, mask=mask_g)
    tl.store(ACC_OUT + row[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], acc,
             mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _combine_splits_kernel(M_IN, L_IN, ACC_IN, OUT, stride_ob, stride_oh, num_heads, num_splits,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Grid: (batch, num_heads). Log-sum-exp merge of the partial results of one (sequence, head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    row = (seq * num_heads + head) * num_splits + offs_s
    m = tl.load(M_IN + row, mask=mask_s, other=float("-inf"))
    l = tl.load(L_IN + row, mask=mask_s, other=0.0)
    acc = tl.load(ACC_IN + row[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no key at all: every weight is 0, output 0
    w = tl.exp(m - m_max)  # exp(m_s - M): rescales each split to the common max
    total = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + seq * stride_ob + head * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=mask_d)


_DECODE_GPU_CONFIGS = [
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=4),
]
_paged_decode_split_autotuned = triton.autotune(
    configs=_DECODE_GPU_CONFIGS, key=["GROUP_PAD", "HEAD_DIM", "HAS_ALIBI", "DOT_PRECISION", "KV_QUANT"],
)(_paged_decode_split_kernel)
INTERPRET_BLOCK_N = 16


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many splits per sequence: enough programs to fill the GPU, but >= 256 keys per split.

    Uses an upper bound of the context (block table width x block size) so that no device->host copy of
    context_lens is needed. Capped at 64 splits.
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    want = triton.cdiv(2 * sms, max(1, batch * num_kv_heads))  # ~2 programs per SM
    return int(max(1, min(want, triton.cdiv(max(max_context, 1), 256), 64)))


def _check(q, k_cache, v_cache, block_table, context_lens, alibi_slopes, quantized=False):
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache, v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    batch, num_heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_heads % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({k_cache.shape[2]})")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or (
            not quantized and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype)):
        raise ValueError(f"q and caches must share a float32/float16/bfloat16 dtype (or the caches hold int8/fp8 "
                         f"codes with k_scale/v_scale), got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be int32 [{batch}, max_blocks_per_seq], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if context_lens.dtype != torch.int32 or context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be int32 [{batch}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if alibi_slopes is not None and (alibi_slopes.shape != (num_heads,) or alibi_slopes.dtype != torch.float32):
        raise ValueError(f"alibi_slopes must be float32 [{num_heads}]")
    if not (q.device == k_cache.device == v_cache.device == block_table.device == context_lens.device):
        raise ValueError("q, caches, block_table and context_lens must be on the same device")


def paged_decode_splits(q, k_cache, v_cache, block_table, context_lens, num_splits, softmax_scale=None,
                        window_size=(-1, -1), alibi_slopes=None, k_scale=None, v_scale=None):
    """Kernel 1 of Flash-Decoding alone: the per-split partial results (shown in the notebook).

    Returns:
        (m, l, acc): m, l float32 [batch, num_heads, num_splits] (row max and sum of exp(score - m) of each
        split), acc float32 [batch, num_heads, num_splits, head_dim] (sum of exp(score - m) * v, not yet
        divided by l). Arguments as `paged_attention_decode`.
    """
    check_kv_scales(k_cache, v_cache, k_scale, v_scale, "caches")
    quant = k_scale is not None
    _check(q, k_cache, v_cache, block_table, context_lens, alibi_slopes, quant)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have unit stride along head_dim")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_table = block_table.contiguous()
    context_lens = context_lens.contiguous()
    m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    if batch == 0:
        return m, l, acc
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    left = window_size[0] if window_size[0] >= 0 else _UNBOUNDED  # right is moot: no keys after the query
    args = (q, k_cache, v_cache, block_table, context_lens,
            alibi_slopes.contiguous() if alibi_slopes is not None else m, m, l, acc,
            k_scale if quant else m, v_scale if quant else m,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
            *(k_scale.stride() if quant else (0, 0, 0)),
            scale, left, num_splits, k_cache.shape[1])
    meta = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)), HAS_ALIBI=alibi_slopes is not None,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_IN_FP32=dot_in_fp32(q.dtype),
                KV_QUANT=quant)
    grid = (batch, num_kv_heads, num_splits)
    if interpreter_active():
        _paged_decode_split_kernel[grid](*args, BLOCK_N=INTERPRET_BLOCK_N, **meta)
    elif not q.is_cuda:
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing minfer.kernels")
    elif autotune_enabled():
        _paged_decode_split_autotuned[grid](*args, **meta)
    else:
        small = q.dtype == torch.float32 or head_dim > 128
        _paged_decode_split_kernel[grid](*args, BLOCK_N=32 if small else 64, num_warps=4,
                                         num_stages=2 if small else 3, **meta)
    return m, l, acc


def combine_splits(m, l, acc, out_dtype=torch.float32, out=None):
    """Kernel 2 of Flash-Decoding: merge partials (m, l, acc) from `paged_decode_splits` into [B, H, D]."""
    batch, num_heads, num_splits, head_dim = acc.shape
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=out_dtype, device=acc.device)
    if batch == 0:
        return out
    _combine_splits_kernel[(batch, num_heads)](
        m, l, acc, out, out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)))
    return out


def paged_attention_decode(q, k_cache, v_cache, block_table, context_lens, softmax_scale=None,
                           window_size=(-1, -1), alibi_slopes=None, num_splits=None, k_scale=None, v_scale=None):
    """One decode step of attention for a batch of sequences whose K/V live in a paged cache.

    Args:
        q: [batch, num_heads, head_dim] (float32/float16/bfloat16), the query of each sequence's newest
            token, at position context_lens[b] - 1.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype as q; the current
            token's K/V must already be written (see `store_kvcache`).
        block_table: int32 [batch, max_blocks_per_seq]; entry i is the physical block of tokens
            i*block_size .. (i+1)*block_size - 1. Entries past the context are not read.
        context_lens: int32 [batch], keys per sequence including the current token (0 gives output 0).
        softmax_scale: default 1 / sqrt(head_dim).
        window_size: (left, right) as flash_attn; only left matters (keys pos-left .. pos are read).
        alibi_slopes: float32 [num_heads]; adds -slope * (pos - j).
        num_splits: splits of the context per sequence (Flash-Decoding). None: `default_num_splits`.
        k_scale, v_scale: float32 [num_blocks, block_size, num_kv_heads] for a quantized cache (the caches
            then hold int8 / float8_e4m3fn / float8_e5m2 codes, value = code * scale; module docstring).

    Returns:
        [batch, num_heads, head_dim] in q's dtype.

    Raises:
        ValueError: shape, dtype or device mismatch; num_heads not a multiple of num_kv_heads;
            head_dim > 256; num_splits < 1; scales without int8/fp8 caches, or of the wrong shape.
    """
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], k_cache.shape[2], block_table.shape[1] * k_cache.shape[1],
                                        q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    m, l, acc = paged_decode_splits(q, k_cache, v_cache, block_table, context_lens, num_splits, softmax_scale,
                                    window_size, alibi_slopes, k_scale, v_scale)
    return combine_splits(m, l, acc, out_dtype=q.dtype)
