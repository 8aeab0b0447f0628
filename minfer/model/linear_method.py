"""How a `Linear` stores its weight and computes y = x W^T + b: the `LinearMethod` seam (vLLM's
`LinearMethodBase`, gpt-fast's swapped linears).

A method has three jobs, called in this order:

    create_weights(layer, ...)            register the tensors it stores (`weight`, or `qweight`, `scales`,
                                          ...), each with a `weight_loader` that copies a checkpoint tensor in
    process_weights_after_loading(layer)  once, after loading: repack for the hardware (or quantize)
    apply(layer, x)                       the forward: x `[..., in_features]` -> `[..., out_features]`

The layer keeps its parameters, and whatever else a method needs per layer goes in `layer.method_state`
(the method's own object: a repacked copy, a slice count); a method object holds only settings, so one
instance serves every layer of a model. Quantized methods (chapter 5) and tensor-parallel ones plug in the
same way.

`UnquantizedLinearMethod` ("nn") is the textbook one: `[out, in]` as loaded, run by `F.linear`. The faster CPU
weight layouts ("split", "onednn", "panels", "hybrid") live in the CPU wing (`minfer/cpu/linear.py`); the
platform (`minfer/platform.py`) chooses one per worker.
"""


from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from minfer.model.layers import Linear


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one) of the same shape.

    A floating tensor is cast to the parameter's floating dtype; an integer parameter (quantized codes)
    takes only an integer tensor, bit for bit.

    Raises:
        ValueError: the shapes differ, a floating parameter is given an integer tensor or an integer one a
            floating tensor (names both dtypes), or a value overflows a narrower floating dtype (a bfloat16
            or float32 checkpoint loaded as float16).
    """
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    if param.dtype.is_floating_point != loaded.dtype.is_floating_point:
        raise ValueError(f"dtype mismatch: parameter {param.dtype} vs checkpoint {loaded.dtype}")
    param.data.copy_(loaded)
    # Only a cast to a narrower range can overflow (the checkpoint tensor itself was checked to be finite).
    if (param.dtype.is_floating_point and torch.finfo(param.dtype).max < torch.finfo(loaded.dtype).max
            and not bool(torch.isfinite(param).all())):
        raise ValueError(f"values beyond {param.dtype}'s range (+-{torch.finfo(param.dtype).max:g}) in this "
                         f"{loaded.dtype} tensor: load the model in float32 or bfloat16")


class LinearMethodBase(abc.ABC):
    """What every linear method implements (vLLM's interface, same names)."""

    name = "base"

    @abc.abstractmethod
    def create_weights(self, layer: "Linear", in_features: int, output_sizes: list[int], bias: bool) -> None:
        """Register the layer's parameters. Each gets a `weight_loader(param, tensor, shard=None)` attribute
        when it loads differently from `default_weight_loader`, and `num_shards` when a merged projection
        (q|k|v, gate|up) loads it from several checkpoint tensors."""

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Called once after all weights are loaded (repack, quantize, ...). Default: nothing."""

    @abc.abstractmethod
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """x `[..., in_features]` -> `[..., out_features]` in x's dtype, bias included."""

    def weight_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        """Rows `W[ids]` of the `[out, in]` matrix as floats, `[*ids.shape, in]` (a tied embedding reads
        the head through this). Raises RuntimeError where the storage cannot give rows."""
        raise RuntimeError(f"the {self.name!r} linear method cannot read weight rows")

    def fused_step_weight(self, layer: "Linear"):
        """How a fused decode step (a platform's step runner, e.g. `minfer.cpu.decode_step`) may read this
        layer's weight in place of calling `apply`, or None (the default) where it may not: the step runner
        then leaves the step to the model."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """`weight [out, in]` (+ `bias [out]`) in the model's dtype, run by `F.linear` ("nn")."""

    name = "nn"

    def create_weights(self, layer: "Linear", in_features: int, output_sizes: list[int], bias: bool) -> None:
        out = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        for p in (layer.weight, layer.bias):
            if p is not None:
                p.weight_loader = layer.weight_loader  # rows of each merged part, see Linear.weight_loader
                p.num_shards = len(output_sizes)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        return layer.weight[ids]
