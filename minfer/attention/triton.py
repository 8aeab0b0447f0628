"""The Triton attention backend (article §4, plugged into chapter 3's seam).

`TritonBackend` implements `minfer.attention.base.AttentionBackend` with the kernels of `minfer.kernels`:

    store_kvcache            new K/V of every token -> its slot of the paged pool     (store_kv)
    flash_attn_varlen        the prefill sequences (whole prompts, or chunks / prompts with a cached prefix)
    paged_attention_decode   one query per decoding sequence, read through its block table

A quantized pool (`kv_cache_dtype` int8 / fp8_e4m3 / fp8_e5m2, `minfer.attention.kv_quant`): `store_kv`
quantizes per token and head as the torch reference does (`PagedTorchBackend.store_quantized`: codes and
float32 scales into the pool), and both attention kernels read the codes and scales and dequantize on load.
Every prefill then reads its keys from the pool, a fresh prompt's too, so that it attends to the values the
pool holds (the reference's rule: a prompt computed whole, in chunks or on a cached prefix sees the same keys).

The fused element-wise kernels (RMSNorm, SiLU-and-mul, RoPE) are chosen when the model is built
(`minfer.model.layers.BuildOptions(fused_ops=minfer.kernels)`, what the platform hands the loader with
this backend), and the fused sampler is
`minfer.kernels.sampler.TritonSampler`.
"""

from __future__ import annotations

import torch

from minfer.attention.base import Attention, AttentionBackend, ForwardContext
from minfer.attention.kv_quant import KVCacheSpec, raw
from minfer.kernels import flash_attn_varlen, paged_attention_decode, store_kvcache


def window_size(layer: Attention) -> tuple[int, int]:
    """flash_attn's (left, right) for the layer: a window of W tokens (key j visible to the query at p iff
    p - W < j <= p) is (W - 1, 0); no window is (-1, -1) (causality is the kernels' own)."""
    w = layer.sliding_window
    return (w - 1, 0) if w else (-1, -1)


