"""GPT-2 (Radford et al., 2019): absolute positions, the article §2's first scheme, in the same engine as RoPE.

    x = wte(tokens) + wpe(positions)          positions enter ONCE, added to the token embedding
    for each layer:  h = x + c_proj(attention(q, k, v))      with q|k|v = c_attn(ln_1(x)), no rotation
                     x = h + mlp.c_proj(gelu(mlp.c_fc(ln_2(h))))
    logits = lm_head(ln_f(x))                 lm_head shares wte's table

Against Llama (`minfer.model.llama`): LayerNorm with a bias instead of RMSNorm, a two-matrix GELU MLP instead
of SwiGLU, biases everywhere, and no RoPE, so Q·K sees position only through what the embedding added to x.
The checkpoint stores its projections as `Conv1D` (`[in, out]`, the transpose of `nn.Linear`); `remap_checkpoint`
transposes them on load. Parameter names are the checkpoint's (`transformer.h.N.attn.c_attn`, ...).

Source: HF `GPT2LMHeadModel` (transformers/models/gpt2/modeling_gpt2.py) is the oracle (tests/test_models_gpt2_bloom.py).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from minfer.attention import Attention, ForwardContext
from minfer.config import ModelConfig
from minfer.model.gelu_mlp import GeluMLP
from minfer.model.layers import BuildOptions, Linear, TiedEmbedding

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions):
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.head_dim = h, d
        self.c_attn = Linear(cfg.hidden_size, 3 * h * d, bias=True, method=build.linear_method)
        self.c_proj = Linear(h * d, cfg.hidden_size, bias=True, method=build.linear_method)
        self.attn = Attention(layer_idx, h, h, d, scale=d ** -0.5)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.c_attn(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        return self.c_proj(self.attn(q, k, v, ctx).reshape(t, -1))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, build: BuildOptions):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = GPT2Attention(cfg, layer_idx, build)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, ("c_fc", "c_proj"), build)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ctx)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, build: BuildOptions, lm_head: Linear):
        super().__init__()
        self.wte = TiedEmbedding(lm_head) if cfg.tie_word_embeddings else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i, build) for i in range(cfg.num_hidden_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # The learned table is indexed by position: a position past n_positions has no row (the loader's
        # max_model_len check keeps the engine below it).
        x = self.wte(input_ids) + self.wpe(ctx.positions)
        for block in self.h:
            x = block(x, ctx)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """GPT-2. `forward(input_ids [T] int64, ctx) -> hidden [T, n_embd]`; `compute_logits(hidden [N, n_embd])
    -> [N, vocab]` float32."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, build: BuildOptions | None = None):
        super().__init__()
        build = build or BuildOptions()
        self.config = cfg
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, method=build.linear_method)
        self.transformer = GPT2Model(cfg, build, self.lm_head)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.transformer(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def remap_checkpoint(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint (name, tensor) -> ours: Conv1D weights transposed to `[out, in]`, the tied table to the
        head, the causal-mask buffers of old checkpoints (`attn.bias`, `attn.masked_bias`) dropped."""
        tied = self.config.tie_word_embeddings
        for name, t in named:
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # GPT2Model checkpoints (no head) name tensors from the root
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if name.endswith(_CONV1D):
                t = t.t().contiguous()
            if tied and name == "lm_head.weight":
                continue
            if tied and name == "transformer.wte.weight":
                name = "lm_head.weight"
            yield name, t


def gpt2_config(d: dict, arch, source: str = "config.json") -> ModelConfig:
    """The config adapter of GPT-2 (`minfer.model.registry`): HF's `n_embd`, `n_layer`, `n_head`, `n_positions`,
    `n_inner`, `layer_norm_epsilon`, `activation_function`.

    Raises:
        ValueError: a missing or non-positive size, or a switch minfer does not implement
            (`scale_attn_by_inverse_layer_idx`, `scale_attn_weights=False`, cross-attention).
    """
    try:
        hidden, n_layers, n_heads, vocab = d["n_embd"], d["n_layer"], d["n_head"], d["vocab_size"]
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
    for name in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions", "n_inner"):
        v = d.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{source}: {name} must be a positive integer, got {v!r}")
    if hidden % n_heads:
        raise ValueError(f"{source}: n_embd {hidden} is not a multiple of n_head {n_heads}")
    for flag, ok in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                     ("add_cross_attention", False)):
        if bool(d.get(flag, ok)) != ok:
            raise ValueError(f"{source}: GPT-2 with {flag}={d.get(flag)!r} is not supported by minfer")
    eos = d.get("eos_token_id")
    return ModelConfig(
        architecture=arch.name, vocab_size=vocab, hidden_size=hidden, intermediate_size=d.get("n_inner") or 4 * hidden,
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
        head_dim=hidden // n_heads, rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=d.get("n_positions", 1024),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), qkv_bias=True, o_bias=True, mlp_bias=True,
        layer_windows=tuple([None] * n_layers), hidden_act=d.get("activation_function", "gelu_new"),
        bos_token_id=d.get("bos_token_id"), eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos or ()),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"), position_embedding="learned")
