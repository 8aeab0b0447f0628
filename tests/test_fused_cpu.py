"""The fused CPU element-wise ops (minfer/cpu/fused_ops.py, cpu/csrc/fused_cpu.cpp) against the torch ops
they replace (RMSNorm, add + RMSNorm, SiLU-and-mul, rotate-half RoPE of minfer/model/layers.py, positions.py),
and a model built with them against transformers and against the same model in plain torch.

Tolerance: float32, 1e-5 (a few ulps: the C++ sums and exps in another order than torch). Batch invariance:
bit for bit, whatever the rows' count, address and thread split.

    pytest tests/test_fused_cpu.py
"""

import pytest
import torch

from minfer.cpu import fused_ops as fc
from minfer.generate import SimpleGenerator
from minfer.model.layers import RMSNorm, silu_and_mul
from minfer.model.loader import load_model
from minfer.model.positions import rotate_half_
from tests.conftest import assert_logits_close
from tests.test_llama import CASES, make_hf_model

pytestmark = pytest.mark.skipif(not fc.fused_cpu_available(), reason="the fused CPU ops do not build here")
TOL = dict(atol=1e-5, rtol=1e-5)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [0, 1, 3, 37])
@pytest.mark.parametrize("hidden", [48, 576, 577])
def test_rms_norm_and_fused_add(rows, hidden):
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = _randn(hidden, seed=2)
    x, r = _randn(rows, hidden), _randn(rows, hidden, seed=1)
    torch.testing.assert_close(fc.rms_norm(x, norm.weight, 1e-5), norm(x), **TOL)
    out, res = fc.fused_add_rms_norm(x, r, norm.weight, 1e-5)
    ref_out, ref_res = norm(x, r)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)  # one float32 add: exact
    torch.testing.assert_close(out, ref_out, **TOL)
    assert torch.equal(r, _randn(rows, hidden, seed=1))  # inputs untouched


def test_rms_norm_strided_rows():
    """Rows of a wider tensor (a view whose rows are not back to back) and a 3-D input (Qwen3's per-head norm)."""
    wide = _randn(5, 100)
    x, w = wide[:, 10:74], _randn(64, seed=3)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = w
    torch.testing.assert_close(fc.rms_norm(x, w, 1e-6), norm(x), **TOL)
    q = _randn(4, 9 * 64 + 192)[:, :576].view(4, 9, 64)
    torch.testing.assert_close(fc.rms_norm(q, w, 1e-6), norm(q), **TOL)


@pytest.mark.parametrize("rows,inter", [(0, 8), (1, 8), (7, 1536), (33, 100)])
def test_silu_and_mul(rows, inter):
    x = _randn(rows, 2 * inter) * 4
    torch.testing.assert_close(fc.silu_and_mul(x), silu_and_mul(x), **TOL)


@pytest.mark.parametrize("tokens,heads,kv_heads,d", [(0, 4, 2, 8), (1, 9, 3, 64), (19, 4, 1, 32), (5, 2, 2, 128)])
def test_rotary_in_place_on_qkv_views(tokens, heads, kv_heads, d):
    """q and k are views of one q|k|v row (rows heads*d + 2*kv_heads*d floats apart), rotated in place."""
    qkv = _randn(tokens, (heads + 2 * kv_heads) * d)
    cos, sin = _randn(tokens, d // 2, seed=1), _randn(tokens, d // 2, seed=2)
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    ref_q, ref_k = rotate_half_(q.clone(), cos, sin), rotate_half_(k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    out_q, out_k = fc.apply_rotary_(q, k, cos, sin)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, ref_q, **TOL)
    torch.testing.assert_close(k, ref_k, **TOL)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v untouched


def test_rotary_other_head_stride():
    """A head stride other than D (heads interleaved with something else) is followed, not assumed."""
    buf = _randn(3, 4, 2, 16)
    q, k = buf[:, :, 0], buf[:, :2, 1]  # head stride 32, D = 16
    cos, sin = _randn(3, 8, seed=1), _randn(3, 8, seed=2)
    ref_q, ref_k = rotate_half_(q.clone(), cos, sin), rotate_half_(k.clone(), cos, sin)
    fc.apply_rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, ref_q, **TOL)
    torch.testing.assert_close(k, ref_k, **TOL)


def _placed(x, offset):
    """x copied into a bigger buffer, `offset` floats in: the same values at another address (alignment)."""
    buf = torch.zeros(x.numel() + 64)
    view = buf[offset:offset + x.numel()].view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("width", [576, 100, 13])
