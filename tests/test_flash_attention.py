"""flash_attn_varlen (Triton, FlashAttention-2) against the naive torch reference (article §4).

On a machine without CUDA the kernel runs under Triton's CPU interpreter, so shapes are tiny. The same
tests run on CUDA when it is present (the `device` parameter).

Tolerances (max abs error of outputs whose entries are O(1)): fp32 2e-4 (fp32 accumulation either way);
fp16 4e-3 (P is rounded to fp16 before the PV product); bf16 3e-2 (8-bit mantissa).
"""

import math

import pytest
import torch

from minfer.kernels import interpreter_active
from minfer.kernels.flash_attention import flash_attn_varlen
from minfer.kernels.reference import attention_reference, flash_attn_varlen_reference

# CPU tensors only work under Triton's interpreter (set automatically when there is no GPU).
DEVICES = (["cpu"] if interpreter_active() else []) + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _packed(lens_q, lens_k, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(lens_q)).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(lens_k)).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), num_heads, head_dim, generator=g)
    k = torch.randn(int(cu_k[-1]), num_kv_heads, head_dim, generator=g)
    v = torch.randn(int(cu_k[-1]), num_kv_heads, head_dim, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)] + [cu_q.to(device), cu_k.to(device)]


def _check(lens_q, lens_k, num_heads, num_kv_heads, head_dim, dtype, device, **kw):
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, num_heads, num_kv_heads, head_dim, dtype, device)
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **kw)
    ref, ref_lse = flash_attn_varlen_reference(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (num_heads, q.shape[0]) and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # rows that see no key: lse = -inf in both
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa8"])
def test_causal_batch_of_short_and_long(device, dtype, heads):
    lens = [1, 17, 40, 5]  # odd lengths, a single-token sequence, several tiles of 16
    _check(lens, lens, heads[0], heads[1], 32, dtype, device, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [8, 16, 64, 80, 96, 128])
def test_head_dims(device, head_dim):
    # 80 and 96 are padded to 128 inside the kernel; 8 to 16.
    _check([19, 3], [19, 3], 4, 2, head_dim, torch.float16, device, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_keys_than_queries(device, dtype):
    # chunked prefill / prefix-cache hit: the queries are the LAST lens_q positions of the keys
    _check([5, 16, 1, 20], [37, 16, 20, 52], 6, 3, 32, dtype, device, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_more_queries_than_keys_gives_zero_rows(device):
    # query i sits at position Lk - Lq + i < 0 for the first rows: they see nothing -> 0, lse -inf
    q, k, v, cu_q, cu_k = _packed([9], [4], 2, 2, 16, torch.float32, device)
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 9, 4, causal=True, return_lse=True)
    assert torch.all(out[:5] == 0) and torch.all(lse[:, :5] == float("-inf"))
    _check([9], [4], 2, 2, 16, torch.float32, device, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [(8, -1), (0, 0), (5, 3), (-1, 4), (20, 20)])
def test_sliding_window(device, causal, window):
    _check([33, 6], [41, 6], 4, 2, 16, torch.float32, device, causal=causal, window_size=window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_alibi(device, causal, dtype):
    slopes = torch.tensor([2 ** (-8 * (i + 1) / 6) for i in range(6)], dtype=torch.float32, device=device)
    _check([21, 2], [30, 2], 6, 3, 32, dtype, device, causal=causal, alibi_slopes=slopes)


@pytest.mark.parametrize("device", DEVICES)
def test_alibi_with_window_and_scale(device):
    slopes = torch.rand(4, device=device)
    _check([25], [25], 4, 1, 16, torch.float32, device, causal=True, window_size=(7, -1), alibi_slopes=slopes,
           softmax_scale=0.3)


@pytest.mark.parametrize("device", DEVICES)
def test_reference_matches_torch_sdpa(device):
    """The reference itself, against torch's own attention, so the tests do not compare two equal bugs."""
    q, k, v, _, _ = _packed([23], [23], 4, 4, 16, torch.float32, device)
    ref = attention_reference(q, k, v, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                            v.transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(ref, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_views_of_fused_qkv(device):
    """q, k, v as column slices of one [T, (H + 2*KVH) * D] projection output (not contiguous)."""
    T, H, KVH, D = 29, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * KVH) * D, device=device)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    assert not q.is_contiguous()
    cu = torch.tensor([0, 11, T], dtype=torch.int32, device=device)
    out = flash_attn_varlen(q, k, v, cu, cu, 18, 18)
    ref = flash_attn_varlen_reference(q, k, v, cu, cu)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_default_scale_is_inverse_sqrt_head_dim(device):
    q, k, v, cu_q, cu_k = _packed([10], [10], 2, 2, 32, torch.float32, device)
    a = flash_attn_varlen(q, k, v, cu_q, cu_k, 10, 10)
    b = flash_attn_varlen(q, k, v, cu_q, cu_k, 10, 10, softmax_scale=1 / math.sqrt(32))
    torch.testing.assert_close(a, b)


def test_errors():
    q, k, v, cu_q, cu_k = _packed([4], [4], 4, 3, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 4, 4)
    q, k, v, cu_q, cu_k = _packed([4], [4], 4, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="int32"):
        flash_attn_varlen(q, k, v, cu_q.long(), cu_k, 4, 4)
    with pytest.raises(ValueError, match="dtype"):
        flash_attn_varlen(q.half(), k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="alibi"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 4, 4, alibi_slopes=torch.ones(3))
