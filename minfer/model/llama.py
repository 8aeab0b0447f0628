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
"""

from __future__ import annotations

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.model.attention import Attention, ForwardContext
from minfer.model.layers import MLP, Linear, MergedLinear, RMSNorm, TiedEmbedding
from minfer.model.positions import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.qkv_proj = MergedLinear(cfg.hidden_size, [h * d, kvh * d, kvh * d], bias=cfg.qkv_bias)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.attn = Attention(layer_idx, h, kvh, d, scale=d ** -0.5, sliding_window=window)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
            dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(ctx.positions, q, k, ctx.extra.get("rope_cos_sin"))
        out = self.attn(q, k, v, ctx)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rotary, ctx):
        # The residual add is fused into the norm (vLLM's layout): each norm returns (normed, new residual).
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotary, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings, max_positions)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        # cos/sin of this forward's positions: gathered once here, not once per layer.
        ctx.extra["rope_cos_sin"] = self.rotary_emb.cos_sin_for(ctx.positions)
        for layer in self.layers:
            x, residual = layer(x, residual, self.rotary_emb, ctx)
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

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            # One table for both: the checkpoint's embedding is loaded into the head (transposed).
            self.model.embed_tokens = TiedEmbedding(self.lm_head)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


# HF architecture name -> class. All four share one implementation; the config switches the differences.
MODEL_REGISTRY = {name: LlamaForCausalLM for name in
                  ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")}
