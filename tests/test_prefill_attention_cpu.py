"""The CPU prefill attention kernel (csrc/prefill_cpu.cpp, `minfer.cpu.attention.attend_prefill_cpu`) against the
torch reference `attend` in float64, its chunk invariance, and where it leaves the work to SDPA."""

from types import SimpleNamespace

import pytest
import torch

from minfer.attention.torch_ref import attend
from minfer.cpu import attention as cpu

pytestmark = pytest.mark.skipif(cpu._prefill_library() is None, reason="the C++ kernel does not build here")


def _layer(h, kvh, d, window=None, alibi=None):
    return SimpleNamespace(num_heads=h, num_kv_heads=kvh, scale=d ** -0.5, sliding_window=window, alibi_slopes=alibi)


def _ref(layer, q, k, v):
    return attend(layer, q.double(), k.double(), v.double())


@pytest.mark.parametrize("tq,tk,h,kvh,d", [(1, 1, 2, 1, 16), (5, 5, 9, 3, 64), (17, 17, 4, 2, 64), (192, 192, 9, 3, 64),
                                           (30, 100, 9, 3, 64), (70, 70, 2, 2, 80), (65, 129, 3, 1, 32),
                                           (9, 200, 1, 1, 8)])
def test_equals_the_reference(tq, tk, h, kvh, d):
    torch.manual_seed(tq * 7 + tk)
    layer = _layer(h, kvh, d)
    q, k, v = torch.randn(tq, h, d) * 2, torch.randn(tk, kvh, d) * 2, torch.randn(tk, kvh, d)
    out = cpu.attend_prefill_cpu(layer, q, k, v)
    assert out.dtype == torch.float32 and out.shape == (tq, h, d)
    torch.testing.assert_close(out.double(), _ref(layer, q, k, v), rtol=1e-5, atol=1e-5)


def test_strided_views_of_a_fused_projection():
    """q, k, v as the model hands them over: views into one q|k|v row of stride (H + 2 KVH) D."""
    torch.manual_seed(1)
    h, kvh, d, t = 4, 2, 32, 50
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    layer = _layer(h, kvh, d)
    torch.testing.assert_close(cpu.attend_prefill_cpu(layer, q, k, v).double(), _ref(layer, q, k, v),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_chunk_gives_the_whole_prompts_bits(threads):
    """Chunked prefill's rows equal the whole prompt's, bit for bit, at any split and thread count."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(2)
        layer = _layer(9, 3, 64)
        q, k, v = torch.randn(150, 9, 64), torch.randn(150, 3, 64), torch.randn(150, 3, 64)
        whole = cpu.attend_prefill_cpu(layer, q, k, v)
        for start in (1, 63, 64, 100, 149):
            assert torch.equal(cpu.attend_prefill_cpu(layer, q[start:], k, v), whole[start:]), start
    finally:
        torch.set_num_threads(old)


def test_what_it_leaves_to_sdpa(monkeypatch):
    calls = []
    import minfer.attention.torch_ref as ref

    real = ref.attend
    monkeypatch.setattr(ref, "attend", lambda *a: calls.append(1) or real(*a))
    q, k, v = torch.randn(6, 2, 16), torch.randn(6, 1, 16), torch.randn(6, 1, 16)
    cpu.attend_prefill_cpu(_layer(2, 1, 16), q, k, v)
    assert calls == []  # the kernel's case
    cpu.attend_prefill_cpu(_layer(2, 1, 16, window=3), q, k, v)  # a window shorter than the keys
    cpu.attend_prefill_cpu(_layer(2, 1, 16, alibi=torch.ones(2)), q, k, v)  # ALiBi
    cpu.attend_prefill_cpu(_layer(2, 1, 16), q.bfloat16(), k.bfloat16(), v.bfloat16())  # bfloat16
    cpu.attend_prefill_cpu(_layer(2, 1, 16), q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # D strided
    assert len(calls) == 4


def test_a_nan_reaches_exactly_the_rows_that_see_it():
    """A NaN in a query spoils its own row; a NaN in key j every row that sees j (rows >= j, causal), and no
    other: the softmax's exp keeps NaN (an overflow upstream must not come out as a finite answer), and masked
    keys still weigh exactly 0."""
    torch.manual_seed(3)
    t, h, kvh, d = 20, 4, 2, 64
    layer = _layer(h, kvh, d)
    q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    qn = q.clone()
    qn[5, 1, 3] = float("nan")
    bad = ~torch.isfinite(cpu.attend_prefill_cpu(layer, qn, k, v)).all(dim=-1)  # [t, h]
    want = torch.zeros(t, h, dtype=torch.bool)
    want[5, 1] = True
    assert torch.equal(bad, want)
    for j in (0, 5, 19):
        kn = k.clone()
        kn[j, 0, 7] = float("nan")  # K/V head 0: query heads 0 and 1
        bad = ~torch.isfinite(cpu.attend_prefill_cpu(layer, q, kn, v)).all(dim=-1)
        want = torch.zeros(t, h, dtype=torch.bool)
        want[j:, :2] = True
        assert torch.equal(bad, want), j
