"""A decode step of all the Llama layers in one C++ call (`csrc/decode_layers_cpu.cpp`; chapter 9 §9.2.4 and
§9.2.6, chapter 5 §5.4): one token of a quantized model, or one token for each of up to 16 (256 with the AVX-512
many-row GEMM, lab notes 9b §9b.17) sequences of a float32
model.

At batch 1 on the CPU the per-op path spends more time in Python than in arithmetic: each of the 30 layers
makes ~60 calls (module calls, output allocations, views, ctypes argument conversion) around its ten kernels.
`DecodeLayersCpu.run` makes one: the C++ loop calls the same kernels (the integer GEMM, the fused RMSNorm /
RoPE / SiLU-and-mul, the paged-decode attention) in the same order, through function pointers taken from the
libraries the per-op path already loaded, with the same arguments, on one scratch buffer allocated per step
(one torch allocation for the 30 layers). The results are the per-op path's bit for bit
(tests/test_decode_layers_cpu.py checks hidden states and the K/V cache contents).

A batched float32 decode step has the same overhead: at 16 rows SmolLM2's step took ~10 ms of Python and torch
dispatch around ~31 ms of GEMMs (the few-row kernel of `minfer.cpu.gemm_f32`), which the one call removes
(chapter 9 §9.2.6).

What it covers, decided once when the plan is built (`DecodeLayersCpu.build`, which returns None, and so the
per-op path, for anything else):
- a Llama-family model on the CPU in float32 built with the fused CPU ops (`BuildOptions.fused_ops` is
  `minfer.cpu.fused_ops`, the platform's choice under kernels="auto");
- every projection of every layer with no bias, either all on the integer GEMM (gguf Q4_0/Q4_1/Q8_0 blocks, gguf
  Q4_K through int4, `int4`, `int8`: steps of one token) or all float32 "panels" (the "hybrid" layout's few-row
  copy, or "panels" itself: steps of up to `PanelLinearMethod.max_rows` tokens, the rows the per-op path gives to
  the same kernel), as each projection's `LinearMethod.fused_step_weight` offers it;
- no QK-norm, no sliding window, no ALiBi, one tensor-parallel rank and one pipeline stage.
And per call (`run` returns None, and the model takes the per-op path): at most `max_rows` tokens; the attention
backend offers the step's tables (`decode_tables`: `CpuContiguousBackend` of the simple path at one token, or
`CpuPagedBackend` with every row a decoding sequence, no prefill) over a float32 cache (a quantized KV cache is
not covered); no forward hooks on the layers (a hook, e.g. an adapter, must see the per-op path); no autograd.

`CpuDecodeStep` is the step runner the platform hands the worker (`Worker.run_model`): token ids in, normed
hidden states out, or None (run the model). `enforce_eager=True` or `kernels="reference"` leaves it out.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from minfer.cpu.build import I64, PTR, CppLibrary, KernelUnavailable
from minfer.cpu.linear import Panels

# It does no float arithmetic of its own (only calls and memcpy): plain optimization is enough.
CFLAGS = ["-O2"]


class DecodeLayersUnavailable(KernelUnavailable):
    """The one-call decode library could not be built or loaded here (the message says why)."""


class _QWeight(ctypes.Structure):
    _fields_ = [("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bits", ctypes.c_int32),
                ("offset", ctypes.c_int32), ("bf16", ctypes.c_int32), ("pad_", ctypes.c_int32),
                ("gs", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("panels", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("block_table", ctypes.c_void_p), ("context_len", ctypes.c_void_p),
                ("block_size", ctypes.c_int64), ("max_blocks", ctypes.c_int64), ("isa", ctypes.c_int32),
                ("nthreads", ctypes.c_int32), ("rows", ctypes.c_int64)]


class _Fns(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("qgemm", "rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "paged_decode", "gemm_f32")]


LIBRARY = CppLibrary("minfer_decode_layers_cpu", "decode_layers_cpu.cpp", CFLAGS, {
    "minfer_decode_layers": ([PTR, PTR, I64, PTR, PTR, PTR, PTR, PTR, PTR], None),
    "minfer_decode_layers_scratch_floats": ([PTR], I64),
}, DecodeLayersUnavailable)


@functools.cache
def _library() -> tuple[ctypes.CDLL, _Fns]:
    """Load the library, and the table of the kernels it calls (the per-op path's own functions).
    Raises DecodeLayersUnavailable (a library did not build)."""
    from minfer.cpu import attention, fused_ops, gemm_f32, qgemm

    try:
        att, fused, gemm, f32 = attention.DECODE.load(), fused_ops.LIBRARY.load(), qgemm.LIBRARY.load(), \
            gemm_f32.LIBRARY.load()
    except KernelUnavailable as e:
        raise DecodeLayersUnavailable(f"a kernel library is unavailable: {e}") from e
    lib = LIBRARY.load()

    def fn(f):
        return ctypes.cast(f, ctypes.c_void_p).value

    fns = _Fns(fn(gemm.minfer_qgemm), fn(fused.minfer_rms_norm_f32), fn(fused.minfer_fused_add_rms_norm_f32),
               fn(fused.minfer_silu_and_mul_f32), fn(fused.minfer_rotary_f32), fn(att.minfer_paged_decode_f32),
               fn(f32.minfer_gemm_f32))
    return lib, fns


def _qweight(w) -> _QWeight:
    from minfer.cpu.qgemm import BLOCK

    if isinstance(w, Panels):
        return _QWeight(n=w.n, k=w.panels.shape[1], panels=w.panels.data_ptr())
    # The arguments `qgemm_unchecked` passes for this weight.
    return _QWeight(w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr() if w.m is not None else None, w.bits,
                    128 if w.bits == 8 else w.offset, int(w.bf16), 0, w.group // BLOCK, w.n, w.k, None)


def _global_hooks() -> bool:
    """True while a global module hook is registered (`torch.nn.modules.module.register_module_forward_hook`
    and its pre-hook twin): it must see every layer's call, so the step takes the per-op path."""
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


class DecodeLayersCpu:
    """The one-call decode step of a `LlamaModel`'s layers. Build with `DecodeLayersCpu.build(model)`."""

    def __init__(self, model, layers, weights):
        self._lib, self._fns = _library()
        cfg = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attn.scale
        self.hidden = layers[0].input_layernorm.weight.shape[0]
        self.inter = layers[0].mlp.gate_up_proj.out_features // 2
        # Steps of one token on the integer GEMM; on float32 panels as many as the per-op path gives them.
        self.max_rows = min(w.max_rows if isinstance(w, Panels) else 1 for ws in weights for w in ws)
        self.eps = layers[0].input_layernorm.eps
        self.layers = layers
        self.weights = weights  # keeps the PackedWeight views alive with the model
        self._static = [(_qweight(q), _qweight(o), _qweight(gu), _qweight(dn),
                         layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr())
                        for layer, (q, o, gu, dn) in zip(layers, weights)]
        # The hook dicts of every module of the layers (torch adds hooks into these same dicts), so that a step
        # checks for a hook with one C-level `any` over them (~300 modules: 32 us as a Python loop per token).
        self._hook_dicts = [d for layer in layers for m in layer.modules() for d in (m._forward_hooks,
                                                                                     m._forward_pre_hooks)]
        # Pointers into the weights are baked into the table: a moved or repacked model must not be run with it.
        # Checked per call on the first and last layers only (what `.to()` or a reload changes); replacing one
        # middle layer's packed buffers by hand is not detected: rebuild the model (load it again) instead.
        self._weight_ptrs = self._current_weight_ptrs()
        self._bound = None  # (weakref to the attention backend, its ctypes layer table)
        step = _Step(hidden=self.hidden, heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                     inter=self.inter, eps=self.eps, scale=self.scale)
        self._step = step
        self._scratch_floats = {}  # rows -> floats of scratch a step needs

    def _current_weight_ptrs(self):
        def ptr(linear):  # the tensor the table points into: the packed codes, or the float32 panels
            w = linear.method.fused_step_weight(linear)
            return None if w is None else (w.panels if isinstance(w, Panels) else w.qs).data_ptr()

        ends = (self.layers[0], self.layers[-1])
        return tuple(p for layer in ends for p in (ptr(layer.self_attn.qkv_proj), ptr(layer.mlp.down_proj),
                                                    layer.input_layernorm.weight.data_ptr()))

    @classmethod
    def build(cls, model) -> "DecodeLayersCpu | None":
        """The plan for `model` (a `LlamaModel`, or a model with its declared `decoder_layers()` and
        `rotary_emb`, whose weights are loaded and packed), or None where the one call does not cover it (the
        module docstring lists what it covers) or its library does not build here."""
        from minfer.cpu import fused_ops
        from minfer.model.positions import RotaryEmbedding
        from minfer.parallel.parallel_state import get_parallel_state

        if getattr(model, "fused_ops", None) is not fused_ops or not hasattr(model, "decoder_layers"):
            return None
        st = get_parallel_state()
        if st.tp_size != 1 or st.pp_size != 1:
            return None
        layers = model.decoder_layers()
        rot = model.rotary_emb
        if not layers or not isinstance(rot, RotaryEmbedding) or not rot.fused:
            return None
        from minfer.cpu.attention import MAX_HEADS

        if layers[0].self_attn.num_heads > MAX_HEADS or rot.head_dim % 2:
            return None
        weights = []
        for layer in layers:
            att, mlp = layer.self_attn, layer.mlp
            if (att.qk_norm or att.attn.sliding_window is not None or att.attn.alibi_slopes is not None
                    or not layer.input_layernorm.fused or not layer.post_attention_layernorm.fused):
                return None
            # Each projection as its LinearMethod offers it to a fused step (None: its forward is more than
            # one kernel call: a bias, another layout).
            ws = [m.method.fused_step_weight(m) for m in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(w is None for w in ws):
                return None
            weights.append(ws)
        norms = [t for layer in layers for t in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        if any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in norms):
            return None
        first = layers[0]
        if first.input_layernorm.eps != first.post_attention_layernorm.eps or any(
                layer.input_layernorm.eps != first.input_layernorm.eps
                or layer.post_attention_layernorm.eps != first.input_layernorm.eps for layer in layers):
            return None
        try:
            return cls(model, layers, weights)
        except DecodeLayersUnavailable:
            return None

    def _layer_table(self, backend):
        """The ctypes table of the layers for this backend's K/V tensors (built once per backend)."""
        bound = self._bound  # read once: another thread may rebind it between two reads (two threads may share a model)
        if bound is not None and bound[0]() is backend:
            return bound[1]
        table = (_Layer * len(self.layers))()
        for i, (layer, st) in enumerate(zip(self.layers, self._static)):
            kv = backend.kv_caches[layer.self_attn.attn.layer_idx]
            table[i] = _Layer(*st[:4], st[4], st[5], kv[0].data_ptr(), kv[1].data_ptr())
        self._bound = (weakref.ref(backend), table)
        return table

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, ctx):
        """All layers for T tokens, one per decoding sequence (T <= `max_rows`): x float32 `[T, hidden]` (the
        embedding, with `residual` None, or the hidden state with its residual `[T, hidden]`) -> (hidden, residual)
        `[T, hidden]` each, as the layer loop of `LlamaModel.forward` returns them, bit for bit; K/V stored in the
        backend's cache. None where this call does not cover the step (the module docstring): the caller then
        runs the per-op path."""
        rows = x.shape[0]
        backend = ctx.attn_backend
        if (rows > self.max_rows or x.dtype != torch.float32 or not x.is_cpu or backend.kv_scales is not None
                or torch.is_grad_enabled()):
            return None
        tables = backend.decode_tables(ctx)  # the backend's own K/V addressing (None: not a pure decode step)
        if tables is None or tables.block_table.shape[0] != rows:
            return None
        block_table, lens, slots = tables.block_table, tables.context_lens, tables.slots
        block_size, max_blocks = tables.block_size, tables.max_blocks
        if backend.kv_caches[0].dtype != torch.float32 or _global_hooks() or any(self._hook_dicts):
            return None
        from minfer.cpu.qgemm import _isa_from_env

        cos, sin = cos_sin[0].contiguous(), cos_sin[1].contiguous()
        if cos.shape != (rows, self.head_dim // 2) or self._current_weight_ptrs() != self._weight_ptrs:
            return None  # (partial rotary takes torch's RoPE in the per-op path; so does a moved model, for good)
        # A fresh step struct and scratch per call (a few microseconds), so two threads may share the model.
        s = _Step.from_buffer_copy(self._step)
        s.rows = rows
        floats = self._scratch_floats.get(rows)
        if floats is None:
            floats = self._scratch_floats[rows] = self._lib.minfer_decode_layers_scratch_floats(ctypes.byref(s))
        scratch = torch.empty(floats, dtype=torch.float32)
        s.cos, s.sin, s.slots = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        s.block_table, s.context_len = block_table.data_ptr(), lens.data_ptr()
        s.block_size, s.max_blocks = block_size, max_blocks
        s.isa, s.nthreads = _isa_from_env(), torch.get_num_threads()
        x = x.contiguous()
        res_in = residual.contiguous() if residual is not None else None
        x_out = torch.empty(rows, self.hidden, dtype=torch.float32)
        res_out = torch.empty(rows, self.hidden, dtype=torch.float32)
        self._lib.minfer_decode_layers(ctypes.byref(self._fns), self._layer_table(backend), len(self.layers),
                                       ctypes.byref(s), x.data_ptr(),
                                       res_in.data_ptr() if res_in is not None else None, x_out.data_ptr(),
                                       res_out.data_ptr(), scratch.data_ptr())
        return x_out, res_out


class CpuDecodeStep:
    """The platform's step runner on a CPU (`minfer.platform.CpuPlatform.step_runner`): a decode step of a
    Llama-family model, from token ids to the normed hidden states, as one C++ call over all layers.

    `run(input_ids [T], ctx) -> hidden [T, hidden] | None`: the worker (`Worker.run_model`) and the simple path
    call it first; None means "not this step" (a prefill, more rows than the plan takes, a hook, ...) and the
    caller runs the model. What it needs from the model it asks through the model's declared methods:
    `embed`, `decoder_layers`, `final_norm`, and each projection's `LinearMethod.fused_step_weight`.
    """

    def __init__(self, model, plan: DecodeLayersCpu):
        self.model, self.plan = model, plan

    @classmethod
    def build(cls, model) -> "CpuDecodeStep | None":
        """The runner for a causal LM (`model.model` its decoder stack), or None where the one call does not
        cover it."""
        inner = getattr(model, "model", None)
        plan = DecodeLayersCpu.build(inner) if inner is not None else None
        return None if plan is None else cls(inner, plan)

    def run(self, input_ids: torch.Tensor | None, ctx) -> torch.Tensor | None:
        # A step with prefill rows is never one call: say so before embedding, which the model would do again.
        if (input_ids is None or input_ids.shape[0] > self.plan.max_rows or ctx.num_prefills
                or torch.is_grad_enabled()):
            return None
        lm = self.model
        x = lm.embed(input_ids)
        out = self.plan.run(x, None, lm.rotary_emb.cos_sin_for(ctx.positions), ctx)
        return None if out is None else lm.final_norm(*out)
