"""Building blocks of the decoder: RMSNorm, the SwiGLU MLP's activation, and the Linear seam.

The Linear seam: every projection is a `Linear` with a `weight_loader` method, the hook that copies a
checkpoint tensor into (a slice of) the parameter. Merged projections (q|k|v, gate|up) load
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


class Linear(nn.Module):
    """y = x W^T + b, with W stored TRANSPOSED: `weight` is `[in_features, out_features]` ("K-major").

    Why: at batch 1 a decode step is a matrix-vector product per layer, bound by how fast the weights stream
    from memory. On these CPUs MKL streams a `[in, out]` matrix through `x @ W` about 1.5x faster than the
    `[out, in]` layout of `nn.Linear`/`F.linear` (measured: 15 vs 10 GB/s over SmolLM2's 30 layers), and on
    GPUs cuBLAS is indifferent. Checkpoints store `[out, in]`; `weight_loader` transposes once at load time.

    `output_sizes` (for merged projections, e.g. q|k|v or gate|up) lists each part's output width; the
    checkpoint's parts are loaded one by one with `weight_loader(param, tensor, shard)`.
    """

    def __init__(self, in_features: int, out_features: int | None = None, bias: bool = False,
                 output_sizes: list[int] | None = None):
        super().__init__()
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        self.in_features, self.out_features = in_features, sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(in_features, self.out_features))
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight)
        return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight).view(*x.shape[:-1], -1)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy checkpoint part `shard` (`[out_part, in]` weight or `[out_part]` bias) into its columns."""
        shard = shard or 0
        start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
        if param is self.bias:
            default_weight_loader(param.data.narrow(0, start, size), loaded)
        else:
            default_weight_loader(param.data.narrow(1, start, size), loaded.t())


def MergedLinear(in_features: int, output_sizes: list[int], bias: bool = False) -> Linear:
    """One Linear whose output concatenates several checkpoint projections (one matmul instead of several)."""
    return Linear(in_features, bias=bias, output_sizes=output_sizes)


class TiedEmbedding(nn.Module):
    """Token embedding that shares its table with the LM head (`tie_word_embeddings`).

    The head stores `[hidden, vocab]` (K-major, see `Linear`); a lookup reads rows of its transpose, a strided
    gather of a few columns, which costs nothing next to the head's full read every step.
    """

    def __init__(self, lm_head: Linear):
        super().__init__()
        self.lm_head = [lm_head]  # a list, so the head is not registered (and loaded) twice

    @property
    def weight(self) -> torch.Tensor:
        """The table as `nn.Embedding` would show it, `[vocab, hidden]` (a view of the head's weight)."""
        return self.lm_head[0].weight.t()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer, 2020): x `[T, 2I]` = gate|up -> silu(gate) * up `[T, I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate|up merged into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
