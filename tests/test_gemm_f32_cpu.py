"""The few-row float32 GEMM (`minfer.cpu.gemm_f32`, the "panels" layout) against a float64 reference,
its batch invariance, and the AVX2 and scalar builds of the same source."""


import pytest
import torch
import torch.nn.functional as F

from minfer.cpu import gemm_f32 as g
from minfer.cpu.linear import onednn_supports
from minfer.model.layers import Linear
from minfer.platform import get_linear_method

pytestmark = pytest.mark.skipif(not g.gemm_f32_available(), reason="the C++ float32 GEMM does not build here")


def _close(y, ref, k):
    # float32 sums of k products of unit-scale values: error ~ sqrt(k) ulps of the partial sums
    tol = 1e-5 * (k ** 0.5) * ref.abs().max().item() + 1e-6
    assert (y.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("m", [1, 2, 5, 15, 16, 17, 33, 64, 129])  # from 17 rows: the AVX-512 many-row tiles
@pytest.mark.parametrize("n,k", [(16, 8), (40, 33), (960, 576), (7, 130), (49, 70)])
def test_gemm_equals_float64_reference(m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    ref = x.double() @ w.double().T
    _close(g.gemm_f32(x, g.pack_weight(w), n), ref, k)
    _close(g.gemm_f32(x, g.pack_weight(w), n, b), ref + b.double(), k)


def test_strided_and_batched_inputs():
    torch.manual_seed(0)
    w = torch.randn(48, 24)
    big = torch.randn(3, 5, 40)
    x = big[..., 8:32]  # rows with a stride of 40 floats
    y = g.gemm_f32(x, g.pack_weight(w), 48)
    assert y.shape == (3, 5, 48)
    _close(y, x.double() @ w.double().T, 24)


@pytest.mark.parametrize("n", [96, 49, 145])
def test_a_row_does_not_depend_on_its_batch(n):
    """Batch invariance: the same row gives the same bits alone, with 15 others, or among 40 or 131 (the
    many-row tiles of 8 rows x 3 panels, with a short last tile and a last group of 1 or 2 panels)."""
    torch.manual_seed(1)
    w = g.pack_weight(torch.randn(n, 200))
    x = torch.randn(140, 200)
    b = torch.randn(n)
    alone = g.gemm_f32(x[7:8], w, n, b)
    for rows in (slice(0, 16), slice(0, 40), slice(7, 9), slice(0, 131), slice(3, 140)):
        y = g.gemm_f32(x[rows], w, n, b)
        assert torch.equal(y[7 - rows.start], alone[0])


def test_unpack_rows_gives_the_matrix_rows():
    w = torch.randn(37, 11)
    ids = torch.tensor([0, 5, 36, 16, 15])
    assert torch.equal(g.unpack_rows(g.pack_weight(w), ids, 37), w[ids])


def test_bad_inputs_are_refused():
    w = g.pack_weight(torch.randn(32, 8))
    with pytest.raises(ValueError, match="float32"):
        g.gemm_f32(torch.randn(2, 8, dtype=torch.float64), w, 32)
    with pytest.raises(ValueError, match="do not fit"):
        g.gemm_f32(torch.randn(2, 9), w, 32)
    with pytest.raises(ValueError, match="do not fit"):
        g.gemm_f32(torch.randn(2, 8), w, 33)
    with pytest.raises(ValueError, match="bias"):
        g.gemm_f32(torch.randn(2, 8), w, 32, torch.randn(31))
    with pytest.raises(ValueError, match="float32"):
        g.pack_weight(torch.randn(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32 CPU x"):
        g.gemm_f32(torch.tensor(1.0), w, 32)
    # the packed weight itself: dtype, shape, layout, device (a wrong one must not reach the kernel)
    for bad in (w.double(), w.view(2, -1), w.transpose(0, 1).contiguous().transpose(0, 1),
                torch.empty(2, 8, 16, device="meta"), torch.empty(2, 8, 8)):
        with pytest.raises(ValueError, match="packed"):
            g.gemm_f32(torch.randn(2, 8), bad, 32)
    with pytest.raises(ValueError, match="bias"):
        g.gemm_f32(torch.randn(2, 8), w, 32, torch.ones(32, device="meta"))


def test_an_unaligned_packed_weight_computes_the_same():
    """The kernel's weight loads do not assume 64-byte alignment (a view into a larger buffer)."""
    torch.manual_seed(4)
    w = torch.randn(50, 64)
    buf = torch.empty(g.pack_weight(w).numel() + 1)
    p = buf[1:].view(4, 64, 16)
    p.copy_(g.pack_weight(w))
    x = torch.randn(4, 64)
    _close(g.gemm_f32(x, p, 50), x.double() @ w.double().T, 64)


def test_unpack_rows_refuses_ids_outside_the_matrix():
    w = torch.randn(50, 8)
    p = g.pack_weight(w)
    assert torch.equal(g.unpack_rows(p, torch.tensor([-1, 49]), 50), w[[49, 49]])
    for bad in (50, 55, -51):
        with pytest.raises(IndexError):
            g.unpack_rows(p, torch.tensor([bad]), 50)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_hybrid_linear_takes_panels_for_few_rows_and_equals_f_linear(rows):
    torch.manual_seed(rows)
    lin = Linear(64, 80, bias=True, method=get_linear_method("hybrid"))
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    w, b = lin.weight.data.clone(), lin.bias.data.clone()
    lin.process_weights_after_loading()
    assert lin.method_state.few_rows.name == "panels"
    x = torch.randn(rows, 64)
    _close(lin(x), x.double() @ w.double().T + b.double(), 64)
    ids = torch.tensor([3, 79])
    assert torch.equal(lin.weight_rows(ids), w[ids])


@pytest.mark.skipif(not onednn_supports(torch.bfloat16),
                    reason="oneDNN's bfloat16 product needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks")
def test_bfloat16_hybrid_keeps_split_for_one_row():
    lin = Linear(32, 32, method=get_linear_method("hybrid"))
    lin.weight.data = torch.randn(32, 32).bfloat16()
    lin.process_weights_after_loading()
    assert lin.method_state.few_rows.name == "split"
    x = torch.randn(1, 32).bfloat16()
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), lin.weight_rows(torch.arange(32)).float()),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("flags,isa", [(["-mno-avx512f"], "avx2"), (["-mno-avx512f", "-mno-avx2", "-mno-fma"], "scalar")])
def test_the_other_instruction_sets_compute_the_same(flags, isa):
    """The AVX2 path (6 rows a pass) and the scalar loop, built here with the wider ISAs switched off: the
    machines this course runs on differ (some EPYCs have no AVX-512)."""
    from minfer.cpu.build import declare, load_library

    lib = load_library(f"minfer_gemm_f32_test_{isa}", g.LIBRARY.source, g.CFLAGS + flags)
    declare(lib, g.LIBRARY.signatures)
    assert lib.minfer_gemm_f32_isa().decode() == isa
    torch.manual_seed(2)
    for m, n, k in [(1, 16, 8), (7, 40, 33), (16, 96, 130), (20, 7, 5)]:
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        out, scratch, packed = torch.empty(m, n), torch.empty(m * k), g.pack_weight(w)  # alive during the call
        lib.minfer_gemm_f32(out.data_ptr(), x.data_ptr(), packed.data_ptr(), b.data_ptr(), m, n, k, k, n,
                            scratch.data_ptr(), 2)
        _close(out, x.double() @ w.double().T + b.double(), k)
