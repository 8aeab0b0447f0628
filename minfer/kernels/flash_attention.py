"""FlashAttention-2 forward pass for packed variable-length batches (article §4).

Sources: Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning" (2023),
Algorithm 1; the Triton tutorial 06-fused-attention. This is a re-derivation for teaching, not a copy.

Idea in one paragraph. Naive attention writes the [Lq, Lk] score matrix S = QK^T to memory, reads it back
for the softmax, writes P, reads it again for PV: O(L^2) bytes of traffic. FlashAttention never stores S.
One program owns a tile of BLOCK_M queries; it keeps the tile of Q, a running row max m, a running row sum l
and an output accumulator in registers, and walks over K/V in tiles of BLOCK_N keys. For each key tile it
computes the scores, updates the max, rescales what it accumulated so far by exp(m_old - m_new) ("online
softmax"), and adds P V. At the end it divides by l once. Traffic is O(L) per query tile, and the result is
exactly softmax(QK^T)V, not an approximation.

FA2's changes over FA1 that this kernel keeps: the loop over K/V is the *inner* loop (each program owns
its queries, so no two programs write the same output rows), the division by l is deferred to the end,
and the grid is parallel over (query tiles, heads, batch) so that short batches still fill the GPU.

Quantized K/V (`k_scale`, `v_scale`): k and v hold int8/fp8 codes with one float32 scale per token and K/V
head (`minfer.attention.kv_quant`; what the Triton backend gathers from a quantized pool); each tile is
dequantized on load, `code * scale` rounded to q's dtype as the torch reference does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import minfer.envs as envs

# exp(x) = 2^(x * log2(e)): the kernel folds log2(e) into the softmax scale and uses exp2, which maps to
# one hardware instruction (the FA2 paper and the Triton tutorial do the same).
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# "no window limit" is a large distance, so the mask needs no special case (2^30 + positions < 2^31).
_UNBOUNDED = 1 << 30


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, start_n, offs_n, offs_d, mask_d,
                 q_pos, seqlen_k, window_left, window_right, slope_log2,
                 qk_scale, ks_base, vs_base, stride_st, MASKED: tl.constexpr, HAS_ALIBI: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, KV_QUANT: tl.constexpr):
    """One step of the inner loop: scores of a [BLOCK_M] query tile against keys start_n..start_n+BLOCK_N.

    MASKED=False is used for tiles the caller proved fully visible to every query of the tile (the bulk of
    a causal matrix): they skip the mask arithmetic.
    """
    k_idx = start_n + offs_n
    if MASKED:
        kv_mask = (k_idx < seqlen_k)[:, None] & mask_d[None, :]
    else:
        kv_mask = mask_d[None, :]  # head_dim may be padded up to a power of two
    k = tl.load(k_base + k_idx[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_QUANT:  # int8/fp8 codes -> values: one scale per (token, K/V head)
        k_s = tl.load(ks_base + k_idx.to(tl.int64) * stride_st, mask=k_idx < seqlen_k, other=0.0)
        k = (k.to(tl.float32) * k_s[:, None]).to(q.dtype)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
    # s is in log2 units: scores * softmax_scale * log2(e).
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_ALIBI:
        # ALiBi: a linear penalty on distance, -slope * |p - j| (flash_attn's convention).
        dist = tl.abs(q_pos[:, None] - k_idx[None, :]).to(tl.float32)
        s = s - slope_log2 * dist
    if MASKED:
        diff = q_pos[:, None] - k_idx[None, :]  # p - j
        visible = (k_idx[None, :] < seqlen_k) & (diff <= window_left) & (-diff <= window_right)
        s = tl.where(visible, s, float("-inf"))
    # Online softmax. m_new can stay -inf when every key so far was masked for a row; subtracting a
    # "safe" 0 then keeps exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = nan.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)  # how much the old running max overestimated: rescale old sums
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = tl.load(v_base + k_idx[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_QUANT:
        v_s = tl.load(vs_base + k_idx.to(tl.int64) * stride_st, mask=k_idx < seqlen_k, other=0.0)
        v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
    if DOT_IN_FP32:
        v = v.to(tl.float32)
    # P is rounded to V's dtype (fp16/bf16) so the second matmul runs on tensor cores; acc stays fp32.
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _flash_attn_varlen_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, SLOPES, K_SCALE, V_SCALE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    stride_st, stride_sh,
    qk_scale, window_left, window_right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ALIBI: tl.constexpr, RETURN_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Grid: (cdiv(max_seqlen_q, BLOCK_M), num_heads, batch). One program = one query tile of one head."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)

    # Where this sequence's queries and keys live in the packed tensors.
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    if pid_m * BLOCK_M >= seqlen_q:
        return  # the grid is sized by the longest sequence; shorter ones have idle tiles

    kv_head = head // GROUP  # GQA/MQA: GROUP query heads share one K/V head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_m = offs_m < seqlen_q

    # int64 offsets: token * stride overflows int32 for large packed batches.
    q_ptrs = Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    k_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    ks_base = K_SCALE + k_start.to(tl.int64) * stride_st + kv_head * stride_sh  # unused unless KV_QUANT
    vs_base = V_SCALE + k_start.to(tl.int64) * stride_st + kv_head * stride_sh

    # Query i of a sequence sits at key position seqlen_k - seqlen_q + i (causal mask aligned to the end,
    # which is what a chunked prefill or a prefix-cache hit needs).
    q_pos = seqlen_k - seqlen_q + offs_m
    first_p = seqlen_k - seqlen_q + pid_m * BLOCK_M
    last_p = seqlen_k - seqlen_q + tl.minimum((pid_m + 1) * BLOCK_M, seqlen_q) - 1

    if HAS_ALIBI:
        slope_log2 = tl.load(SLOPES + head) * 1.4426950408889634
    else:
        slope_log2 = 0.0

    # Key range this tile can see at all: [lo, hi). Tiles wholly outside are never loaded; this is what
    # makes causal attention cost half of full attention, and sliding windows cost O(L * window).
    lo = tl.maximum(first_p - window_left, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(last_p + window_right + 1, seqlen_k)
    # Inside it, [full_lo, full_hi) are tiles that every query of the tile sees completely: no mask there.
    full_lo = tl.minimum((tl.maximum(last_p - window_left, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, hi)
    full_hi = tl.maximum(tl.maximum(tl.minimum(first_p + window_right + 1, seqlen_k), 0) // BLOCK_N * BLOCK_N,
                         full_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1) left edge (sliding window boundary), 2) the unmasked middle, 3) right edge (causal diagonal / end).
    for start_n in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, start_n, offs_n,
                                     offs_d, mask_d, q_pos, seqlen_k, window_left, window_right, slope_log2,
                                     qk_scale, ks_base, vs_base, stride_st, True, HAS_ALIBI, DOT_PRECISION,
                                     DOT_IN_FP32, KV_QUANT)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, start_n, offs_n,
                                     offs_d, mask_d, q_pos, seqlen_k, window_left, window_right, slope_log2,
                                     qk_scale, ks_base, vs_base, stride_st, False, HAS_ALIBI, DOT_PRECISION,
                                     DOT_IN_FP32, KV_QUANT)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, start_n, offs_n,
                                     offs_d, mask_d, q_pos, seqlen_k, window_left, window_right, slope_log2,
                                     qk_scale, ks_base, vs_base, stride_st, True, HAS_ALIBI, DOT_PRECISION,
                                     DOT_IN_FP32, KV_QUANT)

    # Deferred normalization (FA2): one division per row instead of one per tile. A row that saw no key
    # (l = 0) outputs 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = O + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    if RETURN_LSE:
        # Back to natural log: lse = ln(sum_j exp(score_j)) = ln2 * (m + log2 l); a row with no key: -inf.
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        tl.store(LSE + head * stride_lse_h + q_start + offs_m, lse, mask=mask_m)


QUANTIZED_CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def check_kv_scales(k_cache, v_cache, k_scale, v_scale, what: str) -> None:
    """Raise ValueError unless (k_scale, v_scale) are both None, or both float32 `[*k_cache.shape[:-1]]` on the
    caches' device with int8/fp8 caches (shared by the paged-decode and flash wrappers; `what` names the caches)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale (a quantized cache), or neither")
    if k_scale is None:
        return
    if k_cache.dtype not in QUANTIZED_CACHE_DTYPES or v_cache.dtype not in QUANTIZED_CACHE_DTYPES:
        raise ValueError(f"k_scale/v_scale go with int8/fp8 {what}, got {k_cache.dtype}, {v_cache.dtype}")
    want = tuple(k_cache.shape[:-1])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.dtype != torch.float32 or tuple(t.shape) != want or t.device != k_cache.device:
            raise ValueError(f"{name} must be float32 {list(want)} on {k_cache.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must have the same strides")


