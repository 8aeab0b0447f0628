"""Loading a saved AWQ / GPTQ directory (`python -m minfer.quantize`, or any AutoAWQ "gemm" / AutoGPTQ v1
checkpoint with sequential groups): `LLM(model=DIR)` reads `quantization_config` from its config.json.

`read_quantization_config(dir)` validates the config; `unpack_checkpoint` turns each linear's packed
tensors (`qweight`, `qzeros`, `scales`, `g_idx`; layouts in `minfer.quantization.formats`) into one tensor
under the linear's `.weight` name: its codes `[out, in]` tagged with the parameters (`prequant`); and
`PrequantizedLinearMethod` stores them in minfer's int4 (or int8) layout, so the model runs on the same
kernels as `quantization="int4"` (`"int8"`). Float tensors (norms, the embedding/tied head) load as usual.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from minfer.config import INT4_GROUP_SIZES
from minfer.model.layers import LinearMethodBase
from minfer.quantization import formats
from minfer.quantization.gguf import GGUFLinearMethod
from minfer.quantization.int8 import Int8LinearMethod

PACKED = ("qweight", "qzeros", "scales", "g_idx")
SAVED_METHODS = ("awq", "gptq")


def read_quantization_config(path: Path) -> dict | None:
    """The validated `quantization_config` of the HF directory `path`, or None when it has none.

    Returns {"quant_method", "bits", "group_size"} (group_size -1: one group per row).

    Raises:
        ValueError: a quant_method minfer does not read, or settings it cannot run (names the key): bits other
            than 4 (AWQ) or 4/8 (GPTQ), a group size the int4 op lacks, AWQ without zero points or not "gemm",
            a GPTQ desc_act that is not a bool.
    """
    from minfer.model.loader import read_json

    cfg = read_json(path / "config.json").get("quantization_config")
    if cfg is None:
        return None
    where = f"{path / 'config.json'}: quantization_config"
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} must be an object")
    method = cfg.get("quant_method")
    if method not in SAVED_METHODS:
        raise ValueError(f"{where}: quant_method {method!r} is not one minfer reads ({', '.join(SAVED_METHODS)})")
    bits = cfg.get("bits", cfg.get("w_bit"))
    group = cfg.get("group_size", cfg.get("q_group_size"))
    if method == "awq":
        if bits != 4:
            raise ValueError(f"{where}: AWQ bits={bits!r}; minfer reads 4")
        if not cfg.get("zero_point", True) or str(cfg.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"{where}: minfer reads AWQ with zero_point=true and version 'gemm'")
    else:
        if bits not in (4, 8):
            raise ValueError(f"{where}: GPTQ bits={bits!r}; minfer reads 4 or 8")
        if not isinstance(cfg.get("desc_act", False), bool):
            raise ValueError(f"{where}: desc_act={cfg.get('desc_act')!r} must be true or false")
    if bits == 4 and group not in INT4_GROUP_SIZES:
        raise ValueError(f"{where}: group_size={group!r}; the int4 op takes {INT4_GROUP_SIZES}")
    if bits == 8 and group != -1:
        raise ValueError(f"{where}: 8-bit GPTQ with group_size={group!r}; minfer reads -1 (per channel)")
    return {"quant_method": method, "bits": bits, "group_size": group}


def unpack_checkpoint(named: Iterable[tuple[str, torch.Tensor]], qcfg: dict, source: str
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a saved checkpoint -> the same, with each linear's packed tensors replaced by one
    `<linear>.weight` codes tensor tagged `prequant = (kind, scale, zero, perm)` (int4: s, z bf16 `[out, in/G]`;
    int8: None, scale bf16 `[out]`; the codes then int8; perm: None, or for an act-order GPTQ checkpoint the
    input order int64 `[in]` the codes' columns are in, `formats.unpack_gptq`).

    Raises:
        ValueError: a linear with some of qweight/qzeros/scales but not all (names the missing ones), or
            non-finite (NaN/inf) scales.
    """
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        prefix, _, leaf = name.rpartition(".")
        if leaf in PACKED:
            groups.setdefault(prefix, {})[leaf] = t
        else:
            yield name, t
    for prefix, t in groups.items():
        missing = [k for k in ("qweight", "qzeros", "scales") if k not in t]
        if missing:
            raise ValueError(f"{source}: {prefix} has {sorted(t)} but lacks {missing}: the quantized checkpoint "
                             "is incomplete")
        if qcfg["quant_method"] == "awq":
            q, s, zp, perm = (*formats.unpack_awq(t), None)
        else:
            try:  # the group size too: a short `scales` is then named as such
                formats.check_gptq(t, qcfg["bits"], qcfg.get("group_size"))
                q, s, zp, perm = formats.unpack_gptq(t, qcfg["bits"])
            except ValueError as e:
                raise ValueError(f"{source}: {prefix}: {e}") from None
        if not torch.isfinite(s.float()).all():  # NaN/inf scales would turn every output of the layer to NaN
            bad = int((~torch.isfinite(s.float())).sum())
            raise ValueError(f"{source}: {prefix}.scales has {bad} non-finite value(s) (NaN or inf): the "
                             "quantized checkpoint is corrupt")
        if qcfg["bits"] == 8:
            codes, scale = formats.to_minfer_int8(q, s, zp)
            codes.prequant = ("int8", scale, None, perm)
        else:
            codes, scale, zero = formats.to_minfer_int4(q, s, zp)
            codes.prequant = ("int4", scale, zero, perm)
        yield f"{prefix}.weight", codes


