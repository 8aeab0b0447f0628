"""Choosing the attention backend (vLLM's `attention/selector.py`): `attention_backend` of `EngineArgs`.

    "torch"   PagedTorchBackend   plain torch, any device and dtype (the reference)
    "cpu"     CpuPagedBackend     the C++ decode kernel; float32 or bfloat16 on a CPU; an error where it cannot build
    "triton"  TritonBackend       FlashAttention + paged flash-decoding kernels (CUDA, or Triton's interpreter)
    "auto"    "triton" on CUDA (unless the pool is cast: 16-bit K/V under a float32 model, which it refuses);
              "cpu" for a float32 or bfloat16 model on a CPU whose pool is float32, bfloat16, int8 or fp8, when
              its kernel builds (else "torch", with one warning); "torch" everywhere else

A quantized pool (`kv_cache_dtype` int8 / fp8, `minfer.attention.kv_quant`) is read by every backend ("triton"
dequantizes inside its kernels); a cast pool (`kv_cache_dtype="bfloat16"` under a float32 model) by "torch"
only among the GPU-capable ones: "triton" refuses it with a clear error.
"""

from __future__ import annotations

import logging

import torch

from minfer.attention.base import AttentionBackend
from minfer.config import ATTENTION_BACKENDS
from minfer.platform import KernelUnavailable, cpu_attention_reads, cpu_paged_backend  # the CPU wing's backend

logger = logging.getLogger(__name__)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype,
                         kv_dtype: torch.dtype | None = None) -> str:
    """The concrete backend `name` stands for (see the module docstring), for a model computing in `dtype`
    with a pool of `kv_dtype` (default: `dtype`); does not build anything.

    Raises:
        ValueError: an unknown name.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}, got {name!r}")
    if name == "auto":
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if device.type == "cuda":
            cast = kv_dtype.is_floating_point and kv_dtype.itemsize > 1 and kv_dtype != dtype
            return "torch" if cast else "triton"
        return "cpu" if device.type == "cpu" and cpu_attention_reads(dtype, kv_dtype) else "torch"
    return name


def get_attn_backend(name: str, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None = None,
                     spec=None, model_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend for `attention_backend=name` over the paged pool `kv_caches` (one
    `[2, num_blocks, block_size, KVH, D]` tensor per layer; with a quantized pool also its `kv_scales` and
    `spec`, a `minfer.attention.kv_quant.KVCacheSpec`), for a model computing in `model_dtype` (default: the
    pool's dtype).

    Raises:
        ValueError: "cpu" where the C++ kernel cannot run (says why), "triton" over a cast pool (16-bit K/V
            under a float32 model), or an unknown name.
    """
    name_in = name
    pool = kv_caches[0]
    name = resolve_backend_name(name, pool.device, model_dtype or pool.dtype, pool.dtype)
    if name == "triton":
        if kv_scales is None and model_dtype is not None and model_dtype != pool.dtype:
            raise ValueError(f"attention_backend='triton' reads a KV pool of the model's dtype or int8/fp8 codes, "
                             f"not a {pool.dtype} pool under a {model_dtype} model: use kv_cache_dtype='auto', "
                             "'int8' or 'fp8', or attention_backend='torch'")
        from minfer.attention.triton import TritonBackend

        return TritonBackend(kv_caches, kv_scales, spec)
    if name == "cpu":
        try:
            return cpu_paged_backend(kv_caches, kv_scales, spec, model_dtype)
        except KernelUnavailable as e:
            if name_in == "cpu":
                raise ValueError(f"attention_backend='cpu' cannot run here: {e}") from e
            logger.warning("the C++ decode-attention kernel is unavailable (%s); using the torch reference", e)
    if name_in != "auto" and kv_scales is None and (model_dtype is None or model_dtype == pool.dtype):
        from minfer.attention.base import PagedReferenceBackend  # the plain one the chapters teach

        return PagedReferenceBackend(kv_caches)
    from minfer.attention.torch_ref import PagedTorchBackend

    return PagedTorchBackend(kv_caches, kv_scales, spec)
