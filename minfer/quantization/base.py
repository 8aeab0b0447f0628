"""What the weight-quantization methods share: a `LinearMethod` that loads the checkpoint's float weight,
quantizes it once in `process_weights_after_loading`, and then runs one of two routes per call:

- the kernel route (few rows: decode): torch's packed CPU ops (`_weight_int8pack_mm`,
  `_weight_int4pack_mm_for_cpu`) on bfloat16 activations. They stream 1 or 0.5 byte per weight instead of 4,
  which is what decode, bound by memory bandwidth, is paid for. Measured on 2 cores (chapter 5): with float32
  activations the same ops are 5-20x slower than float32 sgemm, with bfloat16 ones 1.7-2.4x faster.
- the dequantize route (many rows: prefill, batched decode): expand the codes to the activation dtype and run
  one `F.linear`, rounding its input and output to bfloat16 as the kernel does (so both routes compute the
  same W4A16 / W8A16 product, up to the order of the sums; chapter 5 §5.5 measures what is left). The
  product is compute-bound there, so the expansion (one pass over the weight) is cheap next to it, and
  MKL/oneDNN's sgemm was 6-20x faster than the packed ops at 64 rows (measured on 2 shared cores).

A tied LM head (`layer.keep_rows`, the embedding reads its rows) stays in the model's float layout: its
49,152-row product is slower through the packed ops than through sgemm (measured), as in vLLM, where the LM
head is not quantized unless asked.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from minfer.model.linear_method import LinearMethodBase, UnquantizedLinearMethod

# Most rows that take the kernel route; above, the dequantize route (see the module docstring). Measured
# crossover on 2 cores between 4 and 16 rows for SmolLM2's shapes.
KERNEL_MAX_ROWS = 4


class QuantizedLinearMethod(LinearMethodBase):
    """Base of the load-time methods ("int8", "int4"): float weight in, codes + scales out.

    Args:
        fallback: the method of the layers left in float (the tied head), e.g. the CPU's "hybrid" layout.
        kernel_max_rows: most rows per call that take the packed-op route (0: always dequantize).
    """

    name = "quantized"

    def __init__(self, fallback: LinearMethodBase | None = None, kernel_max_rows: int = KERNEL_MAX_ROWS):
        self.fallback = fallback or UnquantizedLinearMethod()
        self.kernel_max_rows = kernel_max_rows

    # -- what a method implements ----------------------------------------------------------------------
    @abc.abstractmethod
    def quantize(self, layer, w: torch.Tensor) -> None:
        """Store the codes and scales of `w [out, in]` (float32) on `layer`."""

    @abc.abstractmethod
    def dequantize(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """The `[out, in]` weight the codes stand for, in `dtype`."""

    @abc.abstractmethod
    def kernel(self, layer, x2: torch.Tensor) -> torch.Tensor:
        """`x2 [T, in]` -> `[T, out]` float by the packed op (the kernel route)."""

    def device_kernel(self, layer, x2: torch.Tensor) -> torch.Tensor:
        """`x2 [T, in]` on a GPU (or any non-CPU device) -> `[T, out]` in x2's dtype. Default: dequantize to
        x2's dtype and one `F.linear`; "int4" overrides it with its Triton W4A16 kernel."""
        return F.linear(x2, self.dequantize(layer, x2.dtype))

    # -- the LinearMethod interface --------------------------------------------------------------------
    def create_weights(self, layer, in_features: int, output_sizes: list[int], bias: bool) -> None:
        UnquantizedLinearMethod.create_weights(self, layer, in_features, output_sizes, bias)
        layer.quantized = False

    def process_weights_after_loading(self, layer) -> None:
        if layer.keep_rows:
            self.fallback.process_weights_after_loading(layer)
            return
        w = layer.weight.data.float()
        self.quantize(layer, w)
        del layer.weight  # the float copy goes: only the codes stay resident
        layer.quantized = True

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if not layer.quantized:
            return self.fallback.apply(layer, x)
        x2 = x.reshape(-1, layer.in_features)
        if x2.device.type != "cpu":
            y = self.device_kernel(layer, x2)
        elif x2.shape[0] <= self.kernel_max_rows:
            y = self.kernel(layer, x2).to(x.dtype)
        else:
            # The same product as the kernel's: bfloat16 activations in, float32 sums, bfloat16 out. Without
            # the two roundings a token's logits would depend on how many rows shared its step, and the
            # engine's greedy tokens would drift from the one-sequence path's at near-ties.
            y = F.linear(x2.to(torch.bfloat16).to(x.dtype), self.dequantize(layer, x.dtype))
            y = y.to(torch.bfloat16).to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def weight_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        if not layer.quantized:
            return self.fallback.weight_rows(layer, ids)
        return self.dequantize(layer, torch.float32)[ids]


def store(layer: nn.Module, name: str, t: torch.Tensor) -> None:
    """Keep `t` on `layer` as a buffer: part of `state_dict` and of `memory.resident_bytes`, but not a
    parameter, so `model.parameters()` stays the float tensors in the model's dtype (what callers read the
    model's dtype from)."""
    layer.register_buffer(name, t)
