"""The C++ decode-attention kernel (minfer/cpu/attention.py, cpu/csrc/paged_decode_cpu.cpp) against
`attend` run on each sequence alone, and the engine's choice of backend.

    pytest tests/test_paged_attention_cpu.py
"""

import random
import shutil

import pytest
import torch

from minfer.attention import Attention, ForwardContext, PagedTorchBackend, attend
from minfer.cpu import attention as cpu
from minfer.model.positions import alibi_slopes
from tests.test_paged_torch_backend import _pool_and_tables

needs_kernel = pytest.mark.skipif(not cpu.cpu_kernel_available(), reason="no C++ compiler/ninja to build the kernel")


def test_kernel_builds_where_a_compiler_is():
    """Where a C++ compiler and ninja exist (this project's CI), the kernel must build: a broken build must
    fail here, not silently fall back to the slower reference everywhere."""
    if not (shutil.which("c++") or shutil.which("g++")) or not shutil.which("ninja"):
        pytest.skip("no C++ compiler or ninja on this machine")
    cpu._library.cache_clear()
    cpu._library()


@needs_kernel
@pytest.mark.parametrize("num_seqs", [3, 19])  # fewer / more than 4 x threads: per-head and per-sequence items
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (8, 1, 48)])  # GQA, MHA (D=128), MQA (generic D)
@pytest.mark.parametrize("bs", [1, 16, 32])
def test_kernel_equals_attend(num_seqs, heads, bs):
    h, kvh, d = heads
    rng = random.Random(num_seqs * bs)
    lens = [rng.randint(1, 150) for _ in range(num_seqs)]
    kv, tables, dense = _pool_and_tables(lens, bs, kvh, d, seed=bs)
    layer = Attention(0, h, kvh, d, scale=d ** -0.5)
    q = torch.randn(num_seqs, h, d)
    out = cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables, torch.tensor(lens), layer.scale)
    for i in range(num_seqs):
        torch.testing.assert_close(out[i:i + 1], attend(layer, q[i:i + 1], *dense[i]), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window,alibi", [(7, False), (None, True), (20, True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_window_alibi_threads(window, alibi, threads):
    h, kvh, d, bs = 6, 2, 16, 4
    lens = [1, 2, 7, 8, 9, 40, 90, 3, 64, 65]
    kv, tables, dense = _pool_and_tables(lens, bs, kvh, d, seed=1)
    layer = Attention(0, h, kvh, d, scale=d ** -0.5, sliding_window=window,
                      alibi_slopes=alibi_slopes(h) if alibi else None)
    q = torch.randn(len(lens), h, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables, torch.tensor(lens), layer.scale, window,
                                             layer.alibi_slopes)
    finally:
        torch.set_num_threads(before)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i:i + 1], attend(layer, q[i:i + 1], *dense[i]), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_backend_mixed_prefill_and_decode_equals_torch_reference():
    """A forward with a prefill chunk (cached prefix) and decodes: CpuPagedBackend == PagedTorchBackend."""
    h, kvh, d, bs = 6, 2, 16, 4
    lens = [30, 11, 5, 26]  # sequence 0 is a chunk of 6 new tokens after 24 cached; the rest decode
    kv, tables, _ = _pool_and_tables(lens, bs, kvh, d, seed=2)
    layer = Attention(0, h, kvh, d, scale=d ** -0.5)
    new = 6 + 3
    q, k, v = torch.randn(new, h, d), torch.randn(new, kvh, d), torch.randn(new, kvh, d)
    positions = torch.tensor(list(range(24, 30)) + [n - 1 for n in lens[1:]])
    slots = torch.tensor([int(tables[s, p // bs]) * bs + p % bs
                          for s, p in [(0, p) for p in range(24, 30)] + [(i, lens[i] - 1) for i in range(1, 4)]])
    outs = []
    for backend in (PagedTorchBackend([kv.clone()]), cpu.CpuPagedBackend([kv.clone()])):
        ctx = ForwardContext(attn_backend=backend, positions=positions, num_prefills=1, num_prefill_tokens=6,
                             cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, 30], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=30,
                             slot_mapping=slots, block_tables=tables, context_lens=torch.tensor(lens, dtype=torch.int32))
        outs.append(layer(q, k, v, ctx))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 48)])
