"""Tensor and pipeline parallelism applied to a built single-device model (chapter 12; gpt-fast's `apply_tp`).

`minfer/model/llama.py` is the model of one device. On a rank of a parallel job the loader builds that model,
then calls `parallelize(model)` before the weights are loaded:

    tensor parallelism     each projection is swapped for its sharded twin (`minfer.parallel.layers`):
                           q|k|v and gate|up column-parallel, o_proj and down_proj row-parallel, the
                           embedding and LM head split over the vocabulary; each attention keeps its
                           rank's heads
    pipeline parallelism   the layers of other stages become `PPMissingLayer`s, the embedding stays on the
                           first stage and the norm and head on the last; the model's forward becomes the
                           stage's (`stage_forward`: ids or the previous stage's `[2, T, hidden]` in,
                           `[2, T, hidden]` or the normed hidden states out), and the loader skips the
                           checkpoint tensors of other stages (`skip_checkpoint_tensor`)

The sharded layers load the rank's slice out of each full checkpoint tensor, so the checkpoint is read as is.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from minfer.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minfer.parallel.parallel_state import get_parallel_state
from minfer.parallel.pipeline import stage_layers


class PPMissingLayer(nn.Identity):
    """The place of a layer another pipeline stage holds (vLLM's name): no parameters, never called."""


def parallelize(model: nn.Module) -> nn.Module:
    """Shard `model` (a `LlamaForCausalLM` just built, weights not loaded) for this rank's place in the job
    (`minfer.parallel.parallel_state`); a no-op with one rank. Returns `model`, changed in place.

    Raises:
        ValueError: heads, KV heads or widths that do not divide by tensor_parallel_size, or more stages than
            layers.
    """
    st = get_parallel_state()
    if st.tp_size > 1:
        apply_tensor_parallel(model)
    if st.pp_size > 1:
        apply_pipeline_stage(model, st.pp_rank, st.pp_size)
    return model


def apply_tensor_parallel(model: nn.Module) -> None:
    """Swap every projection of `model` for its tensor-parallel twin, built with the same `LinearMethod`."""
    cfg = model.config
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        method = attn.qkv_proj.method
        attn.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.qkv_bias, method=method)
        attn.num_heads, attn.num_kv_heads = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads
        attn.attn.num_heads, attn.attn.num_kv_heads = attn.num_heads, attn.num_kv_heads
        attn.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias,
                                        method=method)
        mlp.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias,
                                                method=method)
        mlp.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, method=method)
    model.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, method=model.lm_head.method)
    model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                      tied_head=model.lm_head if cfg.tie_word_embeddings else None)


def apply_pipeline_stage(model: nn.Module, pp_rank: int, pp_size: int) -> None:
    """Keep only stage `pp_rank`'s part of `model` (see the module docstring)."""
    cfg, m = model.config, model.model
    start, end = stage_layers(cfg.num_hidden_layers, pp_size, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    for i in range(cfg.num_hidden_layers):
        if start <= i < end:
            m.layers[i].self_attn.attn.layer_idx = i - start  # the stage's KV pool holds only its layers
        else:
            m.layers[i] = PPMissingLayer()
    m.start_layer, m.end_layer, m.is_first, m.is_last = start, end, first, last
    if not last:
        del m.norm
    # The head lives on the last stage; with tied embeddings the first stage reads its table from it too.
    if not (last or (cfg.tie_word_embeddings and first)):
        del model.lm_head
    if not first:
        del m.embed_tokens
    m.decoder_layers = types.MethodType(lambda self: list(self.layers[start:end]), m)
    model.forward = types.MethodType(stage_forward, model)
    model.skip_checkpoint_tensor = types.MethodType(skip_checkpoint_tensor, model)


def stage_forward(self, input_ids: torch.Tensor | None, ctx, intermediate: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """One pipeline stage's forward. First stage: `input_ids [T]`; later stages: `intermediate [2, T, hidden]`
    (hidden state and residual from the stage before). Returns the normed hidden states `[T, hidden]` on the
    last stage, else the `[2, T, hidden]` tensor to send on."""
    m = self.model
    if m.is_first:
        x, residual = m.embed(input_ids), None
    else:
        x, residual = intermediate[0], intermediate[1]
    cos_sin = m.rotary_emb.cos_sin_for(ctx.positions)
    for layer in m.decoder_layers():
        x, residual = layer(x, residual, m.rotary_emb, cos_sin, ctx)
    if not m.is_last:
        return torch.stack((x, residual))
    return m.final_norm(x, residual)


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
