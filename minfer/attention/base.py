"""The attention seam (article §3, §4): one `Attention` layer, a typed `ForwardContext`, and the backend interface.

A forward pass carries one `ForwardContext` (nano-vllm's `Context`, vLLM's attention metadata): where each
token's K/V goes (`slot_mapping`), where each sequence's earlier K/V already is (`block_tables`,
`context_lens`), and the varlen boundaries of the batch (`cu_seqlens_q/k`). The model never looks inside: it
hands q, k, v to `ctx.attn_backend`, which stores the new K/V and computes attention.

A backend does two things per layer, in this order:

    store_kv(layer, k, v, ctx)      the new tokens' K/V -> their slots (a quantized KV cache converts here)
    attend(layer, q, k, v, ctx)     attention of this forward's queries over the cached and new keys

and one thing per forward: `prepare(ctx)` builds what every layer of the forward shares (host-side
offsets, gather plans), stored in `ctx.attn_metadata` when the context is made, so no layer recomputes it.

The plain paged reference the chapters teach is here too: `attend` (one sequence, through
`F.scaled_dot_product_attention`) and `PagedReferenceBackend` (each sequence gathers its keys through its
block table and attends on its own): `attention_backend="torch"` over a pool of the model's dtype, what
`kernels="reference"` runs. The others: `minfer.attention.torch_ref` (the contiguous cache of chapter 1, and a
batched paged backend that also reads quantized and cast pools), `minfer.cpu.attention` (a C++ decode kernel
reading the paged pool in place) and `minfer.attention.triton` (the Triton kernels of `minfer.kernels`).
`minfer.attention.selector` picks one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ForwardContext:
    """Everything a forward pass needs to know about where tokens and their K/V are.

    Token order in a batch: the tokens of prefill sequences (whole prompts or chunks) first, then one token
    per decoding sequence. Sequence i's rows in `block_tables`/`context_lens` follow the same order.

    Attributes:
        attn_backend: the `AttentionBackend` that stores K/V and computes attention.
        positions: int64 `[num_tokens]`, each token's position in its sequence.
        num_prefills: prefill sequences in the batch. num_prefill_tokens: their tokens.
        cu_seqlens_q: int32 `[num_prefills + 1]`, query-token offsets of the prefill sequences.
        cu_seqlens_k: int32 `[num_prefills + 1]`, key offsets (keys = cached prefix + this chunk).
        max_seqlen_q, max_seqlen_k: the largest of those lengths (kernels size their grids with them).
        slot_mapping: int64 `[num_tokens]`, the cache slot (block * block_size + offset) of each new token.
        block_tables: int32 `[num_seqs, max_blocks]`, each sequence's blocks (padded with 0).
        context_lens: int32 `[num_seqs]`, keys each sequence attends to after this step.
        logits_indices: int64 `[num_sampled]`, the rows of the hidden states whose logits are sampled.
        start_pos: for the contiguous (one-sequence) cache, where this forward's tokens start.
        attn_metadata: what `attn_backend.prepare(self)` built for all layers of this forward (its type is
            the backend's own; None for a backend that needs nothing). Filled in at construction.
    """

    attn_backend: "AttentionBackend"
    positions: torch.Tensor
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None
    start_pos: int = 0
    attn_metadata: Any = None

    def __post_init__(self) -> None:
        if self.attn_metadata is None:
            self.attn_metadata = self.attn_backend.prepare(self)


class Attention(nn.Module):
    """Scaled dot-product attention of one layer; the backend in the context does the work.

    Holds what a backend needs to know about the layer: its index (which KV tensor), head counts, softmax
    scale, sliding window (tokens, None = full) and ALiBi slopes (float32 `[num_heads]` or None).

    Raises:
        ValueError: `num_heads` is not a multiple of `num_kv_heads` (GQA/MQA groups must be equal), or a
            sliding window that is not a positive integer.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, alibi_slopes: torch.Tensor | None = None):
        super().__init__()
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an integer >= 1 (tokens), got {sliding_window!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = layer_idx, num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.alibi_slopes = alibi_slopes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q `[T, H, D]`, k/v `[T, KVH, D]` -> `[T, H, D]`."""
        return ctx.attn_backend.forward(self, q, k, v, ctx)


class AttentionBackend(abc.ABC):
    """Where K/V live and how attention reads them. `kv_caches[layer]` is the backend's own per-layer store
    (for the paged backends `[2, num_blocks, block_size, KVH, D]`: K and V). A quantized pool
    (`minfer.attention.kv_quant`) also passes `kv_scales[layer]`, float32 `[2, num_blocks, block_size, KVH]`;
    None for a float pool, with the pool's `spec` (a `KVCacheSpec`) saying how it is quantized.

    Raises (construction): ValueError when a quantized `spec` comes without `kv_scales` or the other way round.
    """

    name: str = "base"

    def __init__(self, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None = None,
                 spec: Any = None):
        if (spec is not None and spec.quantized) != (kv_scales is not None):
            raise ValueError("a quantized KV pool needs both its KVCacheSpec and its kv_scales (and a float one neither)")
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.spec = spec

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The element type of the stored K/V (a quantized KV cache stores int8/fp8 here)."""
        return self.kv_caches[0].dtype

    def decode_tables(self, ctx: "ForwardContext") -> Any:
        """For a step runner that does this step's attention itself (`Platform.step_runner`): the K/V addressing
        of a pure decode step over this backend's cache (a `DecodeTables`-style object of the backend's kernel),
        or None (the default): the step is not for it, and the model attends through `attend`."""
        return None

    def prepare(self, ctx: ForwardContext) -> Any:
        """Once per forward: what all layers share (becomes `ctx.attn_metadata`). Default: nothing."""
        return None

    @abc.abstractmethod
    def store_kv(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> None:
        """Write this forward's k/v `[T, KVH, D]` into the layer's store."""

    @abc.abstractmethod
    def attend(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ctx: ForwardContext) -> torch.Tensor:
        """q `[T, H, D]` (and the new k/v, already stored) -> attention output `[T, H, D]`."""

    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        self.store_kv(layer, k, v, ctx)
        return self.attend(layer, q, k, v, ctx)


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool `[..., Tq, Tk]`: key j visible to query i iff k_pos <= q_pos (causal) and, with a sliding
    window W, q_pos - k_pos < W (the newest W tokens, Mistral's / HF's convention)."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def attend(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence whose queries are the LAST Tq of its Tk keys.

    q `[Tq, H, D]`, k/v `[Tk, KVH, D]` -> `[Tq, H, D]`. GQA: each group of H/KVH query heads shares one K/V
    head (torch's `enable_gqa`). This is the reference the kernels are checked against.
    """
    tq, tk = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    window = layer.sliding_window if layer.sliding_window and layer.sliding_window < tk else None
    mask, causal = None, False
    if layer.alibi_slopes is not None or window is not None or (tq > 1 and tq != tk):
        q_pos = torch.arange(tk - tq, tk, device=q.device)
        k_pos = torch.arange(tk, device=q.device)
        mask = visibility_mask(q_pos, k_pos, window)
        if layer.alibi_slopes is not None:
            bias = -layer.alibi_slopes.view(-1, 1, 1).to(q.device) * (q_pos.view(-1, 1) - k_pos.view(1, -1)).abs()
            mask = bias.masked_fill(~mask, float("-inf")).to(q.dtype).unsqueeze(0)
    elif tq > 1:
        causal = True
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=layer.scale,
                                         enable_gqa=layer.num_heads != layer.num_kv_heads)
    return out[0].transpose(0, 1)


@dataclass
class SequenceSpans:
    """Host-side offsets of one forward (`ctx.attn_metadata`): for each sequence `(q_start, q_end, num_keys)`,
    its rows of the flat queries and how many keys it attends to (its context length)."""

    spans: list[tuple[int, int, int]]


class PagedReferenceBackend(AttentionBackend):
    """The paged KV pool read with plain torch, one sequence at a time.

    `kv_caches[layer]` is `[2, num_blocks, block_size, KVH, D]` (K and V). `store_kv` scatters the new k/v
    `[T, KVH, D]` to their slots (`ctx.slot_mapping [T]`); `attend` gathers each sequence's first `num_keys`
    keys and values through its block table and runs `attend` on its queries, the last ones of its keys.
    """

    name = "torch"

    def prepare(self, ctx: ForwardContext) -> SequenceSpans:
        lens = ctx.context_lens.tolist()
        cu = ctx.cu_seqlens_q.tolist() if ctx.num_prefills else [0]
        spans = [(cu[i], cu[i + 1], lens[i]) for i in range(ctx.num_prefills)]
        first = ctx.num_prefill_tokens  # then one query per decoding sequence
        spans += [(first + j, first + j + 1, n) for j, n in enumerate(lens[ctx.num_prefills:])]
        return SequenceSpans(spans)

    def store_kv(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> None:
        kv = self.kv_caches[layer.layer_idx]
        flat = kv.view(2, kv.shape[1] * kv.shape[2], *kv.shape[3:])  # [2, num_slots, KVH, D]
        flat[0].index_copy_(0, ctx.slot_mapping, k)
        flat[1].index_copy_(0, ctx.slot_mapping, v)

    def attend(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ctx: ForwardContext) -> torch.Tensor:
        kv = self.kv_caches[layer.layer_idx]
        block_size = kv.shape[2]
        out = torch.empty_like(q)
        for i, (q0, q1, n) in enumerate(ctx.attn_metadata.spans):
            blocks = ctx.block_tables[i, :-(-n // block_size)]
            keys = kv[0, blocks].flatten(0, 1)[:n]  # [n, KVH, D]
            vals = kv[1, blocks].flatten(0, 1)[:n]
            out[q0:q1] = attend(layer, q[q0:q1], keys, vals)
        return out
