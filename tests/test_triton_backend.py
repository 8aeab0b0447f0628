"""The Triton attention backend and fused ops against the torch reference (article §4 in the engine).

(a) `TritonBackend` vs `PagedTorchBackend` on hand-built ForwardContexts: prefills with and without a
    cached prefix (or a later chunk), decodes, mixed batches, GQA, sliding windows, ALiBi, shuffled
    block tables. Tolerance fp32 2e-4 (as the kernel tests), fp16 4e-3.
(b) A tiny random Llama built with `BuildOptions(fused_ops=minfer.kernels)`: logits match the torch ops.
(c) `TritonSampler`: greedy exact, seeded rows keep the torch stream, the fused path samples validly.
(d) The real SmolLM2-135M through the engine with attention_backend="triton": greedy tokens identical to
    the torch backend. Under Triton's CPU interpreter this is slow (every kernel launch is interpreted in
    numpy: ~0.1-0.2 s per launch, ~180 launches per forward), so it uses 2 short prompts and 3 tokens.
"""

import pathlib
import sys

import pytest
import torch

from minfer.attention import Attention, ForwardContext, PagedTorchBackend
from minfer.attention.triton import TritonBackend, window_size
from minfer.kernels import interpreter_active
from minfer.kernels.sampler import TritonSampler
from tests.conftest import needs_default_model

DEVICES = (["cpu"] if interpreter_active() else []) + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 2e-4, torch.float16: 4e-3}


