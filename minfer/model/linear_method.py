"""How a `Linear` stores its weight and computes y = x W^T + b: the `LinearMethod` seam (vLLM's
`LinearMethodBase`, gpt-fast's swapped linears).

A method has three jobs, called in this order:

    create_weights(layer, ...)            register the tensors it stores (`weight`, or `qweight`, `scales`,
                                          ...), each with a `weight_loader` that copies a checkpoint tensor in
    process_weights_after_loading(layer)  once, after loading: repack for the hardware (or quantize)
    apply(layer, x)                       the forward: x `[..., in_features]` -> `[..., out_features]`

The layer keeps the state (its parameters); a method object holds only settings, so one instance serves
every layer of a model. Quantized methods (chapter 5) and tensor-parallel ones plug in the same way.

The unquantized methods here are the CPU weight layouts that chapter 1 §1.7 measures
(`python -m minfer.bench gemv`, figures in `assets/benchmarks/gemv_cpu_2threads.json`):

- `"nn"` (`UnquantizedLinearMethod`): as loaded, `[out, in]`, run by `F.linear` (MKL's sgemm on a CPU).
  The GPU keeps this one.
- `"split"`: built for one token at a time, where each weight matrix is one matrix-vector product bound
  by how fast the weights stream from memory. (1) The longer side is contiguous: `[in, out]` ("K-major")
  when out >= in (q|k|v, gate|up, lm_head), `[out, in]` when in > out (down_proj); MKL streams long rows
  fastest. (2) The output columns are cut into `splits` slices `[splits, in, out/splits]` run by one
  batched matmul, so each core streams its own slice (MKL runs a product this small on one core, and one
  core cannot draw the machine's bandwidth): tensor parallelism inside one CPU.
- `"onednn"`: oneDNN's own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`), run by
  `torch.ops.mkldnn._linear_pointwise` (what torch.compile's CPU backend does with frozen weights). On the
  AMD EPYC (Zen 4) CPUs of this course it is 1.2-2.5x faster than MKL for products of 2 to 2,000 rows
  (batched decode, prefill), but slower than "split" for a single row. Its packed tensor is opaque, so a
  head whose table is also the embedding keeps a plain copy for `weight_rows` (`layer.keep_rows`).
- `"panels"` (float32): `[ceil(out/16), in, 16]`, run by minfer's own few-row kernel
  (`minfer.kernels.gemm_f32_cpu`): each 64-byte line of weights feeds the FMAs of up to 16 rows while the
  next lines are prefetched, so a decode step of 1-16 rows streams the weights once at close to the memory's
  rate (chapter 9 §9.2.6: a 16-row step's linears 34 ms against oneDNN's 42, one row 20 ms against 33).
- `"hybrid"` (the default for float32 and bfloat16 on a CPU with oneDNN): two copies, a few-row one ("panels"
  for float32 where its kernel builds, else "split") for up to 16 rows (one for "split"), and "onednn" for
  more. It stores the weights twice (2 x 540 MB for SmolLM2 in float32), the price of the fastest product at
  every batch size; `MINFER_LINEAR_LAYOUT=split` (or `panels`) keeps one copy.
"""

from __future__ import annotations

import abc
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minfer.kernels.gemm_f32_cpu import gemm_f32_available, gemm_f32_unchecked, pack_weight, unpack_rows

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


