"""Calibration for `python -m minfer.quantize`: run a float Llama-family model layer by layer on
calibration text and quantize each layer's linears with RTN, GPTQ or AWQ.

The loop (the GPTQ and AWQ papers' sequential scheme): the hidden states of every calibration sample at
the input of decoder layer l are kept; layer l runs once with its float weights while hooks record the
inputs of its four linears (q|k|v, o, gate|up, down); the method quantizes them; layer l then runs again
with its quantized weights, and its outputs are layer l + 1's inputs. So each layer is calibrated on
what the quantized layers before it actually produce.

The model must be loaded in float32 with the "nn" linear layout (`weight [out, in]` as a parameter), as
`load_for_calibration` does. AWQ changes the model's norm weights and v/up rows in place (the folds);
`QuantizedWeights.float_state` holds every tensor left in float afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from minfer.attention import ForwardContext
from minfer.attention.torch_ref import ContiguousBackend
from minfer.quantization.awq import search_clip, search_scale
from minfer.quantization.formats import affine_params, dequantize_affine, quantize_affine
from minfer.quantization.gptq import gptq_quantize, hessian

METHODS = ("int4", "gptq", "awq")
# minfer's merged linears -> the checkpoint's parts (HF names), in row order.
PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


@dataclass
class QuantizedWeights:
    """What calibration produced: per checkpoint linear (HF name without `.weight`) its (codes int32
    [out, in], scale float32 [out, in/G], zp int32 [out, in/G]), w = (q - zp) s; `float_state` the tensors
    kept in float (HF names); `awq_losses[layer][group]` the loss per alpha of AWQ's grid search; `g_idx`
    per linear its act-order groups int32 [in] (GPTQ with desc_act only; empty otherwise)."""

    method: str
    group_size: int
    bits: int
    linears: dict = field(default_factory=dict)
    float_state: dict = field(default_factory=dict)
    awq_losses: list = field(default_factory=list)
    g_idx: dict = field(default_factory=dict)


def load_for_calibration(model: str):
    """`minfer.model.loader.load_model(model)` in float32 with plain `[out, in]` weights, on the CPU."""
    from minfer.model.layers import UnquantizedLinearMethod
    from minfer.model.loader import load_model

    return load_model(model, dtype="float32", device="cpu", linear_method=UnquantizedLinearMethod())


def calibration_samples(tokenizer, n_samples: int = 32, seq_len: int = 256, text: str | None = None) -> list[list[int]]:
    """`n_samples` consecutive windows of `seq_len` tokens of the shipped calibration text (or `text`).

    Raises:
        ValueError: the text has fewer than n_samples x seq_len tokens.
    """
    from minfer.config import load_shipped_text

    ids = tokenizer.encode(text if text is not None else load_shipped_text("calib"), add_special_tokens=False)
    if len(ids) < n_samples * seq_len:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than {n_samples} x {seq_len}")
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(n_samples)]


def _check_model(model) -> None:
    from minfer.model.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"calibration supports the Llama family (Llama, Mistral, Qwen2, Qwen3), not "
                         f"{type(model).__name__}")
    for m in model.model.layers[0].modules():
        if hasattr(m, "method") and m.layout != "nn":
            raise ValueError(f"calibrate needs unquantized linears (the 'nn' layout), got {m.layout!r}: load an "
                             "unquantized checkpoint with load_for_calibration() (is this model already quantized?)")


def _rtn(w: torch.Tensor, group_size: int, bits: int, zp_min: int):
    out, k = w.shape
    s, zp = affine_params(w.reshape(out, k // group_size, group_size), bits, zp_min)
    return quantize_affine(w, s, zp, group_size, bits), s, zp


@torch.no_grad()
def calibrate(model, samples: list[list[int]], method: str, group_size: int, bits: int = 4,
              n_grid: int = 20, max_rows: int = 512, zp_min: int | None = None,
              use_tqdm: bool = True, desc_act: bool = False) -> QuantizedWeights:
    """Quantize every decoder linear of `model` (module docstring) with `method` ("int4" = RTN, "gptq",
    "awq") at `group_size`, calibrated on `samples` (token-id lists of one length).

    Args:
        n_grid: AWQ's grid points (scale exponent and clipping). max_rows: calibration rows AWQ's searches
            use (a fixed random subset of all sample tokens). zp_min: smallest zero point (default 1 for
            GPTQ's v1 format, 0 otherwise). desc_act: GPTQ's act-order (`gptq_quantize`).

    Raises:
        ValueError: an unknown method, a model that is not Llama-family in the "nn" layout, a group size
            that does not divide a layer.
    """
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}: one of {METHODS}")
    if desc_act and method != "gptq":
        raise ValueError(f"desc_act (act-order) is GPTQ's; method {method!r} has no column order")
    _check_model(model)
    zp_min = (1 if method in ("gptq", "int4") else 0) if zp_min is None else zp_min
    cfg = model.config
    seq_len = len(samples[0])
    cache = ContiguousBackend(cfg.num_hidden_layers, seq_len, cfg.num_key_value_heads, cfg.head_dim,
                              torch.float32)
    positions = torch.arange(seq_len)
    ctx = ForwardContext(cache, positions=positions, start_pos=0)
    rotary = model.model.rotary_emb
    cos_sin = rotary.cos_sin_for(positions)
    states = [(model.model.embed_tokens(torch.tensor(s)), None) for s in samples]
    result = QuantizedWeights(method=method, group_size=group_size, bits=bits)
    gen = torch.Generator().manual_seed(0)

    layers = model.model.layers
    for li, layer in enumerate(tqdm(layers, desc=f"{method} calibration", disable=not use_tqdm)):
        linears = {name: layer.get_submodule(name) for name in PARTS}
        for name, lin in linears.items():
            if lin.in_features % group_size:
                raise ValueError(f"group_size={group_size} does not divide layer {li} {name}'s input width "
                                 f"{lin.in_features}")
        inputs: dict[str, list] = {name: [] for name in linears}
        hooks = [lin.register_forward_pre_hook(lambda m, a, n=name: inputs[n].append(a[0].reshape(-1, a[0].shape[-1])))
                 for name, lin in linears.items()]
        for x, res in states:
            layer(x, res, rotary, cos_sin, ctx)
        for h in hooks:
            h.remove()
        xs = {name: torch.cat(v) for name, v in inputs.items()}
        inputs = None  # the hooks' closures hold the name: this frees the layer's inputs

        if method == "awq":
            rows = torch.randperm(xs["self_attn.qkv_proj"].shape[0], generator=gen)[:max_rows]
            result.awq_losses.append(_awq_layer(layer, cfg, {n: x[rows] for n, x in xs.items()}, xs, group_size,
                                                n_grid))
        for name, lin in linears.items():
            w = lin.weight.data.float()
            g_idx = None
            if method == "gptq":
                q, s, zp, g_idx = gptq_quantize(w, hessian(xs[name]), group_size, bits, zp_min=zp_min,
                                                desc_act=desc_act, return_g_idx=True)
                gi = g_idx.long()
                w_hat = (q.float() - zp[:, gi].float()) * s[:, gi]
            else:
                q, s, zp = _rtn(w, group_size, bits, zp_min)
                w_hat = dequantize_affine(q, s, zp)
            lin.weight.data.copy_(w_hat)  # what the next layer's inputs see
            row = 0
            for part, size in zip(PARTS[name], lin.output_sizes):
                key = f"model.layers.{li}.{part}"
                result.linears[key] = (q[row:row + size], s[row:row + size], zp[row:row + size])
                if desc_act:
                    result.g_idx[key] = g_idx
                row += size
        del xs
        states = [layer(x, res, rotary, cos_sin, ctx) for x, res in states]

    for name, p in model.named_parameters():
        if name.endswith("_proj.weight") and ".layers." in name:
            continue
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        result.float_state[name] = p.data.clone()
    return result


def fold_scales(layer, cfg, scales: dict) -> None:
    """Fold AWQ's scales into one decoder layer, leaving its float function unchanged (tested):

        qkv     [hidden]  input_layernorm.weight / s,            q|k|v columns * s
        o       [kvh*D]   v rows (and bias) / s,                 o_proj columns * s of their v channel
        gate_up [hidden]  post_attention_layernorm.weight / s,   gate|up columns * s
        down    [inter]   up rows (and bias) / s,                down_proj columns * s
    """
    attn, mlp = layer.self_attn, layer.mlp
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    s = scales["qkv"]
    layer.input_layernorm.weight.data.div_(s)
    attn.qkv_proj.weight.data.mul_(s[None, :])
    s = scales["o"]
    v0 = (h + kvh) * d
    attn.qkv_proj.weight.data[v0:].div_(s[:, None])
    if attn.qkv_proj.bias is not None:
        attn.qkv_proj.bias.data[v0:].div_(s)
    attn.o_proj.weight.data.mul_(s[o_expand(cfg)][None, :])
    s = scales["gate_up"]
    layer.post_attention_layernorm.weight.data.div_(s)
    mlp.gate_up_proj.weight.data.mul_(s[None, :])
    s = scales["down"]
    inter = mlp.down_proj.in_features
    mlp.gate_up_proj.weight.data[inter:].div_(s[:, None])
    if mlp.gate_up_proj.bias is not None:
        mlp.gate_up_proj.bias.data[inter:].div_(s)
    mlp.down_proj.weight.data.mul_(s[None, :])


def o_expand(cfg) -> torch.Tensor:
    """int64 [heads * D]: for each o_proj input channel (head, dim), its v channel (head // (h / kvh), dim)."""
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return ((torch.arange(h) // (h // kvh))[:, None] * d + torch.arange(d)[None, :]).reshape(-1)


def _awq_layer(layer, cfg, xs: dict, xs_all: dict, group_size: int, n_grid: int) -> dict:
    """AWQ's scale search, folds and clipping for one decoder layer (minfer.quantization.awq). `xs` are the
    sampled rows per linear input, `xs_all` every row (for mean |x|). Each group's search reads the layer's
    weights before any fold (a fold touches only other groups' weights: v's and up's rows, not o's or down's
    columns). Changes the layer's weights in place; returns {group: losses per alpha}."""
    attn, mlp = layer.self_attn, layer.mlp
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    expand = o_expand(cfg)
    mean = {n: x.abs().mean(0) for n, x in xs_all.items()}
    # the query heads of one v head share its scale: the mean of their |x|
    mean["self_attn.o_proj"] = mean["self_attn.o_proj"].view(kvh, h // kvh, d).mean(1).reshape(-1)
    groups = {"qkv": ("self_attn.qkv_proj", attn.qkv_proj, None), "o": ("self_attn.o_proj", attn.o_proj, expand),
              "gate_up": ("mlp.gate_up_proj", mlp.gate_up_proj, None), "down": ("mlp.down_proj", mlp.down_proj, None)}
    scales, losses = {}, {}
    for g, (name, lin, exp) in groups.items():
        scales[g], losses[g] = search_scale(xs[name], lin.weight.data, group_size, mean[name], exp, n_grid)
    fold_scales(layer, cfg, scales)
    for g, (name, lin, exp) in groups.items():  # the inputs the folded weights see
        xs[name] = xs[name] / scales[g][exp if exp is not None else slice(None)]

    # clipping, on at most 256 rows; not q and k (module docstring of awq.py)
    clip_rows = {n: x[:256] for n, x in xs.items()}
    qk = (h + kvh) * d
    w = attn.qkv_proj.weight.data
    w[qk:] = search_clip(clip_rows["self_attn.qkv_proj"], w[qk:], group_size, n_grid)
    for g, (name, lin, exp) in groups.items():
        if g != "qkv":
            lin.weight.data.copy_(search_clip(clip_rows[name], lin.weight.data, group_size, n_grid))
    return losses
