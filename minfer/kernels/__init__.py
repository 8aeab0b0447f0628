"""Triton kernels of minfer (article §4: FlashAttention, FlashDecoding, kernel fusion).

Every kernel has a plain-torch twin in `minfer.kernels.reference`; the tests compare the two.

On a machine without CUDA the kernels still run: Triton's interpreter executes them with numpy on the CPU
(slow, but exact enough to test and to read). Triton reads `TRITON_INTERPRET=1` as each kernel is decorated,
so this package selects the interpreter (`envs.triton_interpreter_environ`, on a machine without CUDA) before
its modules import triton; importing `minfer` alone sets nothing.
"""

from __future__ import annotations

import os
import sys

import minfer.envs as envs

os.environ.update(envs.triton_interpreter_environ())  # before the modules below import triton

from .cache import store_kvcache
from .flash_attention import flash_attn_varlen, interpreter_active
from .fused import apply_rotary_, fused_add_rms_norm, fused_sample, rms_norm, silu_and_mul
from .paged_decode import combine_splits, paged_attention_decode, paged_decode_splits


def _reinterpret_triton_language() -> int:
    """Make Triton's own library functions (tl.sum, tl.max, ...) runnable under the CPU interpreter.

    This package sets TRITON_INTERPRET=1 when there is no CUDA, but Triton only honours it for functions
    decorated afterwards. A program that built a torch module before importing minfer (building
    one under a device context imports torch._dynamo, which imports triton) has triton.language's helpers
    as compiled-mode JITFunctions, and every kernel would fail with "Cannot call @triton.jit'd outside of
    the scope of a kernel". Re-wrap them as interpreted functions, once, here. Returns how many were
    re-wrapped (0 on a GPU, or when minfer was imported first).
    """
    if not interpreter_active():
        return 0
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction):
                setattr(mod, attr, InterpretedFunction(obj.fn))
                n += 1
    return n


_reinterpret_triton_language()


__all__ = [
    "flash_attn_varlen",
    "paged_attention_decode", "paged_decode_splits", "combine_splits",
    "store_kvcache",
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary_", "fused_sample",
    "interpreter_active",
]