def make_batch(seqs, num_kv_heads, head_dim, block_size=4, dtype=torch.float32, device="cpu", seed=0,
               num_heads=None):
    """A random pool and a ForwardContext for `seqs`: list of (num_cached, num_new); prefills first.

    A sequence with num_new > 1 is a prefill (its cached keys are a prefix or earlier chunks); one with
    num_new == 1 a decode. Physical blocks are handed out in a shuffled order. Returns (pool, q, k, v, ctx
    fields as a dict without the backend).
    """
    g = torch.Generator().manual_seed(seed)
    num_heads = num_heads or num_kv_heads
    ctx_lens = [c + n for c, n in seqs]
    nblk = [(L + block_size - 1) // block_size for L in ctx_lens]
    total_blocks = sum(nblk) + 3  # a few blocks nobody owns
    perm = torch.randperm(total_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in nblk:
        tables.append(perm[i:i + n])
        i += n
    width = max(nblk)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    pool = torch.randn(2, total_blocks, block_size, num_kv_heads, head_dim, generator=g)
    num_tokens = sum(n for _, n in seqs)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    positions, slots = [], []
    for (c, n), t in zip(seqs, tables):
        for p in range(c, c + n):
            positions.append(p)
            slots.append(t[p // block_size] * block_size + p % block_size)
    prefills = [(c, n) for c, n in seqs if n > 1]
    assert all(n > 1 for c, n in seqs[:len(prefills)]), "prefills first"
    p = len(prefills)
    cu_q = torch.tensor([0] + [n for _, n in prefills]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [c + n for c, n in prefills]).cumsum(0).to(torch.int32)
    fields = dict(
        positions=torch.tensor(positions), num_prefills=p, num_prefill_tokens=int(cu_q[-1]),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max((n for _, n in prefills), default=0), max_seqlen_k=max((c + n for c, n in prefills), default=0),
        slot_mapping=torch.tensor(slots), block_tables=block_tables,
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32))
    fields = {k_: (t.to(device) if isinstance(t, torch.Tensor) else t) for k_, t in fields.items()}
    return pool.to(device, dtype), q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), fields


def run_both(seqs, num_heads, num_kv_heads, head_dim=32, window=None, alibi=False, dtype=torch.float32,
             device="cpu", block_size=4):
    pool, q, k, v, fields = make_batch(seqs, num_kv_heads, head_dim, block_size, dtype, device,
                                              num_heads=num_heads)
    slopes = None
    if alibi:
        from minfer.model.positions import alibi_slopes
        slopes = alibi_slopes(num_heads).to(device)
    layer = Attention(0, num_heads, num_kv_heads, head_dim, scale=head_dim ** -0.5, sliding_window=window,
                      alibi_slopes=slopes)
    outs, pools = [], []
    for cls in (PagedTorchBackend, TritonBackend):
        kv = pool.clone()
        backend = cls([kv])
        ctx = ForwardContext(attn_backend=backend, **fields)
        outs.append(layer(q, k, v, ctx))
        pools.append(kv)
    ref, out = outs
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(pools[0], pools[1]), "store_kvcache wrote different slots than index_copy_"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


CASES = {
    "prefill": [(0, 5), (0, 17), (0, 2)],
    "prefill_one": [(0, 9)],
    "prefix_one": [(8, 6)],
    "prefix_and_chunks": [(8, 5), (0, 7), (13, 4)],
    "decode": [(0, 1), (19, 1), (6, 1), (32, 1)],
    "mixed": [(0, 6), (12, 3), (4, 1), (22, 1)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_backend_matches_torch(device, case, heads):
    run_both(CASES[case], *heads, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["prefix_and_chunks", "mixed"])
def test_backend_sliding_window(device, case):
    run_both(CASES[case], 4, 2, window=5, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_alibi_and_fp16(device):
    run_both(CASES["mixed"], 4, 1, alibi=True, device=device)
    run_both(CASES["mixed"], 4, 2, window=7, dtype=torch.float16, device=device, block_size=8)


def test_window_size_convention():
    # W tokens: key j visible to query p iff p - W < j <= p, i.e. flash_attn's (W - 1, 0).
    assert window_size(Attention(0, 2, 2, 16, 1.0, sliding_window=4)) == (3, 0)
    assert window_size(Attention(0, 2, 2, 16, 1.0)) == (-1, -1)


@pytest.mark.skipif(not interpreter_active(), reason="only the CPU interpreter depends on import order")
def test_kernels_run_when_torch_imported_triton_first():
    # Building a torch module imports triton (via torch._dynamo) before minfer.kernels can set
    # TRITON_INTERPRET=1, as LLM(...) does; importing the backend must still leave the kernels runnable.
    import subprocess

    code = ("import sys, torch\n"
            "with torch.device('meta'):\n"  # as load_model: init under a device mode imports dynamo
            "    torch.nn.Embedding(4, 4)\n"
            "assert 'triton.language' in sys.modules and 'minfer.kernels' not in sys.modules\n"
            "from minfer.kernels import rms_norm\n"
            "x, w = torch.randn(2, 8), torch.ones(8)\n"
            "ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n"
            "assert torch.allclose(rms_norm(x, w), ref, atol=1e-5)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).resolve().parents[1], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------------------------------------------------------------
# Fused ops on a tiny random model


def test_fused_ops_tiny_model():
    """The fused kernels are chosen when the model is built; the same weights give the torch ops' logits."""
    import minfer.kernels
    from minfer.attention import ContiguousBackend
    from minfer.config import ModelConfig
    from minfer.model.layers import MLP, BuildOptions, RMSNorm, silu_and_mul
    from minfer.model.llama import LlamaForCausalLM
    from minfer.model.positions import RotaryEmbedding

    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      qk_norm=True, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    ids = torch.randint(0, 64, (7,))

    def logits(m):
        cache = ContiguousBackend(2, 8, 2, 16, torch.float32)
        with torch.inference_mode():
            h = m(ids, ForwardContext(cache, positions=torch.arange(7)))
            return m.compute_logits(h)

    ref = logits(model)
    fused = LlamaForCausalLM(cfg, build=BuildOptions(fused_ops=minfer.kernels)).eval()
    fused.load_state_dict(model.state_dict())
    norms = [m for m in fused.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 1 + 2 * 2 and all(m.fused for m in norms)
    assert all(m.act is not silu_and_mul for m in fused.modules() if isinstance(m, MLP))
    assert all(m.fused for m in fused.modules() if isinstance(m, RotaryEmbedding))
    torch.testing.assert_close(logits(fused), ref, atol=1e-4, rtol=1e-4)
    # The default build keeps the torch code.
    assert all(m.act is silu_and_mul for m in model.modules() if isinstance(m, MLP))
    assert not any(m.fused for m in model.modules() if isinstance(m, RMSNorm))


# ------------------------------------------------------------------------------------------------------
# Sampler


def _Seq(seed=None, **kw):
    from minfer.sampling_params import SamplingParams
    from minfer.sequence import Sequence

    return Sequence("r", 0, [1], SamplingParams(seed=seed, **kw), max_model_len=64)


def test_triton_sampler():
    from minfer.sampling import Sampler

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    # all greedy: exact argmax
    toks, lp, _ = TritonSampler(torch.Generator().manual_seed(1))(logits, [_Seq(temperature=0)] * 4)
    assert torch.equal(toks, logits.argmax(-1)) and lp is None
    # a seeded row sends the batch to the torch sampler: same tokens as the torch Sampler
    seqs_a = [_Seq(seed=7, temperature=0.8), _Seq(temperature=0), _Seq(temperature=1.0), _Seq(temperature=0.5)]
    seqs_b = [_Seq(seed=7, temperature=0.8), _Seq(temperature=0), _Seq(temperature=1.0), _Seq(temperature=0.5)]
    a = TritonSampler(torch.Generator().manual_seed(3))(logits, seqs_a)[0]
    b = Sampler(torch.Generator().manual_seed(3))(logits, seqs_b)[0]
    assert torch.equal(a, b)
    # fused path: greedy rows exact, top-k respected, reproducible for a given engine seed
    seqs = [_Seq(temperature=0), _Seq(temperature=1.0, top_k=3), _Seq(temperature=0.7, top_p=0.5),
            _Seq(temperature=2.0)]
    t1 = TritonSampler(torch.Generator().manual_seed(5))(logits, seqs)[0]
    t2 = TritonSampler(torch.Generator().manual_seed(5))(logits, seqs)[0]
    assert torch.equal(t1, t2) and t1.dtype == torch.int64 and t1.shape == (4,)
    assert int(t1[0]) == int(logits[0].argmax())
    assert int(t1[1]) in logits[1].topk(3).indices.tolist()


# ------------------------------------------------------------------------------------------------------
# The real model


@pytest.fixture(scope="session")
def llm_triton():
    """SmolLM2-135M-Instruct on the Triton backend with fused ops (small pool: 16 blocks of 16 tokens)."""
    from minfer import LLM

    # 16 blocks x 16 tokens; one block of SmolLM2-135M (30 layers x K,V x 16 x 3 heads x 64 x fp32) = 737,280 B.
    return LLM(attention_backend="triton", max_model_len=256, seed=0, kv_cache_memory_bytes=16 * 737_280)


@needs_default_model
def test_real_model_greedy_matches_torch_backend(llm, llm_triton):
    from minfer import SamplingParams

    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # 1 prefill + 2 decode steps
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in llm_triton.generate(prompts, sp)]
    assert got == want
    assert llm_triton.llm_engine.all_blocks_free()
