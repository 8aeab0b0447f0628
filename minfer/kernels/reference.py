"""Plain-torch references for every kernel in `minfer.kernels` (article §4).

These are written to be obviously right, not fast: attention materializes the full score matrix, the
varlen version loops over sequences, the paged version gathers the cache block by block. The tests compare
each Triton kernel against them, and the notebook uses them to show what the kernels compute.

All references compute in float32 and cast the result back to the input dtype, which is what the kernels
do too (fp32 accumulation), so the comparison measures the kernel, not two rounding policies.
"""

from __future__ import annotations

import math

import torch


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window_size: tuple[int, int]) -> torch.Tensor:
    """Boolean [Lq, Lk]: key j visible to query position p iff p - left <= j <= p + right (-1 = unbounded)."""
    left, right = window_size
    diff = q_pos[:, None] - k_pos[None, :]  # p - j
    mask = torch.ones_like(diff, dtype=torch.bool)
    if left >= 0:
        mask &= diff <= left
    if right >= 0:
        mask &= -diff <= right
    return mask


def attention_reference(q, k, v, softmax_scale=None, causal=True, window_size=(-1, -1), alibi_slopes=None,
                        return_lse=False):
    """Naive attention of one sequence: materializes the [heads, Lq, Lk] score matrix.

    Args:
        q: [Lq, num_heads, head_dim]. k, v: [Lk, num_kv_heads, head_dim] (num_heads % num_kv_heads == 0).
        softmax_scale: default 1/sqrt(head_dim).
        causal: query i sits at key position Lk - Lq + i and sees keys up to there (same as window right=0).
        window_size: (left, right), -1 = unbounded, flash_attn's convention.
        alibi_slopes: float32 [num_heads]; adds -slope * |p - j| to the score.
        return_lse: also return the log-sum-exp of the scaled scores, float32 [num_heads, Lq].

    Rows that see no key at all give output 0 and lse -inf.
    """
    Lq, H, D = q.shape
    Lk, KVH, _ = k.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    group = H // KVH
    qf, kf, vf = q.float(), k.float(), v.float()
    kf = kf.repeat_interleave(group, dim=1)  # GQA: query head h reads kv head h // group
    vf = vf.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    q_pos = torch.arange(Lq, device=q.device) + (Lk - Lq)
    k_pos = torch.arange(Lk, device=q.device)
    left, right = window_size
    if causal:
        right = 0
    if alibi_slopes is not None:
        dist = (q_pos[:, None] - k_pos[None, :]).abs().float()
        scores = scores - alibi_slopes.float().view(H, 1, 1) * dist
    mask = _visible(q_pos, k_pos, (left, right))
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]
    probs = torch.exp(scores - lse[..., None].clamp_min(-1e30))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)
    return (out, lse) if return_lse else out


def flash_attn_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                                softmax_scale=None, causal=True, window_size=(-1, -1), alibi_slopes=None,
                                return_lse=False):
    """Same contract as `flash_attn_varlen`, by looping over the sequences of the batch."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        o, lse = attention_reference(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], softmax_scale,
                                     causal, window_size, alibi_slopes, return_lse=True)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, 0)
    return (out, torch.cat(lses, 1)) if return_lse else out


def gather_paged_kv(k_cache, v_cache, block_table_row, context_len: int):
    """The first `context_len` keys/values of one sequence, read from a paged cache: [context_len, KVH, D]."""
    block_size = k_cache.shape[1]
    n_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table_row[:n_blocks].long()
    k = k_cache[blocks].flatten(0, 1)[:context_len]
    v = v_cache[blocks].flatten(0, 1)[:context_len]
    return k, v


def paged_attention_decode_reference(q, k_cache, v_cache, block_table, context_lens, softmax_scale=None,
                                     window_size=(-1, -1), alibi_slopes=None):
    """Decode attention over a paged cache: gather each sequence's keys, then naive attention.

    q: [batch, num_heads, head_dim], one query per sequence at position context_len - 1.
    """
    outs = []
    for b, n in enumerate(context_lens.tolist()):
        k, v = gather_paged_kv(k_cache, v_cache, block_table[b], n)
        outs.append(attention_reference(q[b:b + 1], k, v, softmax_scale, causal=True, window_size=window_size,
                                        alibi_slopes=alibi_slopes))
    return torch.cat(outs, 0)


def store_kvcache_reference(k, v, k_cache, v_cache, slot_mapping):
    """Writes k[i], v[i] to slot slot_mapping[i] (= block * block_size + offset); -1 skips. In place."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[i]
        v_cache[slot // block_size, slot % block_size] = v[i]


def rms_norm_reference(x, weight, eps):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32, cast back to x.dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


def fused_add_rms_norm_reference(x, residual, weight, eps):
    """(rms_norm(x + residual) * weight, x + residual); the sum is rounded to x.dtype first (vLLM)."""
    residual_new = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(residual_new, weight, eps), residual_new


def silu_and_mul_reference(x):
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:], computed in fp32."""
    i = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :i]) * xf[..., i:]).to(x.dtype)


def apply_rotary_reference(q, k, cos, sin):
    """Rotate-half RoPE (GPT-NeoX / HF Llama) on q [T, H, D], k [T, KVH, D]; cos/sin [T, D/2]. Returns copies."""
    def rot(x):
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)
    return rot(q), rot(k)


def sampling_probs_reference(logits, temperature, top_k, top_p):
    """The distribution `fused_sample` draws from, float32 [B, V].

    Order (as HF and vLLM): divide by temperature, keep the top_k largest (-1 = all), softmax, keep the
    smallest prefix of the sorted tokens whose mass reaches top_p (at least one token), renormalize.
    Rows with temperature 0 get a one-hot on argmax.
    """
    B, V = logits.shape
    probs = torch.zeros(B, V, dtype=torch.float32, device=logits.device)
    for b in range(B):
        row = logits[b].float()
        t = float(temperature[b])
        if t == 0.0:
            probs[b, int(torch.argmax(row))] = 1.0
            continue
        vals, idx = torch.sort(row / t, descending=True, stable=True)
        k = int(top_k[b])
        if 0 < k < V:
            vals[k:] = float("-inf")
        p = torch.softmax(vals, -1)
        before = torch.cumsum(p, -1) - p  # mass of the tokens ranked above this one
        p = torch.where(before < float(top_p[b]), p, torch.zeros_like(p))
        p[0] = torch.softmax(vals, -1)[0]  # the best token always stays
        p = p / p.sum()
        probs[b, idx] = p
    return probs


def sample_reference(logits, temperature, top_k, top_p, generator=None):
    """Draws one token per row from `sampling_probs_reference` with torch.multinomial. int64 [B]."""
    probs = sampling_probs_reference(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def w4a16_reference(x, codes, scale, zero, out_dtype=None):
    """What `w4a16_matmul` computes, from the unpacked codes: `bf16(x) @ bf16(W)^T` with float32 sums.

    Args:
        x: [M, K]. codes: uint8 [N, K] in 0..15. scale, zero: [N, K/G] (bfloat16, as `quantize_int4` gives).
    Returns [M, N] in `out_dtype` (default x's). W = (q - 8) s + z is formed in float32 and rounded to bfloat16
    once, as the kernel does in its registers."""
    n, k = codes.shape
    g = k // scale.shape[1]
    w = (codes.float().view(n, -1, g) - 8) * scale.float()[..., None] + zero.float()[..., None]
    w = w.view(n, k).to(torch.bfloat16).float()
    return (x.to(torch.bfloat16).float() @ w.t()).to(out_dtype or x.dtype)