def test_bfloat16_pool_equals_attend_on_its_widened_values(heads):
    """A bfloat16 pool (a bfloat16 model's): the kernel widens each K/V element to float32 as it reads it, so
    it must equal float32 attention over the same (bfloat16-rounded) K/V; and the backend, given a bfloat16
    query, answers in bfloat16 what the float32 kernel answers for the widened query."""
    h, kvh, d = heads
    lens = [1, 5, 17, 33, 64, 100, 2, 9, 40]
    kv, tables, dense = _pool_and_tables(lens, 16, kvh, d, seed=5)
    kv16 = kv.to(torch.bfloat16)
    layer = Attention(0, h, kvh, d, scale=d ** -0.5)
    q = torch.randn(len(lens), h, d).to(torch.bfloat16).float()
    out = cpu.paged_attention_decode_cpu(q, kv16[0], kv16[1], tables, torch.tensor(lens), layer.scale)
    for i in range(len(lens)):
        keys, vals = (x.to(torch.bfloat16).float() for x in dense[i])
        torch.testing.assert_close(out[i:i + 1], attend(layer, q[i:i + 1], keys, vals), rtol=1e-5, atol=1e-5)
    backend = cpu.CpuPagedBackend([kv16.clone()])
    ctx = ForwardContext(attn_backend=backend, positions=torch.tensor([n - 1 for n in lens]), num_prefills=0,
                         num_prefill_tokens=0, cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
                         cu_seqlens_k=torch.zeros(1, dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=max(lens),
                         slot_mapping=torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16
                                                    for i, n in enumerate(lens)]),
                         block_tables=tables, context_lens=torch.tensor(lens, dtype=torch.int32))
    ctx.attn_metadata = backend.prepare(ctx)
    # the new K/V are the ones already in the pool at each sequence's last position
    k_new = torch.stack([kv16[0].flatten(0, 1)[int(s)] for s in ctx.slot_mapping])
    v_new = torch.stack([kv16[1].flatten(0, 1)[int(s)] for s in ctx.slot_mapping])
    got = backend.forward(layer, q.to(torch.bfloat16), k_new, v_new, ctx)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, out.to(torch.bfloat16), rtol=0, atol=0)


@needs_kernel
def test_kernel_rejects_what_it_cannot_read():
    kv = torch.zeros(2, 4, 16, 2, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        cpu.paged_attention_decode_cpu(torch.zeros(1, 4, 8, dtype=torch.float64), kv[0], kv[1], tables, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.paged_attention_decode_cpu(torch.zeros(1, 8, 4).transpose(1, 2), kv[0], kv[1], tables, lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        cpu.paged_attention_decode_cpu(torch.zeros(1, 3, 8), kv[0], kv[1], tables, lens, 1.0)
    with pytest.raises(cpu.CpuKernelUnavailable, match="float32"):
        cpu.CpuPagedBackend([kv.to(torch.float16)])
    q = torch.zeros(1, 4, 8)
    # Out-of-range lengths or block ids would make the C++ read outside the pool: refused up front.
    with pytest.raises(ValueError, match="context_lens"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables, torch.tensor([17]), 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables, torch.tensor([0]), 1.0)
    with pytest.raises(ValueError, match="block ids"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], torch.tensor([[4]]), lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], torch.zeros(2, 1, dtype=torch.int32), lens, 1.0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables, lens, 1.0, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="same shape"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1, :3], tables, lens, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables, lens, 1.0, out=torch.zeros(1, 4, 9))
    assert cpu.paged_attention_decode_cpu(q[:0], kv[0], kv[1], tables[:0], lens[:0], 1.0).shape == (0, 4, 8)
    # int64 ids are checked before the int32 cast (2**32 + 1 must not wrap to block 1); floats are refused.
    with pytest.raises(ValueError, match="block ids"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], torch.tensor([[2**32 + 1]]), lens, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables, torch.tensor([2**32 + 1]), 1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables.float(), lens, 1.0)
    for window in (-3, 0, True, 2.5):
        with pytest.raises(ValueError, match="sliding_window"):
            cpu.paged_attention_decode_cpu(q, kv[0], kv[1], tables, lens, 1.0, sliding_window=window)


