"""A quantized KV cache (int8, fp8_e4m3, fp8_e5m2) in the Triton backend's kernels (article §5, §8-2).

(a) `paged_attention_decode` and `flash_attn_varlen` given int8/fp8 codes and per-token, per-head float32
    scales against the plain-torch references run on the dequantized K/V (`dequantize_kv`): the kernels
    dequantize on load, so the two see the same values and agree to float32 rounding.
(b) `TritonBackend` over a quantized pool against `PagedTorchBackend` (the reference backend) on the same pool:
    prefills with and without a cached prefix, chunks, decodes, mixed batches, GQA; the pools' bytes equal.
(c) Bad input: scales without int8/fp8 caches, scales of the wrong shape, a cast pool on "triton".
On a CPU the kernels run under Triton's interpreter: small shapes.
"""

import pytest
import torch

from minfer.attention import Attention, ForwardContext, PagedTorchBackend
from minfer.attention.kv_quant import dequantize_kv, kv_cache_spec, quantize_kv
from minfer.attention.triton import TritonBackend
from minfer.kernels import flash_attn_varlen, interpreter_active
from minfer.kernels.paged_decode import paged_attention_decode
from minfer.kernels.reference import flash_attn_varlen_reference, paged_attention_decode_reference
from tests.conftest import needs_default_model
from tests.test_triton_backend import CASES, make_batch

DEVICES = (["cpu"] if interpreter_active() else []) + (["cuda"] if torch.cuda.is_available() else [])
KV_DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]
TOL = 2e-4  # float32 queries: same dequantized values, only the order of the sums differs


