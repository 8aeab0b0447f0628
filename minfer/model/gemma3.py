"""Gemma 3 (Gemma Team, 2025, "Gemma 3 Technical Report"): a real sliding-window model, article §3.

    x = embed(tokens) * sqrt(hidden)
    for each layer:  h = x + post_attention_norm(o_proj(attention(rope_l(q_norm(q)), rope_l(k_norm(k)), v)))
                     x = h + post_feedforward_norm(down(gelu_tanh(gate(pre_ff_norm(h))) * up(pre_ff_norm(h))))
                     with q|k|v from input_norm(x); layer l local (a 512-token window, RoPE base 10k)
                     or, every sixth layer, global (full attention, RoPE base 1M)
    logits = lm_head(norm(x))        (tied to embed)

What differs from Llama (`minfer.model.llama`): norms after attention and MLP as well as before them, RMSNorm
scaling by (1 + weight), RMSNorm on each query/key head, GeGLU instead of SwiGLU, the embedding scaled by
sqrt(hidden), the softmax scale `query_pre_attn_scalar ** -0.5`, and two RoPE tables, one per layer kind.
Gemma 3 270M: 18 layers, 4 query heads, 1 KV head, head_dim 256, vocabulary 262,144.

Parameter names are Hugging Face's (`Gemma3ForCausalLM`); the loader's `packed_modules_mapping` merges q|k|v
and gate|up. GGUF files store each norm weight as 1 + w; `minfer.model.gguf` subtracts the 1 again (as
transformers does), so both sources load the same parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from minfer.attention import Attention, ForwardContext
from minfer.config import ModelConfig, check_shape_fields
from minfer.model.gelu_mlp import activation
from minfer.model.layers import BuildOptions, Linear, MergedLinear, TiedEmbedding
from minfer.model.positions import RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + weight), in float32 (Gemma's convention: weight 0 is identity)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions):
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.qkv_proj = MergedLinear(cfg.hidden_size, [h * d, kvh * d, kvh * d], bias=False, method=build.linear_method)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=False, method=build.linear_method)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.window = cfg.layer_windows[layer_idx]
        scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        self.attn = Attention(layer_idx, h, kvh, d, scale=scale, sliding_window=self.window)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                          self.num_kv_heads * self.head_dim], dim=-1)
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        q, k = rotary(ctx.positions, q, k, cos_sin)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), ctx)
        return self.o_proj(out.reshape(t, -1))


class Gemma3MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate|up merged into one matmul."""

    def __init__(self, cfg: ModelConfig, build: BuildOptions):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [i, i], bias=False, method=build.linear_method)
        self.down_proj = Linear(i, cfg.hidden_size, bias=False, method=build.linear_method)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, layer_idx, build)
        self.mlp = Gemma3MLP(cfg, build)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, rotary, cos_sin, ctx):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, cos_sin, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, build: BuildOptions, lm_head: Linear):
        super().__init__()
        self.embed_tokens = TiedEmbedding(lm_head) if cfg.tie_word_embeddings else nn.Embedding(cfg.vocab_size,
                                                                                                 cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, build) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Global layers: the model's base and scaling; local (windowed) layers: their own base, no scaling.
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings, max_positions)
        self.rotary_emb_local = RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, None,
                                                cfg.max_position_embeddings, max_positions)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF multiplies by the scale cast to the activations' dtype first; the same here.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        tables = {"global": self.rotary_emb.cos_sin_for(ctx.positions),
                  "local": self.rotary_emb_local.cos_sin_for(ctx.positions)}
        for layer in self.layers:
            kind = "global" if layer.self_attn.window is None else "local"
            rotary = self.rotary_emb if kind == "global" else self.rotary_emb_local
            x = layer(x, rotary, tables[kind], ctx)
        return self.norm(x)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text model. `forward(input_ids [T] int64, ctx) -> hidden [T, hidden]`;
    `compute_logits(hidden [N, hidden]) -> [N, vocab]` float32."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, build: BuildOptions | None = None):
        super().__init__()
        build = build or BuildOptions()
        self.config = cfg
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, method=build.linear_method)
        self.model = Gemma3Model(cfg, max_positions or cfg.max_position_embeddings, build, self.lm_head)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def gemma3_config(d: dict, arch, source: str = "config.json") -> ModelConfig:
    """The config adapter of Gemma 3 (`minfer.model.registry`), from an HF `Gemma3TextConfig` dict or the GGUF
    metadata (`minfer.model.gguf`). Defaults are transformers': local RoPE base 10,000, every sixth layer
    global (`sliding_window_pattern` 6) unless `layer_types` says otherwise, `query_pre_attn_scalar` 256.

    Raises:
        ValueError: a missing or non-positive size, a non-positive window, or logit soft-capping (not built).
    """
    try:
        n_heads, hidden, n_layers = d["num_attention_heads"], d["hidden_size"], d["num_hidden_layers"]
        inter, vocab = d["intermediate_size"], d["vocab_size"]
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
    check_shape_fields(d, source)
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(cap):
            raise ValueError(f"{source}: Gemma 3 with {cap}={d[cap]!r} is not supported by minfer")
    rope = d.get("rope_parameters") or {}
    full, local = rope.get("full_attention"), rope.get("sliding_attention")
    if full is not None or local is not None:  # transformers 5: one RoPE dict per layer kind
        full, local = dict(full or {}), dict(local or {})
        theta, local_theta = full.pop("rope_theta", 1e6), local.pop("rope_theta", 1e4)
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        theta, local_theta = d.get("rope_theta", 1e6), d.get("rope_local_base_freq", 1e4)
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
        if scaling and "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling and scaling.get("rope_type", "default") == "default":
            scaling = None
    window = d.get("sliding_window", 4096)
    layer_types = d.get("layer_types") or [
        "full_attention" if (i + 1) % d.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(n_layers)]
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    eos = d.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelConfig(
        architecture=arch.name, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=n_layers, num_attention_heads=n_heads,
        num_key_value_heads=d.get("num_key_value_heads") or n_heads, head_dim=d.get("head_dim") or 256,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), qk_norm=True, layer_windows=windows,
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        bos_token_id=d.get("bos_token_id"), eos_token_ids=eos, torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        rope_local_theta=float(local_theta), query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)))
