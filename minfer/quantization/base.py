"""What the weight-quantization methods share: a `LinearMethod` that loads the checkpoint's float weight,
quantizes it once in `process_weights_after_loading`, and then runs one route per device:

- on the CPU (kernels="auto", where the C++ kernel builds): the CPU wing's integer GEMM (`minfer.cpu.qgemm`, handed
  over as `cpu_kernel` by the platform) at EVERY batch
  size. The codes are packed once at load into its tiled layout (the same bytes: 1 or 0.5 byte per weight
  plus the scales), the activations are quantized per call to int8 blocks of 32, and a register-tiled
  micro-kernel sums u8 x s8 products (AVX-512 VNNI or AVX2). One code path for every T keeps a row's result
  batch-invariant, and no call expands the weight to floats. Measured against oneDNN's float32 sgemm on
  SmolLM2's shapes (chapter 5 §5.3, assets/benchmarks/qgemm_kernel_cpu.json): 1.8-4.7x faster at 16-512 rows
  on 2 cores, and reading 4-7x fewer bytes at 1 row. The price is the activation rounding to 8 bits per block
  of 32 (chapter 5 §5.9 measures the perplexity: int8 +0.31% against float32).
- where the kernel does not build (no compiler), or with kernels="reference": the older routes, torch's packed CPU
  ops on bfloat16 activations at <= `kernel_max_rows` rows, else one dequantize + `F.linear` with the same
  bfloat16 roundings;
- other devices: `device_kernel` (dequantize + `F.linear`; int4's Triton W4A16 kernel on a GPU).

A tied LM head (`layer.keep_rows`, the embedding reads its rows) stays in the model's float layout, as in
vLLM, where the LM head is not quantized unless asked. (Measured, chapter 5 §5.3: as int8 codes through the
integer GEMM its product would be 6x faster at 1 row; not routed, since the embedding would then need the
float table kept beside the codes.)
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from minfer.model.layers import LinearMethodBase, UnquantizedLinearMethod

# Where the integer GEMM does not build: most rows that take torch's packed ops; above, the dequantize route.
# Measured crossover on 2 cores between 4 and 16 rows for SmolLM2's shapes.
KERNEL_MAX_ROWS = 4


class QuantizedLinearMethod(LinearMethodBase):
    """Base of the load-time methods ("int8", "int4"): float weight in, codes + scales out.

    Args:
        fallback: the method of the layers left in float (the tied head), e.g. the CPU's "hybrid" layout.
        kernel_max_rows: without the integer GEMM, most rows per call that take the packed-op route (0: always
            dequantize).
        cpu_kernel: the CPU wing's integer GEMM (`minfer.cpu.linear.CpuQuantKernels`, handed over by the
            platform under kernels="auto"): CPU layers are packed for it where it builds. None (the default,
            and kernels="reference"): the torch routes only.
    """

    name = "quantized"

    def __init__(self, fallback: LinearMethodBase | None = None, kernel_max_rows: int = KERNEL_MAX_ROWS,
                 cpu_kernel=None):
        self.fallback = fallback or UnquantizedLinearMethod()
        self.kernel_max_rows = kernel_max_rows
        self.cpu_kernel = cpu_kernel

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

    @abc.abstractmethod
    def pack_for_cpu(self, layer):
        """The layer's codes and scales (the method's own buffers) -> the integer GEMM's `PackedWeight`
        (`self.cpu_kernel.pack`), or None where this layer cannot take it."""

    # Buffers of the method's own layout that the packed copy replaces (dropped after packing).
    unpacked_buffers: tuple[str, ...] = ()

    def maybe_pack(self, layer) -> None:
        """On a CPU with the integer GEMM built (and `cpu_kernel`): repack the layer's codes for it, once, and
        drop the method's own layout (the same bytes are kept once). Sets `layer.qg_format` (None: not packed)."""
        layer.qg_format = None
        device = getattr(layer, self.unpacked_buffers[0]).device
        if not (self.cpu_kernel and device.type == "cpu" and self.cpu_kernel.available()):
            return
        w = self.pack_for_cpu(layer)
        if w is None:
            return
        for name in self.unpacked_buffers:
            if hasattr(layer, name):
                delattr(layer, name)
        self.cpu_kernel.store(layer, w)

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
        if getattr(layer, "qg_format", None) is not None and x2.device.type == "cpu":
            y = self.cpu_kernel.matmul(layer, x2).to(x.dtype)
        elif x2.device.type != "cpu":
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

    def fused_step_weight(self, layer):
        """The integer GEMM's `PackedWeight` of a packed layer without bias whose forward is this class's
        `apply` (one kernel call), else None."""
        if (layer.bias is not None or not layer.quantized or getattr(layer, "qg_format", None) is None
                or type(self).apply is not QuantizedLinearMethod.apply):
            return None
        return self.cpu_kernel.packed(layer)

    def weight_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        if not layer.quantized:
            return self.fallback.weight_rows(layer, ids)
        if getattr(layer, "qg_format", None) is not None:  # only the rows asked for are expanded
            return self.cpu_kernel.dequantize_rows(layer, ids)
        return self.dequantize(layer, torch.float32)[ids]


def store(layer: nn.Module, name: str, t: torch.Tensor) -> None:
    """Keep `t` on `layer` as a buffer: part of `state_dict` and of `memory.resident_bytes`, but not a
    parameter, so `model.parameters()` stays the float tensors in the model's dtype (what callers read the
    model's dtype from)."""
    layer.register_buffer(name, t)