def onednn_available() -> bool:
    """True when this torch build has oneDNN's packed-weight linear (`torch.ops.mkldnn._linear_pointwise`,
    the op torch.compile's CPU backend uses for frozen weights)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


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


class SplitLinearMethod(UnquantizedLinearMethod):
    """The "split" CPU layout (module docstring): `[splits, in, out/splits]` (K-major, when out >= in) or
    `[splits, out/splits, in]`, one batched matmul. `splits=None`: one slice per torch thread, decided when
    the weights are repacked; a count that does not divide `out_features` becomes 1 for that layer."""

    name = "split"
    max_rows = 1  # built for one row (under "hybrid", more rows go to oneDNN)

    def __init__(self, splits: int | None = None):
        self.splits = splits

    def process_weights_after_loading(self, layer: "Linear") -> None:
        splits = self.splits or max(1, torch.get_num_threads())
        splits = splits if splits >= 1 and layer.out_features % splits == 0 else 1
        w = layer.weight.data.view(splits, layer.out_features // splits, layer.in_features)  # [S, out/S, in]
        layer.weight = nn.Parameter((w.transpose(1, 2) if layer.k_major else w).contiguous(), requires_grad=False)
        layer.splits = splits

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, layer.in_features)
        w = layer.weight if layer.k_major else layer.weight.transpose(1, 2)  # [splits, in, out/splits] either way
        if layer.splits == 1:
            y = x2 @ w[0]
        else:
            # [splits, T, out/splits] -> [T, out]; for a single token this is a view, not a copy.
            y = torch.bmm(x2.expand(layer.splits, *x2.shape), w).transpose(0, 1).reshape(x2.shape[0], -1)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        per = layer.out_features // layer.splits
        s, j = ids // per, ids % per
        return layer.weight[s, :, j] if layer.k_major else layer.weight[s, j, :]


ONEDNN_BATCH_HINT = 64  # rows oneDNN tunes its packing for; measured equal to exact hints from 8 to 2048


def _onednn_pack(layer: "Linear", name: str) -> torch.Tensor:
    """oneDNN's packed copy of the layer's `[out, in]` float32 or bfloat16 weight (bfloat16: oneDNN's AVX512-BF16 /
    AMX kernels where the CPU has them). Raises ValueError where it cannot be."""
    if not onednn_available() or layer.weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the {name} layout needs a torch with oneDNN and a float32 or bfloat16 weight")
    return torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, ONEDNN_BATCH_HINT)


def _onednn_apply(layer: "Linear", x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, layer.in_features).contiguous(), packed, layer.bias,
                                           "none", [], "")
    return y.view(*x.shape[:-1], layer.out_features)


class OneDNNLinearMethod(UnquantizedLinearMethod):
    """The "onednn" CPU layout (module docstring). A layer with `keep_rows` keeps its plain `[out, in]`
    copy (`layer.rows`) for `weight_rows`."""

    name = "onednn"

    def process_weights_after_loading(self, layer: "Linear") -> None:
        packed = _onednn_pack(layer, self.name)
        if layer.keep_rows:
            layer.rows = layer.weight.data
        layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return _onednn_apply(layer, x, layer.weight)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        if layer.rows is None:
            raise RuntimeError("rows of a oneDNN-packed weight: set keep_rows before repacking")
        return layer.rows[ids]


class PanelLinearMethod(UnquantizedLinearMethod):
    """The "panels" CPU layout (module docstring): float32 `[ceil(out/16), in, 16]`, run by the few-row C++
    kernel of `minfer.kernels.gemm_f32_cpu` (for any number of rows, but built for up to `max_rows`)."""

    name = "panels"
    max_rows = 16  # the rows measured in the engine (a 16-row step's linears 34 ms against oneDNN's 42, §9.2.6)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        if layer.weight.dtype != torch.float32 or not gemm_f32_available():
            raise ValueError(f"the {self.name} layout needs a float32 weight and the C++ kernel built here")
        layer.weight = nn.Parameter(pack_weight(layer.weight.data), requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return gemm_f32_unchecked(x, layer.weight, layer.out_features, layer.bias)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        return unpack_rows(layer.weight, ids, layer.out_features)


class HybridLinearMethod(UnquantizedLinearMethod):
    """The "hybrid" CPU layout (module docstring): a few-row copy (`layer.few_rows` says which: "panels" for
    float32 where its kernel builds, else "split") for up to its `max_rows` rows, oneDNN's (`layer.packed`, not
    a parameter) for more."""

    name = "hybrid"

    def process_weights_after_loading(self, layer: "Linear") -> None:
        layer.packed = _onednn_pack(layer, self.name)
        panels = layer.weight.dtype == torch.float32 and gemm_f32_available()
        layer.few_rows = PanelLinearMethod() if panels else SplitLinearMethod()
        layer.few_rows.process_weights_after_loading(layer)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if x.numel() > layer.few_rows.max_rows * layer.in_features:
            return _onednn_apply(layer, x, layer.packed)
        return layer.few_rows.apply(layer, x)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        return layer.few_rows.weight_rows(layer, ids)


LINEAR_METHODS = {"hybrid": HybridLinearMethod, "onednn": OneDNNLinearMethod, "split": SplitLinearMethod,
                  "panels": PanelLinearMethod, "nn": UnquantizedLinearMethod}


def get_linear_method(name: str) -> LinearMethodBase:
    """The method called `name` (a key of `LINEAR_METHODS`). Raises ValueError for another name."""
    if name not in LINEAR_METHODS:
        raise ValueError(f"unknown Linear layout {name!r}: one of {', '.join(map(repr, LINEAR_METHODS))}")
    return LINEAR_METHODS[name]()


def default_linear_method(device: torch.device | str, dtype: torch.dtype) -> LinearMethodBase:
    """`MINFER_LINEAR_LAYOUT` if set, else "nn" on a GPU, "hybrid" for float32 or bfloat16 on a CPU with oneDNN,
    "split" otherwise. Raises ValueError for a bad override.

    bfloat16 took "split" (a batched matmul) until issue 18's profile of a bfloat16 server: there the linears of
    a 16-row decode step ran at 6-52 GFLOP/s through `bmm`, oneDNN's packed bfloat16 product at 74-240
    (`benchmarks/wave_profile.py`, chapter 9 §9.2.5)."""
    forced = os.environ.get("MINFER_LINEAR_LAYOUT")
    if forced:
        if forced not in LINEAR_METHODS:
            raise ValueError(f"MINFER_LINEAR_LAYOUT={forced!r}: use one of {', '.join(LINEAR_METHODS)}")
        return get_linear_method(forced)
    if torch.device(device).type != "cpu":
        return UnquantizedLinearMethod()
    if dtype in (torch.float32, torch.bfloat16) and onednn_available():
        return HybridLinearMethod()
    return SplitLinearMethod()
