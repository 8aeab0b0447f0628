"""Memory arithmetic the chapters quote (article §1-3, §4 GQA).

KV cache bytes = layers x batch x seq_len x kv_heads x head_dim x 2 (K and V) x bytes_per_element.

The article states this formula in §1; here it is a function, and tests check it against the bytes of the
tensors minfer actually allocates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from minfer.config import DTYPES


def dtype_bytes(dtype: str | torch.dtype) -> float:
    """Bytes per element of a dtype given as a torch dtype or a name ("bf16", "float32", "int8", ...).

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
    return DTYPES[name][1]


def kv_cache_bytes(num_layers: int, batch: int, seq_len: int, num_kv_heads: int, head_dim: int,
                   dtype: str | torch.dtype = "float16", scale_bytes: int = 0) -> int:
    """KV cache size in bytes: layers x batch x seq_len x kv_heads x (head_dim x bytes_per_element + scale_bytes) x 2.

    Args:
        num_layers: decoder layers. batch: sequences. seq_len: tokens per sequence (prompt + output).
        num_kv_heads: key/value heads (GQA/MQA: fewer than query heads). head_dim: per-head width.
        dtype: element type of the cache (torch dtype or name).
        scale_bytes: bytes stored beside each token's head vector (a quantized cache's scale: 4 for minfer's
            float32 per-token, per-head scales, `minfer.attention.kv_quant`; 0 for a float cache).

    Returns:
        bytes (int).

    Raises:
        ValueError: a non-positive size or an unknown dtype.
    """
    for name, v in dict(num_layers=num_layers, batch=batch, seq_len=seq_len,
                        num_kv_heads=num_kv_heads, head_dim=head_dim).items():
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if not isinstance(scale_bytes, int) or scale_bytes < 0:
        raise ValueError(f"scale_bytes must be a non-negative integer, got {scale_bytes!r}")
    return int(num_layers * batch * seq_len * num_kv_heads * (head_dim * dtype_bytes(dtype) + scale_bytes) * 2)


def kv_bytes_per_token(config, dtype: str | torch.dtype = "float16", scale_bytes: int = 0) -> int:
    """KV bytes one token occupies across all layers, for a model config (HF-style attribute names)."""
    return kv_cache_bytes(config.num_hidden_layers, 1, 1, config.num_key_value_heads, config.head_dim, dtype,
                          scale_bytes)


@dataclass(frozen=True)
class ArchShape:
    """The few numbers of a model that decide its KV cache (public configs, for the chapters)."""

    name: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


# From each model's public config.json.
KNOWN_ARCHS = {
    "SmolLM2-135M": ArchShape("SmolLM2-135M", 30, 9, 3, 64),
    "Llama-3-8B": ArchShape("Llama-3-8B", 32, 32, 8, 128),
    "Qwen2.5-7B": ArchShape("Qwen2.5-7B", 28, 28, 4, 128),
    "Llama-2-7B": ArchShape("Llama-2-7B", 32, 32, 32, 128),
}


def gqa_savings(arch: ArchShape, seq_len: int = 4096, batch: int = 1, dtype="bfloat16") -> dict:
    """KV bytes with the model's real KV heads vs. if every query head had its own K/V (MHA), and MQA."""
    mha = kv_cache_bytes(arch.num_hidden_layers, batch, seq_len, arch.num_attention_heads, arch.head_dim, dtype)
    gqa = kv_cache_bytes(arch.num_hidden_layers, batch, seq_len, arch.num_key_value_heads, arch.head_dim, dtype)
    mqa = kv_cache_bytes(arch.num_hidden_layers, batch, seq_len, 1, arch.head_dim, dtype)
    return {"model": arch.name, "mha_bytes": mha, "gqa_bytes": gqa, "mqa_bytes": mqa, "saving": mha / gqa}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters and buffers that a forward pass reads (tied weights counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = id(t) if t.is_mkldnn else t.data_ptr()  # an opaque oneDNN tensor has no data pointer
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def physical_memory_bytes() -> int:
    """Bytes of RAM on this machine (what a CPU KV pool or swap space must fit in)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"
