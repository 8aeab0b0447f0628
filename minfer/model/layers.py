"""Building blocks of the decoder: RMSNorm, the SwiGLU MLP's activation, and the Linear seam.

The Linear seam: every projection is a `torch.nn.Linear`; a merged one has a `weight_loader` method, the hook that
copies a checkpoint tensor into (a slice of) the parameter. Merged projections (q|k|v, gate|up) load
several checkpoint tensors into one matrix, so a forward pass runs one matmul instead of three. Later
chapters swap these modules for quantized or tensor-parallel ones with the same loader interface
(the pattern of nano-vllm and vLLM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 (Zhang & Sennrich, 2019).

    `forward(x, residual)` also fuses the residual add: returns (norm(x + residual), x + residual), the
    shape of vLLM's fused kernel, so the Triton version can replace it one for one.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape.

    Raises:
        ValueError: the shapes differ (names both shapes).
    """
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class MergedLinear(nn.Linear):
    """One Linear whose output is the concatenation of several checkpoint projections.

    `output_sizes` lists each part's rows, e.g. [H*D, KVH*D, KVH*D] for q|k|v. The checkpoint's tensors are
    loaded one by one with `weight_loader(param, tensor, shard)`, `shard` the part's index.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        """Copy checkpoint part `shard` into its rows of `param` (this module's weight or bias)."""
        start = sum(self.output_sizes[:shard])
        default_weight_loader(param.data.narrow(0, start, self.output_sizes[shard]), loaded)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer, 2020): x `[T, 2I]` = gate|up -> silu(gate) * up `[T, I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate|up merged into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
