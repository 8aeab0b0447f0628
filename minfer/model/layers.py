"""Building blocks of the decoder: RMSNorm, the SwiGLU MLP's activation, and the Linear seam.

The Linear seam: every projection is a `Linear` with a `weight_loader` method, the hook that copies a
checkpoint tensor into (a slice of) the parameter. Merged projections (q|k|v, gate|up) load
several checkpoint tensors into one matrix, so a forward pass runs one matmul instead of three. Later
chapters swap these modules for quantized or tensor-parallel ones with the same loader interface
(the pattern of nano-vllm and vLLM).
"""

from __future__ import annotations

import os

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


def onednn_available() -> bool:
    """True when this torch build has oneDNN's packed-weight linear (`torch.ops.mkldnn._linear_pointwise`,
    the op torch.compile's CPU backend uses for frozen weights)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Module):
    """y = x W^T + b. Loads like `nn.Linear` (`weight [out_features, in_features]`), then repacks for the CPU.

    `process_weights_after_loading` (vLLM's name for the hook) rewrites the loaded weight into one of four
    layouts, chosen once per model by the module-level function of the same name. Chapter 1 §1.7 measures
    them (`python -m minfer.bench gemv`, figures in `assets/benchmarks/gemv_cpu_2threads.json`):

    - `"nn"`: as loaded, `[out, in]`, run by `F.linear` (MKL's sgemm on a CPU). The GPU keeps this one.
    - `"split"`: built for one token at a time, where each weight matrix is one matrix-vector product bound
      by how fast the weights stream from memory. (1) The longer side is contiguous: `[in, out]`
      ("K-major") when out >= in (q|k|v, gate|up, lm_head), `[out, in]` when in > out (down_proj); MKL
      streams long rows fastest. (2) The output columns are cut into `splits` slices
      `[splits, in, out/splits]` run by one batched matmul, so each core streams its own slice (MKL runs a
      product this small on one core, and one core cannot draw the machine's bandwidth): tensor
      parallelism (chapter 7) inside one CPU.
    - `"onednn"`: oneDNN's own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`), run by
      `torch.ops.mkldnn._linear_pointwise` (what torch.compile's CPU backend does with frozen weights). On
      the AMD EPYC (Zen 4) CPUs of this course it is 1.2-2.5x faster than MKL for products of 2 to 2,000
      rows (batched decode, prefill), but slower than "split" for a single row. Its packed tensor is opaque,
      so a head whose table is also the embedding keeps a plain copy for `weight_rows` (`keep_rows`).
    - `"hybrid"` (the default for float32 on a CPU with oneDNN): both copies, "split" for one row and
      "onednn" for more. It stores the weights twice (2 x 540 MB for SmolLM2 in float32), the price of
      the fastest product at every batch size; `MINFER_LINEAR_LAYOUT=split` keeps one copy.

    `output_sizes` (for merged projections, e.g. q|k|v or gate|up) lists each part's output width; the
    checkpoint's parts are loaded one by one with `weight_loader(param, tensor, shard)`.
    """

    ONEDNN_BATCH_HINT = 64  # rows oneDNN tunes its packing for; measured equal to exact hints from 8 to 2048

    def __init__(self, in_features: int, out_features: int | None = None, bias: bool = False,
                 output_sizes: list[int] | None = None):
        super().__init__()
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        self.in_features, self.out_features = in_features, sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        self.layout = "nn"
        self.splits = 0  # the "split" layout's number of column slices
        self.k_major = self.out_features >= in_features  # the "split" layout: [in, out] slices, else [out, in]
        self.keep_rows = False  # set by TiedEmbedding: weight_rows must work whatever the layout
        self._rows: torch.Tensor | None = None  # plain [out, in] copy kept for weight_rows under "onednn"
        self._onednn: torch.Tensor | None = None  # oneDNN-packed copy under "hybrid" (not a parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., in_features]` -> `[..., out_features]`, in x's dtype."""
        if self.layout == "nn":
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        if self.layout == "onednn" or (self._onednn is not None and x2.shape[0] > 1):
            packed = self.weight if self.layout == "onednn" else self._onednn
            y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, self.bias, "none", [], "")
            return y.view(*x.shape[:-1], self.out_features)
        w = self.weight if self.k_major else self.weight.transpose(1, 2)  # [splits, in, out/splits] either way
        if self.splits == 1:
            y = x2 @ w[0]
        else:
            # [splits, T, out/splits] -> [T, out]; for a single token this is a view, not a copy.
            y = torch.bmm(x2.expand(self.splits, *x2.shape), w).transpose(0, 1).reshape(x2.shape[0], -1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def process_weights_after_loading(self, splits: int = 1, layout: str = "split") -> None:
        """Repack the loaded `[out, in]` weight into `layout` ("split", "onednn", "hybrid" or "nn"; see the
        class docstring); call once, after loading.

        `splits` (the "split" part of "split" and "hybrid") is clamped to 1 when it does not divide `out_features`.
        Raises RuntimeError if already repacked, ValueError for an unknown layout or "onednn" where this torch
        has no oneDNN or the weight is not float32.
        """
        if self.layout != "nn":
            raise RuntimeError("Linear weights are already repacked")
        if layout not in LINEAR_LAYOUTS:
            raise ValueError(f"unknown Linear layout {layout!r}: one of {', '.join(map(repr, LINEAR_LAYOUTS))}")
        if layout == "nn":
            return
        if layout in ("onednn", "hybrid"):
            if not onednn_available() or self.weight.dtype != torch.float32:
                raise ValueError(f"the {layout} layout needs a torch with oneDNN and a float32 weight")
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, self.ONEDNN_BATCH_HINT)
            if layout == "onednn":
                if self.keep_rows:
                    self._rows = self.weight.data
                self.weight = nn.Parameter(packed, requires_grad=False)
                self.layout = "onednn"
                return
            self._onednn = packed  # and the "split" copy below, for single rows
        splits = splits if splits >= 1 and self.out_features % splits == 0 else 1
        w = self.weight.data.view(splits, self.out_features // splits, self.in_features)  # [S, out/S, in]
        self.weight = nn.Parameter((w.transpose(1, 2) if self.k_major else w).contiguous(), requires_grad=False)
        self.splits, self.layout = splits, layout

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `W[ids]` of the `[out, in]` matrix, whatever the storage layout: `[*ids.shape, in]`.

        Raises RuntimeError under "onednn" unless `keep_rows` was set before repacking."""
        if self.layout == "nn":
            return self.weight[ids]
        if self.layout == "onednn":  # "hybrid" reads its "split" copy below
            if self._rows is None:
                raise RuntimeError("rows of a oneDNN-packed weight: set keep_rows before repacking")
            return self._rows[ids]
        per = self.out_features // self.splits
        s, j = ids // per, ids % per
        return self.weight[s, :, j] if self.k_major else self.weight[s, j, :]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy checkpoint part `shard` (`[out_part, in]` weight or `[out_part]` bias) into its rows."""
        if self.layout != "nn":
            raise RuntimeError("load weights before process_weights_after_loading repacks them")
        shard = shard or 0
        start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
        default_weight_loader(param.data.narrow(0, start, size), loaded)


LINEAR_LAYOUTS = ("hybrid", "onednn", "split", "nn")


def default_linear_layout(model: nn.Module) -> str:
    """The layout `process_weights_after_loading(model)` picks: `MINFER_LINEAR_LAYOUT` if set, else "nn" on a
    GPU, "hybrid" for float32 on a CPU with oneDNN, "split" otherwise. Raises ValueError for a bad override."""
    forced = os.environ.get("MINFER_LINEAR_LAYOUT")
    if forced:
        if forced not in LINEAR_LAYOUTS:
            raise ValueError(f"MINFER_LINEAR_LAYOUT={forced!r}: use one of {', '.join(LINEAR_LAYOUTS)}")
        return forced
    p = next(model.parameters())
    if p.device.type != "cpu":
        return "nn"
    return "hybrid" if p.dtype == torch.float32 and onednn_available() else "split"


def process_weights_after_loading(model: nn.Module, layout: str | None = None) -> str:
    """Repack every `Linear` of a freshly loaded model into `layout` (default: `default_linear_layout`); the
    "split" part uses one column slice per torch thread. Returns the layout used."""
    layout = layout or default_linear_layout(model)
    if layout == "nn":
        return layout
    splits = max(1, torch.get_num_threads())
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading(splits, layout)
    return layout


def MergedLinear(in_features: int, output_sizes: list[int], bias: bool = False) -> Linear:
    """One Linear whose output concatenates several checkpoint projections (one matmul instead of several)."""
    return Linear(in_features, bias=bias, output_sizes=output_sizes)


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
        return head.weight if head.layout == "nn" else head.weight_rows(torch.arange(head.out_features))

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
