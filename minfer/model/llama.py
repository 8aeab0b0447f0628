"""The decoder-only transformer of the Llama family (article §1): Llama, Mistral, Qwen2, Qwen3.

    x = embed(tokens)
    for each layer:  h = x + o_proj(attention(rope(q(norm(x))), rope(k(norm(x))), v(norm(x))))
                     x = h + down(silu(gate(norm(h))) * up(norm(h)))
    logits = lm_head(norm(x))

The four architectures differ only in switches of `ModelConfig`: QKV bias (Qwen2), RMSNorm on each
query/key head before RoPE (Qwen3), sliding windows (Mistral), tied embeddings (small models).
Parameter names follow Hugging Face's, except the merged projections (`qkv_proj`, `gate_up_proj`), which
`packed_modules_mapping` tells the loader about.

Inputs are flat (varlen): `input_ids [num_tokens]` and `positions [num_tokens]` for all sequences of a
batch at once, with a `ForwardContext` saying which token belongs where.

This file is the single-device model. Tensor and pipeline parallelism (chapter 12) are applied to a built
model from outside (`minfer.parallel.apply`: sharded layers swapped in, another stage's layers left out),
as gpt-fast's `apply_tp` does.
"""

from __future__ import annotations

import torch
from torch import nn

from minfer.attention import Attention, ForwardContext
from minfer.config import ModelConfig
from minfer.model.layers import MLP, BuildOptions, Linear, MergedLinear, RMSNorm, TiedEmbedding
from minfer.model.llama_config import llama_config  # noqa: F401 (the registry reads the adapter here)
from minfer.model.positions import RotaryEmbedding


class LlamaAttention(nn.Module):
    """Self-attention with grouped-query heads: q|k|v in one matmul (`H + 2 KVH` heads of `D`), RoPE on q and
    k, paged attention, then o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions):
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        method = build.linear_method
        self.qkv_proj = MergedLinear(cfg.hidden_size, [h * d, kvh * d, kvh * d], bias=cfg.qkv_bias, method=method)
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=cfg.o_bias, method=method)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, fused=build.fused_ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, fused=build.fused_ops)
        self.qk_norm = cfg.qk_norm
        window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, d, scale=d ** -0.5, sliding_window=window)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin: torch.Tensor, ctx: ForwardContext
                ) -> torch.Tensor:
        t, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        # q|k|v as `[T, H + 2 KVH, D]` heads, then three slices of it: views, as `split` + `view` would give,
        # in 4 aten calls instead of 7 (a batch-1 decode step pays each call 30 times; chapter 9 §9.2.4).
        qkv = self.qkv_proj(x).view(t, h + 2 * kvh, self.head_dim)
        q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(ctx.positions, q, k, cos_sin)
        out = self.attn(q, k, v, ctx)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, build)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, build)  # SwiGLU (minfer/model/layers.py)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=build.fused_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=build.fused_ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding, cos_sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the norm (vLLM's layout): each norm returns (normed, new residual).
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotary, cos_sin, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """The decoder stack: embedding, `num_hidden_layers` decoder layers, the final norm."""

    def __init__(self, cfg: ModelConfig, max_positions: int, build: BuildOptions):
        super().__init__()
        if not cfg.tie_word_embeddings:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, build) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=build.fused_ops)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings, max_positions, fused=build.fused_ops)
        self.fused_ops = build.fused_ops

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """`input_ids [T]` int64 -> the normed hidden states `[T, hidden]`."""
        x, residual = self.embed(input_ids), None
        # cos/sin of this forward's positions: gathered once here, not once per layer.
        cos_sin = self.rotary_emb.cos_sin_for(ctx.positions)
        for layer in self.decoder_layers():
            x, residual = layer(x, residual, self.rotary_emb, cos_sin, ctx)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [T]` -> the embeddings `[T, hidden]`."""
        return self.embed_tokens(input_ids)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """The decoder layers this model runs, in order. `embed`, `decoder_layers` and `final_norm` are the
        forward's three parts, named so a platform's step runner (`minfer.cpu.decode_step`) and a pipeline
        stage (`minfer.parallel.apply`) can run them without copying this file."""
        return list(self.layers)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output and residual `[T, hidden]` -> the normed hidden states `[T, hidden]`."""
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM.

    `forward(input_ids [T] int64, ctx) -> hidden [T, hidden_size]`;
    `compute_logits(hidden [N, hidden_size]) -> [N, vocab]` in float32.
    """

    # checkpoint name -> (our parameter, shard index) for merged projections.
    # With tied embeddings the checkpoint's embedding table is the head's weight.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, build: BuildOptions | None = None):
        super().__init__()
        build = build or BuildOptions()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings, build)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, method=build.linear_method)
        if cfg.tie_word_embeddings:
            # One table for both: the checkpoint's embedding is loaded into the head, and looked up from it.
            self.model.embed_tokens = TiedEmbedding(self.lm_head)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
