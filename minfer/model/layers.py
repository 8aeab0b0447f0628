"""Building blocks of the decoder: RMSNorm, the SwiGLU MLP, the tied embedding and the `Linear` seam.

The Linear seam: every projection is a `Linear` whose storage and forward belong to a `LinearMethod`
(below; the CPU layouts, quantized and tensor-parallel methods plug in the same way). Merged
projections (q|k|v, gate|up) load several checkpoint tensors into one matrix, so a forward pass runs one
matmul instead of three; each parameter's `weight_loader` knows which rows a checkpoint part goes to (the
pattern of nano-vllm and vLLM).

`BuildOptions` is what a model is built with: the linear method, and the fused element-wise kernels or None
(plain torch): the Triton ones (the Triton attention backend wants them) or the C++ CPU loops (a float32 model
on the CPU). The platform (`minfer.platform`) decides both, and the loader hands them over as objects before
the model is built, so no layer asks which device it runs on and none is patched afterwards.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# -- the LinearMethod seam ----------------------------------------------------------------------------------
# How a `Linear` stores its weight and computes y = x W^T + b (vLLM's `LinearMethodBase`, gpt-fast's swapped
# linears).
# How a `Linear` stores its weight and computes y = x W^T + b: the `LinearMethod` seam (vLLM's
# `LinearMethodBase`, gpt-fast's swapped linears).
#
# A method has three jobs, called in this order:
#
#     create_weights(layer, ...)            register the tensors it stores (`weight`, or `qweight`, `scales`,
#                                           ...), each with a `weight_loader` that copies a checkpoint tensor in
#     process_weights_after_loading(layer)  once, after loading: repack for the hardware (or quantize)
#     apply(layer, x)                       the forward: x `[..., in_features]` -> `[..., out_features]`
#
# The layer keeps its parameters, and whatever else a method needs per layer goes in `layer.method_state`
# (the method's own object: a repacked copy, a slice count); a method object holds only settings, so one
# instance serves every layer of a model. Quantized methods (chapter 5) and tensor-parallel ones plug in the
# same way.
#
# `UnquantizedLinearMethod` ("nn") is the textbook one: `[out, in]` as loaded, run by `F.linear`. The faster CPU
# weight layouts ("split", "onednn", "panels", "hybrid") live in the CPU wing (`minfer/cpu/linear.py`); the
# platform (`minfer/platform.py`) chooses one per worker.

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

    def fused_step_weight(self, layer: "Linear") -> Any:
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


class FusedOps(Protocol):
    """Fused element-wise kernels a model may be built with (`BuildOptions.fused_ops`), each with the contract of
    the torch code it replaces. The platform hands one over: the Triton kernels of `minfer.kernels`, or the CPU
    wing's C++ loops `minfer.cpu.fused_ops` (both modules fit)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """`RMSNorm` of x `[T, H]`: new memory."""
        ...

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): new memory, inputs untouched."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., 2I]` = gate|up -> silu(gate) * up `[..., I]`."""
        ...

    def apply_rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q `[T, H, D]` and k `[T, KVH, D]` in place (rotate-half layout); returns them."""
        ...


FUSED_OP_NAMES = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary_")


def check_fused_ops(ops: Any) -> FusedOps | None:
    """`ops` if it is None or has every op of `FusedOps`. Raises TypeError otherwise (a name such as "cpu" or a
    bool: the platform's `fused_ops()` turns those into the kernels)."""
    if ops is None or all(callable(getattr(ops, n, None)) for n in FUSED_OP_NAMES):
        return ops
    raise TypeError(f"fused ops must be None or an object with {', '.join(FUSED_OP_NAMES)} (what "
                    f"minfer.platform's Platform.fused_ops() returns), got {ops!r}")


@dataclass(frozen=True)
class BuildOptions:
    """How a model's layers are built.

    Attributes:
        linear_method: the `LinearMethod` of every `Linear` (one object shared by all layers).
        fused_ops: the kernels RMSNorm (with the residual add), SiLU-and-mul and RoPE run as (`FusedOps`), or
            None: plain torch. The platform (`minfer.platform`) picks it.

    Raises:
        TypeError: `fused_ops` is neither None nor a `FusedOps`.
    """

    linear_method: LinearMethodBase = field(default_factory=UnquantizedLinearMethod)
    fused_ops: FusedOps | None = None

    def __post_init__(self):
        check_fused_ops(self.fused_ops)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 (Zhang & Sennrich, 2019).

    `forward(x, residual)` also fuses the residual add: returns (norm(x + residual), x + residual), the
    shape of vLLM's fused kernel, so the fused versions (`fused`, a `FusedOps`) replace it one for one.
    """

    def __init__(self, dim: int, eps: float = 1e-6, fused: FusedOps | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = check_fused_ops(fused) is not None
        if fused is not None:
            self._kernels = (fused.rms_norm, fused.fused_add_rms_norm)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            norm, add_norm = self._kernels
            return norm(x, self.weight, self.eps) if residual is None else add_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class Linear(nn.Module):
    """y = x W^T + b for `W [out_features, in_features]`, stored and computed by `method` (default "nn").

    Args:
        in_features: input width. out_features: output width (or give `output_sizes`).
        bias: add a bias `[out_features]`.
        output_sizes: for merged projections (q|k|v, gate|up), each part's output width; the checkpoint's
            parts load one by one with `weight_loader(param, tensor, shard)`.
        method: a `LinearMethodBase` (default, or "nn": `UnquantizedLinearMethod`). A CPU layout is an object
            of the CPU wing (`minfer.platform.get_linear_method(name)`).

    After loading, `process_weights_after_loading()` lets the method repack (or quantize) the weights, once.
    """

    def __init__(self, in_features: int, out_features: int | None = None, bias: bool = False,
                 output_sizes: list[int] | None = None, method: LinearMethodBase | str | None = None):
        super().__init__()
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        self.in_features, self.out_features = in_features, sum(self.output_sizes)
        if isinstance(method, str):
            if method != "nn":
                raise ValueError(f"unknown Linear layout {method!r}: the model knows 'nn'; a CPU layout is a method "
                                 "object (minfer.platform.get_linear_method)")
            method = UnquantizedLinearMethod()
        self.method = method or UnquantizedLinearMethod()
        self.keep_rows = False  # set by TiedEmbedding: weight_rows must work whatever the layout
        self.method_state = None  # what the method keeps per layer beside the parameters (its own object)
        self.weights_processed = False
        self.method.create_weights(self, in_features, self.output_sizes, bias)

    @property
    def layout(self) -> str:
        """The method's name ("nn", "split", "onednn", "hybrid", or a quantization method's)."""
        return self.method.name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., in_features]` -> `[..., out_features]`, in x's dtype."""
        return self.method.apply(self, x)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Let the method repack the loaded weights (once). Raises RuntimeError if already done, ValueError
        where the method cannot run on these weights (e.g. "onednn" without oneDNN or float32)."""
        if self.weights_processed:
            raise RuntimeError("Linear weights are already repacked")
        self.method.process_weights_after_loading(self)
        self.weights_processed = True

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `W[ids]` of the `[out, in]` matrix, whatever the storage layout: `[*ids.shape, in]`.

        Raises RuntimeError under "onednn" unless `keep_rows` was set before repacking."""
        return self.method.weight_rows(self, ids)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy checkpoint part `shard` (`[out_part, ...]`: a weight's rows or a bias's entries) into its rows.

        Raises RuntimeError after repacking, ValueError on a shape or dtype mismatch."""
        if self.weights_processed:
            raise RuntimeError("load weights before process_weights_after_loading repacks them")
        shard = shard or 0
        start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
        default_weight_loader(param.data.narrow(0, start, size), loaded)


def process_weights_after_loading(model: nn.Module) -> str:
    """Call `process_weights_after_loading` of every `Linear` of a freshly loaded model. Returns the name of
    the first Linear's method (the model's layout, for logs)."""
    name = "none"
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()
            name = module.layout if name == "none" else name
    return name


def MergedLinear(in_features: int, output_sizes: list[int], bias: bool = False,
                 method: LinearMethodBase | None = None) -> Linear:
    """One Linear whose output concatenates several checkpoint projections (one matmul instead of several)."""
    return Linear(in_features, bias=bias, output_sizes=output_sizes, method=method)


class TiedEmbedding(nn.Module):
    """Token embedding that shares its table with the LM head (`tie_word_embeddings`).

    A lookup reads rows of the head's `[vocab, hidden]` matrix through `Linear.weight_rows`, whatever layout
    the head was repacked into: under "split" a gather of a few strided columns of the one shared table;
    under "onednn", whose packed table cannot be indexed, rows of a plain copy the head keeps for this
    (`keep_rows`; the table is then stored twice, 113 MB more for SmolLM2 in float32).
    """

    def __init__(self, lm_head: Linear):
        super().__init__()
        self.lm_head = [lm_head]  # a list, so the head is not registered (and loaded) twice
        lm_head.keep_rows = True

    @property
    def weight(self) -> torch.Tensor:
        """The table as `nn.Embedding` would show it, `[vocab, hidden]` (a copy under the "split" layout)."""
        head = self.lm_head[0]
        if head.layout == "nn":
            return head.weight
        return head.weight_rows(torch.arange(head.out_features, device=head.weight.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head[0].weight_rows(ids)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer, 2020): x `[T, 2I]` = gate|up -> silu(gate) * up `[T, I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate|up merged into one matmul."""

    def __init__(self, hidden: int, intermediate_size: int, bias: bool = False, build: BuildOptions | None = None):
        super().__init__()
        build = build or BuildOptions()
        self.gate_up_proj = MergedLinear(hidden, [intermediate_size, intermediate_size], bias=bias, method=build.linear_method)
        self.down_proj = Linear(intermediate_size, hidden, bias=bias, method=build.linear_method)
        self.act = build.fused_ops.silu_and_mul if build.fused_ops is not None else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
