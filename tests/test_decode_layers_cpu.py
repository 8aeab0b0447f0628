"""The one-call decode step (minfer/cpu/decode_step.py, csrc/decode_layers_cpu.cpp) against the per-op
path, bit for bit: the hidden state and residual after the last layer, and every layer's K/V cache, at several
positions, for the weight formats of the integer GEMM (gguf Q4_1 and Q8_0 blocks, int4, int8), with GQA, on
tiny random models and on the default model; and the cases it must leave to the per-op path."""

import pytest
import torch

from minfer.attention.base import ForwardContext
from minfer.cpu import decode_step as dl
from minfer.cpu import gemm_f32
from minfer.cpu.qgemm import pack
from minfer.generate import SimpleGenerator
from minfer.model.loader import load_model
from minfer.quantization.base import store
from tests.conftest import needs_default_model
from tests.test_llama import make_hf_model


def _available():
    try:
        dl._library()
        return True
    except dl.DecodeLayersUnavailable:
        return False


pytestmark = pytest.mark.skipif(not _available(), reason="the C++ kernels do not build here")

SHAPES = {  # head_dim 16 (the kernel's generic path) and 64 (its specialised one); both GQA
    "d16-gqa2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "d64-gqa2": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1),
}


def _repack_as_gguf(model, kind: str, seed: int = 0) -> None:
    """Give every projection random codes in a GGUF block format (the layout the gguf method packs a file's
    blocks into): Q4_1 is w = q d + m, 4-bit, float16 d and m per 32; Q8_0 is w = q d, 8-bit, float16 d per 32."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            n, k = lin.out_features, lin.in_features
            d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
            if kind == "q4_1":
                codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
                w = pack(codes, d, (-8 * d.float()).half(), 4, 0)
            else:
                codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
                w = pack(codes, (d.float() / 16).half(), None, 8)
            for name in ("qg_qs", "qg_d", "qg_m"):
                if hasattr(lin, name):
                    delattr(lin, name)
            for name, t in w.tensors().items():
                store(lin, name, t)
            lin.qg_format = (w.bits, w.offset, w.bf16, w.group, w.n, w.k)


def _tiny(tmp_path, shape, fmt):
    make_hf_model(tmp_path, "LlamaConfig", dict(SHAPES[shape], tie_word_embeddings=True))
    quant, cfg = {"int8": ("int8", None), "int4": ("int4", {"group_size": 32})}.get(fmt, ("int4", {"group_size": 32}))
    lm = load_model(str(tmp_path), dtype="float32", device="cpu", quantization=quant, quantization_config=cfg)
    if fmt in ("q4_1", "q8_0"):
        _repack_as_gguf(lm.model, fmt)
    return lm.model


class _Counting:
    """The step runner (`CpuDecodeStep` over `plan`), counting the steps it covered; `forward` runs a step as
    the worker's `run_model` does: the runner, else the model."""

    def __init__(self, model, plan):
        self.model, self.runner, self.used = model, dl.CpuDecodeStep(model.model, plan), 0

    def forward(self, ids, ctx):
        out = self.runner.run(ids, ctx)
        self.used += out is not None
        return self.model(ids, ctx) if out is None else out


@torch.inference_mode()
def _compare(model, prompt, steps, seed=0):
    """Prefill `prompt` into two caches, then decode `steps` tokens one at a time, one cache through the one-call
    step and the other through the per-op path, feeding both the same tokens; every step's hidden state and
    both caches must be equal bit for bit. Returns how many steps took the one call."""
    lm = model.model
    plan = dl.DecodeLayersCpu.build(lm)
    assert plan is not None, "the one-call decode should cover this model"
    gen = SimpleGenerator(model)
    caches = [gen.new_cache(len(prompt) + steps + 1) for _ in range(2)]
    ids = torch.tensor(prompt)
    for c in caches:
        model(ids, ForwardContext(c, positions=torch.arange(len(prompt)), start_pos=0))
    g = torch.Generator().manual_seed(seed)
    counting = _Counting(model, plan)
    for p in range(len(prompt), len(prompt) + steps):
        tok = torch.randint(0, model.config.vocab_size, (1,), generator=g)
        pos = torch.tensor([p])
        outs = []
        for c, forward in zip(caches, (counting.forward, model)):
            outs.append(forward(tok, ForwardContext(c, positions=pos, start_pos=p)))
        assert torch.equal(outs[0], outs[1]), f"hidden state differs at position {p}"
        for layer, (a, b) in enumerate(zip(caches[0].kv_caches, caches[1].kv_caches)):
            assert torch.equal(a[:, :p + 1], b[:, :p + 1]), f"K/V of layer {layer} differ at position {p}"
    return counting.used


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "int4", "int8"])
def test_one_call_decode_is_bit_identical_to_the_per_op_path(tmp_path, shape, fmt):
    model = _tiny(tmp_path, shape, fmt)
    assert _compare(model, [1, 5, 9, 2, 7, 30, 4], steps=6) == 6


