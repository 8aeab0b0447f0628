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
    """y = x W^T + b. Loads like `nn.Linear` (`weight [out_features, in_features]`), then repacks for decode.

    Why repack: at batch 1 a decode step is one matrix-vector product per weight matrix, bound by how fast
    the weights stream from memory, and two facts about these CPUs decide the layout (measured per SmolLM2
    shape by `python -m minfer.bench gemv`; figures in `assets/benchmarks/gemv_cpu_2threads.json`):

    1. MKL's matrix-vector product streams a matrix fastest along long contiguous rows. So the weight is
       stored with its LONGER side contiguous: `[in, out]` (y = x @ W, "K-major") when out >= in (q|k|v,
       gate|up, lm_head: 1.3-1.9x faster than nn.Linear's `[out, in]`), `[out, in]` when in > out (down_proj).
    2. MKL runs a matrix-vector product of these sizes on ONE core, and one core cannot draw the machine's
       whole memory bandwidth. Splitting the output columns into `splits` slices `[splits, in, out/splits]`
       and multiplying them with one batched matmul lets torch hand one slice to each core: tensor
       parallelism (the idea of chapter 7) inside a single CPU. With both: 1.4-2.3x over nn.Linear on 2 cores.

    `output_sizes` (for merged projections, e.g. q|k|v or gate|up) lists each part's output width; the
    checkpoint's parts are loaded one by one with `weight_loader(param, tensor, shard)`.
    """

    def __init__(self, in_features: int, out_features: int | None = None, bias: bool = False,
                 output_sizes: list[int] | None = None):
        super().__init__()
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        self.in_features, self.out_features = in_features, sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        self.splits = 0  # 0: nn.Linear layout; >= 1: repacked into this many column slices
        self.k_major = self.out_features >= in_features  # the repacked layout: [in, out] slices, else [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., in_features]` -> `[..., out_features]`, in x's dtype."""
        if self.splits == 0:
            return F.linear(x, self.weight, self.bias)
        w = self.weight if self.k_major else self.weight.transpose(1, 2)  # [splits, in, out/splits] either way
        x2 = x.reshape(-1, self.in_features)
        if self.splits == 1:
            y = x2 @ w[0]
        else:
            # [splits, T, out/splits] -> [T, out]; for a single token this is a view, not a copy.
            y = torch.bmm(x2.expand(self.splits, *x2.shape), w).transpose(0, 1).reshape(x2.shape[0], -1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def process_weights_after_loading(self, splits: int = 1) -> None:
        """Repack the loaded `[out, in]` weight for CPU decode (see the class docstring); call once.

        `splits` is clamped to 1 when it does not divide `out_features`. Raises RuntimeError if already repacked.
        """
        if self.splits:
            raise RuntimeError("Linear weights are already repacked")
        splits = splits if splits >= 1 and self.out_features % splits == 0 else 1
        w = self.weight.data.view(splits, self.out_features // splits, self.in_features)  # [S, out/S, in]
        self.weight = nn.Parameter((w.transpose(1, 2) if self.k_major else w).contiguous(), requires_grad=False)
        self.splits = splits

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `W[ids]` of the `[out, in]` matrix, whatever the storage layout: `[*ids.shape, in]`."""
        if self.splits == 0:
            return self.weight[ids]
        per = self.out_features // self.splits
        s, j = ids // per, ids % per
        return self.weight[s, :, j] if self.k_major else self.weight[s, j, :]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy checkpoint part `shard` (`[out_part, in]` weight or `[out_part]` bias) into its rows."""
        if self.splits:
            raise RuntimeError("load weights before process_weights_after_loading repacks them")
        shard = shard or 0
        start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
        default_weight_loader(param.data.narrow(0, start, size), loaded)


def process_weights_after_loading(model: nn.Module) -> None:
    """Repack every `Linear` of a freshly loaded model for fast CPU decode, one column slice per torch thread
    (a no-op on GPUs)."""
    if next(model.parameters()).device.type != "cpu":
        return
    splits = max(1, torch.get_num_threads())
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading(splits)


def MergedLinear(in_features: int, output_sizes: list[int], bias: bool = False) -> Linear:
    """One Linear whose output concatenates several checkpoint projections (one matmul instead of several)."""
    return Linear(in_features, bias=bias, output_sizes=output_sizes)


class TiedEmbedding(nn.Module):
    """Token embedding that shares its table with the LM head (`tie_word_embeddings`).

    A lookup reads rows of the head's `[vocab, hidden]` matrix through `Linear.weight_rows`, whatever layout
    the head was repacked into: a gather of a few strided columns, nothing next to the head's full read
    every step.
    """

    def __init__(self, lm_head: Linear):
        super().__init__()
        self.lm_head = [lm_head]  # a list, so the head is not registered (and loaded) twice

    @property
    def weight(self) -> torch.Tensor:
        """The table as `nn.Embedding` would show it, `[vocab, hidden]` (a copy once the head is repacked)."""
        head = self.lm_head[0]
        return head.weight if head.splits == 0 else head.weight_rows(torch.arange(head.out_features))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head[0].weight_rows(ids)


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
