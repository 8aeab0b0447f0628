"""The register-tiled integer GEMM (minfer/cpu/qgemm.py, csrc/qgemm_cpu.cpp; chapter 5 §5.3) for every
weight format it runs: GGUF Q4_0 / Q4_1 / Q8_0 (from gguf's own quantizer), int4 (groups 32-256, bfloat16 s
and z) and int8 (one bfloat16 scale per row). Each instruction-set path against the same arithmetic in
float64 torch and against a plain dequantize-then-matmul within the bound of the activation rounding, on odd
shapes (T 1..70, K a multiple of 32 but not of 64, N not a multiple of 16); the three paths give the same
bits; a row's result does not depend on the batch, the tile it falls in or the thread count; the packed
layout reads back; bad input.

    PYTHONPATH=$PWD python -m pytest -q tests/test_qgemm.py
"""

import pytest
import torch

from minfer.cpu.qgemm import (
    BLOCK,
    ISAS,
    dequantize_rows,
    pack,
    qgemm,
    qgemm_available,
    quantize_activations,
    reference_matmul,
    unpack_rows,
)

needs_kernel = pytest.mark.skipif(not qgemm_available(), reason="the C++ kernel does not build here")
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "int4-32", "int4-64", "int4-128", "int4-256", "int8"]


def _isas():
    """The paths this CPU can run (a forced path the CPU lacks would silently run another one)."""
    from minfer.cpu.qgemm import best_isa

    return [name for name, i in ISAS.items() if 0 < i <= ISAS[best_isa()]]


def _weight(fmt: str, n: int, k: int, seed: int = 0):
    """A PackedWeight of `fmt` from random float weights, quantized the way minfer's loaders do; k must suit
    the format's group. Returns (packed, the float32 weight the codes stand for, computed independently)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    w[min(1, n - 1), :32] = 0  # an all-zero block
    if fmt in ("Q4_0", "Q4_1", "Q8_0"):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        from minfer.cpu.gguf_matmul import pack_gguf, repack_blocks

        raw = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[fmt]).copy())
        ref = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[fmt]).copy()).float()
        return pack_gguf([repack_blocks(raw, fmt)], fmt), ref
    if fmt == "int8":
        from minfer.quantization.int8 import dequantize_int8, quantize_int8

        q, s = quantize_int8(w)
        return pack(q, s[:, None], None, 8), dequantize_int8(q, s)
    from minfer.quantization.int4 import dequantize_int4, quantize_int4

    codes, s, z = quantize_int4(w, int(fmt.split("-")[1]))
    return pack(codes, s, z, 4, offset=8), dequantize_int4(codes, s, z)


def _k_for(fmt: str) -> int:
    """K a multiple of 32 and of the format's group, but not of 64 where the group allows (odd block count)."""
    group = int(fmt.split("-")[1]) if fmt.startswith("int4") else 32
    return 3 * max(group, 32) if group <= 32 else 3 * group


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_layout_reads_back(fmt):
    k = _k_for(fmt)
    w, ref = _weight(fmt, 37, k)
    assert torch.equal(dequantize_rows(w), ref)  # the tiles stand for the loader's weights exactly
    ids = torch.tensor([36, 0, 17, 17])
    assert torch.equal(dequantize_rows(w, ids), ref[ids])
    codes, d, m = unpack_rows(w, ids)
    assert codes.shape == (4, k) and d.shape == (4, k // w.group)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t,n", [(1, 37), (3, 5), (17, 130), (70, 33)])
def test_kernel_against_torch_references_on_every_isa(fmt, t, n):
    k = _k_for(fmt)
    w, wf = _weight(fmt, n, k, seed=t + n)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(k)) * 3
    x[0, :32] = 0  # an all-zero activation block: scale 0
    got = {isa: qgemm(x, w, isa=isa) for isa in _isas()}
    first = next(iter(got.values()))
    for isa, y in got.items():
        assert y.shape == (t, n) and y.dtype == torch.float32
        assert torch.equal(y, first), f"{isa} differs from {next(iter(got))}"  # same float operations
    y = first.double()
    # 1) the kernel's own arithmetic (activations rounded to int8 blocks) in float64: float32 sums only
    same = reference_matmul(x, w)
    scale = x.abs().double() @ wf.abs().double().t()
    assert float(((y - same).abs() - 2e-6 * scale).max()) <= 1e-6
    # 2) plain dequantize-then-matmul: off by at most sum_k |w_k| dx_k / 2 (each x_k rounded by <= dx / 2)
    plain = x.double() @ wf.double().t()
    _, dx = quantize_activations(x)
    bound = (dx.double().repeat_interleave(BLOCK, dim=1) / 2) @ wf.abs().double().t()
    assert bool(((y - plain).abs() <= bound + 2e-6 * scale + 1e-6).all())


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "Q8_0", "int4-64", "int8"])
def test_a_rows_result_does_not_depend_on_the_batch_tile_or_threads(fmt):
    k = _k_for(fmt)
    w, _ = _weight(fmt, 75, k, seed=5)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    for isa in _isas():
        alone = torch.cat([qgemm(x[i:i + 1], w, isa=isa) for i in range(64)])
        for t in (1, 3, 17, 64):  # tail tiles of 1..3 rows, one chunk and more
            assert torch.equal(qgemm(x[:t], w, isa=isa), alone[:t]), (isa, t)
        assert torch.equal(qgemm(x[5:22], w, isa=isa), alone[5:22])  # rows in other tile positions
        threads = torch.get_num_threads()
        try:
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                assert torch.equal(qgemm(x, w, isa=isa), alone), (isa, n_threads)
        finally:
            torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "Q8_0", "int4-64", "int8"])
