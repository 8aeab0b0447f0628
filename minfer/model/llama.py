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

from minfer.attention import Attention, ForwardContext
from minfer.config import ModelConfig
from minfer.model.layers import BuildOptions, RMSNorm, fused_kernels, silu_and_mul
from minfer.model.positions import RotaryEmbedding
from minfer.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minfer.parallel.parallel_state import get_parallel_state
from minfer.parallel.pipeline import stage_layers


class LlamaAttention(nn.Module):
    """Self-attention on this rank's heads (all of them with one rank; chapter 12's head split with more):
    q|k|v column-parallel by heads, o_proj row-parallel, so the block ends in one all-reduce."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions, kv_layer_idx: int | None = None):
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        method = build.linear_method
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, h, kvh, bias=cfg.qkv_bias, method=method)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.o_proj = RowParallelLinear(h * d, cfg.hidden_size, bias=cfg.o_bias, method=method)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, fused=build.fused_ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, fused=build.fused_ops)
        self.qk_norm = cfg.qk_norm
        window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        # The KV pool of a pipeline stage holds only its layers: the cache index is the layer's place in the stage.
        self.attn = Attention(layer_idx if kv_layer_idx is None else kv_layer_idx, self.num_heads, self.num_kv_heads,
                              d, scale=d ** -0.5, sliding_window=window)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin, ctx: ForwardContext) -> torch.Tensor:
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


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward, down(silu(gate(x)) * up(x)): gate|up column-parallel (one matmul for both),
    down row-parallel, so the MLP ends in the block's second all-reduce."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, build: BuildOptions):
        super().__init__()
        method = build.linear_method
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias=bias, method=method)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, method=method)
        self.act = fused_kernels(build.fused_ops).silu_and_mul if build.fused_ops else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions, kv_layer_idx: int | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, build, kv_layer_idx)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, build)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=build.fused_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=build.fused_ops)

    def forward(self, x, residual, rotary, cos_sin, ctx):
        # The residual add is fused into the norm (vLLM's layout): each norm returns (normed, new residual).
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotary, cos_sin, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class PPMissingLayer(nn.Identity):
    """The place of a layer another pipeline stage holds (vLLM's name): no parameters, never called."""


class LlamaModel(nn.Module):
    """The decoder stack, or this pipeline stage's part of it: layers `[start_layer, end_layer)` (all of them
    with one stage), the embedding on the first stage, the final norm on the last (`stage_layers`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, build: BuildOptions):
        super().__init__()
        st = get_parallel_state()
        self.start_layer, self.end_layer = stage_layers(cfg.num_hidden_layers, st.pp_size, st.pp_rank)
        self.is_first, self.is_last = st.is_first_stage, st.is_last_stage
        if self.is_first and not cfg.tie_word_embeddings:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # Global layer indices keep the checkpoint's names (model.layers.17...); the other stages' are placeholders.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, build, kv_layer_idx=i - self.start_layer)
            if self.start_layer <= i < self.end_layer else PPMissingLayer() for i in range(cfg.num_hidden_layers))
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=build.fused_ops)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings, max_positions, fused=build.fused_ops)
        self.fused_ops = build.fused_ops

    def forward(self, input_ids: torch.Tensor | None, ctx: ForwardContext,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: `input_ids [T]`; later stages: `intermediate [2, T, hidden]` (hidden state and residual
        from the stage before). Returns the normed hidden states `[T, hidden]` on the last stage, else the
        intermediate tensor `[2, T, hidden]` to send on."""
        if self.is_first:
            x, residual = self.embed(input_ids), None
        else:
            x, residual = intermediate[0], intermediate[1]
        # cos/sin of this forward's positions: gathered once here, not once per layer.
        cos_sin = self.rotary_emb.cos_sin_for(ctx.positions)
        for layer in self.decoder_layers():
            x, residual = layer(x, residual, self.rotary_emb, cos_sin, ctx)
        if not self.is_last:
            return torch.stack((x, residual))
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [T]` -> the embeddings `[T, hidden]` (first stage)."""
        return self.embed_tokens(input_ids)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's decoder layers, in order (all of them with one stage)."""
        return list(self.layers[self.start_layer:self.end_layer])

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
        st = get_parallel_state()
        # The head lives on the last stage; with tied embeddings the first stage needs its table too.
        if st.is_last_stage or (cfg.tie_word_embeddings and st.is_first_stage):
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, method=build.linear_method)
        if cfg.tie_word_embeddings and st.is_first_stage:
            # One table for both: the checkpoint's embedding is loaded into the head (transposed).
            self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tied_head=self.lm_head)

    def forward(self, input_ids: torch.Tensor | None, ctx: ForwardContext,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, ctx, intermediate)

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """True for a checkpoint tensor another pipeline stage holds (a layer outside this stage's range, the
        embedding, norm or head of another stage): the loader passes over it."""
        m = self.model
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            return not m.start_layer <= i < m.end_layer
        if name.startswith("lm_head.") or (name.startswith("model.embed_tokens.") and self.config.tie_word_embeddings):
            return not hasattr(self, "lm_head")
        if name.startswith("model.embed_tokens."):
            return not m.is_first
        if name.startswith("model.norm."):
            return not m.is_last
        return False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def llama_config(d: dict, arch, source: str = "config.json") -> ModelConfig:
    """The config adapter of the Llama family (`minfer.model.registry`): `ModelConfig` from a parsed HF config
    dict; handles both `rope_theta`+`rope_scaling` (transformers 4) and `rope_parameters` (transformers 5).

    `arch` is the `registry.Architecture`; its traits say what the family members add (Qwen2's QKV bias,
    Qwen3's QK-norm, Qwen's opt-in `use_sliding_window`).

    Raises:
        ValueError: a missing required field (the message names `source`).
    """
    try:
        n_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        n_layers = d["num_hidden_layers"]
        inter = d["intermediate_size"]
        vocab = d["vocab_size"]
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
    for name in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                 "num_key_value_heads", "head_dim"):
        v = d.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{source}: {name} must be a positive integer, got {v!r}")
    head_dim = d.get("head_dim") or hidden // n_heads
    rope = d.get("rope_parameters") or {}
    if "rope_theta" in rope and not isinstance(rope.get("rope_theta"), dict):
        theta = rope["rope_theta"]
    else:
        theta = d.get("rope_theta", 10000.0)
    scaling = dict(d.get("rope_scaling") or rope or {})
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    if d.get("alibi") or d.get("position_embedding_type") == "alibi":
        raise ValueError(f"{source}: ALiBi and RoPE are both set: {arch.name} rotates Q/K with RoPE, and this "
                         "config also asks for ALiBi (`alibi`/`position_embedding_type`); a model takes one of them")
    traits = arch.traits
    # Qwen2 always has a QKV bias and never an o_proj bias; the others follow `attention_bias`.
    qkv_bias = traits.get("qkv_bias", bool(d.get("attention_bias", False)))
    o_bias = bool(d.get("attention_bias", False)) and not traits.get("qkv_bias", False)
    window = d.get("sliding_window")
    if traits.get("window_opt_in") and not d.get("use_sliding_window", False):
        window = None
    layer_types = d.get("layer_types")
    if window and layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:
        windows = tuple([window] * n_layers)
    eos = d.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelConfig(
        architecture=arch.name, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=n_layers, num_attention_heads=n_heads,
        num_key_value_heads=d.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=traits.get("qk_norm", False), layer_windows=windows,
        hidden_act=d.get("hidden_act", "silu"), bos_token_id=d.get("bos_token_id"), eos_token_ids=eos,
        torch_dtype=d.get("torch_dtype") or d.get("dtype"))
