"""KV cache quantization (article §5, §8-2): K/V stored in 8 bits in the paged pool, dequantized in attention.

`kv_cache_dtype` (vLLM's names) picks how the pool stores K/V:

    "auto"                         the model's dtype (no conversion)
    "float32" "bfloat16" "float16" a plain cast on store (2x fewer bytes than float32 for the 16-bit ones)
    "int8"                         symmetric INT8 codes, x ~= code * scale, code in [-127, 127]
    "fp8" = "fp8_e4m3"             float8 e4m3 (OCP FP8, max 448; 3 mantissa bits), x ~= code * scale
    "fp8_e5m2"                     float8 e5m2 (max 57344; 2 mantissa bits, more range, less precision)

**Scale granularity: one float32 scale per token and K/V head**, `scale = max|x| / qmax` over that head's
`head_dim` values, stored beside the blocks in a `[2, num_blocks, block_size, KVH]` tensor per layer (K and V).
Why per token and not per block (one scale per block and head, the issue's other option): a block fills one
token per decode step, so a per-block scale must be fixed before the block's later tokens exist (they clip
when they are larger) or the whole block re-quantized when a larger one arrives (more error, and a read-
modify-write of the block on every step). A per-token scale is computed from the token itself, once, at
store time; blocks shared by prefix caching, swapped to the CPU or copied for beam search carry their scales
along unchanged. The price is 4 bytes per head vector: 4 / head_dim extra (6.25% for SmolLM2's head_dim 64),
so an INT8 pool holds 3.76x the tokens of a float32 one (not 4x) and 1.88x those of a bfloat16 one.
vLLM's fp8 KV cache uses one scale per layer (per tensor, calibrated or 1.0): fewer bytes, but a fixed range.

K and V keep no other state; the quantized pool is read through the same block tables. Every backend that
reads a quantized pool sees each key exactly as it was stored: the torch reference attends a fresh prompt
to the dequantized round trip of its own K/V (`PagedTorchBackend.forward`), so a prompt computed whole,
in chunks, or on top of a cached prefix sees the same keys and gives the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minfer.config import KV_CACHE_DTYPES, QUANTIZED_KV_CACHE_DTYPES

_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVCacheSpec:
    """How a pool stores K/V. name: the `kv_cache_dtype` asked for ("auto" resolved to the model's dtype name).
    dtype: the torch dtype of the stored elements. quantized: 8-bit codes with per-token, per-head scales.
    qmax: the largest code magnitude (127, 448, 57344); 0 when not quantized."""

    name: str
    dtype: torch.dtype
    quantized: bool
    qmax: float

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale stored per token and K/V head (for K, and again for V)."""
        return SCALE_DTYPE.itemsize if self.quantized else 0


def kv_cache_spec(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVCacheSpec:
    """The storage of `kv_cache_dtype` for a model computing in `model_dtype`.

    Raises:
        ValueError: an unknown `kv_cache_dtype`.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return KVCacheSpec(str(model_dtype).removeprefix("torch."), model_dtype, False, 0.0)
    dtype = _STORAGE[kv_cache_dtype]
    if kv_cache_dtype not in QUANTIZED_KV_CACHE_DTYPES:
        return KVCacheSpec(kv_cache_dtype, dtype, False, 0.0)
    qmax = 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)
    return KVCacheSpec(kv_cache_dtype, dtype, True, qmax)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a 1-byte tensor as uint8 (torch's CPU index_copy/index_select do not take float8; the
    codes are moved as bytes, which is all a copy needs)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def quantize_kv(x: torch.Tensor, spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V `[T, KVH, D]` (any float dtype) -> (codes `[T, KVH, D]` of `spec.dtype`, float32 scales `[T, KVH]`).

    scale = max|x| / qmax per token and head (a zero row gets the smallest positive scale, so its codes are
    0 and nothing divides by zero); codes = x / scale, rounded to nearest (INT8: `round`, clamped to
    [-127, 127], symmetric so that 0 is exact; FP8: torch's round-to-nearest-even cast, after clamping to
    the format's finite range, so no code is NaN).
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / spec.qmax).clamp_min(torch.finfo(torch.float32).tiny)
    y = (xf / scale.unsqueeze(-1)).clamp(-spec.qmax, spec.qmax)
    codes = y.round().to(torch.int8) if spec.dtype == torch.int8 else y.to(spec.dtype)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes `[..., D]` (int8/fp8) and scales `[...]` -> `codes * scale` `[..., D]` in `dtype` (computed in float32)."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def code_table(dtype: torch.dtype) -> torch.Tensor:
    """float32 `[256]`: the value of every byte as a code of `dtype` (int8 or an fp8 type). The C++ decode kernel
    dequantizes fp8 with it (one table load per element; exact, since every fp8 value is a float32)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
