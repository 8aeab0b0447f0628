"""`quantization="gguf"`: run a GGUF file's own blocks instead of expanding them to float32.

llama.cpp's blocks (ggml-common.h; q are the stored codes):

    Q4_0  32 weights, 18 bytes: d (f16), qs[16]                        w = (q - 8) d        q in 0..15
    Q4_1  32 weights, 20 bytes: d, m (f16), qs[16]                     w = q d + m          q in 0..15
          qs[j] holds weight j in its low nibble and weight j + 16 in its high one
    Q8_0  32 weights, 34 bytes: d (f16), qs[32] int8                   w = q d              q in -128..127
    Q5_0  32 weights, 22 bytes: d (f16), qh[4] (5th bits), qs[16]      w = (q - 16) d       q in 0..31
    Q4_K  256 weights, 144 bytes: d, dmin (f16), 8 x (6-bit sc, 6-bit m) packed in 12 bytes, qs[128]
          sub-block j of 32:                                          w = q (d sc_j) - dmin m_j
    Q6_K  256 weights, 210 bytes: ql[128], qh[64], sc[16] int8, d (f16)
          sub-block j of 16:                                          w = (q - 32) (d sc_j) q in 0..63

Three routes. The default, for Q4_0, Q4_1 and Q8_0 (SmolLM2-135M's file is all Q4_1 with a Q8_0 embedding/head),
where the C++ kernel builds:

- **blocks** (`minfer.cpu.qgemm`, chapter 5 §5.3): the file's codes and float16 scales, packed once
  into the register-tiled integer GEMM's layout (`gguf_matmul.pack_gguf`: the same bytes per weight), times
  float32 activations that the kernel quantizes to int8 blocks of 32 per call (llama.cpp's method: integer
  dot products, one float multiply-add per block). Bytes read per token = the file's. The activation
  rounding is the one approximation (bounded in `tests/test_qgemm.py`). Every batch size takes the kernel on
  the CPU (a register tile of 4 rows x 32 columns: faster than float32 sgemm at every T measured, and one
  code path keeps a row's logits independent of the batch); other devices dequantize + `F.linear`. A tied
  head in one of these types (SmolLM2's Q8_0 head) stays packed too: the embedding expands only the rows it
  looks up (`CpuQuantKernels.dequantize_rows`, gguf's numbers exactly).

`quantization_config={"kernel": "torch"}` (or kernels="reference", or a machine without a C++ compiler) takes the two older routes,
each exact up to a stated rounding, which also run the types the kernel does not (Q4_K, Q5_0, Q6_K):

- **int4 op** (`minfer.quantization.int4`, w = (q - 8) s + z, groups of 32): Q4_0 is s = d, z = 0; Q4_1 is
  s = d, z = m + 8d; Q4_K is s = d sc_j, z = 8 d sc_j - dmin m_j (its 6-bit sub-block scales, decoded from
  their packing, make each 32-weight sub-block an ordinary group). The codes go across unchanged. The op
  keeps s and z in bfloat16, so they are rounded from float32 to bfloat16's 8 significant bits: each weight
  moves by at most 2^-8 of its group's 8 |s| + |z| (`tests/test_quant.py` measures it against gguf's own
  dequantization).
- **int8 codes with group scales** (`minfer.cpu.int8_group`, w = q s): Q8_0 is q, s = d (groups of
  32); Q5_0 is q - 16, s = d (32); Q6_K is q - 32, s = d sc_j (16). float32 scales, so this route is exact:
  the codes times the scales are gguf's dequantized weights bit for bit (checked at load). It costs 1 byte
  per weight plus 4 per group (1.125 and 1.25 bytes per weight) where the file has 8.5, 5.5 and 6.56 bits.
  torch's `_weight_int8pack_mm` has one scale per output row, so it cannot run these blocks without a second
  rounding; the C++ kernel of `int8_group` does the group scales itself.

The codes and scales are read from the blocks' bytes (the scales) and from gguf's own dequantization (the
codes: q = round(w / s), exact because w = q s was computed in float32 from a small integer q). A layer
whose parts mix the two routes (none in SmolLM2's or Gemma 3's files) and other tensor types (F32, F16,
...) are expanded to float32 and run by the fallback layout. A tied LM head in a 4-bit type stays float (the
embedding reads its rows); one in Q8_0 (SmolLM2-135M's Q4_1 file and Gemma 3's store their embedding/head so)
stays int8 codes on the `kernel: "torch"` route: the embedding expands only the rows it looks up, and the
head's product always takes the int8-group kernel (measured faster than float32 sgemm there, chapter 5 §5.3).

The loader (`minfer.model.loader`) hands these tensors over as their raw bytes, `uint8 [out, bytes]` tagged
with `ggml_type`, through `gguf_tensors`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minfer.model.layers import LinearMethodBase, UnquantizedLinearMethod
from minfer.quantization.base import KERNEL_MAX_ROWS, store
from minfer.quantization.int4 import Int4LinearMethod

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_GROUP_TYPES = ("Q8_0", "Q5_0", "Q6_K")
NATIVE_TYPES = INT4_TYPES + INT8_GROUP_TYPES
# bytes per block and weights per block of the types decoded here (ggml-common.h)
# Most rows per call for the int8-group kernel (measured against dequantize + F.linear: chapter 5).
INT8_GROUP_KERNEL_MAX_ROWS = KERNEL_MAX_ROWS
_LAYOUT = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32), "Q5_0": (22, 32), "Q4_K": (144, 256),
           "Q6_K": (210, 256)}


def _gguf_float(raw: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """gguf's own dequantization of raw rows `uint8 [out, bytes]` -> float32 `[out, in]`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(raw.contiguous().numpy(), GGMLQuantizationType[ggml_type]), dtype=np.float32))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (last dim) as a float16 value -> float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _codes_from(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """q = round((w + offset) / scale) per group (`w [out, groups, G]`, scale/offset `[out, groups]`); 0 where
    the scale is 0 (all weights of the group are then -offset)."""
    num = w if offset is None else w + offset[..., None]
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.where(scale[..., None] == 0, torch.zeros_like(num), torch.round(num / safe[..., None]))


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes `[..., 12]` -> the 8 sub-block scales and 8 mins `[..., 8]` (6 bits each; llama.cpp's
    get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 split between the
    nibbles of bytes 8-11 and the top 2 bits of bytes 0-3 / 4-7)."""
    s = sc.to(torch.int32)
    lo = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return lo.float(), mn.float()


