"""Choosing the attention backend (vLLM's `attention/selector.py`): `attention_backend` of `EngineArgs`.

    "torch"   PagedReferenceBackend  plain torch, one sequence at a time (the reference; `attention/base.py`), or
              PagedTorchBackend      over a quantized or cast pool (batched torch, any device and dtype)
    "cpu"     CpuPagedBackend     the CPU wing's C++ decode kernel (`minfer/cpu/attention.py`); float32 or bfloat16
                                  on a CPU; an error where it cannot run
    "triton"  TritonBackend       FlashAttention + paged flash-decoding kernels (CUDA, or Triton's interpreter)
    "auto"    what the platform takes here (`Platform.get_attn_backend_cls`): "triton" on CUDA (unless the pool
              is cast: 16-bit K/V under a float32 model, which it refuses); "cpu" for a float32 or bfloat16 model
              on a CPU whose pool is float32, bfloat16, int8 or fp8, when its kernel builds (else "torch", with
              one warning); "torch" everywhere else and with kernels="reference"

The selector checks the name and builds what the platform returns for it (`platform=`, the worker's
`minfer.platform.Platform`); it never asks which device it runs on. Without a platform only the backends of
this folder are built: "auto" is then the torch reference.

A quantized pool (`kv_cache_dtype` int8 / fp8, `minfer.attention.kv_quant`) is read by every backend ("triton"
dequantizes inside its kernels); a cast pool (`kv_cache_dtype="bfloat16"` under a float32 model) by "torch"
only among the GPU-capable ones: "triton" refuses it with a clear error.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from minfer.attention.base import AttentionBackend, PagedReferenceBackend
from minfer.attention.torch_ref import PagedTorchBackend
from minfer.config import ATTENTION_BACKENDS


class BackendChooser(Protocol):
    """What the selector asks of a platform (`minfer.platform.Platform` is one)."""

    def get_attn_backend_cls(self, name: str, model_dtype: torch.dtype,
                             kv_dtype: torch.dtype) -> Callable[..., AttentionBackend]:
        """What builds backend `name` here, called as `cls(kv_caches, kv_scales, spec)`."""
        ...


def get_attn_backend(name: str, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None = None,
                     spec=None, model_dtype: torch.dtype | None = None,
                     platform: BackendChooser | None = None) -> AttentionBackend:
    """The backend for `attention_backend=name` over the paged pool `kv_caches` (one
    `[2, num_blocks, block_size, KVH, D]` tensor per layer; with a quantized pool also its `kv_scales` and
    `spec`, a `minfer.attention.kv_quant.KVCacheSpec`), for a model computing in `model_dtype` (default: the
    pool's dtype), as `platform` builds it (`Platform.get_attn_backend_cls`; see the module docstring for
    None).

    Raises:
        ValueError: an unknown name, "triton" over a cast pool (16-bit K/V under a float32 model), "cpu" where
            the C++ kernel cannot run (says why) or without a platform.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}, got {name!r}")
    pool = kv_caches[0]
    model_dtype = model_dtype or pool.dtype
    if name == "triton" and kv_scales is None and model_dtype != pool.dtype:
        raise ValueError(f"attention_backend='triton' reads a KV pool of the model's dtype or int8/fp8 codes, "
                         f"not a {pool.dtype} pool under a {model_dtype} model: use kv_cache_dtype='auto', "
                         "'int8' or 'fp8', or attention_backend='torch'")
    if platform is not None:
        backend_cls = platform.get_attn_backend_cls(name, model_dtype, pool.dtype)
    elif name == "cpu":
        raise ValueError("attention_backend='cpu' is the CPU platform's backend: pass the worker's platform "
                         "(minfer.platform.get_platform)")
    elif name == "triton":
        from minfer.attention.triton import TritonBackend

        backend_cls = TritonBackend
    elif name == "torch" and kv_scales is None and model_dtype == pool.dtype:
        backend_cls = PagedReferenceBackend  # the plain one the chapters teach
    else:
        backend_cls = PagedTorchBackend
    return backend_cls(kv_caches, kv_scales, spec)
