"""Fused kernels (RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE, sampling) against torch (article §4).

Tolerances: fp32 1e-5; fp16/bf16 one rounding of the output (the kernels compute in fp32 and cast once,
like the references), checked with rtol 1e-2 / 2e-2 to allow a last-bit difference (the CPU interpreter
truncates fp32 -> bf16 instead of rounding to nearest).
Sampling: greedy must be exact; 20k draws over a vocabulary of 8 must be within total-variation 0.03 of
the target distribution (the expected TV of 20k draws from these distributions is ~0.005-0.01).
"""


import pytest
import torch

from minfer.kernels import (
    apply_rotary_,
    fused_add_rms_norm,
    fused_sample,
    interpreter_active,
    rms_norm,
    silu_and_mul,
)
from minfer.kernels import reference as R

# CPU tensors only work under Triton's interpreter (set automatically when there is no GPU).
DEVICES = (["cpu"] if interpreter_active() else []) + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 576])
def test_rms_norm(device, dtype, hidden):
    x = _randn(2, 3, hidden, dtype=dtype, device=device)
    w = _randn(hidden, dtype=dtype, device=device, seed=1)
    out = rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, R.rms_norm_reference(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(device, dtype):
    x = _randn(5, 40, dtype=dtype, device=device)
    res = _randn(5, 40, dtype=dtype, device=device, seed=1)
    w = _randn(40, dtype=dtype, device=device, seed=2)
    x0, res0 = x.clone(), res.clone()
    out, res_new = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = R.fused_add_rms_norm_reference(x, res, w, 1e-6)
    # one fp32 add, one rounding: exact, except that Triton's CPU interpreter rounds fp32 -> bf16 toward
    # zero (the GPU rounds to nearest even), so bf16 may differ by one unit in the last place.
    exact = dict(atol=0, rtol=0) if dtype != torch.bfloat16 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(res_new, ref_res, **exact)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [7, 64, 1500])
def test_silu_and_mul(device, dtype, inter):
    x = _randn(3, 2 * inter, dtype=dtype, device=device)
    out = silu_and_mul(x)
    assert out.shape == (3, inter)
    torch.testing.assert_close(out, R.silu_and_mul_reference(x), **TOL[dtype])


def _rotate_half_hf(x, cos, sin):
    """HF Llama's formulation (independent of the reference): x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    c = torch.cat([cos, cos], -1)[:, None, :]
    s = torch.cat([sin, sin], -1)[:, None, :]
    return (x.float() * c + rot.float() * s).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 4, 2, 16), (3, 9, 3, 64), (2, 8, 1, 80)], ids=["gqa2", "smollm", "mqa80"])
def test_apply_rotary_in_place_on_qkv_views(device, dtype, shape):
    T, H, KVH, D = shape
    qkv = _randn(T, (H + 2 * KVH) * D, dtype=dtype, device=device)
    q = qkv[:, :H * D].view(T, H, D)  # strided views, as the engine gets them from one projection
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    pos = torch.arange(T, device=device).float() * 7
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = ang.cos(), ang.sin()
    want_q, want_k = _rotate_half_hf(q, cos, sin), _rotate_half_hf(k, cos, sin)
    ref_q, ref_k = R.apply_rotary_reference(q, k, cos, sin)
    v_before = qkv[:, (H + KVH) * D:].clone()
    got_q, got_k = apply_rotary_(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(qkv[:, (H + KVH) * D:], v_before)  # V part of the buffer untouched


# ---------------------------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_is_exact_argmax(device, dtype):
    logits = _randn(37, 300, dtype=dtype, device=device)
    logits[3, 10] = logits[3, 200] = logits[3].max() + 1  # a tie: torch.argmax picks the first
    B = logits.shape[0]
    temp = torch.zeros(B, device=device)
    top_k = torch.tensor([-1, 5] * 18 + [-1], device=device)  # filters must not change greedy
    top_p = torch.tensor([1.0, 0.5] * 18 + [1.0], device=device)
    assert torch.equal(fused_sample(logits, temp, top_k, top_p), logits.float().argmax(-1))
    assert torch.equal(fused_sample(logits, temp, -torch.ones_like(top_k), torch.ones_like(top_p)),
                       logits.float().argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_is_greedy_and_mixed_batch(device):
    logits = _randn(16, 50, device=device)
    temp = torch.tensor([1.0, 0.0] * 8, device=device)
    top_k = torch.tensor([1, -1] * 8, device=device)
    out = fused_sample(logits, temp, top_k, torch.ones(16, device=device))
    assert torch.equal(out, logits.argmax(-1))


CASES = {  # temperature, top_k, top_p
    "plain": (1.0, -1, 1.0),
    "hot": (1.7, -1, 1.0),
    "top_k3_cold": (0.7, 3, 1.0),
    "top_p0.8": (1.0, -1, 0.8),
    "top_k5_top_p0.9": (1.3, 5, 0.9),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_distribution_of_20k_draws(device, case):
    t, k, p = CASES[case]
    n, vocab = 20000, 8
    logits = torch.tensor([[1.5, -0.3, 0.8, 2.0, -1.0, 0.1, 1.1, 0.4]], device=device).repeat(n, 1)
    temp = torch.full((n,), t, device=device)
    top_k = torch.full((n,), k, device=device)
    top_p = torch.full((n,), p, device=device)
    draws = fused_sample(logits, temp, top_k, top_p, seeds=torch.arange(n, device=device) * 7919 + 1)
    assert draws.dtype == torch.int64 and draws.shape == (n,)
    empirical = torch.bincount(draws, minlength=vocab).float().cpu() / n
    target = R.sampling_probs_reference(logits[:1].cpu(), temp[:1].cpu(), top_k[:1].cpu(), top_p[:1].cpu())[0]
    assert torch.all(empirical[target == 0] == 0), "a filtered-out token was drawn"
    tv = 0.5 * (empirical - target).abs().sum().item()
    assert tv < 0.03, f"total variation {tv:.4f}: {empirical} vs {target}"


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_draws(device):
    logits = _randn(64, 1000, device=device)
    temp = torch.ones(64, device=device)
    top_k = torch.full((64,), 50, device=device)
    top_p = torch.full((64,), 0.95, device=device)
    seeds = torch.arange(64, device=device) + 123
    a = fused_sample(logits, temp, top_k, top_p, seeds=seeds)
    b = fused_sample(logits, temp, top_k, top_p, seeds=seeds)
    c = fused_sample(logits, temp, top_k, top_p, seeds=seeds + 1000)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(5)
    d = fused_sample(logits, temp, top_k, top_p)
    torch.manual_seed(5)
    e = fused_sample(logits, temp, top_k, top_p)
    assert torch.equal(d, e)  # seeds=None draws its seeds from torch's generator


def test_errors():
    with pytest.raises(ValueError):
        rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError):
        apply_rotary_(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError):
        fused_sample(torch.randn(2, 8), torch.ones(3), torch.ones(2, dtype=torch.long), torch.ones(2))
