"""`quantization="int8"`: weight-only, per-output-channel symmetric INT8 (LLM.int8()'s vector-wise scale
without its outliers, Dettmers et al. 2022; vLLM's W8A16).

    scale[n] = max_k |W[n, k]| / 127        q[n, k] = round(W[n, k] / scale[n]) in [-127, 127]
    W_hat[n, k] = q[n, k] * scale[n]        |W - W_hat| <= scale[n] / 2 per element

Stored: `qweight int8 [out, in]` (1 byte per weight), `scales float32 [out]` and their bfloat16 copy for the
packed op (`torch.ops.aten._weight_int8pack_mm(x bf16 [T, in], qweight, scales bf16) -> [T, out]`).
"""

from __future__ import annotations

import torch

from minfer.quantization.base import QuantizedLinearMethod, store


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [out, in]` float -> (q int8 [out, in], scale float32 [out]); an all-zero row gets scale 1."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [out, in], scale [out]) -> `[out, in]` in `dtype`."""
    return (q.to(dtype) * scale.to(dtype)[:, None])


class Int8LinearMethod(QuantizedLinearMethod):
    """Per-channel symmetric INT8 weights (module docstring); no settings (group size does not apply)."""

    name = "int8"

    def quantize(self, layer, w: torch.Tensor) -> None:
        q, scale = quantize_int8(w)
        store(layer, "qweight", q)
        store(layer, "scales", scale)
        store(layer, "scales_bf16", scale.to(torch.bfloat16))

    def dequantize(self, layer, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(layer.qweight, layer.scales_bf16, dtype)  # the scales the kernel multiplies by

    def kernel(self, layer, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), layer.qweight, layer.scales_bf16)