class PrequantizedLinearMethod(GGUFLinearMethod):
    """A saved checkpoint's codes in minfer's int4 (or int8) storage; float parts (the tied head) by `fallback`.

    The checkpoint parts arrive as in `GGUFLinearMethod` (a meta placeholder collects them); a layer whose
    parts are all tagged `prequant` of one kind is stored quantized, an all-float one goes to the fallback.
    An act-order GPTQ layer keeps its codes' input order as the buffer `input_perm` int64 `[in]`, and `apply`
    reads `x[..., input_perm]` (one gather of the activations; the int4 op sees contiguous groups).
    """

    name = "prequantized"

    def __init__(self, method: str, fallback: LinearMethodBase | None = None, cpu_kernel=None):
        super().__init__(fallback=fallback, cpu_kernel=cpu_kernel)
        self.name = method
        self.int8 = Int8LinearMethod(fallback=self.fallback, cpu_kernel=cpu_kernel)

    def process_weights_after_loading(self, layer) -> None:
        parts = [layer.gguf_parts[i] for i in range(len(layer.output_sizes))]
        layer.gguf_parts = {}
        kinds = {getattr(p, "prequant", ("float",))[0] for p in parts}
        if len(kinds) > 1:
            raise ValueError(f"a merged linear mixes quantized and float parts ({sorted(kinds)})")
        kind = kinds.pop()
        if kind == "float":
            dtype = layer.weight.dtype
            layer.weight = nn.Parameter(torch.cat([p.float() for p in parts]).to(dtype), requires_grad=False)
            self.fallback.process_weights_after_loading(layer)
            layer.prequant = None
            return
        del layer.weight
        perms = [p.prequant[3] for p in parts]
        if any(q is not None for q in perms):
            if any(q is None or not torch.equal(q, perms[0]) for q in perms):
                raise ValueError("the parts of a merged linear (q|k|v or gate|up) have different act-order "
                                 "g_idx: minfer needs one input order per merged linear")
            codes = torch.cat(parts)
            if perms[0].numel() != codes.shape[1]:  # e.g. a row-parallel shard of the inputs
                raise ValueError(f"an act-order linear's g_idx covers {perms[0].numel()} inputs, its codes "
                                 f"{codes.shape[1]}: act-order checkpoints load only unsharded")
            layer.register_buffer("input_perm", perms[0])
        codes = torch.cat(parts)
        if kind == "int4":
            s = torch.cat([p.prequant[1] for p in parts])
            z = torch.cat([p.prequant[2] for p in parts])
            self.int4.store(layer, codes, s, z)
        else:
            layer.register_buffer("qweight", codes.contiguous())
            layer.register_buffer("scales", torch.cat([p.prequant[1] for p in parts]))
            self.int8.maybe_pack(layer)
        layer.prequant = kind
        layer.quantized = True

    def _method(self, layer):
        return {"int4": self.int4, "int8": self.int8}.get(layer.prequant, self.fallback)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            x = x.index_select(-1, perm)
        return self._method(layer).apply(layer, x)

    def weight_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        return self._method(layer).weight_rows(layer, ids)
