"""Writing new keys/values into the paged KV cache (article §4, with the paged cache of §3 and chapter 3).

Each new token's K and V (one row per KV head) goes to a slot of the cache chosen by the block manager:
slot = block_id * block_size + offset. One program copies one token; the copy is a gather-free, fully
coalesced [num_kv_heads, head_dim] row write. Same contract as vLLM's reshape_and_cache / nano-vllm's
store_kvcache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(K, V, K_CACHE, V_CACHE, SLOT_MAPPING,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                          num_kv_heads, block_size,
                          HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid: (num_tokens,). Copies k[t], v[t] ([num_kv_heads, head_dim]) to their cache slot."""
    t = tl.program_id(0)
    slot = tl.load(SLOT_MAPPING + t).to(tl.int64)
    if slot < 0:
        return  # padding token (e.g. a CUDA-graph slot with no sequence): nothing to store
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(K_CACHE + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             k, mask=mask)
    tl.store(V_CACHE + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
             v, mask=mask)


def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
    """Writes k[i], v[i] into the caches at slot_mapping[i]; in place, returns nothing.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim].
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype as k/v.
        slot_mapping: integer [num_tokens]; slot = block_id * block_size + offset, -1 = skip this token.

    Raises:
        ValueError: shape/dtype/device mismatch, non-integer slot_mapping, or caches without unit stride
            along head_dim.
    """
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k, v must both be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"caches must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}], "
                         f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: k {k.dtype} vs cache {k_cache.dtype}, v {v.dtype} vs cache {v_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be int32/int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if not (k.device == v.device == k_cache.device == v_cache.device == slot_mapping.device):
        raise ValueError("k, v, caches and slot_mapping must be on the same device")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must have unit stride along head_dim")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))