@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_decode_threads(tmp_path, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert _compare(_tiny(tmp_path, "d64-gqa2", "q4_1"), [3, 1, 4, 1, 5], steps=3) == 3
    finally:
        torch.set_num_threads(old)


def test_falls_back_where_it_does_not_apply(tmp_path, monkeypatch):
    make_hf_model(tmp_path, "LlamaConfig", dict(SHAPES["d16-gqa2"], tie_word_embeddings=True))
    # float32 weights in oneDNN's layout (or "split"): torch's matmuls, not one of the C++ GEMMs
    for layout in ("onednn", "split"):
        monkeypatch.setenv("MINFER_LINEAR_LAYOUT", layout)
        assert dl.DecodeLayersCpu.build(load_model(str(tmp_path), dtype="float32", device="cpu").model.model) is None
    monkeypatch.delenv("MINFER_LINEAR_LAYOUT")
    f32 = dl.DecodeLayersCpu.build(load_model(str(tmp_path), dtype="float32", device="cpu").model.model)
    # the "hybrid" default: float32 panels for up to 16 rows, or 256 with the AVX-512 many-row tile
    from minfer.cpu.gemm_f32 import max_rows

    assert f32 is not None and f32.max_rows == max_rows() == (256 if gemm_f32.isa() == "avx512" else 16)
    quant = dict(quantization="int4", quantization_config={"group_size": 32})
    # fused ops off (the per-op path is torch's): no plan
    plain = load_model(str(tmp_path), dtype="float32", device="cpu", fused_ops=False, **quant).model
    assert dl.DecodeLayersCpu.build(plain.model) is None
    # the platform leaves the step runner out with kernels="reference" or enforce_eager, and builds it otherwise
    from minfer.platform import get_platform

    model = load_model(str(tmp_path), dtype="float32", device="cpu", **quant).model
    assert get_platform("auto", "cpu", torch.float32, enforce_eager=True).step_runner(model) is None
    assert get_platform("reference", "cpu", torch.float32).step_runner(model) is None
    assert isinstance(get_platform("auto", "cpu", torch.float32).step_runner(model), dl.CpuDecodeStep)
    ref = load_model(str(tmp_path), dtype="float32", device="cpu", kernels="reference", **quant).model
    assert get_platform("auto", "cpu", torch.float32).step_runner(ref) is None  # no fused ops, no integer GEMM
    plan = dl.DecodeLayersCpu.build(model.model)
    assert plan is not None
    gen = SimpleGenerator(model)
    with torch.inference_mode():
        x = model.model.embed_tokens(torch.tensor([3]))
        pos = torch.tensor([0])
        cos_sin = model.model.rotary_emb.cos_sin_for(pos)
        # a quantized KV cache is not covered
        q8 = SimpleGenerator(model, kv_cache_dtype="int8").new_cache(8)
        assert plan.run(x, None, cos_sin, ForwardContext(q8, positions=pos, start_pos=0)) is None
        # a forward hook (an adapter, a probe) must see the per-op path
        c = gen.new_cache(8)
        h = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
        assert plan.run(x, None, cos_sin, ForwardContext(c, positions=pos, start_pos=0)) is None
        h.remove()
        # so must a global module hook (torch.nn.modules.module.register_module_forward_hook)
        h = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        assert plan.run(x, None, cos_sin, ForwardContext(c, positions=pos, start_pos=0)) is None
        h.remove()
        assert plan.run(x, None, cos_sin, ForwardContext(c, positions=pos, start_pos=0)) is not None
    # a sliding window is not covered
    make_hf_model(tmp_path / "w", "MistralConfig", dict(SHAPES["d16-gqa2"], sliding_window=8))
    win = load_model(str(tmp_path / "w"), dtype="float32", device="cpu", **quant).model
    assert dl.DecodeLayersCpu.build(win.model) is None


@needs_default_model
def test_default_gguf_model_bit_identical():
    model = load_model(quantization="gguf").model
    assert _compare(model, [1, 504, 3459, 28, 253, 1345], steps=4) == 4


@torch.inference_mode()
def test_paged_pool_bit_identical(tmp_path):
    """The engine's paged pool (CpuPagedBackend, one decoding sequence): a scattered block table, the new K/V
    stored at its slot, attention over the blocks; the same bits as the per-op path, pool included."""
    from minfer.cpu.attention import CpuPagedBackend

    model = _tiny(tmp_path, "d16-gqa2", "q4_1")
    lm, cfg = model.model, model.config
    plan = dl.DecodeLayersCpu.build(lm)
    nb, bs = 8, 4
    g = torch.Generator().manual_seed(3)
    pool = [torch.randn(2, nb, bs, cfg.num_key_value_heads, cfg.head_dim, generator=g)
            for _ in range(cfg.num_hidden_layers)]
    backends = [CpuPagedBackend([t.clone() for t in pool]) for _ in range(2)]
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    counting = _Counting(model, plan)
    for p in (0, 3, 6, 13):  # positions inside the 1st, 2nd and 4th blocks of the table
        slot = int(table[0, p // bs]) * bs + p % bs
        tok, pos = torch.tensor([11 + p]), torch.tensor([p])
        outs = []
        for b, forward in zip(backends, (counting.forward, model)):
            ctx = ForwardContext(b, positions=pos, slot_mapping=torch.tensor([slot]), block_tables=table,
                                 context_lens=torch.tensor([p + 1], dtype=torch.int32))
            outs.append(forward(tok, ctx))
        assert torch.equal(outs[0], outs[1]), f"hidden state differs at position {p}"
        for a, b in zip(backends[0].kv_caches, backends[1].kv_caches):
            assert torch.equal(a, b), f"pools differ after position {p}"
    assert counting.used == 4


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 129, 256, 257])
@torch.inference_mode()
def test_batched_float32_decode_bit_identical(tmp_path, rows):
    """A float32 model's batched decode step (the "hybrid" layout's panels, CpuPagedBackend): `rows` sequences
    of different lengths with scattered block tables, each storing its token at its own slot; the same bits as
    the per-op path, pool included. Past `plan.max_rows` (16, or 256 with the AVX-512 many-row tile) the panels
    take no more rows: the per-op path (oneDNN) runs."""
    from minfer.cpu.attention import CpuPagedBackend

    make_hf_model(tmp_path, "LlamaConfig", dict(SHAPES["d64-gqa2"], tie_word_embeddings=True))
    model = load_model(str(tmp_path), dtype="float32", device="cpu").model
    lm, cfg = model.model, model.config
    plan = dl.DecodeLayersCpu.build(lm)
    assert plan is not None
    nb, bs = 4 * rows + 2, 4
    g = torch.Generator().manual_seed(rows)
    pool = [torch.randn(2, nb, bs, cfg.num_key_value_heads, cfg.head_dim, generator=g)
            for _ in range(cfg.num_hidden_layers)]
    backends = [CpuPagedBackend([t.clone() for t in pool]) for _ in range(2)]
    table = torch.randperm(nb, generator=g)[:4 * rows].view(rows, 4).to(torch.int32)  # 4 blocks each, disjoint
    start = torch.randint(0, 12, (rows,), generator=g)  # each sequence's position before the first step
    counting = _Counting(model, plan)
    for step in range(3):
        pos = start + step
        slots = (table[torch.arange(rows), pos // bs].long() * bs + pos % bs)
        tok = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
        outs = []
        for b, forward in zip(backends, (counting.forward, model)):
            ctx = ForwardContext(b, positions=pos, slot_mapping=slots, block_tables=table,
                                 context_lens=(pos + 1).to(torch.int32))
            outs.append(forward(tok, ctx))
        assert torch.equal(outs[0], outs[1]), f"hidden states differ at step {step}"
        for a, b in zip(backends[0].kv_caches, backends[1].kv_caches):
            assert torch.equal(a, b), f"pools differ after step {step}"
    assert counting.used == (3 if rows <= plan.max_rows else 0)
