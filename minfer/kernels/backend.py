"""The Triton attention backend and the fused-op installer (article §4, plugged into chapter 3's seam).

`TritonBackend` implements `minfer.model.attention.AttentionBackend` with the kernels of this package:

    store_kvcache            new K/V of every token -> its slot of the paged pool
    flash_attn_varlen        the prefill sequences (whole prompts, or chunks / prompts with a cached prefix)
    paged_attention_decode   one query per decoding sequence, read through its block table

`install_fused_ops(model)` swaps the element-wise torch code of a loaded model for the fused kernels
(RMSNorm with and without the residual add, SiLU-and-mul, RoPE), per instance: the torch classes keep
their default behaviour, so a second model loaded in the same process is untouched.

`TritonSampler` draws with `fused_sample` when a batch needs nothing the kernel lacks (logprobs, min_p,
per-request seeds); otherwise it is exactly the torch `Sampler`.
"""

from __future__ import annotations

import sys
import types

import torch

from minfer.kernels import (apply_rotary_, flash_attn_varlen, fused_add_rms_norm, fused_sample,
                            paged_attention_decode, rms_norm, silu_and_mul, store_kvcache)
from minfer.model.attention import Attention, AttentionBackend, ForwardContext
from minfer.sampling import Sampler


def _ensure_interpreted_triton_language() -> int:
    """Make Triton's own library functions (tl.sum, tl.max, ...) runnable under the CPU interpreter.

    `minfer.kernels` sets TRITON_INTERPRET=1 when there is no CUDA, but that only takes effect for
    functions decorated afterwards. Building any torch model imports torch._dynamo, which imports triton;
    if that happened first (e.g. `LLM(...)` creates the model before the engine imports the kernels),
    triton.language's helpers are compiled-mode JITFunctions and every kernel fails with "Cannot call
    @triton.jit'd outside of the scope of a kernel". Re-wrap them as interpreted functions. Returns how many
    were re-wrapped (0 on a GPU or when the import order was right).
    """
    from minfer.kernels import interpreter_active

    if not interpreter_active():
        return 0
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction):
                setattr(mod, attr, InterpretedFunction(obj.fn))
                n += 1
    return n


_ensure_interpreted_triton_language()


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

    def __init__(self, ctx: ForwardContext, block_size: int):
        p, n_pt = ctx.num_prefills, ctx.num_prefill_tokens
        if p == 1:
            total_k = ctx.max_seqlen_k  # host-side already: no device read
        else:
            total_k = ctx.extra.get("num_prefill_keys")
            if total_k is None:
                # One small device->host read per forward (not per layer); free on the CPU.
                total_k = int(ctx.cu_seqlens_k[p])
        self.total_k = int(total_k)
        self.has_prefix = self.total_k != n_pt
        self.key_slots = None
        if self.has_prefix:
            dev = ctx.context_lens.device
            lens = ctx.context_lens[:p].long()
            seq = torch.repeat_interleave(torch.arange(p, device=dev), lens, output_size=self.total_k)
            pos = torch.arange(self.total_k, device=dev) - ctx.cu_seqlens_k[:p].long()[seq]
            blocks = ctx.block_tables[:p].long()[seq, pos // block_size]
            self.key_slots = blocks * block_size + pos % block_size


class TritonBackend(AttentionBackend):
    """Paged attention with the Triton kernels. `kv_caches[layer]` is `[2, num_blocks, block_size, KVH, D]`.

    Per layer: one `store_kvcache` launch, one `flash_attn_varlen` launch over all prefill sequences,
    one `paged_attention_decode` over all decoding sequences. Prefill sequences without a cached prefix
    attend to their new k/v directly; otherwise their keys are gathered from the pool (the gather indices
    are computed once per forward and shared by all layers, kept in `ctx.extra`).
    """

    def __init__(self, kv_caches: list[torch.Tensor]):
        self.kv_caches = kv_caches
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

    def forward(self, layer: Attention, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        kv = self.kv_caches[layer.layer_idx]
        k_cache, v_cache = kv[0], kv[1]
        store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
        num_tokens, n_pt, p = q.shape[0], ctx.num_prefill_tokens, ctx.num_prefills
        window, slopes = window_size(layer), self._alibi(layer, q.device)
        if p == 0 or n_pt == num_tokens:
            out = None  # one kernel writes everything: no torch.empty + copy
        else:
            out = torch.empty_like(q)
        if p:
            plan = ctx.extra.get("_triton_prefill")
            if plan is None:
                plan = ctx.extra["_triton_prefill"] = _PrefillPlan(ctx, k_cache.shape[1])
            if plan.has_prefix:
                keys = k_cache.flatten(0, 1)[plan.key_slots]
                vals = v_cache.flatten(0, 1)[plan.key_slots]
                cu_k = ctx.cu_seqlens_k
            else:
                keys, vals, cu_k = k[:n_pt], v[:n_pt], ctx.cu_seqlens_q
            o = flash_attn_varlen(q[:n_pt], keys, vals, ctx.cu_seqlens_q, cu_k, ctx.max_seqlen_q,
                                  ctx.max_seqlen_k, softmax_scale=layer.scale, causal=True, window_size=window,
                                  alibi_slopes=slopes)
            if out is None:
                return o
            out[:n_pt] = o
        if n_pt < num_tokens:
            o = paged_attention_decode(q[n_pt:], k_cache, v_cache, ctx.block_tables[p:], ctx.context_lens[p:],
                                       softmax_scale=layer.scale, window_size=window, alibi_slopes=slopes)
            if out is None:
                return o
            out[n_pt:] = o
        return out


# ------------------------------------------------------------------------------------------------------
# Fused element-wise ops, installed per instance


def _fused_rms_norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
    """RMSNorm.forward with the Triton kernels: norm(x), or (norm(x + residual), x + residual)."""
    if residual is None:
        return rms_norm(x, self.weight, self.eps)
    return fused_add_rms_norm(x, residual, self.weight, self.eps)


def _fused_rotary_forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin=None):
    """RotaryEmbedding.forward with the in-place Triton kernel (falls back to torch where it cannot run)."""
    cos, sin = cos_sin if cos_sin is not None else self.cos_sin_for(positions)
    usable = (cos.shape[-1] * 2 == q.shape[-1] and q.stride(-1) == 1 and k.stride(-1) == 1
              and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)))
    if not usable:
        return type(self).forward(self, positions, q, k, (cos, sin))
    # In place: q and k are fresh views of this layer's qkv projection, read by nothing else.
    return apply_rotary_(q, k, cos.contiguous(), sin.contiguous())


