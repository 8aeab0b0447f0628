"""The CPU's float weight layouts: `LinearMethod`s that chapter 1 §1.7 and chapter 9 §9.2.6 measure
(`python -m minfer.bench gemv`, figures in `assets/benchmarks/gemv_cpu_2threads.json`). The platform
(`minfer.platform.CpuPlatform`) picks one for every `Linear` of a model; `kernels="reference"` keeps
`UnquantizedLinearMethod` ("nn": `[out, in]` as loaded, run by `F.linear`).

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
  (`minfer.cpu.gemm_f32`): each 64-byte line of weights feeds the FMAs of up to 16 rows while the
  next lines are prefetched, so a decode step of 1-16 rows streams the weights once at close to the memory's
  rate (faster than oneDNN's for 1 to 16 rows: lab notes 9b (chapters/lab/09b-cpu-performance.md) §9b.6). Past
  16 rows, where the library is built for AVX-512, a tile of 8 rows x 48 features in registers (§9b.17).
- `"hybrid"` (the default for float32 and bfloat16 on a CPU with oneDNN): two copies, a few-row one ("panels"
  for float32 where its kernel builds, else "split") for up to `PanelLinearMethod.max_rows` rows (16, or 256
  with the AVX-512 many-row tile; one for "split"), and "onednn" for
  more. It stores the weights twice (2 x 540 MB for SmolLM2 in float32), the price of the fastest product at
  every batch size; `envs.MINFER_LINEAR_LAYOUT`=split (or `panels`) keeps one copy (an override for benchmarks,
  read by `minfer.platform`).

What a layout keeps beside the layer's `weight` parameter is its per-layer state, `layer.method_state`
(`SplitState`, `OneDNNState`, `HybridState`); the `Linear` itself carries no layout fields.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from minfer.cpu.gemm_f32 import gemm_f32_available, gemm_f32_unchecked, pack_weight, unpack_rows
from minfer.cpu.gemm_f32 import max_rows as gemm_f32_max_rows
from minfer.model.layers import UnquantizedLinearMethod

if TYPE_CHECKING:
    from minfer.model.layers import Linear


def onednn_available() -> bool:
    """True when this torch build has oneDNN's packed-weight linear (`torch.ops.mkldnn._linear_pointwise`,
    the op torch.compile's CPU backend uses for frozen weights)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@functools.lru_cache(maxsize=None)
def onednn_supports(dtype: torch.dtype) -> bool:
    """True when oneDNN can pack and multiply a `dtype` weight on this CPU: float32 wherever oneDNN is built in;
    bfloat16 only where the CPU has the instructions oneDNN's bfloat16 path needs (AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; an AVX2-only CPU has neither). Probed once per dtype by packing a tiny weight."""
    if not onednn_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


@dataclass
class SplitState:
    """A "split" layer's layout: `k_major` (`[splits, in, out/splits]`, else `[splits, out/splits, in]`) and the
    number of column slices."""

    k_major: bool
    splits: int


class SplitLinearMethod(UnquantizedLinearMethod):
    """The "split" CPU layout (module docstring): `[splits, in, out/splits]` (K-major, when out >= in) or
    `[splits, out/splits, in]`, one batched matmul. `splits=None`: one slice per torch thread, decided when
    the weights are repacked; a count that does not divide `out_features` becomes 1 for that layer."""

    name = "split"
    max_rows = 1  # built for one row (under "hybrid", more rows go to oneDNN)

    def __init__(self, splits: int | None = None):
        self.splits = splits

    def process_weights_after_loading(self, layer: "Linear") -> None:
        layer.method_state = self.repack(layer)

    def repack(self, layer: "Linear") -> SplitState:
        """Repack `layer.weight` in place into this layout; returns the layer's `SplitState`."""
        splits = self.splits or max(1, torch.get_num_threads())
        splits = splits if splits >= 1 and layer.out_features % splits == 0 else 1
        st = SplitState(k_major=layer.out_features >= layer.in_features, splits=splits)
        w = layer.weight.data.view(splits, layer.out_features // splits, layer.in_features)  # [S, out/S, in]
        layer.weight = nn.Parameter((w.transpose(1, 2) if st.k_major else w).contiguous(), requires_grad=False)
        return st

    def apply(self, layer: "Linear", x: torch.Tensor, st: SplitState | None = None) -> torch.Tensor:
        st = st or layer.method_state
        x2 = x.reshape(-1, layer.in_features)
        w = layer.weight if st.k_major else layer.weight.transpose(1, 2)  # [splits, in, out/splits] either way
        if st.splits == 1:
            y = x2 @ w[0]
        else:
            # [splits, T, out/splits] -> [T, out]; for a single token this is a view, not a copy.
            y = torch.bmm(x2.expand(st.splits, *x2.shape), w).transpose(0, 1).reshape(x2.shape[0], -1)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor, st: SplitState | None = None) -> torch.Tensor:
        st = st or layer.method_state
        per = layer.out_features // st.splits
        s, j = ids // per, ids % per
        return layer.weight[s, :, j] if st.k_major else layer.weight[s, j, :]


