"""Weight quantization (minfer/quantization/): round-trip bounds, each route against a plain-torch
dequantize-then-matmul reference on odd shapes, GGUF Q4 blocks against gguf's own dequantization, the
configuration errors, and the engine's greedy tokens against the simple path with the same method."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minfer.cpu.linear import CpuQuantKernels
from minfer.model.layers import Linear, UnquantizedLinearMethod
from minfer.quantization import get_quantization_method, parse_quantization_config
from minfer.quantization.int4 import (
    Int4LinearMethod,
    dequantize_int4,
    int4pack_block,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from minfer.quantization.int8 import Int8LinearMethod, dequantize_int8, quantize_int8
from tests.conftest import needs_default_model


def make_linear(method, out, k, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) * 0.05
    w[0, :7] *= 40  # an outlier row: its scale must not leak into the other rows
    layer = Linear(k, out, bias=bias, method=method)
    layer.weight.data.copy_(w)
    if bias:
        layer.bias.data.copy_(torch.randn(out, generator=g))
    layer.process_weights_after_loading()
    return layer, w


def test_int8_round_trip_bound():
    w = torch.randn(37, 53) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different scales
    q, s = quantize_int8(w)
    err = (dequantize_int8(q, s) - w).abs()
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16
    assert bool((err <= s.float()[:, None] / 2 * (1 + 1e-6)).all())
    assert bool((s.float() >= w.abs().amax(1) / 127).all())  # rounded up: no code is clamped


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_bound(group_size):
    w = torch.randn(24, 256) * 0.1
    codes, s, z = quantize_int4(w, group_size)
    assert int(codes.max()) <= 15 and codes.dtype == torch.uint8
    err = (dequantize_int4(codes, s, z) - w).abs().reshape(24, -1, group_size)
    # s/2 from rounding, plus what bfloat16's rounding of the zero moves the group's grid by
    bound = s.float() / 2 + z.float().abs() * 2 ** -8 + 1e-7
    assert bool((err <= bound[..., None]).all())


@pytest.mark.parametrize("out,k", [(64, 96), (960, 576), (128, 32)])
def test_int4_pack_unpack_is_the_ops_layout(out, k):
    codes = torch.randint(0, 16, (out, k), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(codes), int4pack_block(codes.device)), codes)


def reference(x, w_hat):
    """What both routes compute: bfloat16 activations, float32 sums, a bfloat16 result."""
    return F.linear(x.to(torch.bfloat16).float(), w_hat).to(torch.bfloat16).float()


@pytest.mark.parametrize("method", ["int8", "int4-32", "int4-64"])
@pytest.mark.parametrize("out,k", [(48, 192), (80, 320), (960, 576), (17, 128)])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_routes_match_dequantize_then_matmul(method, out, k, rows):
    kernels = CpuQuantKernels()  # the CPU's integer GEMM where it builds (the platform's kernels="auto")
    m = Int8LinearMethod(cpu_kernel=kernels) if method == "int8" else Int4LinearMethod(int(method.split("-")[1]),
                                                                                      cpu_kernel=kernels)
    layer, w = make_linear(m, out, k, bias=True)
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows))
    y = layer(x)
    assert y.shape == (2, rows, out) and y.dtype == torch.float32
    x2 = x.reshape(-1, k)
    if layer.qg_format is not None:  # the CPU's integer GEMM: activations rounded to int8 blocks of 32
        from minfer.cpu.qgemm import quantize_activations, reference_matmul

        ref = reference_matmul(x2, kernels.packed(layer)).float().view(2, rows, out) + layer.bias
        tol = 1e-5
        qx, dx = quantize_activations(x2)
        x_err = (qx.float() * dx[..., None] - x2.view(len(x2), -1, 32)).reshape(2, rows, k).norm(dim=-1, keepdim=True)
    else:  # torch's packed ops / the dequantize route: bfloat16 activations and output
        ref = reference(x2, m.dequantize(layer, torch.float32)).view(2, rows, out) + layer.bias
        tol = 1e-2  # bf16 output: ~2^-8 relative
        x_err = x.norm(dim=-1, keepdim=True) * 2 ** -8
    scale = ref.abs().max()
    assert float((y - ref).abs().max()) <= tol * float(scale)
    # and the quantized product is off the float one by at most what the weight error can do (Cauchy-Schwarz:
    # |x . (w_n - w_hat_n)| <= |x| |w_n - w_hat_n|), plus the roundings of x (and y)
    full = F.linear(x, w) + layer.bias
    w_err = (m.dequantize(layer, torch.float32) - w).norm(dim=1)  # [out]
    bound = x.norm(dim=-1, keepdim=True) * w_err + x_err * w.norm(dim=1) + full.abs() * 2 ** -7 + 1e-4
    assert bool(((y - full).abs() <= bound).all())


def test_quantized_layer_keeps_no_float_weight():
    layer, _ = make_linear(Int4LinearMethod(32), 64, 128)
    assert not hasattr(layer, "weight") or layer.weight is None
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert nbytes == 64 * 128 // 2 + (128 // 32) * 64 * 2 * 2  # 0.5 B/weight + bf16 scale and zero per group


def test_tied_head_stays_float():
    m = Int8LinearMethod(fallback=UnquantizedLinearMethod())
    head = Linear(32, 100, method=m)
    head.keep_rows = True
    head.weight.data.normal_()
    w = head.weight.data.clone()
    head.process_weights_after_loading()
    assert torch.equal(head.weight_rows(torch.tensor([3, 5])), w[[3, 5]])


def test_group_size_that_does_not_divide_is_refused_with_the_width():
    with pytest.raises(ValueError, match=r"does not divide .* 576 .*use one of \[32, 64\]"):
        make_linear(Int4LinearMethod(128), 64, 576)


@pytest.mark.parametrize("q,cfg,match", [
    ("int5", None, "unknown quantization method 'int5'"),
    ("bitsandbytes", None, "not built"),
    ("awq", {"group_size": 64}, "unknown key"),
    ("int4", {"group_size": 48}, "group_size must be one of"),
    ("int4", {"group_size": "64"}, "group_size must be one of"),
    ("int4", {"bits": 4}, "unknown key"),
    ("int8", {"group_size": 64}, "unknown key"),
    ("int8", {"kernel": "fast"}, "int8 kernel must be one of"),
    ("int4", "{group_size: 64}", "not valid JSON"),
    ("int4", "[64]", "must be a JSON object"),
    (None, {"group_size": 64}, "without a quantization method"),
])
def test_bad_quantization_arguments(q, cfg, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(q, cfg)


def test_engine_args_refuse_bad_quantization_before_loading():
    from minfer.config import EngineArgs

    with pytest.raises(ValueError, match="unknown quantization method"):
        EngineArgs(quantization="int3")
    assert EngineArgs(quantization="int4", quantization_config='{"group_size": 32}').quantization_config == {"group_size": 32}


def test_server_flags_reach_engine_args():
    from minfer.serve.__main__ import build_parser, engine_args_from

    args = engine_args_from(build_parser().parse_args(["--quantization", "int4", "--quantization-config",
                                                       '{"group_size": 64}']))
    assert args.quantization == "int4" and args.quantization_config == {"group_size": 64}


def test_get_method_names():
    fb = UnquantizedLinearMethod()
    assert get_quantization_method("int8", None, fb).name == "int8"
    m = get_quantization_method("int4", {"group_size": 32}, fb)
    assert m.name == "int4" and m.group_size == 32 and m.fallback is fb



def test_int8_torch_kernel_is_weight_only_w8a16():
    """{"kernel": "torch"}: no integer GEMM, so the activations are not rounded to int8 (W8A16: bfloat16 in and
    out of a product over the int8 weights); the default packs for the integer GEMM where it builds (W8A8)."""
    fb, kernels = UnquantizedLinearMethod(), object()  # `kernels`: what the platform hands over (CpuQuantKernels)
    m = get_quantization_method("int8", {"kernel": "torch"}, fb, cpu_kernel=kernels)
    assert m.cpu_kernel is None and get_quantization_method("int8", None, fb, cpu_kernel=kernels).cpu_kernel is kernels
    layer, w = make_linear(m, 80, 320)
    assert layer.qg_format is None
    x = torch.randn(9, 320, generator=torch.Generator().manual_seed(0))
    want = F.linear(x.to(torch.bfloat16).float(), dequantize_int8(layer.qweight, layer.scales)).to(torch.bfloat16)
    assert torch.allclose(layer(x), want.float(), rtol=2 ** -7, atol=1e-4)

# -- the GGUF file's own blocks -------------------------------------------------------------------------

@needs_default_model
def test_gguf_q4_1_blocks_map_onto_the_int4_op():
    from gguf.quants import dequantize

    from minfer.model.gguf import iter_gguf_blocks, open_gguf
    from minfer.model.sources import resolve_model
    from minfer.quantization.gguf import decode_q4_blocks

    reader = open_gguf(resolve_model("smollm2-135m-instruct").path)
    b = next(b for b in iter_gguf_blocks(reader) if b.tensor_type.name == "Q4_1")
    ref = torch.from_numpy(np.array(dequantize(b.data, b.tensor_type), dtype=np.float32))
    raw = torch.from_numpy(np.array(b.data, dtype=np.uint8)).reshape(b.shape[0], -1)
    codes, d, z = decode_q4_blocks(raw, "Q4_1")
    exact = dequantize_int4(codes, d, z)  # s = d, z = m + 8d in float32: gguf's numbers
    assert float((exact - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
    # in bfloat16, as the op stores them: off by the rounding of d and m + 8d only
    approx = dequantize_int4(codes, d.bfloat16(), z.bfloat16())
    bound = (8 * d.abs() + z.abs()) * 2 ** -8
    err = (approx - ref).abs().reshape(codes.shape[0], -1, 32)
    assert bool((err <= bound[..., None] + 1e-7).all())


# -- the engine against the simple path, same method ----------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time, a small robot"]


def measured_pair_error(pairs) -> float:
    """How far the two paths of `pairs` move the gap between two tokens' log-probs, measured where they agree.

    `pairs` holds (got, ref) `CompletionOutput`s of the same prompt from two paths, both with `logprobs`. At
    every position before the first differing token (the context is then the same token for token, the
    differing position excluded), the tokens both paths list get errors e_t = got_t - ref_t (nats); the gap
    between two tokens moves by e_a - e_b, so the position's error is max e - min e. Returns the largest over
    all positions of all pairs (0.0 for bit-identical paths). The log-normaliser is common to all tokens of a
    position and cancels: this is the error of the logits' differences, the quantity a greedy choice reads.
    """
    err = 0.0
    for got, ref in pairs:
        for i, (x, y) in enumerate(zip(got.token_ids, ref.token_ids)):
            if x != y:
                break
            a, b = got.logprobs[i], ref.logprobs[i]
            d = [a[t] - b[t] for t in b if t in a]
            if len(d) >= 2:
                err = max(err, max(d) - min(d))
    return err


def assert_same_up_to_near_ties(pairs, what: str, max_flips: int) -> list:
    """Greedy tokens of two paths equal, or equal up to a flip at a near tie, judged against the run's own error.

    For each (got, ref) of `pairs` (see `measured_pair_error`): the tokens are equal, or at the first position
    where they differ the token `got` took is in `ref`'s top log-probs and `ref` preferred its own token by a
    margin (ref's log-prob of its token minus that of got's) no larger than `measured_pair_error(pairs)`, the
    largest gap error the two paths showed at the positions where they saw the same context. After a flip the
    continuations differ and are not compared. At most `max_flips` pairs may flip.

    How the tolerance is chosen: a fixed number of nats (0.125, one bfloat16 step, before) held on the CPU it was
    measured on and failed on another (a Zen 3 without AVX-512 flipped int8 KV's prompt 1 at a margin of 0.162
    nats), because the error of a quantized or differently-ordered path depends on the ISA's kernels. The
    measured error follows the machine: on a Xeon with AVX-512 the int8 KV pool read by torch attention moved a
    gap by up to 0.62 nats (median 0.13) against the simple path, in chunks of 32 by up to 0.30, and the
    default config by 0.0 (bit-identical, so no flip passes there). A flip is a failure when its margin is
    larger than any error the same two paths made elsewhere in the run: a real divergence (a clear winner
    lost), or a token outside ref's top log-probs. `max_flips` bounds how many prompts may flip, so that a path
    broken enough to have a large error everywhere still fails.

    Returns:
        per pair, the index of the flip or None.
    Raises:
        AssertionError: naming `what`, the prompt, the position, the margin and the measured error.
    """
    tol = measured_pair_error(pairs)
    flips = []
    for n, (got, ref) in enumerate(pairs):
        a, b = got.token_ids, ref.token_ids
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            assert len(a) == len(b), f"{what}: prompt {n}: {len(a)} tokens vs {len(b)}"
        else:
            top = ref.logprobs[at]
            assert a[at] in top, (f"{what}: prompt {n}: token {at} differs ({a[at]} vs {b[at]}) and {a[at]} is not "
                                  f"among the reference's top log-probs")
            margin = top[b[at]] - top[a[at]]
            assert margin <= tol, (f"{what}: prompt {n}: token {at} differs ({a[at]} vs {b[at]}) with a margin of "
                                   f"{margin:.3f} nats, more than the {tol:.3f} nats the two paths differ by where "
                                   "they agree")
        flips.append(at)
    assert sum(f is not None for f in flips) <= max_flips, f"{what}: flips at {flips}, at most {max_flips} allowed"
    return flips


def _out(ids, lps):
    return SimpleNamespace(token_ids=ids, logprobs=lps)


def test_near_tie_rule_follows_the_measured_error_and_still_fails_a_clear_divergence():
    """The helper accepts a flip whose margin is within the error the two paths show where they agree, and
    fails one with a clear winner, one outside the top log-probs, any flip between bit-identical paths, and more
    flips than allowed."""
    # prompt 0 agrees everywhere; at position 1 the gap between tokens 5 and 6 moves by 0.3 nats (-1.0 -> -1.3
    # against -2.0 -> -2.0), the largest error: the measured tolerance is 0.3
    agree = (_out([5, 5, 5], [{5: -0.1, 6: -2.5}, {5: -1.3, 6: -2.0}, {5: -0.2, 6: -3.0}]),
             _out([5, 5, 5], [{5: -0.1, 6: -2.5}, {5: -1.0, 6: -2.0}, {5: -0.2, 6: -3.0}]))

    def flip(margin, taken=8):  # prompt 1: the reference prefers 7 by `margin`; the other path took `taken`
        return (_out([7, taken], [{7: -0.5, 8: -1.0}, {taken: -0.1, 7: -0.9}]),
                _out([7, 7], [{7: -0.5, 8: -1.0}, {7: -0.6, 8: -0.6 - margin}]))

    assert measured_pair_error([agree]) == pytest.approx(0.3)
    assert assert_same_up_to_near_ties([agree, flip(0.2)], "t", max_flips=1) == [None, 1]
    with pytest.raises(AssertionError, match=r"prompt 1: token 1 differs \(8 vs 7\) with a margin of 0.800 nats, "
                                             r"more than the 0.300"):
        assert_same_up_to_near_ties([agree, flip(0.8)], "t", max_flips=1)
    with pytest.raises(AssertionError, match="not among the reference's top log-probs"):
        assert_same_up_to_near_ties([agree, flip(0.2, taken=9)], "t", max_flips=1)
    with pytest.raises(AssertionError, match="at most 0 allowed"):
        assert_same_up_to_near_ties([agree, flip(0.2)], "t", max_flips=0)
    exact = (agree[1], agree[1])  # bit-identical where they agree: the tolerance is 0, no flip passes
    with pytest.raises(AssertionError, match="margin of 0.010 nats, more than the 0.000"):
        assert_same_up_to_near_ties([exact, flip(0.01)], "t", max_flips=1)
    with pytest.raises(AssertionError, match="3 tokens vs 2"):
        assert_same_up_to_near_ties([(agree[0], _out([5, 5], agree[1].logprobs[:2]))], "t", max_flips=0)


@needs_default_model
@pytest.mark.parametrize("quantization,config", [("int8", None), ("gguf", None), ("int4", {"group_size": 32})])
def test_engine_greedy_equals_simple_path(quantization, config):
    from minfer import LLM, SamplingParams

    # A pool of 6 blocks of 16 tokens for 4 sequences of ~32 tokens (2 blocks each): some are preempted, by
    # swap. Quantized products round activations and outputs to bfloat16 (chapter 5 §5.3), which turns a
    # last-bit difference upstream (the attention kernel, the float head's two layouts) into a whole
    # bfloat16 step now and then: measured, 'def fibonacci(n):' flips at token 13, where the two best tokens
    # are 0.051 nats apart, in some runs and not others. So the check is: identical tokens,
    # or identical up to such a measured near-tie. (Recompute, which re-runs decoded tokens as a prefill
    # through the other route, gives more such flips; chapter 5 says so.) On the CPU every method now rounds
    # activations to int8 blocks of 32 (the integer GEMM, chapter 5 §5.3), which is batch-invariant itself but
    # turns the float32 model's own engine-vs-simple differences (measured: up to 2.4e-5 nats in the
    # log-probs, the attention path) into up to 0.15 nats by the first decode step, wherever an activation
    # sits on a rounding boundary: measured, gguf flipped on 2 of the 4 prompts (fibonacci at token 13, the
    # robot story at token 6), each at a near-tie. So up to 2 flips, each at a near-tie.
    llm = LLM(quantization=quantization, quantization_config=config, max_model_len=64, block_size=16,
              kv_cache_memory_bytes=6 * 16 * 30 * 2 * 3 * 64 * 4, seed=0, preemption_mode="swap", swap_space=0.05)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, sp)
    pairs = [(o.outputs[0], llm.generate_simple(p, sp)[0].outputs[0]) for p, o in zip(PROMPTS, outs)]
    assert_same_up_to_near_ties(pairs, quantization, max_flips=2)
    stats = llm.stats()
    assert stats.num_preemptions > 0  # the batched run really was preempted
    layer = llm.llm_engine.worker.model.model.layers[0].mlp.gate_up_proj
    assert layer.quantized and not hasattr(layer, "weight")


@needs_default_model
def test_gguf_needs_a_gguf_model(tmp_path):
    from minfer.model.loader import load_model
    from minfer.model.sources import ModelSource

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="quantization='gguf' runs a .gguf file"):
        load_model(source=ModelSource(kind="hf", path=tmp_path, name="x"), quantization="gguf")


@pytest.mark.parametrize("flags,needle", [
    (["--quantization", "int4", "--quantization-config", '{"group_size": 48}'], "group_size must be one of"),
    (["--quantization", "int9"], "unknown quantization method"),
])
def test_server_refuses_bad_quantization_before_loading(flags, needle):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "minfer.serve", *flags], cwd=root, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


@pytest.mark.parametrize("k", [8, 100, 104])
def test_int8_on_widths_the_packed_op_cannot_take(k):
    """int8 on an input width that is not a multiple of 32 keeps the torch route, and torch's packed op reads
    past the row for widths that are not a multiple of 16 (it returned ~4e33 or crashed the process for 100
    and 104): those take dequantize + F.linear, the same W8A16 product."""
    layer, w = make_linear(Int8LinearMethod(), 64, k, bias=True)
    x = torch.randn(3, k)
    y = layer(x)
    ref = reference(x, Int8LinearMethod().dequantize(layer, torch.float32)) + layer.bias
    assert float((y - ref).abs().max()) <= 1e-2 * float(ref.abs().max())


def test_int4pack_block_follows_the_cpu_vector_width():
    """torch's CPU int4 packing sizes its row blocks by 4 float vectors (64 rows with AVX-512, 32 with AVX2), so
    reading its layout back must use this machine's block, and the GPU layout stays 64."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512", "AVX2"):
        pytest.skip(f"no known int4 block for torch's {capability} kernels")
    assert int4pack_block("cpu") == (64 if capability == "AVX512" else 32)
    assert int4pack_block("cuda") == 64
    # the op's layout on the reference path (no C++ kernel): the method reads its own codes back
    m = Int4LinearMethod(64)
    layer, w = make_linear(m, 128, 64)
    codes, _, _ = quantize_int4(w, 64)
    assert layer.int4_packed and torch.equal(m.codes(layer), codes)