def dequantize_int8_group(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(qweight int8 [out, in], scale [out, in/G]) -> `[out, in]` in `dtype` (computed in float32): w = q s."""
    out, k = qweight.shape
    g = scale.shape[1]
    return (qweight.view(out, g, k // g).float() * scale.float()[..., None]).reshape(out, k).to(dtype)


def decode_int8_group_blocks(raw: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw rows `uint8 [out, bytes]` of Q8_0/Q5_0/Q6_K -> (codes int8 [out, in], scale float32 [out, in/G]) with
    w = q s exactly (G = 32; 16 for Q6_K). Raises ValueError for another type, or if the codes do not
    reproduce gguf's dequantization exactly."""
    if ggml_type not in INT8_GROUP_TYPES:
        raise ValueError(f"decode_int8_group_blocks: {ggml_type} is not one of {INT8_GROUP_TYPES}")
    nbytes, per_block = _LAYOUT[ggml_type]
    out = raw.shape[0]
    b = raw.reshape(out, -1, nbytes)
    w = _gguf_float(raw, ggml_type)
    if ggml_type == "Q6_K":
        d = _f16(b[..., 208:210])  # [out, superblocks]
        scale = (d[..., None] * b[..., 192:208].contiguous().view(torch.int8).float()).reshape(out, -1)  # groups of 16
    else:
        scale = _f16(b[..., 0:2])
    g = w.shape[1] // scale.shape[1]
    codes = _codes_from(w.view(out, -1, g), scale).reshape(out, -1)
    if codes.abs().max() > 127 or not torch.equal(dequantize_int8_group(codes.to(torch.int8), scale), w):
        raise ValueError(f"{ggml_type} blocks did not decode to int8 codes x scales exactly (a corrupt tensor?)")
    return codes.to(torch.int8), scale


def decode_q4_blocks(raw: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw rows `uint8 [out, bytes]` of Q4_0/Q4_1/Q4_K -> (codes uint8 [out, in], s float32 [out, in/32],
    z float32 [out, in/32]) with w = (q - 8) s + z. Raises ValueError for another type."""
    if ggml_type == "Q4_K":
        return _decode_q4_k(raw)
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"decode_q4_blocks: {ggml_type} is not one of {INT4_TYPES}")
    nb = BLOCK_BYTES[ggml_type]
    out = raw.shape[0]
    b = raw.reshape(out, -1, nb)  # [out, groups, bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if ggml_type == "Q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        zero, qs = m + 8 * d, b[..., 4:]
    else:
        zero, qs = torch.zeros_like(d), b[..., 2:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # [out, groups, 32]: weights 0..15 then 16..31
    return codes.reshape(out, -1), d, zero


def _decode_q4_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows -> int4-op groups of 32 (module docstring): s = d sc_j, z = 8 s - dmin m_j."""
    out = raw.shape[0]
    b = raw.reshape(out, -1, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [out, superblocks]
    sc, mn = _k_scales(b[..., 4:16])  # [out, superblocks, 8]
    scale = (d[..., None] * sc).reshape(out, -1)  # [out, in/32]
    minus = (dmin[..., None] * mn).reshape(out, -1)
    w = _gguf_float(raw, "Q4_K").view(out, -1, BLOCK)
    codes = _codes_from(w, scale, minus)
    if codes.min() < 0 or codes.max() > 15:
        raise ValueError("Q4_K blocks did not decode to 4-bit codes (a corrupt tensor?)")
    return codes.to(torch.uint8).reshape(out, -1), scale, 8 * scale - minus


def gguf_tensor(block, cfg, unpermute) -> torch.Tensor:
    """One `GGUFBlocks` -> the tensor the loader passes on: raw rows tagged `ggml_type` for Linear weights of a
    type in NATIVE_TYPES, a float32 tensor (gguf's own dequantization) for everything else."""
    from gguf.quants import dequantize

    type_name = block.tensor_type.name
    is_linear = block.name.startswith("model.layers.") and block.name.endswith("_proj.weight")
    # The head (or the tied embedding, which the loader hands to the head) in an int8-group type stays raw too.
    is_linear |= type_name in INT8_GROUP_TYPES and (block.name == "lm_head.weight" or (
        block.name == "model.embed_tokens.weight" and cfg.tie_word_embeddings))
    heads = cfg.num_attention_heads if ".q_proj." in block.name else cfg.num_key_value_heads
    if type_name in NATIVE_TYPES and is_linear:
        raw = torch.from_numpy(np.array(block.data, dtype=np.uint8)).reshape(block.shape[0], -1)
        if block.rope_permuted:  # a permutation of whole rows: the blocks of a row stay together
            raw = unpermute(raw, heads)
        raw.ggml_type = type_name
        return raw
    w = torch.from_numpy(np.array(dequantize(block.data, block.tensor_type), dtype=np.float32))
    return unpermute(w, heads) if block.rope_permuted else w


class GGUFLinearMethod(LinearMethodBase):
    """The file's blocks in the C++ kernel, through the int4 op or as int8 codes with group scales (module
    docstring); other layers by `fallback`.

    The `weight` parameter is a meta-device placeholder (no memory) whose loader keeps each checkpoint part
    as given; `process_weights_after_loading` turns parts that all take one route into that route's storage
    (`layer.gguf_route` "int4" or "int8_group"), anything else into a float weight for the fallback.

    Args:
        kernel: "blocks" (default: Q4_0 / Q4_1 / Q8_0 layers in the file's bytes through the integer GEMM
            `qgemm`, where its C++ kernel builds; Q4_K through the same kernel as int4 groups) or "torch" (the
            int4 op and int8 codes only).
        kernel_max_rows: most rows per call that the int8-group C++ kernel takes; more go through one
            dequantize + `F.linear` (chapter 5 measures the crossover).
        cpu_kernel: the CPU wing's integer GEMMs (`minfer.cpu.linear.CpuQuantKernels`, from the platform under
            kernels="auto"); None (the default, and kernels="reference"): no C++ kernel at all (the "torch"
            routes, and int8 codes by dequantize + `F.linear`).
    """

    name = "gguf"

    def __init__(self, fallback: LinearMethodBase | None = None, kernel_max_rows: int = INT8_GROUP_KERNEL_MAX_ROWS,
                 kernel: str = "blocks", cpu_kernel=None):
        if kernel not in ("blocks", "torch"):
            raise ValueError(f"gguf kernel must be 'blocks' or 'torch', got {kernel!r}")
        kernel = kernel if cpu_kernel else "torch"
        self.fallback = fallback or UnquantizedLinearMethod()
        self.int4 = Int4LinearMethod(group_size=BLOCK, fallback=self.fallback,
                                     cpu_kernel=cpu_kernel if kernel == "blocks" else None)
        self.kernel_max_rows = kernel_max_rows
        self.kernel = kernel
        self.cpu_kernel = cpu_kernel

    def create_weights(self, layer, in_features: int, output_sizes: list[int], bias: bool) -> None:
        out = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(out, in_features, device="meta"), requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        layer.gguf_parts = {}
        layer.quantized = False
        layer.gguf_route = "float"

        def load(param, loaded, shard=None):
            if param is layer.weight:
                if not hasattr(loaded, "ggml_type") and loaded.shape != (output_sizes[shard or 0], in_features):
                    raise ValueError(f"shape mismatch: part {tuple(loaded.shape)} vs "
                                     f"{(output_sizes[shard or 0], in_features)}")
                layer.gguf_parts[shard or 0] = loaded
            else:
                layer.weight_loader(param, loaded, shard)

        for p in (layer.weight, layer.bias):
            if p is not None:
                p.weight_loader = load
                p.num_shards = len(output_sizes)

    def process_weights_after_loading(self, layer) -> None:
        parts = [layer.gguf_parts[i] for i in range(len(layer.output_sizes))]
        layer.gguf_parts = {}
        types = {getattr(p, "ggml_type", "float") for p in parts}
        k = self.cpu_kernel
        if self.kernel == "blocks" and len(types) == 1 and types <= set(k.gguf_types) and k.available():
            layer.ggml_type = types.pop()
            layer.model_dtype = layer.weight.dtype  # the model's dtype (the placeholder was built in it)
            del layer.weight
            k.store(layer, k.pack_gguf(parts, layer.ggml_type))
            layer.quantized, layer.gguf_route = True, "blocks"
            return
        if types <= set(INT4_TYPES) and not layer.keep_rows:
            decoded = [decode_q4_blocks(p, p.ggml_type) for p in parts]
            codes, s, z = (torch.cat(t, dim=0) for t in zip(*decoded))
            del layer.weight
            self.int4.store(layer, codes, s.to(torch.bfloat16), z.to(torch.bfloat16))
            layer.quantized, layer.gguf_route = True, "int4"
            return
        layer.weight_dtype = layer.weight.dtype  # the model's dtype (the placeholder was built in it)
        if types <= set(INT8_GROUP_TYPES):  # the tied head too: the embedding reads its rows (weight_rows)
            decoded = [decode_int8_group_blocks(p, p.ggml_type) for p in parts]
            g = min(c.shape[1] // sc.shape[1] for c, sc in decoded)  # merged parts share the smallest group
            scales = [sc.repeat_interleave(c.shape[1] // sc.shape[1] // g, dim=1) for c, sc in decoded]
            del layer.weight
            store(layer, "qweight", torch.cat([c for c, _ in decoded], dim=0).contiguous())
            store(layer, "scales", torch.cat(scales, dim=0).contiguous())
            layer.quantized, layer.gguf_route = True, "int8_group"
            layer.model_dtype = layer.weight_dtype
            return
        floats = [p.float() if not hasattr(p, "ggml_type") else _dequantize_raw(p) for p in parts]
        dtype = layer.weight.dtype  # the model's dtype (the placeholder was built in it)
        layer.weight = nn.Parameter(torch.cat(floats, dim=0).to(dtype), requires_grad=False)
        self.fallback.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.gguf_route == "blocks":
            x2 = x.reshape(-1, layer.in_features)
            if x2.device.type == "cpu":
                y = self.cpu_kernel.matmul(layer, x2).to(x.dtype)
            else:
                y = F.linear(x2, self.cpu_kernel.dequantize_rows(layer, dtype=x.dtype))
            if layer.bias is not None:
                y = y + layer.bias
            return y.view(*x.shape[:-1], layer.out_features)
        if layer.gguf_route != "int8_group":
            return (self.int4 if layer.quantized else self.fallback).apply(layer, x)
        x2 = x.reshape(-1, layer.in_features)
        y = None
        # The tied head always takes the kernel: expanding its 49,152 x 576 codes per call costs more than
        # the kernel at any batch (measured), and one code path for every batch keeps its logits batch-invariant.
        if x2.device.type == "cpu" and self.cpu_kernel and (x2.shape[0] <= self.kernel_max_rows or layer.keep_rows):
            y = self.cpu_kernel.int8_group_matmul(x2, layer.qweight, layer.scales)  # None: no compiler here
            y = None if y is None else y.to(x.dtype)  # (then the dequantize route computes the same product)
        if y is None:
            y = F.linear(x2, dequantize_int8_group(layer.qweight, layer.scales, x.dtype))
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def fused_step_weight(self, layer):
        """The integer GEMM's `PackedWeight` of a "blocks" layer (or an "int4" one, through the int4 method)
        without bias, where the forward is this class's `apply`; else None."""
        if layer.bias is not None or type(self).apply is not GGUFLinearMethod.apply:
            return None
        if layer.gguf_route == "int4":
            return self.int4.fused_step_weight(layer)
        if layer.gguf_route != "blocks" or getattr(layer, "qg_format", None) is None:
            return None
        return self.cpu_kernel.packed(layer)

    def weight_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        if layer.gguf_route == "blocks":  # only the rows asked for are expanded (gguf's numbers exactly)
            return self.cpu_kernel.dequantize_rows(layer, ids, layer.model_dtype)
        if layer.gguf_route == "int8_group":  # only the rows asked for are expanded
            return dequantize_int8_group(layer.qweight[ids], layer.scales[ids]).to(layer.model_dtype)
        return (self.int4 if layer.quantized else self.fallback).weight_rows(layer, ids)


def _dequantize_raw(raw: torch.Tensor) -> torch.Tensor:
    """Raw rows -> float32 by gguf's own dequantization (a native part of a tied head, or merged with a part of
    the other route)."""
    return _gguf_float(raw, raw.ggml_type)
