"""Checks for notebook 02 (positions): apply RoPE to q and k, ALiBi's head slopes, NTK-aware RoPE frequencies.

Each check builds small seeded inputs on the CPU and compares the learner's function with minfer's own code in
`minfer/model/positions.py` (`rotate_half_`, `compute_inv_freq`, `alibi_slopes`).
"""

from __future__ import annotations

import torch

from minfer.course import expect_close, passed
from minfer.model.positions import alibi_slopes, compute_inv_freq, rotate_half_


def _minfer_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    inv_freq, _ = compute_inv_freq(x.shape[-1], theta, None, 4096)
    ang = torch.outer(positions.float(), inv_freq)
    return rotate_half_(x.float(), ang.cos(), ang.sin())


def check_rope(apply_rope) -> None:
    """`apply_rope(x [T, H, D], positions [T], theta) -> [T, H, D]`: HF's rotate-half layout, pair i is
    (x[..., i], x[..., i + D/2]) rotated by position * theta^(-2i/D). Also checks that q·k depends only on
    the distance."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=g)
    pos = torch.tensor([0, 1, 2, 5, 17, 100, 2047])
    for theta in (10000.0, 500.0):
        expect_close("Exercise 2.1", apply_rope(x, pos, theta), _minfer_rope(x, pos, theta), atol=1e-4,
                     what=f"apply_rope(x, positions, theta={theta})")
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)
    s1 = (apply_rope(q, torch.tensor([10]), 10000.0) * apply_rope(k, torch.tensor([3]), 10000.0)).sum()
    s2 = (apply_rope(q, torch.tensor([110]), 10000.0) * apply_rope(k, torch.tensor([103]), 10000.0)).sum()
    expect_close("Exercise 2.1", s2, s1, atol=1e-4, what="q·k at positions (110, 103) against (10, 3)")
    passed("Exercise 2.1")


def check_alibi_slopes(slopes) -> None:
    """`slopes(n) -> list or tensor of n floats`, Press et al.'s geometric slopes with the interleaving for a
    head count that is not a power of two."""
    for n in (1, 4, 8, 6, 12, 16):
        expect_close("Exercise 2.2", torch.as_tensor(slopes(n), dtype=torch.float32), alibi_slopes(n),
                     atol=1e-7, what=f"slopes({n})")
    passed("Exercise 2.2")


def check_ntk_inv_freq(ntk_inv_freq) -> None:
    """`ntk_inv_freq(head_dim, theta, factor) -> [head_dim // 2]`: NTK-aware scaling raises the base to
    theta * factor^(d / (d - 2)); the frequencies are then the default ones of that base. The reference is minfer's
    dynamic NTK (`compute_inv_freq`, rope_type "dynamic") with its own factor 1, read at `factor` times the
    trained length: it raises the base by the same rule, with the scale taken from the current length."""
    for d, theta, factor in ((64, 10000.0, 4.0), (32, 10000.0, 2.0), (64, 100000.0, 8.0)):
        trained = 512
        expected, _ = compute_inv_freq(d, theta, {"rope_type": "dynamic", "factor": 1.0}, trained,
                                       seq_len=int(factor * trained))
        got = torch.as_tensor(ntk_inv_freq(d, theta, factor), dtype=torch.float32)
        expect_close("Exercise 2.3", got, expected, atol=1e-9, rtol=1e-4,
                      what=f"ntk_inv_freq({d}, {theta}, {factor})")
    passed("Exercise 2.3")


def _rope_interleaved(x, pos, theta):  # GPT-J's layout: pairs (x0, x1), (x2, x3): not what Llama checkpoints use
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.outer(pos.float(), inv)[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()
    return out


WRONG_ANSWERS = {
    "check_rope": _rope_interleaved,
    # the power-of-two formula for every n: right for 4, 8, 16, wrong for 6 and 12
    "check_alibi_slopes": lambda n: [2 ** (-8 * (i + 1) / n) for i in range(n)],
    # linear interpolation instead: every frequency divided by the factor
    "check_ntk_inv_freq": lambda d, theta, factor: 1.0 / (theta ** (torch.arange(0, d, 2).float() / d)) / factor,
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