def test_unavailable_kernel_falls_back_or_fails_clearly(monkeypatch, caplog):
    """A kernel that cannot be built here (no compiler): "auto" uses the torch reference with a warning; "cpu"
    is a clear ValueError."""
    from minfer.attention import get_attn_backend
    from minfer.platform import get_platform

    platform = get_platform("auto", "cpu", torch.float32)

    def unavailable():
        raise cpu.CpuKernelUnavailable("building paged_decode_cpu.cpp failed: no compiler (simulated)")

    monkeypatch.setattr(cpu, "_library", unavailable)
    pool = [torch.zeros(2, 2, 4, 1, 8)]
    with caplog.at_level("WARNING", logger="minfer.platform"):
        assert type(get_attn_backend("auto", pool, platform=platform)) is PagedTorchBackend
    assert "no compiler (simulated)" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run here"):
        get_attn_backend("cpu", pool, platform=platform)


@needs_kernel
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("window,alibi", [(None, False), (5, False), (None, True)])
def test_contiguous_cache_decodes_with_the_kernel_like_the_reference(kv_cache_dtype, window, alibi):
    """The simple path's `CpuContiguousBackend`: a prefill (SDPA, as the reference) and then decode steps through
    the C++ kernel over the contiguous cache, against `ContiguousBackend` (dequantize + SDPA) on the same K/V."""
    from minfer.attention import ContiguousBackend

    g = torch.Generator().manual_seed(3)
    h, kvh, d = 8, 2, 32
    layer = Attention(0, h, kvh, d, d ** -0.5, sliding_window=window,
                      alibi_slopes=alibi_slopes(h) if alibi else None)
    ours = cpu.CpuContiguousBackend(1, 24, kvh, d, torch.float32, "cpu", kv_cache_dtype)
    ref = ContiguousBackend(1, 24, kvh, d, torch.float32, "cpu", kv_cache_dtype)
    q, k, v = (torch.randn(9, n, d, generator=g) for n in (h, kvh, kvh))
    for be in (ours, ref):
        be.forward(layer, q, k, v, ForwardContext(be, positions=torch.arange(9), start_pos=0))
    for pos in range(9, 14):
        q1, k1, v1 = (torch.randn(1, n, d, generator=g) for n in (h, kvh, kvh))
        out = [be.forward(layer, q1, k1, v1, ForwardContext(be, positions=torch.tensor([pos]), start_pos=pos))
               for be in (ours, ref)]
        assert ours.kv_caches[0].equal(ref.kv_caches[0])  # the same stored codes
        torch.testing.assert_close(out[0], out[1], atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="holds 24 tokens"):
        ForwardContext(ours, positions=torch.tensor([24]), start_pos=24)


@needs_kernel
def test_simple_path_takes_the_kernel_backend_on_a_float32_cpu_model(monkeypatch):
    from minfer.attention import ContiguousBackend
    from minfer.config import ModelConfig
    from minfer.generate import SimpleGenerator
    from minfer.model.llama import LlamaForCausalLM

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    gen = SimpleGenerator(LlamaForCausalLM(cfg).eval())
    assert type(gen.new_cache(8)) is cpu.CpuContiguousBackend
    monkeypatch.setattr(cpu, "_library", lambda: (_ for _ in ()).throw(cpu.CpuKernelUnavailable("off")))
    assert type(gen.new_cache(8)) is ContiguousBackend
