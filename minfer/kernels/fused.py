"""Fused element-wise kernels around attention: RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE,
and sampling (article §4, "kernel fusion").

Why fuse. Each of these operations does a few flops per element, so its time is the time to move the
tensor through HBM. Written as separate torch ops, `rmsnorm(x + residual)` reads and writes the hidden
state several times (add, square, mean, multiply, multiply, cast); one kernel that keeps the row in
registers reads x and residual once and writes the two results once. Same reasoning as FlashAttention:
count the bytes, not the flops. The vLLM kernels of the same names follow the same contracts.

All arithmetic is in fp32 registers; results are cast back to the input dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------------
# RMSNorm and residual-add + RMSNorm


@triton.jit
def _rms_norm_kernel(X, RES, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Grid: (rows,). One program normalizes one row; the whole row fits in one block of registers."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(RES + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # The new residual stream is stored in the model's dtype, and the norm is taken of exactly what
        # was stored, so the next layer sees consistent values.
        x = (x + r).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    mean_sq = tl.sum(x * x, 0) / n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(mean_sq + eps) * w
    tl.store(OUT + row * stride_o + cols, y.to(OUT.dtype.element_ty), mask=mask)


def _as_rows(x):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight.

    Args:
        x: [..., hidden] (float32/float16/bfloat16). weight: [hidden]. eps: float.

    Returns:
        tensor like x (new memory).

    Raises:
        ValueError: weight shape does not match x's last dim, or hidden > 65536.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if x.shape[-1] > 65536:
        raise ValueError("hidden size > 65536 does not fit one block")
    x2 = _as_rows(x)
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0,
                                         x2.shape[1], float(eps), HAS_RESIDUAL=False,
                                         BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape)


def fused_add_rms_norm(x, residual, weight, eps=1e-6):
    """residual_new = x + residual; out = rms_norm(residual_new) * weight, in one pass (vLLM's contract).

    Args:
        x, residual: [..., hidden], same shape and dtype. weight: [hidden]. eps: float.

    Returns:
        (out, residual_new), both like x (new memory; inputs are not modified).

    Raises:
        ValueError: shape or dtype mismatch.
    """
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"x and residual must match, got {tuple(x.shape)} {x.dtype} vs "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    x2, r2 = _as_rows(x), _as_rows(residual)
    out, res_out = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0),
                                         res_out.stride(0), x2.shape[1], float(eps), HAS_RESIDUAL=True,
                                         BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape), res_out.view(x.shape)


# --------------------------------------------------------------------------------------------------------
# SiLU(gate) * up


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, n_inter, BLOCK: tl.constexpr):
    """Grid: (tokens, cdiv(I, BLOCK)). out[t, i] = silu(x[t, i]) * x[t, I + i]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(X + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + t * stride_x + n_inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(OUT + t * stride_o + cols, y.to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x):
    """x [..., 2*I] -> silu(x[..., :I]) * x[..., I:], shape [..., I] (the gated MLP of Llama-style models).

    Raises:
        ValueError: odd last dimension.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even (gate and up halves), got {x.shape[-1]}")
    x2 = _as_rows(x)
    n_inter = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], n_inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(n_inter, 1)))
    if x2.shape[0] and n_inter:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_inter, block))](x2, out, x2.stride(0), out.stride(0),
                                                                         n_inter, BLOCK=block)
    return out.view(*x.shape[:-1], n_inter)


# --------------------------------------------------------------------------------------------------------
# Rotary position embedding, rotate-half layout


@triton.jit
def _rotate_half_tile(X, t, stride_t, stride_h, n_heads, c, s, offs_h, offs_d, HALF: tl.constexpr):
    mask = (offs_h < n_heads)[:, None] & (offs_d < HALF)[None, :]
    p1 = X + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    # A 2-D rotation of the pair (x1[i], x2[i]) by the angle of frequency i at this token's position.
    tl.store(p1, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, COS, SIN, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                   n_q_heads, n_k_heads,
                   HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid: (tokens,). cos/sin of the token are loaded once and used for all its q and k heads."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    c = tl.load(COS + t * stride_ct + offs_d, mask=mask_d, other=1.0).to(tl.float32)[None, :]
    s = tl.load(SIN + t * stride_st + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    _rotate_half_tile(Q, t, stride_qt, stride_qh, n_q_heads, c, s, tl.arange(0, BLOCK_HQ), offs_d, HALF)
    _rotate_half_tile(K, t, stride_kt, stride_kh, n_k_heads, c, s, tl.arange(0, BLOCK_HK), offs_d, HALF)


def apply_rotary_(q, k, cos, sin):
    """Rotary embedding in place, rotate-half (GPT-NeoX / HF Llama) layout.

    out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin with x1 = x[..., :D/2], x2 = x[..., D/2:].

    Args:
        q: [T, H, D], k: [T, KVH, D] (may be strided views, e.g. of a fused QKV output; the last dim must
            be contiguous). cos, sin: float32 [T, D/2], already gathered at each token's position.

    Returns:
        (q, k), the same tensors, modified in place.

    Raises:
        ValueError: shape mismatch, odd head_dim, or last dim not contiguous.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, H, D] and k [T, KVH, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}")
    T, H, D = q.shape
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if cos.shape != (T, D // 2) or sin.shape != (T, D // 2):
        raise ValueError(f"cos and sin must be [{T}, {D // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("q, k, cos, sin must be contiguous along the last dim (in-place kernel)")
    if T:
        _rotary_kernel[(T,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             cos.stride(0), sin.stride(0), H, k.shape[1], HALF=D // 2,
                             BLOCK_HQ=triton.next_power_of_2(H), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
                             BLOCK_D=triton.next_power_of_2(D // 2))
    return q, k


# --------------------------------------------------------------------------------------------------------
# Sampling


@triton.jit
def _sample_kernel(LOGITS, stride_l, TEMP, SEEDS, INDEX_MAP, stride_map, OUT, n_rows, vocab,
                   HAS_INDEX_MAP: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid: (cdiv(B, ROWS),). Draws argmax_i(logit_i / T + Gumbel_i) per row; T = 0 gives plain argmax.

    Gumbel-max trick: if g_i = -log(-log(u_i)) with u_i uniform, then argmax_i(log p_i + g_i) is a sample
    of p. Equivalently ("exponential race") argmax_i p_i / E_i with E_i = -log u_i ~ Exp(1). So sampling
    needs no softmax, no normalization and no cumulative sum: one streaming pass with a running argmax,
    which is why it fuses into a single kernel. u_i comes from Philox(seed of the row, i): the same
    seed gives the same token on any run.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask_r = rows < n_rows
    temp = tl.load(TEMP + rows, mask=mask_r, other=1.0)
    greedy = temp == 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    seed = tl.load(SEEDS + rows, mask=mask_r, other=0)
    best_val = tl.full([ROWS], float("-inf"), tl.float32)
    best_idx = tl.zeros([ROWS], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = mask_r[:, None] & (cols < vocab)[None, :]
        x = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        u = tl.rand(seed[:, None], cols[None, :])
        u = tl.maximum(u, 1e-20)  # u = 0 would give an infinite noise
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy[:, None], x, x * inv_t[:, None] + gumbel)
        score = tl.where(mask, score, float("-inf"))
        chunk_max = tl.max(score, 1)
        # first column reaching the max: ties resolve to the lowest index, as torch.argmax does
        chunk_arg = tl.min(tl.where(score == chunk_max[:, None], cols[None, :], 2147483647), 1)
        take = chunk_max > best_val  # strict: an earlier chunk wins ties
        best_idx = tl.where(take, chunk_arg, best_idx)
        best_val = tl.where(take, chunk_max, best_val)
    if HAS_INDEX_MAP:
        best_idx = tl.load(INDEX_MAP + rows.to(tl.int64) * stride_map + best_idx, mask=mask_r, other=0)
    tl.store(OUT + rows, best_idx.to(tl.int64), mask=mask_r)


def fused_sample(logits, temperature, top_k, top_p, seeds=None, generator=None):
    """One token per row: temperature, then top-k, then top-p, then a draw; greedy where temperature is 0.

    Args:
        logits: [B, V] (any float dtype).
        temperature: float [B]; 0 means greedy (exact argmax, lowest index on ties).
        top_k: int [B]; keep the k largest logits, -1 (or 0, or >= V) = off.
        top_p: float [B]; keep the smallest set of most likely tokens whose mass reaches top_p (after
            top-k, renormalized, as HF/vLLM); 1 = off. The most likely token is always kept.
        seeds: int64 [B], optional per-row seeds for the in-kernel Philox generator; same seed, same
            logits -> same token. None: drawn from `generator` (or torch's default generator).
        generator: torch.Generator used only when seeds is None.

    Returns:
        int64 [B] token ids.

    Raises:
        ValueError: shape or device mismatch.

    Implementation: when any row uses top-k or top-p, the filter is done in torch (one stable sort of
    the temperature-scaled logits, a cumulative sum, masks set to -inf) and the kernel then draws from the
    sorted, masked row and maps the position back to a token id. Otherwise the kernel reads the raw
    logits directly and applies the temperature itself. The draw is always the Triton kernel (Gumbel-max
    with in-kernel Philox noise); a fully in-kernel top-k/top-p would need a per-row selection, which is
    left out for readability.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    B, V = logits.shape
    dev = logits.device
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if t.shape != (B,) or t.device != dev:
            raise ValueError(f"{name} must be [{B}] on {dev}, got {tuple(t.shape)} on {t.device}")
    if seeds is None:
        gen_device = generator.device if generator is not None else "cpu"
        seeds = torch.randint(0, 2**31 - 1, (B,), generator=generator, device=gen_device).to(dev)
    elif seeds.shape != (B,):
        raise ValueError(f"seeds must be [{B}], got {tuple(seeds.shape)}")
    seeds = seeds.to(device=dev, dtype=torch.int64).contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out

    greedy = temperature == 0
    filtered = ((top_k > 0) & (top_k < V)) | (top_p < 1.0)
    index_map = None
    if bool((filtered & ~greedy).any()):
        t_safe = torch.where(greedy, torch.ones_like(temperature), temperature)
        vals, index_map = torch.sort(logits.float() / t_safe[:, None], dim=-1, descending=True, stable=True)
        ranks = torch.arange(V, device=dev)
        k_eff = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
        vals = vals.masked_fill(ranks[None, :] >= k_eff[:, None], float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        remove = mass_before >= top_p.to(torch.float32)[:, None]
        remove[:, 0] = False
        logits = vals.masked_fill(remove & ~greedy[:, None], float("-inf"))
        temperature = torch.where(greedy, temperature, torch.ones_like(temperature))  # already scaled
        index_map = index_map.contiguous()
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()

    block_v = min(1024, triton.next_power_of_2(V))
    rows = max(1, min(triton.next_power_of_2(B), 4096 // block_v))
    _sample_kernel[(triton.cdiv(B, rows),)](
        logits, logits.stride(0), temperature, seeds, index_map if index_map is not None else out,
        index_map.stride(0) if index_map is not None else 0, out, B, V,
        HAS_INDEX_MAP=index_map is not None, ROWS=rows, BLOCK_V=block_v)
    return out
