"""`Linear` and its linear methods (minfer/model/layers.py with its `LinearMethod` seam, cpu/linear.py): the CPU layouts (K-major or not,
split into column slices; oneDNN's packed one) compute what nn.Linear does, and the loader hands each
parameter its tensors through its own `weight_loader`."""

import pytest
import torch
import torch.nn.functional as F

from minfer.cpu.linear import LINEAR_METHODS, SplitLinearMethod, onednn_available, onednn_supports
from minfer.model.layers import Linear, TiedEmbedding, default_weight_loader, process_weights_after_loading
from minfer.platform import get_linear_method, get_platform


def default_linear_method(device, dtype, kernels="auto"):
    return get_platform(kernels, device, dtype).linear_method()

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


def _loaded(in_f, out_f, bias, tokens, method=None):
    """A Linear loaded with random weights, an input of `tokens` rows, and what F.linear gives for it."""
    torch.manual_seed(0)
    lin = Linear(in_f, out_f, bias=bias, method=method)
    w, b = torch.randn(out_f, in_f), torch.randn(out_f)
    lin.weight_loader(lin.weight, w)
    if bias:
        lin.weight_loader(lin.bias, b)
    x = torch.randn(tokens, in_f)
    return lin, w, x, F.linear(x, w, b if bias else None)


@pytest.mark.parametrize("in_f,out_f", [(16, 48), (48, 16), (24, 24), (10, 15)])
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7])
def test_repacked_linear_equals_f_linear(in_f, out_f, splits, bias, tokens):
    lin, w, x, expected = _loaded(in_f, out_f, bias, tokens, SplitLinearMethod(splits))
    lin.process_weights_after_loading()
    assert lin.method_state.k_major == (out_f >= in_f)
    assert lin.method_state.splits == (splits if out_f % splits == 0 else 1)
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x.view(1, tokens, in_f)), expected.view(1, tokens, out_f), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, out_f - 1, out_f // 2, 1])
    assert torch.equal(lin.weight_rows(ids), w[ids])
    with pytest.raises(RuntimeError, match="already repacked"):
        lin.process_weights_after_loading()


@needs_onednn
@pytest.mark.parametrize("layout", ["onednn", "hybrid"])
@pytest.mark.parametrize("in_f,out_f", [(16, 48), (48, 16), (10, 15)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 130])
def test_onednn_linear_equals_f_linear(layout, in_f, out_f, bias, tokens):
    method = get_linear_method(layout)
    if layout == "hybrid":
        method.splits = 2
    lin, w, x, expected = _loaded(in_f, out_f, bias, tokens, method)
    lin.process_weights_after_loading()
    assert lin.layout == layout and (lin.weight if layout == "onednn" else lin.method_state.packed).is_mkldnn
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x.view(1, tokens, in_f)), expected.view(1, tokens, out_f), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x.t().contiguous().t()), expected, rtol=1e-5, atol=1e-5)  # strided input
    ids = torch.tensor([0, out_f - 1])
    if layout == "onednn":  # nothing kept: rows cannot be read from oneDNN's layout
        with pytest.raises(RuntimeError, match="keep_rows"):
            lin.weight_rows(ids)
    else:  # hybrid reads rows from its "split" copy
        assert torch.equal(lin.weight_rows(ids), w[ids])
    with pytest.raises(RuntimeError, match="already repacked"):
        lin.process_weights_after_loading()


@needs_onednn
@pytest.mark.skipif(not onednn_supports(torch.bfloat16),
                    reason="oneDNN's bfloat16 product needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks")
@pytest.mark.parametrize("tokens", [1, 16, 130])
def test_hybrid_linear_in_bfloat16_equals_f_linear(tokens):
    """bfloat16 on a CPU takes "hybrid" too (oneDNN's packed bfloat16 product for more than one row): it must
    compute what F.linear does in bfloat16, to bfloat16's rounding (sums in float32 in both, rounded once)."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 64).bfloat16(), torch.randn(tokens, 64).bfloat16()
    lin = Linear(64, 48, method=get_linear_method("hybrid"))
    lin.weight.data = w.clone()
    lin.method.splits = 2
    lin.process_weights_after_loading()
    assert lin.method_state.packed.is_mkldnn
    got = lin(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (x.float() @ w.float().T), rtol=1.6e-2, atol=3e-2)


def test_bad_layouts_are_named(monkeypatch):
    with pytest.raises(ValueError, match="unknown Linear layout"):
        Linear(4, 4, method="fast")
    lin = Linear(4, 4, method=get_linear_method("onednn"))
    lin.weight.data = lin.weight.data.double()
    with pytest.raises(ValueError, match="float32"):
        lin.process_weights_after_loading()
    monkeypatch.setenv("MINFER_LINEAR_LAYOUT", "fastest")
    with pytest.raises(ValueError, match="MINFER_LINEAR_LAYOUT"):
        default_linear_method("cpu", torch.float32)
    monkeypatch.setenv("MINFER_LINEAR_LAYOUT", "split")
    assert default_linear_method("cpu", torch.float32).name == "split"
    monkeypatch.delenv("MINFER_LINEAR_LAYOUT")
    assert default_linear_method("cpu", torch.float32).name == ("hybrid" if onednn_available() else "split")
    assert default_linear_method("cpu", torch.bfloat16).name == (
        "hybrid" if onednn_supports(torch.bfloat16) else "split")
    assert default_linear_method("cuda", torch.bfloat16).name == "nn"
    assert default_linear_method("cpu", torch.float32, kernels="reference").name == "nn"
    assert set(LINEAR_METHODS) == {"nn", "split", "onednn", "hybrid", "panels"}


def test_weight_loader_keeps_integer_codes_and_refuses_floats_for_them():
    """A quantized method's integer parameter takes integer tensors bit for bit, never a cast float."""
    codes = torch.zeros(2, 3, dtype=torch.int32)
    default_weight_loader(codes, torch.tensor([[1, -2, 3], [2**31 - 1, 0, 7]], dtype=torch.int32))
    assert codes[1, 0] == 2**31 - 1
    with pytest.raises(ValueError, match="dtype mismatch"):
        default_weight_loader(codes, torch.ones(2, 3))
    with pytest.raises(ValueError, match="shape mismatch"):
        default_weight_loader(codes, torch.ones(3, 2, dtype=torch.int32))


@pytest.mark.parametrize("layout", ["split", pytest.param("onednn", marks=needs_onednn),
                                    pytest.param("hybrid", marks=needs_onednn)])
def test_merged_parts_land_in_their_rows_and_tied_embedding_reads_the_head(layout):
    torch.manual_seed(0)
    parts = [torch.randn(6, 8), torch.randn(4, 8), torch.randn(2, 8)]
    lin = Linear(8, output_sizes=[6, 4, 2], method=get_linear_method(layout))
    assert lin.weight.num_shards == 3
    for i, p in enumerate(parts):
        lin.weight.weight_loader(lin.weight, p, i)  # what the loader calls: the parameter's own loader
    emb = TiedEmbedding(lin)
    full = torch.cat(parts)
    assert process_weights_after_loading(lin) == layout
    assert lin.layout == layout
    if layout == "split":
        assert lin.method_state.splits in (max(1, torch.get_num_threads()), 1)
    x = torch.randn(3, 8)
    torch.testing.assert_close(lin(x), x @ full.T, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[0, 11], [5, 6]])
    assert torch.equal(emb(ids), full[ids])
    assert torch.equal(emb.weight, full)
    with pytest.raises(RuntimeError, match="before process_weights_after_loading"):
        lin.weight_loader(lin.weight, parts[0], 0)
