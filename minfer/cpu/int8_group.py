"""Int8 codes with one float32 scale per group of 16 or 32 inputs, and the C++ kernel that multiplies by them in
place (chapter 5): the layout GGUF's Q8_0, Q5_0 and Q6_K blocks decode into exactly (`minfer.quantization.gguf`).

    W[n, G g + j] = scale[n, g] * qweight[n, G g + j]      qweight int8 [out, in], scale float32 [out, in/G]

torch's `_weight_int8pack_mm` takes one scale per output row, not one per group, so it cannot run these
blocks without re-quantizing them (a second rounding); `csrc/int8_group_cpu.cpp` does the group scales itself:
each weight row is read once, turned into floats in L1 (code x its group's scale) and dotted with every
row of the batch. float32 activations in, float32 out: the product is
gguf's own dequantization times x, up to the order of the sums. Built like the decode-attention kernel
(`minfer.cpu.attention`: torch's extension builder, `-march=native`, one build per kind of CPU, so an
AVX-512 machine and an AVX2-only one each get code for their own instructions), called through ctypes.
"""

from __future__ import annotations

import torch

from minfer.cpu.build import I32, I64, PTR, CppLibrary, KernelUnavailable
from minfer.quantization.gguf import dequantize_int8_group  # noqa: F401  (the same product, in torch)

# No -ffast-math: the sums keep their order, so a row gives the same bits at any batch size.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
GROUP_SIZES = (16, 32)


class Int8GroupKernelUnavailable(KernelUnavailable):
    """The C++ kernel could not be built or loaded here (the message says why)."""


LIBRARY = CppLibrary("minfer_int8_group_cpu", "int8_group_cpu.cpp", CFLAGS, {
    "minfer_int8_group_matmul": ([PTR, PTR, PTR, PTR, I64, I64, I64, I64, I32], None),
}, Int8GroupKernelUnavailable)
_library = LIBRARY.load
int8_group_kernel_available = LIBRARY.available


def int8_group_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [T, in]` float32 times the weight `[out, in]` that (qweight, scale) stand for, transposed: `[T, out]`.

    Args:
        x: float32 `[T, in]` (other float dtypes are converted). qweight: int8 `[out, in]`, contiguous.
        scale: float32 `[out, in / G]`, G in (16, 32).

    Raises:
        Int8GroupKernelUnavailable: the kernel cannot be built here.
        ValueError: wrong dtypes or shapes.
    """
    lib = _library()
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous int8 [out, in] tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    out, k = qweight.shape
    if scale.dtype != torch.float32 or scale.dim() != 2 or scale.shape[0] != out or not scale.is_contiguous() \
            or scale.shape[1] == 0 or k % scale.shape[1] or k // scale.shape[1] not in GROUP_SIZES:
        raise ValueError(f"scale must be a contiguous float32 [{out}, {k} / G] tensor with G in {GROUP_SIZES}, got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    if x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU tensor [T, {k}], got {tuple(x.shape)} on {x.device}")
    x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    if x.shape[0]:
        lib.minfer_int8_group_matmul(y.data_ptr(), x.data_ptr(), qweight.data_ptr(), scale.data_ptr(), x.shape[0],
                                     out, k, k // scale.shape[1], torch.get_num_threads())
    return y
