"""Torch attention backends beyond the plain reference (`minfer.attention.base`):

- `ContiguousBackend`: chapter 1's KV cache, one sequence, one preallocated tensor per layer (any pool dtype).
- `PagedTorchBackend`: chapter 3's paged pool read with torch, batched for speed and able to read quantized
  (int8/fp8) and cast pools; the fallback where no kernel runs, and the base of the CPU wing's backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minfer.attention.base import Attention, AttentionBackend, ForwardContext, attend, visibility_mask
from minfer.attention.kv_quant import SCALE_DTYPE, KVCacheSpec, dequantize_kv, kv_cache_spec, quantize_kv, raw

_attend_sequence = attend  # for the backends' class bodies, where `attend` is their own method


class ContiguousBackend(AttentionBackend):
    """Chapter 1's KV cache as a backend: per layer one `[max_len, KVH, D]` tensor for a single sequence.

    Prefill writes rows [0, T) and attends causally; each decode step writes row `start_pos` and attends
    to rows [0, start_pos]. Allocated once, so decode does no per-token allocation.

    `kv_cache_dtype` (`minfer.attention.kv_quant`): "auto" keeps K/V in `dtype`; a quantized one stores codes
    and per-token, per-head scales `[2, max_len, KVH]` and attends to their dequantized values (the prompt
    too), exactly as the paged backends do, so this stays the oracle of a quantized engine.

    Raises (at `store_kv`): ValueError when a forward would write past `max_len`.
    """

    name = "contiguous"

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kv_cache_dtype: str = "auto"):
        spec = kv_cache_spec(kv_cache_dtype, dtype)
        shape = (max_len, num_kv_heads, head_dim)
        scales = ([torch.zeros((2, max_len, num_kv_heads), dtype=SCALE_DTYPE, device=device) for _ in range(num_layers)]
                  if spec.quantized else None)
        super().__init__([torch.zeros((2, *shape), dtype=spec.dtype, device=device) for _ in range(num_layers)],
                         scales, spec)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches + (self.kv_scales or []))

    def store_kv(self, layer: Attention, k, v, ctx: ForwardContext) -> None:
        start, end = ctx.start_pos, ctx.start_pos + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; this forward needs {end}")
        kv = self.kv_caches[layer.layer_idx]
        if self.kv_scales is None:
            kv[:, start:end].copy_(torch.stack((k, v)))  # one slice and one copy for K and V together
            return
        sc = self.kv_scales[layer.layer_idx]
        for i, x in enumerate((k, v)):
            codes, scale = quantize_kv(x, self.spec)
            raw(kv[i])[start:end] = raw(codes)
            sc[i, start:end] = scale

    def attend(self, layer: Attention, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        end = ctx.start_pos + q.shape[0]
        kv = self.kv_caches[layer.layer_idx]
        if self.kv_scales is None:
            return self.attend_prefill(layer, q, kv[0, :end].to(q.dtype), kv[1, :end].to(q.dtype))
        sc = self.kv_scales[layer.layer_idx]
        return self.attend_prefill(layer, q, dequantize_kv(kv[0, :end], sc[0, :end], q.dtype),
                                   dequantize_kv(kv[1, :end], sc[1, :end], q.dtype))

    # One sequence's causal attention (the module's `attend`); the CPU backends put their own kernel here.
    attend_prefill = staticmethod(_attend_sequence)


@dataclass
class PagedMetadata:
    """What every layer of one paged forward shares (`ctx.attn_metadata` of `PagedTorchBackend`).

    prefill_bounds: host-side `(q_start, q_end, num_keys)` of each prefill sequence.
    decode: the length-sorted decode groups (None when the batch has no decoding sequence).
    """

    prefill_bounds: list[tuple[int, int, int]]
    decode: "_DecodePlan | None"


class PagedTorchBackend(AttentionBackend):
    """The paged KV pool read with plain torch (the reference for the Triton kernels).

    `kv_caches[layer]` is `[2, num_blocks, block_size, KVH, D]`. New K/V are scattered to `slot_mapping`;
    prefill sequences gather their keys block by block through `block_tables` (they may have a cached
    prefix); decode sequences are gathered in small groups of similar length and attended group by group.

    Two things make the decode path fast on a CPU (measured with 64 sequences of 64-768 tokens, SmolLM2's
    shapes: 56 ms per layer before, 5 ms after):

    - The gathered K/V go into a workspace allocated once and reused by every layer and step
      (`index_select(..., out=)`). A fresh tensor of tens of MB per layer is a fresh `mmap` whose pages
      fault in one by one: that, not the copy, was most of the gather's time.
    - Sequences are sorted by context length and attended in groups of `DECODE_GROUP`: each group is
      padded only to its own longest context, and its gathered K/V are still in the L3 cache when attention
      reads them.

    A quantized pool (`spec.quantized`, with `kv_scales`): `store_kv` quantizes per token and head, the
    gathers dequantize to the query's dtype, and a fresh prompt attends to the dequantized round trip of its
    own K/V, the values the pool now holds (so chunking or a cached prefix changes nothing).

    Raises (construction): ValueError when a quantized `spec` comes without `kv_scales` or the other way round.
    """

    name = "torch"
    DECODE_GROUP = 8

    def __init__(self, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None = None,
                 spec: KVCacheSpec | None = None):
        super().__init__(kv_caches, kv_scales, spec)
        self.block_size = kv_caches[0].shape[2]
        self._workspace: torch.Tensor | None = None  # [2, rows, block_size, KVH, D], grown on demand
        self._scale_workspace: torch.Tensor | None = None  # [2, rows, block_size, KVH] (quantized pool)

    def prepare(self, ctx: ForwardContext) -> PagedMetadata:
        # Host-side offsets, read once per forward rather than once per layer.
        bounds = []
        if ctx.num_prefills:
            cu, lens = ctx.cu_seqlens_q.tolist(), ctx.context_lens[:ctx.num_prefills].tolist()
            bounds = [(cu[i], cu[i + 1], lens[i]) for i in range(ctx.num_prefills)]
        has_decode = ctx.num_prefill_tokens < ctx.positions.shape[0]
        return PagedMetadata(bounds, self._decode_plan(ctx) if has_decode else None)

    @staticmethod
    def store(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k/v `[T, KVH, D]` into the pool at `slot_mapping [T]` (one index_copy per tensor)."""
        nb, bs = kv_cache.shape[1], kv_cache.shape[2]
        flat = kv_cache.view(2, nb * bs, *kv_cache.shape[3:])
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)

    @staticmethod
    def gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """Keys or values `[length, KVH, D]` of one sequence from `cache [num_blocks, bs, KVH, D]`."""
        bs = cache.shape[1]
        nblk = (length + bs - 1) // bs
        return cache[block_table[:nblk]].flatten(0, 1)[:length]

    @staticmethod
    def store_quantized(kv_cache: torch.Tensor, kv_scales: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slot_mapping: torch.Tensor, spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize k/v `[T, KVH, D]` per token and head and write codes and scales at `slot_mapping [T]`.
        Returns the dequantized k/v (what the pool holds now), in k's dtype."""
        nb, bs = kv_cache.shape[1], kv_cache.shape[2]
        flat = raw(kv_cache).view(2, nb * bs, *kv_cache.shape[3:])
        flat_s = kv_scales.view(2, nb * bs, kv_scales.shape[3])
        out = []
        for i, x in enumerate((k, v)):
            codes, scale = quantize_kv(x, spec)
            flat[i].index_copy_(0, slot_mapping, raw(codes))
            flat_s[i].index_copy_(0, slot_mapping, scale)
            out.append(dequantize_kv(codes, scale, x.dtype))
        return out[0], out[1]

    def _gather_kv(self, layer: Attention, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        """One sequence's keys and values `[length, KVH, D]` from the pool, in `dtype` (dequantized or cast)."""
        kv = self.kv_caches[layer.layer_idx]
        keys = self.gather(raw(kv[0]), block_table, length).view(kv.dtype)
        vals = self.gather(raw(kv[1]), block_table, length).view(kv.dtype)
        if self.kv_scales is None:
            return keys.to(dtype), vals.to(dtype)
        sc = self.kv_scales[layer.layer_idx]
        return (dequantize_kv(keys, self.gather(sc[0], block_table, length), dtype),
                dequantize_kv(vals, self.gather(sc[1], block_table, length), dtype))

    def store_kv(self, layer: Attention, k, v, ctx: ForwardContext) -> None:
        self._store(layer, k, v, ctx)

    def _store(self, layer: Attention, k, v, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v; return them as the pool now holds them, in k's dtype (the round trip of a quantized or
        cast pool; k/v themselves for a pool of the model's dtype)."""
        kv = self.kv_caches[layer.layer_idx]
        if self.kv_scales is not None:
            return self.store_quantized(kv, self.kv_scales[layer.layer_idx], k, v, ctx.slot_mapping, self.spec)
        if kv.dtype == k.dtype:
            self.store(kv, k, v, ctx.slot_mapping)
            return k, v
        kc, vc = k.to(kv.dtype), v.to(kv.dtype)  # a cast pool: kv_cache_dtype="bfloat16" under a float32 model
        self.store(kv, kc, vc, ctx.slot_mapping)
        return kc.to(k.dtype), vc.to(k.dtype)

    def forward(self, layer: Attention, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        # A fresh prompt attends to its keys as the pool holds them (see the class docstring).
        k, v = self._store(layer, k, v, ctx)
        return self.attend(layer, q, k, v, ctx)

    def attend(self, layer: Attention, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        kv = self.kv_caches[layer.layer_idx]
        out = torch.empty_like(q)
        for i, (q0, q1, n) in enumerate(ctx.attn_metadata.prefill_bounds):
            if n == q1 - q0:  # a whole prompt, nothing cached before it: its keys are the new ones
                keys, vals = k[q0:q1], v[q0:q1]
            else:  # a later chunk or a prefix-cache hit: earlier keys come from the pool
                keys, vals = self._gather_kv(layer, ctx.block_tables[i], n, q.dtype)
            out[q0:q1] = self.attend_prefill(layer, q[q0:q1], keys, vals)
        if ctx.num_prefill_tokens < q.shape[0]:
            out[ctx.num_prefill_tokens:] = self._decode(layer, kv, q[ctx.num_prefill_tokens:], ctx)
        return out

    attend_prefill = staticmethod(_attend_sequence)  # as ContiguousBackend's

    def _decode_plan(self, ctx: ForwardContext) -> "_DecodePlan":
        """The decode sequences sorted by context length, cut into groups of `DECODE_GROUP`, each with its
        block ids to gather and its padded key length."""
        tables = ctx.block_tables[ctx.num_prefills:]
        lens = ctx.context_lens[ctx.num_prefills:].long()
        host_lens = lens.tolist()
        order = sorted(range(len(host_lens)), key=host_lens.__getitem__)
        order_t = torch.tensor(order, device=lens.device)
        groups = []
        for start in range(0, len(order), self.DECODE_GROUP):
            end = min(start + self.DECODE_GROUP, len(order))
            rows = order_t[start:end]
            nblk = -(-host_lens[order[end - 1]] // self.block_size)  # the group's last row is its longest
            groups.append(_DecodeGroup(start, end, tables[rows, :nblk].flatten(), nblk * self.block_size, lens[rows]))
        return _DecodePlan(order_t, torch.argsort(order_t), groups)

    def _workspace_for(self, kv: torch.Tensor, rows: int) -> torch.Tensor:
        """A `[2, >= rows, block_size, KVH, D]` buffer for gathered K/V, reallocated only when it must grow."""
        ws = self._workspace
        if ws is None or ws.shape[1] < rows or ws.dtype != kv.dtype or ws.device != kv.device:
            ws = self._workspace = torch.empty((2, rows, *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
        return ws

    def _decode(self, layer: Attention, kv, q, ctx: ForwardContext) -> torch.Tensor:
        """Decode: one query per sequence against its own context, group by group (see the class docstring)."""
        plan = ctx.attn_metadata.decode
        rows = max(g.block_ids.numel() for g in plan.groups)
        ws = raw(self._workspace_for(kv, rows))
        sc = None
        if self.kv_scales is not None:
            sc = self.kv_scales[layer.layer_idx]
            sws = self._scale_workspace
            if sws is None or sws.shape[1] < rows or sws.device != sc.device:
                sws = self._scale_workspace = torch.empty((2, rows, *sc.shape[2:]), dtype=sc.dtype, device=sc.device)
        q_sorted = q[plan.order]  # [B, H, D], shortest context first: each group is a contiguous slice
        out = torch.empty_like(q_sorted)
        for g in plan.groups:
            b, n = g.end - g.start, g.block_ids.numel()
            keys = torch.index_select(raw(kv[0]), 0, g.block_ids, out=ws[0, :n])
            vals = torch.index_select(raw(kv[1]), 0, g.block_ids, out=ws[1, :n])
            if sc is not None:  # dequantize the group's gathered codes with their gathered scales
                ks = torch.index_select(sc[0], 0, g.block_ids, out=sws[0, :n])
                vs = torch.index_select(sc[1], 0, g.block_ids, out=sws[1, :n])
                keys = dequantize_kv(keys.view(kv.dtype), ks, q.dtype)
                vals = dequantize_kv(vals.view(kv.dtype), vs, q.dtype)
            elif kv.dtype != q.dtype:
                keys, vals = keys.view(kv.dtype).to(q.dtype), vals.view(kv.dtype).to(q.dtype)
            keys = keys.view(b, g.key_len, *kv.shape[3:])
            vals = vals.view(b, g.key_len, *kv.shape[3:])
            out[g.start:g.end] = F.scaled_dot_product_attention(
                q_sorted[g.start:g.end].unsqueeze(2), keys.transpose(1, 2), vals.transpose(1, 2),
                attn_mask=g.attn_mask(layer, q.dtype), scale=layer.scale,
                enable_gqa=layer.num_heads != layer.num_kv_heads).squeeze(2)  # [b, H, D]
        return out[plan.inverse]


@dataclass
class _DecodeGroup:
    """Decode sequences `start:end` of the length-sorted batch, padded to `key_len` keys."""

    start: int
    end: int
    block_ids: torch.Tensor  # int32 [b * key_len / block_size]: what to gather, row by row
    key_len: int
    lens: torch.Tensor  # int64 [b], each sequence's context length
    masks: dict = field(default_factory=dict)

    def attn_mask(self, layer: Attention, dtype: torch.dtype) -> torch.Tensor:
        """SDPA's mask, `[b, 1, 1, L]` bool or `[b, H, 1, L]` ALiBi bias. The same for every layer with the same
        window, so built once per forward. The padding keys of shorter sequences sit at positions >= their
        length, where the causal test already hides them."""
        mask = self.masks.get(layer.sliding_window)
        if mask is None:
            k_pos = torch.arange(self.key_len, device=self.lens.device)
            q_pos = (self.lens - 1).view(-1, 1)
            mask = self.masks[layer.sliding_window] = visibility_mask(
                q_pos, k_pos.expand(q_pos.shape[0], -1), layer.sliding_window).unsqueeze(1)  # [b, 1, 1, L]
        if layer.alibi_slopes is None:
            return mask
        k_pos = torch.arange(self.key_len, device=self.lens.device)
        dist = ((self.lens - 1).view(-1, 1, 1, 1) - k_pos.view(1, 1, 1, -1)).abs()
        bias = -layer.alibi_slopes.view(1, -1, 1, 1).to(dist.device) * dist
        return bias.masked_fill(~mask, float("-inf")).to(dtype)


@dataclass
class _DecodePlan:
    order: torch.Tensor  # int64 [B]: decode rows sorted by context length
    inverse: torch.Tensor  # int64 [B]: where each row went
    groups: list[_DecodeGroup]
