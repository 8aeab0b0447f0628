"""Building blocks of the decoder: RMSNorm, the SwiGLU MLP, the tied embedding and the `Linear` seam.

The Linear seam: every projection is a `Linear` whose storage and forward belong to a `LinearMethod`
(`minfer.model.linear_method`: the CPU layouts now, quantized and tensor-parallel methods later). Merged
projections (q|k|v, gate|up) load several checkpoint tensors into one matrix, so a forward pass runs one
matmul instead of three; each parameter's `weight_loader` knows which rows a checkpoint part goes to (the
pattern of nano-vllm and vLLM).

`BuildOptions` is what a model is built with: the linear method, and the fused element-wise kernels or None
(plain torch): the Triton ones (the Triton attention backend wants them) or the C++ CPU loops (a float32 model
on the CPU). The platform (`minfer.platform`) decides both, and the loader hands them over as objects before
the model is built, so no layer asks which device it runs on and none is patched afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minfer.model.linear_method import LinearMethodBase, UnquantizedLinearMethod, default_weight_loader


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


def check_fused_ops(ops) -> FusedOps | None:
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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
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

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, build: BuildOptions | None = None):
        super().__init__()
        build = build or BuildOptions()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias, method=build.linear_method)
        self.down_proj = Linear(intermediate, hidden, bias=bias, method=build.linear_method)
        self.act = build.fused_ops.silu_and_mul if build.fused_ops is not None else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


# Activation names of HF configs -> functions (GPT-2's "gelu_new" and BLOOM's GELU are the tanh approximation).
ACTIVATIONS = {
    "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu, "silu": F.silu,
}


def activation(name: str, source: str = "config"):
    """The function of an HF activation name. Raises ValueError for one minfer does not implement."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{source}: activation {name!r} is not supported; minfer implements {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GeluMLP(nn.Module):
    """The two-matrix feed-forward of GPT-2 and BLOOM: down(act(up(x) + b) ) + b, act usually tanh-GELU.

    `up`/`down` are the module names given (GPT-2: c_fc/c_proj; BLOOM: dense_h_to_4h/dense_4h_to_h), so the
    parameter names stay the checkpoint's."""

    def __init__(self, hidden: int, intermediate: int, act: str, names: tuple[str, str],
                 build: BuildOptions | None = None):
        super().__init__()
        build = build or BuildOptions()
        self.names = names
        setattr(self, names[0], Linear(hidden, intermediate, bias=True, method=build.linear_method))
        setattr(self, names[1], Linear(intermediate, hidden, bias=True, method=build.linear_method))
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = getattr(self, self.names[0]), getattr(self, self.names[1])
        return down(self.act(up(x)))
