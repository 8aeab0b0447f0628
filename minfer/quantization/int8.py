"""`quantization="int8"`: weight-only, per-output-channel symmetric INT8 (LLM.int8()'s vector-wise scale
without its outliers, Dettmers et al. 2022; vLLM's W8A16).

    scale[n] = max_k |W[n, k]| / 127        q[n, k] = round(W[n, k] / scale[n]) in [-127, 127]
    W_hat[n, k] = q[n, k] * scale[n]        |W - W_hat| <= scale[n] / 2 per element

The scale is stored in bfloat16, rounded up so that no code needs clamping, and the codes are computed with
the stored scale, so the bound above holds for what is stored. Stored on a CPU where the C++ kernel builds:
the integer GEMM's tiles (`minfer.cpu.qgemm`, one scale group = the whole row; 1 byte per weight),
which every batch size runs (activations quantized to int8 blocks of 32; `minfer.quantization.base`).
Elsewhere: `qweight int8 [out, in]` and `scales bfloat16 [out]`, for `torch.ops.aten._weight_int8pack_mm(x
bf16 [T, in], qweight, scales) -> [T, out]` or a dequantize + `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.quantization.base import QuantizedLinearMethod, store


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [out, in]` float -> (q int8 [out, in], scale bfloat16 [out]); an all-zero row gets scale 1."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    # x (1 + 2^-8) before rounding to bfloat16 (8 significant bits): the stored scale is >= amax / 127.
    scale = torch.where(amax > 0, amax / 127.0 * (1 + 2 ** -8), torch.ones_like(amax)).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [out, in], scale [out]) -> `[out, in]` in `dtype`."""
    return (q.to(dtype) * scale.to(dtype)[:, None])


class Int8LinearMethod(QuantizedLinearMethod):
    """Per-channel symmetric INT8 weights (module docstring); no settings (group size does not apply)."""

    name = "int8"
    unpacked_buffers = ("qweight", "scales")

    def quantize(self, layer, w: torch.Tensor) -> None:
        q, scale = quantize_int8(w)
        store(layer, "qweight", q)
        store(layer, "scales", scale)
        self.maybe_pack(layer)

    def pack_for_cpu(self, layer):
        s = layer.scales
        if s.dtype not in (torch.bfloat16, torch.float16) or layer.qweight.shape[1] % 32:
            return None  # a float32 scale would be rounded; a width the kernel's blocks do not cover
        return self.cpu_kernel.pack(layer.qweight, s.reshape(-1, 1), None, 8)

    def dequantize(self, layer, dtype: torch.dtype) -> torch.Tensor:
        if getattr(layer, "qg_format", None) is not None:
            return self.cpu_kernel.dequantize_rows(layer, dtype=dtype)
        return dequantize_int8(layer.qweight, layer.scales, dtype)

    def kernel(self, layer, x2: torch.Tensor) -> torch.Tensor:
        if layer.qweight.shape[1] % 16:
            # torch's packed op reads past the row for widths that are not a multiple of 16 (measured: garbage
            # or a segfault at 8, 100, 104): the same W8A16 product by dequantize + F.linear instead
            y = F.linear(x2.to(torch.bfloat16).float(), dequantize_int8(layer.qweight, layer.scales))
            return y.to(torch.bfloat16)
        return torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), layer.qweight, layer.scales)