def install_fused_ops(model: torch.nn.Module) -> dict[str, int]:
    """Swap the model's RMSNorm, SiLU-and-mul and RoPE for the fused Triton kernels, on these instances only.

    Idempotent. Returns how many modules of each kind were switched (e.g. {"rms_norm": 61, "mlp": 30,
    "rotary": 1} for SmolLM2-135M).
    """
    from minfer.model.layers import MLP, RMSNorm
    from minfer.model.positions import RotaryEmbedding

    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0}
    for m in model.modules():
        if getattr(m, "_minfer_fused", False):
            continue
        if isinstance(m, RMSNorm):
            m.forward = types.MethodType(_fused_rms_norm_forward, m)
            counts["rms_norm"] += 1
        elif isinstance(m, MLP):
            m.act = silu_and_mul
            counts["mlp"] += 1
        elif isinstance(m, RotaryEmbedding):
            m.forward = types.MethodType(_fused_rotary_forward, m)
            counts["rotary"] += 1
        else:
            continue
        m._minfer_fused = True
    return counts


# ------------------------------------------------------------------------------------------------------
# Sampling


class TritonSampler(Sampler):
    """`Sampler` that draws with `fused_sample` (one Gumbel-max kernel, top-k/top-p as a torch pre-pass).

    The kernel path is taken only for batches where no row wants logprobs or min_p and no row has its own
    seed (a seeded request must keep the torch Sampler's stream to stay reproducible across backends and
    batches). All-greedy batches stay an exact argmax; greedy rows of a mixed batch get temperature 0,
    which the kernel turns into an exact argmax too. Random draws come from the engine generator (one seed
    per row for the kernel's Philox), so a run is reproducible for a given engine seed.
    """

    def __call__(self, logits: torch.Tensor, seqs):
        params = [s.params for s in seqs]
        if all(p.greedy for p in params) or any(
                p.logprobs is not None or p.min_p > 0 or s.generator is not None for s, p in zip(seqs, params)):
            return super().__call__(logits, seqs)
        dev = logits.device
        temp = torch.tensor([0.0 if p.greedy else float(p.temperature) for p in params], device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
        top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=dev)
        tokens = fused_sample(logits, temp, top_k, top_p, generator=self.generator)
        return tokens, None, None