class _PrefillPlan:
    """What every layer of one forward needs for its prefill part; computed once per ForwardContext.

    has_prefix: some prefill sequence attends to more keys than its new tokens (cached prefix, or a later
    chunk of a chunked prompt); then `key_slots [total_k]` are the pool slots of all its keys, in
    cu_seqlens_k order, so a layer gathers them with one index op per cache.
    """

    def __init__(self, ctx: ForwardContext, block_size: int, from_pool: bool = False):
        p, n_pt = ctx.num_prefills, ctx.num_prefill_tokens
        # One sequence: host-side already. Several: one small device->host read per forward (not per layer).
        self.total_k = int(ctx.max_seqlen_k if p == 1 else ctx.cu_seqlens_k[p])
        # from_pool (a quantized pool): every prefill reads its keys as stored, so the gather is always built.
        self.has_prefix = self.total_k != n_pt or from_pool
        self.key_slots = None
        if self.has_prefix:
            dev = ctx.context_lens.device
            lens = ctx.context_lens[:p].long()
            seq = torch.repeat_interleave(torch.arange(p, device=dev), lens, output_size=self.total_k)
            pos = torch.arange(self.total_k, device=dev) - ctx.cu_seqlens_k[:p].long()[seq]
            blocks = ctx.block_tables[:p].long()[seq, pos // block_size]
            self.key_slots = blocks * block_size + pos % block_size


class TritonBackend(AttentionBackend):
    """Paged attention with the Triton kernels. `kv_caches[layer]` is `[2, num_blocks, block_size, KVH, D]`;
    a quantized pool comes with `kv_scales[layer]` float32 `[2, num_blocks, block_size, KVH]` and its `spec`.

    Per layer: one `store_kvcache` launch, one `flash_attn_varlen` launch over all prefill sequences,
    one `paged_attention_decode` over all decoding sequences. Prefill sequences without a cached prefix
    attend to their new k/v directly; otherwise their keys are gathered from the pool (the gather indices
    are computed once per forward and shared by all layers: `ctx.attn_metadata`, a `_PrefillPlan`).
    """

    name = "triton"

    def __init__(self, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None = None,
                 spec: KVCacheSpec | None = None):
        super().__init__(kv_caches, kv_scales, spec)
        self._slopes: dict[int, torch.Tensor] = {}

    def _alibi(self, layer: Attention, device) -> torch.Tensor | None:
        s = layer.alibi_slopes
        if s is None:
            return None
        if s.device != device or s.dtype != torch.float32:
            key = id(layer)
            cached = self._slopes.get(key)
            if cached is None or cached.device != device:
                cached = self._slopes[key] = s.to(device=device, dtype=torch.float32).contiguous()
            s = cached
        return s

    def prepare(self, ctx: ForwardContext) -> "_PrefillPlan | None":
        if not ctx.num_prefills:
            return None
        return _PrefillPlan(ctx, self.kv_caches[0].shape[2], from_pool=self.kv_scales is not None)

    def store_kv(self, layer: Attention, k, v, ctx: ForwardContext) -> None:
        kv = self.kv_caches[layer.layer_idx]
        if self.kv_scales is not None:
            # Quantize with the reference's own code: the pool's bytes are then identical whichever backend
            # wrote them (swap, prefix caching and a switch of backend see the same codes).
            from minfer.attention.torch_ref import PagedTorchBackend

            PagedTorchBackend.store_quantized(kv, self.kv_scales[layer.layer_idx], k, v, ctx.slot_mapping, self.spec)
            return
        store_kvcache(k, v, kv[0], kv[1], ctx.slot_mapping)

    def attend(self, layer: Attention, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        kv = self.kv_caches[layer.layer_idx]
        k_cache, v_cache = kv[0], kv[1]
        k_scale = v_scale = None
        if self.kv_scales is not None:
            k_scale, v_scale = self.kv_scales[layer.layer_idx]
        num_tokens, n_pt, p = q.shape[0], ctx.num_prefill_tokens, ctx.num_prefills
        window, slopes = window_size(layer), self._alibi(layer, q.device)
        if p == 0 or n_pt == num_tokens:
            out = None  # one kernel writes everything: no torch.empty + copy
        else:
            out = torch.empty_like(q)
        if p:
            plan = ctx.attn_metadata
            ks = vs = None
            if plan.has_prefix:
                # Gathered as bytes (torch's CPU indexing does not take float8), viewed back as the codes.
                keys = raw(k_cache).flatten(0, 1)[plan.key_slots].view(k_cache.dtype)
                vals = raw(v_cache).flatten(0, 1)[plan.key_slots].view(v_cache.dtype)
                if k_scale is not None:
                    ks, vs = k_scale.flatten(0, 1)[plan.key_slots], v_scale.flatten(0, 1)[plan.key_slots]
                cu_k = ctx.cu_seqlens_k
            else:
                keys, vals, cu_k = k[:n_pt], v[:n_pt], ctx.cu_seqlens_q
            o = flash_attn_varlen(q[:n_pt], keys, vals, ctx.cu_seqlens_q, cu_k, ctx.max_seqlen_q,
                                  ctx.max_seqlen_k, softmax_scale=layer.scale, causal=True, window_size=window,
                                  alibi_slopes=slopes, k_scale=ks, v_scale=vs)
            if out is None:
                return o
            out[:n_pt] = o
        if n_pt < num_tokens:
            o = paged_attention_decode(q[n_pt:], k_cache, v_cache, ctx.block_tables[p:], ctx.context_lens[p:],
                                       softmax_scale=layer.scale, window_size=window, alibi_slopes=slopes,
                                       k_scale=k_scale, v_scale=v_scale)
            if out is None:
                return o
            out[n_pt:] = o
        return out
