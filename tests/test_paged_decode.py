"""Paged decode attention (Flash-Decoding) and store_kvcache against the torch references (article §4).

Tiny shapes: on a CPU the kernels run under Triton's interpreter. Tolerances as in test_flash_attention.
"""


import pytest
import torch

from minfer.kernels import (
    flash_attn_varlen,
    interpreter_active,
    store_kvcache,
)
from minfer.kernels.paged_decode import combine_splits, paged_attention_decode, paged_decode_splits
from minfer.kernels.reference import attention_reference, paged_attention_decode_reference, store_kvcache_reference

# CPU tensors only work under Triton's interpreter (set automatically when there is no GPU).
DEVICES = (["cpu"] if interpreter_active() else []) + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _paged(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Random caches and a SHUFFLED block table: each sequence's blocks are scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in context_lens) + 1  # one spare column, never read
    num_blocks = len(context_lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    block_table = torch.randperm(num_blocks, generator=g)[:len(context_lens) * max_blocks]
    block_table = block_table.view(len(context_lens), max_blocks).to(torch.int32)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    return (q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), block_table.to(device),
            ctx.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(device, dtype, heads, block_size):
    q, kc, vc, bt, ctx = _paged([1, 37, 70, 16], heads[0], heads[1], 32, block_size, dtype, device)
    out = paged_attention_decode(q, kc, vc, bt, ctx, num_splits=3)
    ref = paged_attention_decode_reference(q, kc, vc, bt, ctx)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 5, 16, None])
def test_num_splits_do_not_change_the_result(device, num_splits):
    # 16 splits of a 3-token sequence: most splits are empty and must drop out of the merge
    q, kc, vc, bt, ctx = _paged([3, 90], 4, 2, 16, 16, torch.float32, device)
    out = paged_attention_decode(q, kc, vc, bt, ctx, num_splits=num_splits)
    torch.testing.assert_close(out, paged_attention_decode_reference(q, kc, vc, bt, ctx), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [(0, -1), (9, -1), (40, 0)])
@pytest.mark.parametrize("alibi", [False, True])
def test_window_and_alibi(device, window, alibi):
    q, kc, vc, bt, ctx = _paged([5, 50, 33], 6, 3, 16, 16, torch.float32, device)
    slopes = torch.rand(6, device=device) if alibi else None
    out = paged_attention_decode(q, kc, vc, bt, ctx, window_size=window, alibi_slopes=slopes, num_splits=2)
    ref = paged_attention_decode_reference(q, kc, vc, bt, ctx, window_size=window, alibi_slopes=slopes)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_splits_merge_to_the_log_sum_exp(device):
    """The partials of kernel 1 combine to the full softmax's log-sum-exp: M + log(sum_s l_s e^(m_s - M))."""
    q, kc, vc, bt, ctx = _paged([45], 2, 2, 16, 16, torch.float32, device)
    m, l, acc = paged_decode_splits(q, kc, vc, bt, ctx, num_splits=3)
    assert m.shape == (1, 2, 3) and acc.shape == (1, 2, 3, 16)
    big_m = m.max(-1, keepdim=True).values
    lse = big_m.squeeze(-1) + torch.log((l * torch.exp(m - big_m)).sum(-1))
    k = kc[bt[0, :3].long()].flatten(0, 1)[:45]
    v = vc[bt[0, :3].long()].flatten(0, 1)[:45]
    _, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(lse[0], ref_lse[:, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(combine_splits(m, l, acc), paged_attention_decode_reference(q, kc, vc, bt, ctx),
                               atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_context_gives_zero(device):
    q, kc, vc, bt, ctx = _paged([0, 4], 2, 1, 16, 16, torch.float32, device)
    out = paged_attention_decode(q, kc, vc, bt, ctx, num_splits=2)
    assert torch.all(out[0] == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kvcache(device, dtype, block_size):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(7, 3, 8, generator=g).to(device, dtype)
    v = torch.randn(7, 3, 8, generator=g).to(device, dtype)
    kc = torch.zeros(5, block_size, 3, 8, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([0, block_size * 3 + 5, -1, 2 * block_size - 1, block_size * 4, -1, 7], device=device)
    kc2, vc2 = kc.clone(), vc.clone()
    store_kvcache(k, v, kc, vc, slots)
    store_kvcache_reference(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert int((kc != 0).any(-1).any(-1).sum()) == 5  # the two -1 slots wrote nothing


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_then_decode_agree(device):
    """Prompt K/V written with store_kvcache, then the decode kernel for the last token must equal the last
    row of flash_attn_varlen over the whole prompt (two kernels, one answer)."""
    H, KVH, D, bs = 6, 2, 32, 16
    lens = [23, 40]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lens), H, D, generator=g).to(device)
    k = torch.randn(sum(lens), KVH, D, generator=g).to(device)
    v = torch.randn(sum(lens), KVH, D, generator=g).to(device)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
    prefill = flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens))

    kc = torch.zeros(12, bs, KVH, D, device=device)
    vc = torch.zeros_like(kc)
    block_table = torch.tensor([[7, 2, 0], [11, 4, 9]], dtype=torch.int32, device=device)
    slots = torch.cat([block_table[b].long().repeat_interleave(bs)[:n] * bs + torch.arange(n, device=device) % bs
                       for b, n in enumerate(lens)])
    store_kvcache(k, v, kc, vc, slots)
    last = torch.tensor(lens, device=device).cumsum(0) - 1
    out = paged_attention_decode(q[last], kc, vc, block_table, torch.tensor(lens, dtype=torch.int32, device=device),
                                 num_splits=2)
    torch.testing.assert_close(out, prefill[last], atol=2e-4, rtol=2e-4)


def test_errors():
    q, kc, vc, bt, ctx = _paged([5], 4, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="int32"):
        paged_attention_decode(q, kc, vc, bt.long(), ctx)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode(q, kc, vc, bt, ctx, num_splits=0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(q[:, :3], kc, vc, bt, ctx)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(q[:, :2], q[:, :2], kc, vc, torch.zeros(2))
