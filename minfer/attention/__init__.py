"""Attention (article §3, §4): the layer, the per-forward context, and the backends that store K/V.

    base.py       Attention, ForwardContext (typed), AttentionBackend (store_kv / attend / prepare), and the plain
                  reference: attend, PagedReferenceBackend (chapter 3)
    torch_ref.py  ContiguousBackend (chapter 1), PagedTorchBackend (batched; quantized and cast pools)
    triton.py     TritonBackend over the Triton kernels of minfer.kernels (chapter 4)
    selector.py   get_attn_backend(name, kv_caches, kv_scales, spec, model_dtype, platform): "auto", "torch", "cpu",
                  "triton", built as the platform says (`Platform.get_attn_backend_cls`; "cpu": the CPU wing's
                  `CpuPagedBackend`, minfer/cpu/attention.py)
    kv_quant.py   kv_cache_dtype: K/V quantized on store to int8 / fp8 with per-token, per-head scales (chapter 5)
"""

from minfer.attention.base import Attention, AttentionBackend, ForwardContext, PagedReferenceBackend
from minfer.attention.selector import ATTENTION_BACKENDS, get_attn_backend
from minfer.attention.torch_ref import ContiguousBackend, PagedTorchBackend, attend, visibility_mask

__all__ = ["ATTENTION_BACKENDS", "Attention", "AttentionBackend", "ContiguousBackend", "ForwardContext",
           "PagedReferenceBackend", "PagedTorchBackend", "attend", "get_attn_backend", "visibility_mask"]
