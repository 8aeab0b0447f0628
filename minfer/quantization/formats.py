"""The saved 4-bit (and 8-bit) layouts of `python -m minfer.quantize`: AutoAWQ's "gemm" and AutoGPTQ's v1,
the two formats vLLM's `awq` and `gptq` methods load.

Both store, per quantized `nn.Linear` `W [out, in]` with groups of G consecutive inputs, integer codes q, an
integer zero point zp and a float16 scale s per (group, output), with

    w[o, i] = (q[o, i] - zp[g(i), o]) * s[g(i), o]          g(i) = i // G

and pack 32 / bits codes into each int32, lowest bits first:

    AWQ ("gemm")   qweight int32 [in, out/8]    8 *outputs* per int32, in the order 0 2 4 6 1 3 5 7
                   qzeros  int32 [in/G, out/8]  same packing; zp itself
                   scales  float16 [in/G, out]
    GPTQ (v1)      qweight int32 [in*bits/32, out]  32/bits *inputs* per int32, in order
                   qzeros  int32 [in/G, out*bits/32] outputs in order; zp - 1 (v1's offset: readers add 1)
                   scales  float16 [in/G, out]
                   g_idx   int32 [in]: column i's group; i // G, or with act-order (desc_act) the group
                           of its place in the quantization order (`minfer.quantization.gptq`)

`quantization_config` (config.json): AWQ `{"quant_method": "awq", "bits": 4, "group_size": G,
"zero_point": true, "version": "gemm"}`; GPTQ `{"quant_method": "gptq", "bits": 4|8, "group_size": G | -1,
"desc_act": false|true, "sym": false|true}`. minfer converts what it reads into its own int4 op's
w = (q - 8) s + z (z = (8 - zp) s, rounded to bfloat16) or, for 8-bit GPTQ with one group per row and zp =
128, into its int8 storage (q - 128, s): `to_minfer_int4`, `to_minfer_int8`.

Because v1 stores zp - 1 in `bits` bits, zp must be at least 1: `affine_params(..., zp_min=1)`.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column j of a pack of 8 goes to nibble AWQ_ORDER.index(j)


def affine_params(wg: torch.Tensor, bits: int = 4, zp_min: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max parameters of groups `wg [..., G]` -> (scale float32 [...], integer zero point int32 [...])
    with zp in [zp_min, 2^bits - 1] and the scale rounded to float16 (what is saved)."""
    qmax = 2 ** bits - 1
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / qmax).clamp_min(1e-5).half().float()
    zp = torch.round(-lo / scale).clamp(zp_min, qmax).to(torch.int32)
    return scale, zp