ONEDNN_BATCH_HINT = 64  # rows oneDNN tunes its packing for; measured equal to exact hints from 8 to 2048


def _onednn_pack(layer: "Linear", name: str) -> torch.Tensor:
    """oneDNN's packed copy of the layer's `[out, in]` float32 or bfloat16 weight (bfloat16: oneDNN's AVX512-BF16 /
    AMX kernels where the CPU has them). Raises ValueError where it cannot be."""
    if not onednn_supports(layer.weight.dtype):
        raise ValueError(f"the {name} layout needs a torch with oneDNN and a float32 weight, or a bfloat16 weight on "
                         f"a CPU with oneDNN's bfloat16 instructions (AVX512-BW/VL/DQ or AVX-NE-CONVERT); this "
                         f"weight is {layer.weight.dtype}")
    return torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, ONEDNN_BATCH_HINT)


def _onednn_apply(layer: "Linear", x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, layer.in_features).contiguous(), packed, layer.bias,
                                           "none", [], "")
    return y.view(*x.shape[:-1], layer.out_features)


@dataclass
class OneDNNState:
    """A "onednn" layer's plain `[out, in]` copy for `weight_rows` (kept only where `layer.keep_rows`)."""

    rows: torch.Tensor | None


class OneDNNLinearMethod(UnquantizedLinearMethod):
    """The "onednn" CPU layout (module docstring). A layer with `keep_rows` keeps its plain `[out, in]`
    copy (`OneDNNState.rows`) for `weight_rows`."""

    name = "onednn"

    def process_weights_after_loading(self, layer: "Linear") -> None:
        packed = _onednn_pack(layer, self.name)
        layer.method_state = OneDNNState(rows=layer.weight.data if layer.keep_rows else None)
        layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return _onednn_apply(layer, x, layer.weight)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        if layer.method_state.rows is None:
            raise RuntimeError("rows of a oneDNN-packed weight: set keep_rows before repacking")
        return layer.method_state.rows[ids]


@dataclass(frozen=True)
class Panels:
    """How a fused step reads a float32 "panels" weight (`LinearMethodBase.fused_step_weight`): the panels
    `[ceil(n/16), k, 16]` (`minfer.cpu.gemm_f32`), the output width n, and the most rows the layer's own
    forward runs on them."""

    panels: torch.Tensor
    n: int
    max_rows: int


class PanelLinearMethod(UnquantizedLinearMethod):
    """The "panels" CPU layout (module docstring): float32 `[ceil(out/16), in, 16]`, run by the few-row C++
    kernel of `minfer.cpu.gemm_f32` (for any number of rows, but built for up to `max_rows`)."""

    name = "panels"

    @property
    def max_rows(self) -> int:
        """Up to here it beats oneDNN's product in the engine (`minfer.cpu.gemm_f32.max_rows`: 16, or 256 with the
        AVX-512 many-row tile; lab notes 9b (chapters/lab/09b-cpu-performance.md) §9b.6, §9b.17)."""
        return gemm_f32_max_rows()

    def process_weights_after_loading(self, layer: "Linear") -> None:
        self.repack(layer)

    def repack(self, layer: "Linear") -> None:
        """Repack `layer.weight` in place into panels (no per-layer state). Raises ValueError where it cannot."""
        if layer.weight.dtype != torch.float32 or not gemm_f32_available():
            raise ValueError(f"the {self.name} layout needs a float32 weight and the C++ kernel built here")
        layer.weight = nn.Parameter(pack_weight(layer.weight.data), requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor, st=None) -> torch.Tensor:
        return gemm_f32_unchecked(x, layer.weight, layer.out_features, layer.bias)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor, st=None) -> torch.Tensor:
        return unpack_rows(layer.weight, ids, layer.out_features)

    def fused_step_weight(self, layer: "Linear") -> Panels | None:
        return None if layer.bias is not None else Panels(layer.weight, layer.out_features, self.max_rows)


@dataclass
class HybridState:
    """A "hybrid" layer's two copies: oneDNN's packed one (not a parameter), and the method of the few-row copy
    (in `layer.weight`: "panels" or "split") with that copy's own state."""

    packed: torch.Tensor
    few_rows: SplitLinearMethod | PanelLinearMethod
    few_state: SplitState | None


