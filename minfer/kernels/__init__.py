"""Triton kernels of minfer (article §4: FlashAttention, FlashDecoding, kernel fusion).

Every kernel has a plain-torch twin in `minfer.kernels.reference`; the tests compare the two.

On a machine without CUDA the kernels still run: Triton's interpreter executes them with numpy on the CPU
(slow, but exact enough to test and to read). The environment variable must be set *before* the kernels are
decorated with `@triton.jit`, which is why it happens here, ahead of the imports below.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .cache import store_kvcache  # noqa: E402
from .flash_attention import flash_attn_varlen  # noqa: E402
from .fused import apply_rotary_, fused_add_rms_norm, fused_sample, rms_norm, silu_and_mul  # noqa: E402
from .paged_decode import combine_splits, paged_attention_decode, paged_decode_splits  # noqa: E402


def interpreter_active() -> bool:
    """True when Triton runs kernels with its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


__all__ = [
    "flash_attn_varlen",
    "paged_attention_decode", "paged_decode_splits", "combine_splits",
    "store_kvcache",
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary_", "fused_sample",
    "interpreter_active",
]