def quantize_affine(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, group_size: int,
                    bits: int = 4) -> torch.Tensor:
    """Codes int32 [out, in] of `w [out, in]` for per-group `scale`, `zp` `[out, in/G]`."""
    out, k = w.shape
    wg = w.reshape(out, k // group_size, group_size)
    q = torch.round(wg / scale[..., None]) + zp[..., None]
    return q.clamp(0, 2 ** bits - 1).to(torch.int32).reshape(out, k)


def dequantize_affine(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
    """(codes [out, in], scale/zp [out, in/G]) -> float32 `[out, in]` = (q - zp) s."""
    out, k = q.shape
    g = scale.shape[1]
    w = (q.reshape(out, g, k // g).float() - zp[..., None].float()) * scale[..., None].float()
    return w.reshape(out, k)


def _pack_last(v: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int codes [..., n] -> int32 [..., n*bits/32]: 32/bits consecutive entries per int32, entry j of a pack
    at bits `bits * order.index(j)` (default: in order)."""
    per = 32 // bits
    v = v.to(torch.int64).reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]  # slot i holds entry order[i]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (v << shifts).sum(-1)  # in [0, 2^32): the int32's bit pattern, two's complement below
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def _unpack_last(p: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Inverse of `_pack_last`: int32 [..., m] -> int32 [..., m*32/bits]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    v = ((p.to(torch.int64) & 0xFFFFFFFF)[..., None] >> shifts) & (2 ** bits - 1)  # [..., m, per], slot order
    if order is not None:
        v = v[..., [list(order).index(j) for j in range(per)]]  # back to entry order
    return v.reshape(*p.shape[:-1], -1).to(torch.int32)


def pack_awq(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor) -> dict[str, torch.Tensor]:
    """minfer's (codes [out, in], scale [out, in/G], zp [out, in/G]) -> AWQ gemm tensors (module docstring)."""
    return {"qweight": _pack_last(q.t().contiguous(), 4, AWQ_ORDER),
            "qzeros": _pack_last(zp.t().contiguous(), 4, AWQ_ORDER),
            "scales": scale.t().contiguous().half()}


def unpack_awq(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ gemm tensors -> (codes int32 [out, in], scale float32 [out, in/G], zp int32 [out, in/G])."""
    q = _unpack_last(t["qweight"], 4, AWQ_ORDER).t().contiguous()
    zp = _unpack_last(t["qzeros"], 4, AWQ_ORDER).t().contiguous()
    return q, t["scales"].float().t().contiguous(), zp


def pack_gptq(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, bits: int = 4,
              g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """minfer's (codes, scale, zp) -> GPTQ v1 tensors (module docstring); `g_idx` int32 [in] for act-order
    codes (default i // G). Raises ValueError for zp < 1."""
    if int(zp.min()) < 1:
        raise ValueError("GPTQ v1 stores zp - 1: every zero point must be >= 1 (affine_params(zp_min=1))")
    k, g = q.shape[1], scale.shape[1]
    return {"qweight": _pack_last(q.contiguous(), bits).t().contiguous(),
            "qzeros": _pack_last((zp - 1).t().contiguous(), bits),
            "scales": scale.t().contiguous().half(),
            "g_idx": (torch.arange(k) // (k // g) if g_idx is None else g_idx).to(torch.int32).clone()}


def check_gptq(t: dict[str, torch.Tensor], bits: int = 4, group_size: int | None = None) -> None:
    """Refuse GPTQ v1 tensors of the wrong dtype, shape or range, each error naming the tensor and what it
    should be (unchecked, a short `scales` or a bad `g_idx` reads as act-order groups of unequal size, and a
    float `qweight` is silently truncated). `group_size` -1 is one group per row; None: any that divides in.

    Raises:
        ValueError: qweight/qzeros not int32 or not 2-D, scales not float or not finite, g_idx not an integer
            tensor, or any of them not the shape (or g_idx not the range) qweight's implies.
    """
    for name in ("qweight", "qzeros"):
        if t[name].dtype != torch.int32 or t[name].dim() != 2:
            raise ValueError(f"{name} is {t[name].dtype} {tuple(t[name].shape)}: GPTQ stores it as int32, 2-D")
    k, out = t["qweight"].shape[0] * 32 // bits, t["qweight"].shape[1]  # qweight int32 [in*bits/32, out]
    sc = t["scales"]
    if not sc.is_floating_point():
        raise ValueError(f"scales is {sc.dtype}: GPTQ stores float scales (float16)")
    groups = 1 if group_size == -1 else k // group_size if group_size else sc.shape[0] if sc.dim() == 2 else 0
    if sc.shape != (groups, out) or groups < 1 or k % groups:
        raise ValueError(f"scales has shape {tuple(sc.shape)}, not ({groups}, {out}): one row per group of "
                         f"qweight's {k} inputs")
    if not bool(torch.isfinite(sc).all()):
        raise ValueError(f"scales has {int((~torch.isfinite(sc)).sum())} non-finite value(s) (NaN or inf): the "
                         "checkpoint is corrupt")
    if t["qzeros"].shape != (groups, out * bits // 32):
        raise ValueError(f"qzeros has shape {tuple(t['qzeros'].shape)}, not ({groups}, {out * bits // 32})")
    if "g_idx" in t:
        g = t["g_idx"]
        if g.is_floating_point() or g.is_complex() or g.dtype == torch.bool:
            raise ValueError(f"g_idx is {g.dtype}: GPTQ stores each input's group as int32")
        if g.shape != (k,):
            raise ValueError(f"g_idx has shape {tuple(g.shape)}, not ({k},): one group per input of qweight")
        if k and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise ValueError(f"g_idx holds groups {int(g.min())}..{int(g.max())}, outside 0..{groups - 1} "
                             f"(scales has {groups} rows)")


def unpack_gptq(t: dict[str, torch.Tensor], bits: int = 4
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ v1 tensors -> (codes int32 [out, in], scale float32 [out, in/G], zp int32 [out, in/G], perm).

    With sequential groups (g_idx = i // G, or no g_idx) perm is None and column i is in group i // G. With
    act-order groups, perm int64 [in] is the stable sort of g_idx and the codes come back with their columns
    in that order (`q[:, perm]`), so that the groups are again G consecutive columns: then
    `W[:, perm] x[perm] = W x`, and a layer computes its output from `x[..., perm]`.

    Raises:
        ValueError: tensors `check_gptq` refuses, or a g_idx whose groups do not each hold G columns.
    """
    check_gptq(t, bits)
    q = _unpack_last(t["qweight"].t().contiguous(), bits)  # [out, in]
    zp = (_unpack_last(t["qzeros"], bits) + 1).t().contiguous()
    scale = t["scales"].float().t().contiguous()
    out, k = q.shape
    want = torch.arange(k) // (k // scale.shape[1])
    perm = None
    if "g_idx" in t:
        g_idx = t["g_idx"].to(torch.int64)
        if g_idx.shape != (k,):
            raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, not ({k},)")
        if not torch.equal(g_idx, want):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], want):
                raise ValueError(f"this GPTQ checkpoint's g_idx does not give each of its {scale.shape[1]} groups "
                                 f"{k // scale.shape[1]} columns: minfer reads groups of equal size")
            q = q[:, perm].contiguous()
    return q, scale, zp, perm


def to_minfer_int4(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor):
    """(codes, scale, zp) -> minfer's int4 (codes uint8, s bf16, z bf16) with w = (q - 8) s + z."""
    return q.to(torch.uint8), scale.to(torch.bfloat16), ((8 - zp.float()) * scale).to(torch.bfloat16)


def to_minfer_int8(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor):
    """8-bit codes with one group per row and zp = 128 -> minfer's int8 (q int8 [out, in], scale bf16 [out]).

    Raises:
        ValueError: more than one group per row, or a zero point other than 128 (not symmetric).
    """
    if scale.shape[1] != 1 or not bool((zp == 128).all()):
        raise ValueError("minfer reads 8-bit GPTQ only per output channel (group_size -1) and symmetric (sym)")
    return (q - 128).to(torch.int8), scale[:, 0].to(torch.bfloat16)
