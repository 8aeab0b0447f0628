"""`quantization="gguf"`: run a GGUF file's own 4-bit blocks instead of expanding them to float32.

llama.cpp's blocks (ggml-common.h; 32 weights of one row each):

    Q4_0  18 bytes: d (float16), qs[16]                 w = (q - 8) d
    Q4_1  20 bytes: d (float16), m (float16), qs[16]    w = q d + m
          qs[j] holds weight j in its low nibble and weight j + 16 in its high one, q in 0..15

Both are the int4 op's group of 32 (`minfer.quantization.int4`, w = (q - 8) s + z): Q4_0 is s = d, z = 0;
Q4_1 is s = d, z = m + 8d. The codes go across unchanged. The op keeps s and z in bfloat16, so d and m + 8d
are rounded from float16's 11 significant bits to bfloat16's 8: each weight moves by at most 2^-9 of its
group's scale times 8 plus 2^-9 of the zero (`tests/test_quant.py` measures it against gguf's own
dequantization). Other tensor types (F32, F16, Q8_0, K-quants) are expanded to float32 and run by the
fallback layout, as is the tied LM head; SmolLM2-135M's Q4_1 file stores its embedding/head as Q8_0.

The loader (`minfer.model.loader`) hands Q4_0/Q4_1 tensors over as their raw bytes, `uint8 [out, bytes]`
tagged with `ggml_type`, through `gguf_tensors`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from minfer.model.linear_method import LinearMethodBase, UnquantizedLinearMethod
from minfer.quantization.int4 import Int4LinearMethod

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
NATIVE_TYPES = tuple(BLOCK_BYTES)


def decode_q4_blocks(raw: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw rows `uint8 [out, in/32 * bytes]` of Q4_0/Q4_1 -> (codes uint8 [out, in], s float32 [out, in/32],
    z float32 [out, in/32]) with w = (q - 8) s + z. Raises ValueError for another type."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"decode_q4_blocks: {ggml_type} is not one of {NATIVE_TYPES}")
    nb = BLOCK_BYTES[ggml_type]
    out = raw.shape[0]
    b = raw.reshape(out, -1, nb)  # [out, groups, bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if ggml_type == "Q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        zero, qs = m + 8 * d, b[..., 4:]
    else:
        zero, qs = torch.zeros_like(d), b[..., 2:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # [out, groups, 32]: weights 0..15 then 16..31
    return codes.reshape(out, -1), d, zero


def gguf_tensor(block, cfg, unpermute) -> torch.Tensor:
    """One `GGUFBlocks` -> the tensor the loader passes on: raw rows tagged `ggml_type` for Q4_0/Q4_1
    Linear weights, a float32 tensor (gguf's own dequantization) for everything else."""
    from gguf.quants import dequantize

    type_name = block.tensor_type.name
    is_linear = block.name.startswith("model.layers.") and block.name.endswith("_proj.weight")
    heads = cfg.num_attention_heads if ".q_proj." in block.name else cfg.num_key_value_heads
    if type_name in NATIVE_TYPES and is_linear:
        raw = torch.from_numpy(np.array(block.data, dtype=np.uint8)).reshape(block.shape[0], -1)
        if block.rope_permuted:  # a permutation of whole rows: the blocks of a row stay together
            raw = unpermute(raw, heads)
        raw.ggml_type = type_name
        return raw
    w = torch.from_numpy(np.array(dequantize(block.data, block.tensor_type), dtype=np.float32))
    return unpermute(w, heads) if block.rope_permuted else w


class GGUFLinearMethod(LinearMethodBase):
    """The file's Q4_0/Q4_1 blocks through the int4 op (module docstring); other layers by `fallback`.

    The `weight` parameter is a meta-device placeholder (no memory) whose loader keeps each checkpoint part
    as given; `process_weights_after_loading` turns all-Q4 parts into int4 storage, anything else into a
    float weight for the fallback.
    """

    name = "gguf"

    def __init__(self, fallback: LinearMethodBase | None = None):
        self.fallback = fallback or UnquantizedLinearMethod()
        self.int4 = Int4LinearMethod(group_size=BLOCK, fallback=self.fallback)

    def create_weights(self, layer, in_features: int, output_sizes: list[int], bias: bool) -> None:
        out = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(out, in_features, device="meta"), requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        layer.gguf_parts = {}
        layer.quantized = False

        def load(param, loaded, shard=None):
            if param is layer.weight:
                if not hasattr(loaded, "ggml_type") and loaded.shape != (output_sizes[shard or 0], in_features):
                    raise ValueError(f"shape mismatch: part {tuple(loaded.shape)} vs "
                                     f"{(output_sizes[shard or 0], in_features)}")
                layer.gguf_parts[shard or 0] = loaded
            else:
                layer.weight_loader(param, loaded, shard)

        for p in (layer.weight, layer.bias):
            if p is not None:
                p.weight_loader = load
                p.num_shards = len(output_sizes)

    def process_weights_after_loading(self, layer) -> None:
        parts = [layer.gguf_parts[i] for i in range(len(layer.output_sizes))]
        layer.gguf_parts = {}
        types = {getattr(p, "ggml_type", "float") for p in parts}
        if types <= set(NATIVE_TYPES) and not layer.keep_rows:
            decoded = [decode_q4_blocks(p, p.ggml_type) for p in parts]
            codes, s, z = (torch.cat(t, dim=0) for t in zip(*decoded))
            del layer.weight
            self.int4.store(layer, codes, s.to(torch.bfloat16), z.to(torch.bfloat16))
            layer.quantized = True
            return
        floats = [p.float() if not hasattr(p, "ggml_type") else torch.from_numpy(
            _dequantize_raw(p)) for p in parts]
        dtype = layer.weight.dtype  # the model's dtype (the placeholder was built in it)
        layer.weight = nn.Parameter(torch.cat(floats, dim=0).to(dtype), requires_grad=False)
        self.fallback.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return (self.int4 if layer.quantized else self.fallback).apply(layer, x)

    def weight_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        return (self.int4 if layer.quantized else self.fallback).weight_rows(layer, ids)


def _dequantize_raw(raw: torch.Tensor) -> np.ndarray:
    """Raw Q4 rows -> float32 (a Q4 part of a tied head, or merged with a non-Q4 part)."""
    codes, s, z = decode_q4_blocks(raw, raw.ggml_type)
    out = codes.shape[0]
    w = (codes.reshape(out, s.shape[1], BLOCK).float() - 8) * s[..., None] + z[..., None]
    return w.reshape(out, -1).numpy()
