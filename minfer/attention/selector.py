"""Choosing the attention backend (vLLM's `attention/selector.py`): `attention_backend` of `EngineArgs`.

    "torch"   PagedTorchBackend   plain torch, any device and dtype (the reference)
    "cpu"     CpuPagedBackend     the C++ decode kernel; float32 on a CPU; an error where it cannot build
    "triton"  TritonBackend       FlashAttention + paged flash-decoding kernels (CUDA, or Triton's interpreter)
    "auto"    "cpu" for a float32 pool on a CPU when its kernel builds (else "torch", with one warning);
              "torch" everywhere else
"""

from __future__ import annotations

import logging

import torch

from minfer.attention.base import AttentionBackend
from minfer.config import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend `name` stands for (see the module docstring); does not build anything.

    Raises:
        ValueError: an unknown name.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}, got {name!r}")
    if name == "auto":
        return "cpu" if device.type == "cpu" and dtype == torch.float32 else "torch"
    return name


def get_attn_backend(name: str, kv_caches: list[torch.Tensor]) -> AttentionBackend:
    """The backend for `attention_backend=name` over the paged pool `kv_caches` (one
    `[2, num_blocks, block_size, KVH, D]` tensor per layer).

    Raises:
        ValueError: "cpu" where the C++ kernel cannot run (says why), or an unknown name.
    """
    name_in = name
    pool = kv_caches[0]
    name = resolve_backend_name(name, pool.device, pool.dtype)
    if name == "triton":
        from minfer.attention.triton import TritonBackend

        return TritonBackend(kv_caches)
    if name == "cpu":
        from minfer.attention.cpu import CpuKernelUnavailable, CpuPagedBackend

        try:
            return CpuPagedBackend(kv_caches)
        except CpuKernelUnavailable as e:
            if name_in == "cpu":
                raise ValueError(f"attention_backend='cpu' cannot run here: {e}") from e
            logger.warning("the C++ decode-attention kernel is unavailable (%s); using the torch reference", e)
    from minfer.attention.torch_ref import PagedTorchBackend

    return PagedTorchBackend(kv_caches)
