"""Checks for notebook 05's exercises (quantization). Each builds small seeded inputs on the CPU and compares the
learner's answer with minfer's own code: `minfer.quantization.int4` (group-wise INT4), the bytes that
`quantize_int4` / `quantize_int8` actually store, `minfer.quantization.awq.scales_for` (AWQ's scales) and
`minfer.attention.kv_quant` (the INT8 KV cache)."""

from __future__ import annotations

import torch

from minfer.course import expect_close, expect_equal, passed


def _weights(rows: int = 8, cols: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[:, 7] *= 20  # an outlier input channel, as real layers have
    return w


def check_fake_quant_int4(fake_quant_int4) -> None:
    """Exercise 5.1: `fake_quant_int4(w [out, in], group_size) -> w_hat [out, in]` (float32), minfer's INT4:
    per group s = (max - min) / 15 and z = min + 8 s, both rounded to bfloat16; q = clamp(round((w - z) / s) + 8,
    0, 15); w_hat = (q - 8) s + z."""
    from minfer.quantization.int4 import dequantize_int4, quantize_int4

    ex = "Exercise 5.1"
    for g in (32, 64):
        w = _weights(seed=g)
        got = fake_quant_int4(w.clone(), g)
        expected = dequantize_int4(*quantize_int4(w, g))
        expect_close(ex, got, expected, atol=1e-6, rtol=1e-5, what=f"w_hat at group size {g}")
    err = (got - w).abs().max().item()
    print(f"largest |w_hat - w| at G = 64: {err:.4f} (in the groups of the outlier column, whose step is widest)")
    passed(ex)


def check_bytes_per_weight(bytes_per_weight) -> None:
    """Exercise 5.2: `bytes_per_weight(bits, group_size, scale_bytes=2, has_zero=True) -> float`: the code bits
    plus one scale (and zero) per group of `group_size` weights, compared with what minfer stores."""
    from minfer.quantization.int4 import quantize_int4
    from minfer.quantization.int8 import quantize_int8

    ex = "Exercise 5.2"
    w = _weights(16, 576)
    for g in (32, 64):
        codes, s, z = quantize_int4(w, g)
        stored = (codes.numel() / 2 + s.numel() * s.element_size() + z.numel() * z.element_size()) / w.numel()
        expect_close(ex, bytes_per_weight(4, g, 2, True), stored, what=f"int4 g{g} bytes per weight")
    q, s = quantize_int8(w)
    stored = (q.numel() * q.element_size() + s.numel() * s.element_size()) / w.numel()
    expect_close(ex, bytes_per_weight(8, 576, 2, False), stored, what="int8 (one scale per 576-wide row)")
    expect_close(ex, bytes_per_weight(4, 32, 2, True), 20 / 32, what="GGUF Q4_1 (a float16 d and m per 32)")
    expect_close(ex, bytes_per_weight(8, 32, 2, False), 34 / 32, what="GGUF Q8_0 (a float16 d per 32)")
    passed(ex)


def check_awq_scale(awq_scale) -> None:
    """Exercise 5.3: `awq_scale(w [out, in], x [n, in], x_mean [in], alpha) -> (w_s, x_s)`: s = x_mean^alpha
    normalized by sqrt(max s * min s) (`awq.scales_for`), w_s = w * s per input column, x_s = x / s."""
    from minfer.quantization.awq import scales_for

    ex = "Exercise 5.3"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=g)
    x[:, 5] *= 30
    w = torch.randn(16, 64, generator=g) * 0.1
    x_mean = x.abs().mean(0)
    for alpha in (0.0, 0.5):
        w_s, x_s = awq_scale(w.clone(), x.clone(), x_mean.clone(), alpha)
        s = scales_for(x_mean, alpha)
        expect_close(ex, w_s, w * s[None, :], what=f"the scaled weights (alpha={alpha})")
        expect_close(ex, x_s @ w_s.t(), x @ w.t(), atol=1e-4, what=f"(x / s) @ (w s)^T (alpha={alpha})")
    passed(ex)


def check_kv_int8(quantize_kv_int8) -> None:
    """Exercise 5.4: `quantize_kv_int8(x [T, H, D]) -> (codes int8 [T, H, D], scales float32 [T, H])`, one scale
    per token and head: scale = max|x| / 127 over the head's D values, codes = round(x / scale) in [-127, 127]."""
    from minfer.attention.kv_quant import kv_cache_spec, quantize_kv

    ex = "Exercise 5.4"
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 64, generator=g)
    x[2, 1] *= 50  # one loud token in one head must not coarsen the others
    codes, scales = quantize_kv_int8(x.clone())
    ref_codes, ref_scales = quantize_kv(x, kv_cache_spec("int8", torch.float32))
    expect_equal(ex, tuple(scales.shape), tuple(ref_scales.shape), what="the scales' shape")
    expect_close(ex, scales, ref_scales, atol=0, rtol=1e-6, what="the scales")
    expect_equal(ex, torch.as_tensor(codes).to(torch.int8), ref_codes, what="the codes")
    passed(ex)


def _wrong_fake_quant(w, group_size):
    # forgets the zero: a symmetric grid around 0 with the asymmetric step
    out, k = w.shape
    wg = w.reshape(out, k // group_size, group_size)
    s = ((wg.amax(-1) - wg.amin(-1)) / 15).to(torch.bfloat16).float()[..., None]
    return (torch.round(wg / s).clamp(-8, 7) * s).reshape(out, k)


def _wrong_kv(x):
    # one scale for the whole tensor: the loud token coarsens every other token's grid
    scale = x.abs().amax() / 127
    codes = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return codes, scale.expand(x.shape[:2]).clone()


WRONG_ANSWERS = {
    "check_fake_quant_int4": _wrong_fake_quant,
    "check_bytes_per_weight": lambda bits, group_size, scale_bytes=2, has_zero=True: bits / 8,  # forgets the scales
    "check_awq_scale": lambda w, x, x_mean, alpha: (w * x_mean.pow(alpha), x * x_mean.pow(alpha)),  # x times s
    "check_kv_int8": _wrong_kv,
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
