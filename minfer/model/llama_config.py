"""The config adapter of the Llama family (`minfer.model.registry`): Hugging Face's config.json -> `ModelConfig`."""

from __future__ import annotations

from minfer.config import ModelConfig, check_shape_fields


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
    check_shape_fields(d, source)
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