def test_the_unpacked_panel_and_the_packed_stream_give_the_same_bits(fmt):
    # from PANEL_ROWS rows on, the kernel unpacks each column panel once per call (one code per byte, float
    # scales); below, it reads the packed codes: at T just below / at / above the switch, odd N (a half tile
    # and a lone last tile), the rows must come out as they do one at a time
    from minfer.cpu.qgemm import PANEL_ROWS

    k = _k_for(fmt)
    w, _ = _weight(fmt, 16 * 5 + 3, k, seed=7)
    x = torch.randn(PANEL_ROWS + 9, k, generator=torch.Generator().manual_seed(2)) * 2
    for isa in _isas():
        alone = torch.cat([qgemm(x[i:i + 1], w, isa=isa) for i in range(len(x))])
        for t in (PANEL_ROWS - 1, PANEL_ROWS, PANEL_ROWS + 1, PANEL_ROWS + 9):
            assert torch.equal(qgemm(x[:t], w, isa=isa), alone[:t]), (isa, t)


@needs_kernel
def test_bad_input_is_a_clear_error():
    codes = torch.randint(0, 16, (8, 48), dtype=torch.uint8)
    s = torch.ones(8, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack(codes, s, None, 4)  # K not a multiple of 32
    codes = torch.randint(0, 16, (8, 96), dtype=torch.uint8)
    with pytest.raises(ValueError, match="group must be"):
        pack(codes, torch.ones(8, 2, dtype=torch.bfloat16), None, 4)  # groups of 48
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        pack(codes, torch.ones(8, 3), None, 4)
    with pytest.raises(ValueError, match="bits"):
        pack(codes, torch.ones(8, 3, dtype=torch.float16), None, 3)
    w = pack(codes, torch.ones(8, 3, dtype=torch.float16), None, 4)
    with pytest.raises(ValueError, match="x must be"):
        qgemm(torch.zeros(1, 64), w)
    with pytest.raises(ValueError, match="isa must be"):
        qgemm(torch.zeros(1, 96), w, isa="sse")
    assert qgemm(torch.zeros(0, 96), w).shape == (0, 8)


@needs_kernel
def test_non_finite_and_tiny_activations_give_the_same_bits_on_every_isa():
    """A NaN or an inf in an activation block makes that row's outputs NaN on every path (the float product
    would be NaN or inf; before, the scalar path gave finite numbers and AVX2/VNNI -inf of the wrong sign), and
    a block below 127 x FLT_MIN is the zero block (before, 1/d overflowed: 5-10x too large, of either sign)."""
    w, _ = _weight("int8", 16, 64)
    rows = torch.ones(4, 64)
    rows[0, 0] = float("nan")
    rows[1, 33] = float("inf")
    rows[2, :32] = 1e-39  # the first block tiny, the second ordinary
    rows[3, :] = -float("inf")
    got = {isa: qgemm(rows, w, isa=isa) for isa in _isas()}
    first = next(iter(got.values()))
    for isa, y in got.items():
        assert torch.equal(y.isnan(), first.isnan()) and torch.equal(y.nan_to_num(), first.nan_to_num()), isa
    assert first[[0, 1, 3]].isnan().all()
    tiny_as_zero = rows[2].clone()
    tiny_as_zero[:32] = 0
    assert torch.equal(first[2], qgemm(tiny_as_zero[None], w)[0])


def test_four_bit_codes_out_of_range_are_refused():
    codes = torch.zeros(16, 32, dtype=torch.uint8)
    codes[0, 0] = 20
    with pytest.raises(ValueError, match="0..15"):
        pack(codes, torch.ones(16, 1, dtype=torch.float16), None, 4)


@needs_kernel

def test_eight_bit_codes_of_another_dtype_are_a_clear_error_and_an_empty_four_bit_weight_packs():
    one = torch.ones(16, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="8-bit codes must be int8"):
        pack(torch.full((16, 32), 200, dtype=torch.uint8), one, None, 8)  # would read back as -56
    with pytest.raises(ValueError, match="8-bit codes must be int8"):
        pack(torch.full((16, 32), 300, dtype=torch.int16), one, None, 8)
    empty = pack(torch.zeros(0, 32, dtype=torch.uint8), torch.ones(0, 1, dtype=torch.float16), None, 4)
    assert empty.n == 0  # as an empty 8-bit weight is (max() of no codes is not asked)

def test_active_isa_follows_a_forced_set_the_cpu_has(monkeypatch):
    from minfer.cpu.qgemm import active_isa, best_isa

    best = best_isa()
    assert active_isa() == best
    for name in _isas():  # every set this CPU has, forced, is the one that runs
        monkeypatch.setenv("MINFER_GGUF_ISA", name)
        assert active_isa() == name
    monkeypatch.setenv("MINFER_GGUF_ISA", "vnni")  # forced beyond the CPU: its best
    assert active_isa() == best