def interpreter_active() -> bool:
    """True when Triton runs kernels with its CPU interpreter (TRITON_INTERPRET=1, set by `minfer.kernels`
    when there is no CUDA: `envs.triton_interpreter_environ`)."""
    return envs.triton_interpreter()


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels should upcast tl.dot operands to fp32.

    Only under the CPU interpreter with bfloat16: there tl.dot on bf16 operands returns garbage
    (numpy has no bf16; seen with triton 3.9), so the kernels compute that product in fp32 instead.
    On a GPU bf16 goes to the tensor cores as is.
    """
    return interpreter_active() and dtype == torch.bfloat16


# On a GPU the best tile shape depends on head_dim and the chip; let Triton time a few candidates once
# per (head_dim, group, alibi) and cache the winner. Under the CPU interpreter a fixed small tile is used.
_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
]
_flash_attn_varlen_autotuned = triton.autotune(
    configs=_GPU_CONFIGS, key=["GROUP", "HEAD_DIM", "HAS_ALIBI", "RETURN_LSE", "DOT_PRECISION", "KV_QUANT"],
)(_flash_attn_varlen_kernel)



def autotune_enabled() -> bool:
    """GPU launches autotune unless `envs.MINFER_AUTOTUNE`=0 (the tests set it: they compile many variants and
    timing five tile shapes for each would dominate their run time)."""
    return envs.MINFER_AUTOTUNE


def _default_gpu_config(head_dim: int, dtype: torch.dtype) -> dict:
    """A tile that fits shared memory for every head_dim/dtype, used when autotuning is off.

    Shared memory holds the Q tile plus num_stages copies of a K and a V tile; fp32 and head_dim 256
    halve the tiles so that this stays under ~100 KB on any recent GPU.
    """
    if dtype == torch.float32 or head_dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8 if head_dim > 64 else 4, num_stages=2)


# Tile used under the interpreter: small, so that the tests' short sequences cross several tiles.
INTERPRET_BLOCK_M = 16
INTERPRET_BLOCK_N = 16


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                      causal=True, window_size=(-1, -1), alibi_slopes=None, return_lse=False, k_scale=None,
                      v_scale=None):
    """FlashAttention-2 forward over a packed batch of variable-length sequences (flash_attn's varlen API).

    Args:
        q: [total_q, num_heads, head_dim], float32 / float16 / bfloat16. Sequence b's queries are rows
            cu_seqlens_q[b]:cu_seqlens_q[b+1].
        k, v: [total_k, num_kv_heads, head_dim], same dtype as q. num_heads must be a multiple of
            num_kv_heads (GQA; 1 = MQA); query head h reads K/V head h // (num_heads // num_kv_heads).
        cu_seqlens_q, cu_seqlens_k: int32 [batch + 1], cumulative sequence lengths starting at 0.
        max_seqlen_q: an upper bound of the query lengths (sizes the grid; too small drops queries).
        max_seqlen_k: the longest key length (accepted for API compatibility; the kernel reads lengths
            from cu_seqlens_k).
        softmax_scale: default 1 / sqrt(head_dim).
        causal: query i of a sequence with Lq queries and Lk keys sits at key position Lk - Lq + i and sees
            keys j <= that position. Same as window_size right = 0.
        window_size: (left, right); key j is visible to query position p iff p - left <= j <= p + right;
            -1 means unbounded on that side.
        alibi_slopes: float32 [num_heads]; adds -slope * |p - j| to each score.
        return_lse: also return the log-sum-exp of each row's scaled scores.
        k_scale, v_scale: float32 [total_k, num_kv_heads]: k and v then hold int8 / float8_e4m3fn /
            float8_e5m2 codes, value = code * scale (a quantized KV cache; module docstring).

    Returns:
        out [total_q, num_heads, head_dim] in q's dtype; with return_lse also lse, float32
        [num_heads, total_q]. A query that sees no key gets output 0 and lse -inf.

    Raises:
        ValueError: mismatched shapes/dtypes/devices, head_dim > 256, num_heads not a multiple of
            num_kv_heads, cu_seqlens not int32 of matching length, bad alibi_slopes, scales without int8/fp8
            k/v or of the wrong shape.

    Head dims that are not powers of two (80, 96) are padded to the next power of two inside the kernel
    with masked loads; nothing is copied.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D [tokens, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    if k.shape != v.shape or k.shape[2] != head_dim:
        raise ValueError(f"k and v must both be [total_k, num_kv_heads, {head_dim}], got {k.shape}, {v.shape}")
    check_kv_scales(k, v, k_scale, v_scale, "k, v")
    quant = k_scale is not None
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or (
            not quant and (k.dtype != q.dtype or v.dtype != q.dtype)):
        raise ValueError(f"q, k, v must share a float32/float16/bfloat16 dtype (or k, v hold int8/fp8 codes with "
                         f"k_scale/v_scale), got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == cu_seqlens_q.device == cu_seqlens_k.device):
        raise ValueError("q, k, v and cu_seqlens must be on the same device")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be int32")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.numel() < 2:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both be [batch + 1] with batch >= 1")
    if alibi_slopes is not None and (alibi_slopes.shape != (num_heads,) or alibi_slopes.dtype != torch.float32):
        raise ValueError(f"alibi_slopes must be float32 [{num_heads}], got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")

    # The kernel assumes unit stride along head_dim (vector loads); other strides are passed through, so
    # q/k/v may be views into a fused QKV projection.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    batch = cu_seqlens_q.numel() - 1
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    left, right = window_size
    if causal:
        right = 0
    left = _UNBOUNDED if left < 0 else left
    right = _UNBOUNDED if right < 0 else right

    out = torch.empty(total_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, total_q, dtype=torch.float32, device=q.device) if return_lse else out
    slopes = alibi_slopes.contiguous() if alibi_slopes is not None else out
    if total_q == 0 or max_seqlen_q == 0:
        return (out, lse) if return_lse else out

    args = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, slopes,
            k_scale if quant else out, v_scale if quant else out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0) if return_lse else 0,
            *(k_scale.stride() if quant else (0, 0)),
            scale * _LOG2E, left, right)
    meta = dict(GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs >= 16
                HAS_ALIBI=alibi_slopes is not None, RETURN_LSE=return_lse,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                DOT_IN_FP32=dot_in_fp32(q.dtype), KV_QUANT=quant)
    if interpreter_active():
        grid = (triton.cdiv(max_seqlen_q, INTERPRET_BLOCK_M), num_heads, batch)
        _flash_attn_varlen_kernel[grid](*args, BLOCK_M=INTERPRET_BLOCK_M, BLOCK_N=INTERPRET_BLOCK_N, **meta)
    elif not q.is_cuda:
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing minfer.kernels")
    elif autotune_enabled():
        grid = lambda META: (triton.cdiv(max_seqlen_q, META["BLOCK_M"]), num_heads, batch)  # noqa: E731
        _flash_attn_varlen_autotuned[grid](*args, **meta)
    else:
        cfg = _default_gpu_config(head_dim, q.dtype)
        grid = (triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), num_heads, batch)
        _flash_attn_varlen_kernel[grid](*args, **cfg, **meta)
    return (out, lse) if return_lse else out