class HybridLinearMethod(UnquantizedLinearMethod):
    """The "hybrid" CPU layout (module docstring): a few-row copy ("panels" for float32 where its kernel builds,
    else "split") for up to its `max_rows` rows, oneDNN's for more (`HybridState`)."""

    name = "hybrid"

    def process_weights_after_loading(self, layer: "Linear") -> None:
        packed = _onednn_pack(layer, self.name)
        few = PanelLinearMethod() if layer.weight.dtype == torch.float32 and gemm_f32_available() \
            else SplitLinearMethod()
        layer.method_state = HybridState(packed, few, few.repack(layer))

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        st = layer.method_state
        if x.numel() > st.few_rows.max_rows * layer.in_features:
            return _onednn_apply(layer, x, st.packed)
        return st.few_rows.apply(layer, x, st.few_state)

    def weight_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        st = layer.method_state
        return st.few_rows.weight_rows(layer, ids, st.few_state)

    def fused_step_weight(self, layer: "Linear") -> Panels | None:
        few = layer.method_state.few_rows
        return few.fused_step_weight(layer) if isinstance(few, PanelLinearMethod) else None


LINEAR_METHODS = {"hybrid": HybridLinearMethod, "onednn": OneDNNLinearMethod, "split": SplitLinearMethod,
                  "panels": PanelLinearMethod, "nn": UnquantizedLinearMethod}


class CpuQuantKernels:
    """The integer GEMM of the CPU wing, for the quantized `LinearMethod`s of `minfer.quantization`: the platform
    hands them one (`CpuPlatform.quantization_options`, kernels="auto"), and they pack a CPU layer's codes for
    it (`minfer.cpu.qgemm`: int8, int4, gguf Q4_0/Q4_1/Q8_0 blocks) where it builds. Without one (kernels=
    "reference", a GPU) they keep their torch routes. Stateless: one object serves every layer."""

    from minfer.cpu.gguf_matmul import KERNEL_TYPES as gguf_types  # the gguf types the GEMM runs as stored

    def available(self) -> bool:
        """True when the integer GEMM builds here (built on the first call)."""
        from minfer.cpu.qgemm import qgemm_available

        return qgemm_available()

    def pack(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, offset: int = 0):
        """Codes `[out, in]` and 16-bit scales (and zeros) per group -> a `minfer.cpu.qgemm.PackedWeight`."""
        from minfer.cpu.qgemm import pack

        return pack(codes, scale, zero, bits, offset)

    def pack_gguf(self, parts: list[torch.Tensor], ggml_type: str):
        """A merged layer's raw gguf parts (`uint8 [out_i, bytes]`, all of `ggml_type`) -> one `PackedWeight`."""
        from minfer.cpu.gguf_matmul import pack_gguf, repack_blocks

        return pack_gguf([repack_blocks(p, ggml_type) for p in parts], ggml_type)

    def store(self, layer, w) -> None:
        """Keep `w`'s tensors on `layer` as buffers (`qg_*`) and its shape as `layer.qg_format`."""
        for name, t in w.tensors().items():
            layer.register_buffer(name, t)
        layer.qg_format = (w.bits, w.offset, w.bf16, w.group, w.n, w.k)

    def packed(self, layer):
        """The `PackedWeight` over a layer's `qg_*` buffers (built per call: a buffer moved by `.to()` is seen)."""
        from minfer.cpu.qgemm import PackedWeight

        bits, offset, bf16, group, n, k = layer.qg_format
        return PackedWeight(layer.qg_qs, layer.qg_d, getattr(layer, "qg_m", None), bits, offset, bf16, group, n, k)

    def matmul(self, layer, x2: torch.Tensor) -> torch.Tensor:
        """`x2 [T, in]` float on the CPU -> `[T, out]` float32 by the integer GEMM."""
        from minfer.cpu.qgemm import qgemm_unchecked

        return qgemm_unchecked(x2, self.packed(layer))

    def dequantize_rows(self, layer, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        """Rows `ids` (all: None) of the packed layer's `[out, in]` weight, in `dtype`."""
        from minfer.cpu.qgemm import dequantize_rows

        return dequantize_rows(self.packed(layer), ids, dtype)

    def unpack_rows(self, layer, ids: torch.Tensor):
        """(codes, scales, zeros) of rows `ids` of the packed layer."""
        from minfer.cpu.qgemm import unpack_rows

        return unpack_rows(self.packed(layer), ids)

    def int8_group_matmul(self, x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
        """`x2 [T, in]` times int8 codes with group scales (`minfer.cpu.int8_group`), or None where that kernel
        does not build (the caller dequantizes: the same product)."""
        from minfer.cpu.int8_group import Int8GroupKernelUnavailable, int8_group_matmul

        try:
            return int8_group_matmul(x2, qweight, scales)
        except Int8GroupKernelUnavailable:
            return None