def _quantized(x: torch.Tensor, name: str):
    """x [..., KVH, D] -> (codes, float32 scales [..., KVH]) as the pool stores them."""
    spec = kv_cache_spec(name, torch.float32)
    codes, scales = quantize_kv(x.reshape(-1, *x.shape[-2:]), spec)
    return codes.view(x.shape), scales.view(x.shape[:-1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", KV_DTYPES)
def test_paged_decode_dequantizes_on_load(device, name):
    g = torch.Generator().manual_seed(0)
    nb, bs, kvh, d, heads = 12, 16, 2, 32, 6
    kc, ks = _quantized(torch.randn(nb, bs, kvh, d, generator=g), name)
    vc, vs = _quantized(torch.randn(nb, bs, kvh, d, generator=g), name)
    bt = torch.randperm(nb, generator=g)[:9].view(3, 3).to(torch.int32)
    ctx = torch.tensor([1, 37, 45], dtype=torch.int32)
    q = torch.randn(3, heads, d, generator=g)
    out = paged_attention_decode(*(t.to(device) for t in (q, kc, vc, bt, ctx)), num_splits=2,
                                 k_scale=ks.to(device), v_scale=vs.to(device))
    ref = paged_attention_decode_reference(q, dequantize_kv(kc, ks, torch.float32), dequantize_kv(vc, vs, torch.float32),
                                           bt, ctx)
    torch.testing.assert_close(out.cpu(), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", KV_DTYPES)
def test_flash_prefill_dequantizes_on_load(device, name):
    g = torch.Generator().manual_seed(1)
    lens_q, lens_k = [5, 17], [12, 17]  # the first has a 7-token cached prefix
    q = torch.randn(sum(lens_q), 4, 32, generator=g)
    kc, ks = _quantized(torch.randn(sum(lens_k), 2, 32, generator=g), name)
    vc, vs = _quantized(torch.randn(sum(lens_k), 2, 32, generator=g), name)
    cu_q = torch.tensor([0, 5, 22], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 29], dtype=torch.int32)
    out = flash_attn_varlen(*(t.to(device) for t in (q, kc, vc, cu_q, cu_k)), 17, 17,
                            k_scale=ks.to(device), v_scale=vs.to(device))
    ref = flash_attn_varlen_reference(q, dequantize_kv(kc, ks, torch.float32), dequantize_kv(vc, vs, torch.float32),
                                      cu_q, cu_k)
    torch.testing.assert_close(out.cpu(), ref, atol=TOL, rtol=TOL)


def _run_both(seqs, num_heads, num_kv_heads, name, device, head_dim=32, block_size=4):
    pool, q, k, v, fields = make_batch(seqs, num_kv_heads, head_dim, block_size, torch.float32, device,
                                       num_heads=num_heads)
    spec = kv_cache_spec(name, torch.float32)
    codes, scales = _quantized(pool, name)  # the cached prefix, as a quantized pool holds it
    layer = Attention(0, num_heads, num_kv_heads, head_dim, scale=head_dim ** -0.5)
    outs, pools = [], []
    for cls in (PagedTorchBackend, TritonBackend):
        kv, sc = codes.clone(), scales.clone()
        backend = cls([kv], [sc], spec)
        outs.append(layer(q, k, v, ForwardContext(attn_backend=backend, **fields)))
        pools.append((kv.view(torch.uint8), sc))
    ref, out = outs
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", KV_DTYPES)
@pytest.mark.parametrize("case", ["prefill", "prefix_and_chunks", "decode", "mixed"])
def test_backend_matches_torch_reference_on_a_quantized_pool(device, name, case):
    _run_both(CASES[case], 6, 2, name, device)


def test_bad_scales_are_clear_errors():
    q = torch.randn(1, 2, 16)
    kc, ks = _quantized(torch.randn(2, 4, 1, 16), "int8")
    bt, ctx = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="both"):
        paged_attention_decode(q, kc, kc, bt, ctx, k_scale=ks)
    with pytest.raises(ValueError, match="int8/fp8"):
        paged_attention_decode(q, kc.float(), kc.float(), bt, ctx, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        paged_attention_decode(q, kc, kc, bt, ctx, k_scale=ks[:1], v_scale=ks[:1])
    with pytest.raises(ValueError, match="dtype"):  # codes without scales are not values
        paged_attention_decode(q, kc, kc, bt, ctx)
    with pytest.raises(ValueError, match="int8/fp8"):
        flash_attn_varlen(torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16),
                          torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 3, 3,
                          k_scale=torch.ones(3, 1), v_scale=torch.ones(3, 1))


def test_triton_refuses_a_cast_pool_but_takes_a_quantized_one():
    from minfer.attention import get_attn_backend
    from minfer.kv_cache import KVCachePool
    from tests.test_kv_cache_quant import CFG as cfg
    quant = KVCachePool(cfg, 2, 4, torch.float32, torch.device("cpu"), kv_cache_dtype="int8")
    assert isinstance(get_attn_backend("triton", quant.layers, quant.scales, quant.spec, torch.float32), TritonBackend)
    cast = KVCachePool(cfg, 2, 4, torch.float32, torch.device("cpu"), kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="triton"):
        get_attn_backend("triton", cast.layers, cast.scales, cast.spec, torch.float32)


@needs_default_model
@pytest.mark.slow
def test_real_model_engine_on_triton_with_int8_kv_equals_simple_path():
    """SmolLM2-135M, attention_backend="triton", kv_cache_dtype="int8": the engine's greedy tokens (flash prefill
    and paged decode over the quantized pool) equal the simple path's (contiguous cache quantized the same way).
    Under the interpreter every launch is slow: 2 short prompts, 3 tokens, as tests/test_triton_backend.py."""
    from minfer import LLM, SamplingParams

    llm = LLM(attention_backend="triton", kv_cache_dtype="int8", max_model_len=256, seed=0,
              kv_cache_memory_bytes=16 * 16 * 30 * 3 * 68 * 2)  # 16 blocks of 16 tokens with int8 codes + scales
    assert isinstance(llm.llm_engine.worker.backend, TritonBackend) and llm.llm_engine.worker.pool.scales is not None
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = [llm.generate_simple(p, sp)[0].outputs[0].token_ids for p in prompts]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    assert llm.llm_engine.all_blocks_free()
