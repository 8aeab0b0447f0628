"""BLOOM (BigScience, 2022): ALiBi positions (Press et al., 2022, "Train Short, Test Long"), article §2.

    x = word_embeddings_layernorm(word_embeddings(tokens))     no position added to x at all
    for each layer:  h = x + dense(attention(q, k, v; scores - slope_h * (i - j)))   q|k|v = query_key_value(ln(x))
                     x = h + mlp(post_attention_layernorm(h))                       GELU, two matrices
    logits = lm_head(ln_f(x))                                  lm_head shares word_embeddings' table

Position enters only as a bias on each head's scores, linear in the distance i - j with a fixed slope per head
(`minfer.model.positions.alibi_slopes`); every attention backend adds it (`Attention.alibi_slopes`).
HF adds `slope * j` instead of `-slope * (i - j)`: the two differ by `slope * i`, the same for every key of
a query, which softmax cancels.

The checkpoint's fused `query_key_value` interleaves per head (`[H, 3, D]` rows); `remap_checkpoint` reorders
the rows to q|k|v once at load, so the forward splits with a view.

Source: HF `BloomForCausalLM` (transformers/models/bloom/modeling_bloom.py) is the oracle.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from minfer.attention import Attention, ForwardContext
from minfer.config import ModelConfig
from minfer.model.gelu_mlp import GeluMLP
from minfer.model.layers import BuildOptions, Linear, TiedEmbedding
from minfer.model.positions import alibi_slopes


class BloomAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions, slopes: torch.Tensor):
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.head_dim = h, d
        self.query_key_value = Linear(cfg.hidden_size, 3 * h * d, bias=True, method=build.linear_method)
        self.dense = Linear(h * d, cfg.hidden_size, bias=True, method=build.linear_method)
        self.attn = Attention(layer_idx, h, h, d, scale=d ** -0.5, alibi_slopes=slopes)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.query_key_value(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        return self.dense(self.attn(q, k, v, ctx).reshape(t, -1))


class BloomBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions, slopes: torch.Tensor):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attention = BloomAttention(cfg, layer_idx, build, slopes)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, ("dense_h_to_4h", "dense_4h_to_h"),
                           build)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class BloomModel(nn.Module):
    def __init__(self, cfg: ModelConfig, build: BuildOptions, lm_head: Linear):
        super().__init__()
        self.word_embeddings = (TiedEmbedding(lm_head) if cfg.tie_word_embeddings
                                else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.word_embeddings_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # One slopes tensor shared by every layer (a buffer, so it follows the model's device; float32 always).
        self.register_buffer("alibi_slopes", alibi_slopes(cfg.num_attention_heads).float(), persistent=False)
        self.h = nn.ModuleList(BloomBlock(cfg, i, build, self.alibi_slopes) for i in range(cfg.num_hidden_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        for block in self.h:
            x = block(x, ctx)
        return self.ln_f(x)


class BloomForCausalLM(nn.Module):
    """BLOOM. `forward(input_ids [T] int64, ctx) -> hidden [T, hidden]`; `compute_logits(hidden [N, hidden])
    -> [N, vocab]` float32."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, build: BuildOptions | None = None):
        super().__init__()
        build = build or BuildOptions()
        self.config = cfg
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, method=build.linear_method)
        self.transformer = BloomModel(cfg, build, self.lm_head)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.transformer(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def remap_checkpoint(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint (name, tensor) -> ours: `query_key_value` rows from per-head `[H, 3, D]` to `[3, H, D]`,
        the tied table to the head."""
        h, d = self.config.num_attention_heads, self.config.head_dim
        tied = self.config.tie_word_embeddings
        for name, t in named:
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name
            if name.endswith("query_key_value.weight"):
                t = t.view(h, 3, d, -1).transpose(0, 1).reshape(3 * h * d, -1)
            elif name.endswith("query_key_value.bias"):
                t = t.view(h, 3, d).transpose(0, 1).reshape(-1)
            if tied and name == "lm_head.weight":
                continue
            if tied and name == "transformer.word_embeddings.weight":
                name = "lm_head.weight"
            yield name, t


def bloom_config(d: dict, arch, source: str = "config.json") -> ModelConfig:
    """The config adapter of BLOOM (`minfer.model.registry`): `hidden_size` (or `n_embed`), `n_layer`, `n_head`,
    `layer_norm_epsilon`. BLOOM has no trained length (ALiBi has no table); `seq_length` or 2048 is used.

    Raises:
        ValueError: a missing or non-positive size, RoPE fields on an ALiBi model, or
            `apply_residual_connection_post_layernorm` (not implemented).
    """
    try:
        hidden = d.get("hidden_size") or d["n_embed"]
        n_layers = d.get("n_layer") or d["num_hidden_layers"]
        n_heads = d.get("n_head") or d["num_attention_heads"]
        vocab = d["vocab_size"]
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
    for name, v in (("hidden_size", hidden), ("n_layer", n_layers), ("n_head", n_heads), ("vocab_size", vocab)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{source}: {name} must be a positive integer, got {v!r}")
    if hidden % n_heads:
        raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of n_head {n_heads}")
    if d.get("rope_scaling") or d.get("rope_theta") or d.get("rope_parameters"):
        raise ValueError(f"{source}: ALiBi and RoPE are both set: BLOOM's positions are ALiBi biases, and this "
                         "config also has rope_* fields; a model takes one of them")
    if d.get("apply_residual_connection_post_layernorm"):
        raise ValueError(f"{source}: BLOOM with apply_residual_connection_post_layernorm=True is not supported")
    eos = d.get("eos_token_id")
    return ModelConfig(
        architecture=arch.name, vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
        head_dim=hidden // n_heads, rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=d.get("seq_length") or 2048,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), qkv_bias=True, o_bias=True, mlp_bias=True,
        layer_windows=tuple([None] * n_layers), hidden_act="gelu_pytorch_tanh",
        bos_token_id=d.get("bos_token_id"), eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos or ()),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"), position_embedding="alibi")