def test_rows_are_bit_identical_whatever_the_batch_and_the_address(width):
    """Batch invariance (what the engine-vs-simple-path tests need): each row of a 64-row call, computed again
    alone (T = 1), in 7-row slices, and from addresses 1, 3 and 5 floats off, gives the same bits, for all four
    ops, and with 1 and 2 threads."""
    x, r, w = _randn(64, 2 * width) * 3, _randn(64, 2 * width, seed=1), _randn(2 * width, seed=2)
    ops = {
        "rms_norm": lambda a, b: fc.rms_norm(a, w, 1e-5),
        "fused_add_rms_norm": lambda a, b: torch.cat(fc.fused_add_rms_norm(a, b, w, 1e-5), -1),
        "silu_and_mul": lambda a, b: fc.silu_and_mul(a),
        "rotary": lambda a, b: torch.cat(fc.apply_rotary_(
            a.clone().view(a.shape[0], 2, width), b[:, :width].clone().view(a.shape[0], 1, width),
            b[:, :width // 2].contiguous(), b[:, width // 2:width].contiguous()), 1).flatten(1),
    }
    threads = torch.get_num_threads()
    try:
        for name, op in ops.items():
            if name == "rotary" and width % 2:
                continue
            torch.set_num_threads(2)
            full = op(x, r)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for rows in (1, 7):
                    for start in range(0, 64 - rows + 1, 19):
                        for offset in (0, 1, 3, 5):
                            got = op(_placed(x[start:start + rows], offset), _placed(r[start:start + rows], offset + 2))
                            assert torch.equal(got, full[start:start + rows]), (name, n_threads, rows, start, offset)
    finally:
        torch.set_num_threads(threads)


def test_exp_of_silu_holds_at_the_extremes():
    """SiLU through the own exp: large negative and positive gates, where exp under- or overflows."""
    g = torch.tensor([[-200.0, -90.0, -87.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.5, 200.0]])
    x = torch.cat((g, torch.ones_like(g)), -1)
    torch.testing.assert_close(fc.silu_and_mul(x), silu_and_mul(x), **TOL)


def test_bad_input_is_refused():
    x = _randn(2, 8)
    with pytest.raises(ValueError, match="float32 CPU"):
        fc.rms_norm(x.double(), torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        fc.rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="must match"):
        fc.fused_add_rms_norm(x, _randn(3, 8), torch.ones(8))
    with pytest.raises(ValueError, match="even"):
        fc.silu_and_mul(_randn(2, 7))
    with pytest.raises(ValueError, match="cos and sin"):
        fc.apply_rotary_(_randn(2, 2, 8), _randn(2, 1, 8), _randn(2, 3), _randn(2, 4))
    with pytest.raises(ValueError, match="contiguous along the last dim"):
        fc.apply_rotary_(_randn(2, 2, 16)[..., ::2], _randn(2, 1, 8), _randn(2, 4), _randn(2, 4))


@pytest.mark.parametrize("case", ["llama-gqa-tied", "qwen2-bias", "qwen3-qknorm", "llama-yarn"])
def test_model_with_fused_cpu_ops_matches_transformers_and_plain_torch(tmp_path, case):
    cfg_name, overrides = CASES[case]
    hf = make_hf_model(tmp_path, cfg_name, overrides)
    ids = [int(i) for i in _randn(23).abs().mul(50).long() % 320]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    fused = load_model(str(tmp_path), dtype="float32", device="cpu", fused_ops="cpu")
    plain = load_model(str(tmp_path), dtype="float32", device="cpu", fused_ops=False)
    layer = fused.model.model.layers[0]
    assert layer.input_layernorm.fused and layer.mlp.act is fc.silu_and_mul  # the C++ ops really run
    assert not plain.model.model.layers[0].input_layernorm.fused
    logits = {}
    for name, lm in (("fused", fused), ("plain", plain)):
        gen = SimpleGenerator(lm.model)
        logits[name] = gen.prefill_logits(ids, gen.new_cache(len(ids)))
    assert_logits_close(logits["fused"], ref)
    assert_logits_close(logits["fused"], logits["plain"])


def test_loader_keeps_plain_torch_where_the_cpu_ops_do_not_apply(tmp_path):
    cfg_name, overrides = CASES["llama-gqa-tied"]
    make_hf_model(tmp_path, cfg_name, overrides)
    bf16 = load_model(str(tmp_path), dtype="bfloat16", device="cpu", fused_ops="cpu")
    assert not bf16.model.model.layers[0].input_layernorm.fused
    # kernels="reference": the platform keeps plain torch, even where "cpu" is asked for
    off = load_model(str(tmp_path), dtype="float32", device="cpu", fused_ops="cpu", kernels="reference")
    assert not off.model.model.layers[0].input_layernorm.fused
    assert not load_model(str(tmp_path), dtype="float32", device="cpu",
                          kernels="reference").model.model.layers[0].input_layernorm.fused
    # kernels="auto" (the default, the worker's too): the platform's choice, on for float32
    assert load_model(str(tmp_path), dtype="float32", device="cpu").model.model.layers[0].input_layernorm.fused


def test_zero_dim_input_is_a_clear_error():
    x = torch.tensor(1.0)
    with pytest.raises(ValueError, match="0-d"):
        fc.rms_norm(x, torch.ones(1))
    with pytest.raises(ValueError, match="0-d"):
        fc.silu_and_mul(x)
