"""Checks for notebook 04's exercises (FlashAttention, Flash-Decoding, GQA).

- Exercise 4.1 `check_merge`: merge two partial softmax results (m, l, o) into one, the step Flash-Decoding's
  `combine_splits` does and FlashAttention's inner loop does tile by tile. Compared with minfer's naive
  attention (`minfer.kernels.reference.attention_reference`), which takes one softmax over all the keys.
- Exercise 4.2 `check_tiles`: which (query tile, key tile) blocks a causal mask with an optional sliding window
  lets the kernel skip. Compared with the dense visibility mask of `minfer.kernels.reference._visible`.
- Exercise 4.3 `check_kv_head`: which K/V head a query head reads under GQA. Compared with
  `attention_reference` run on all heads at once.
"""

from __future__ import annotations

import math

import torch

from minfer.course import expect_close, expect_equal, passed
from minfer.kernels.reference import _visible, attention_reference


def _partial(scores: torch.Tensor, v: torch.Tensor):
    """(m, l, o) of one block of keys: row max, sum of exp(s - m), unnormalized sum of exp(s - m) v."""
    m = scores.max(-1).values
    p = torch.exp(scores - m[..., None])
    return m, p.sum(-1), p @ v


def check_merge(merge) -> None:
    """`merge(m1, l1, o1, m2, l2, o2) -> (m, l, o)`: the merged row max [H], sum [H] and unnormalized output
    [H, D] of two blocks of keys; o / l must equal softmax over all keys @ V and m + log l the log-sum-exp."""
    ex = "Exercise 4.1"
    g = torch.Generator().manual_seed(4)
    H, D, n = 3, 8, 20
    q = torch.randn(1, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(n, 1, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(n, 1, D, generator=g, dtype=torch.float64)
    want, lse = attention_reference(q, k, v, causal=False, return_lse=True)   # [1, H, D], [H, 1]
    scores = torch.einsum("qhd,kd->hk", q, k[:, 0]) / math.sqrt(D)            # [H, n]
    for cut in (7, 1, 19):
        a = _partial(scores[:, :cut], v[:cut, 0])
        b = _partial(scores[:, cut:], v[cut:, 0])
        m, l, o = merge(*a, *b)
        m, l, o = (torch.as_tensor(t, dtype=torch.float64) for t in (m, l, o))
        expect_close(ex, m, torch.maximum(a[0], b[0]), what=f"the merged max m (keys split at {cut})")
        expect_close(ex, o / l[:, None], want[0], atol=1e-9,
                     what=f"o / l, the attention output (keys split at {cut})")
        expect_close(ex, m + torch.log(l), lse[:, 0], atol=1e-9, what=f"m + log l, the log-sum-exp (split at {cut})")
    passed(ex)


def _dense_tiles(Lq: int, Lk: int, block_m: int, block_n: int, window: int | None) -> torch.Tensor:
    """True for each tile holding at least one visible (query, key) pair; query i sits at key Lk - Lq + i."""
    vis = _visible(torch.arange(Lq) + (Lk - Lq), torch.arange(Lk), (-1 if window is None else window, 0))
    tm, tn = math.ceil(Lq / block_m), math.ceil(Lk / block_n)
    pad = torch.zeros(tm * block_m, tn * block_n, dtype=torch.bool)
    pad[:Lq, :Lk] = vis
    return pad.view(tm, block_m, tn, block_n).any(3).any(1)


def check_tiles(tiles_to_compute) -> None:
    """`tiles_to_compute(Lq, Lk, block_m, block_n, window=None) -> bool [ceil(Lq/bm), ceil(Lk/bn)]`: True for
    the tiles the kernel must load under a causal mask (and a sliding window of `window` keys to the left)."""
    ex = "Exercise 4.2"
    cases = [(256, 256, 32, 32, None), (256, 256, 32, 32, 64), (64, 64, 16, 32, None), (20, 50, 8, 16, None),
             (37, 37, 16, 8, 10), (1, 45, 16, 16, None), (100, 130, 32, 16, 40),
             (32, 32, 8, 8, 9), (256, 256, 32, 32, 65)]  # a tile edge on the window's boundary
    for Lq, Lk, bm, bn, w in cases:
        got = torch.as_tensor(tiles_to_compute(Lq, Lk, bm, bn, w)).bool()
        expect_equal(ex, got, _dense_tiles(Lq, Lk, bm, bn, w),
                     what=f"the tile grid for Lq={Lq}, Lk={Lk}, block_m={bm}, block_n={bn}, window={w}")
    passed(ex)


def check_kv_head(kv_head_for) -> None:
    """`kv_head_for(h, num_heads, num_kv_heads) -> int`: the K/V head that query head h reads."""
    ex = "Exercise 4.3"
    g = torch.Generator().manual_seed(43)
    for H, KVH in [(8, 2), (9, 3), (6, 1), (4, 4)]:
        q = torch.randn(5, H, 4, generator=g)
        k, v = torch.randn(5, KVH, 4, generator=g), torch.randn(5, KVH, 4, generator=g)
        want = attention_reference(q, k, v)                       # every head at once, minfer's GQA rule
        for h in range(H):
            kv = int(kv_head_for(h, H, KVH))
            if not 0 <= kv < KVH:
                raise AssertionError(f"{ex}: query head {h} of {H} maps to K/V head {kv}, but there are {KVH}")
            got = attention_reference(q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1])
            expect_close(ex, got[:, 0], want[:, h], what=f"head {h}'s output ({H} query heads, {KVH} K/V heads)")
    passed(ex)


def _merge_without_rescale(m1, l1, o1, m2, l2, o2):
    return torch.maximum(m1, m2), l1 + l2, o1 + o2


def _tiles_without_offset(Lq, Lk, block_m, block_n, window=None):
    """Forgets that query i sits at key Lk - Lq + i when there are more keys than queries."""
    t = torch.zeros(math.ceil(Lq / block_m), math.ceil(Lk / block_n), dtype=torch.bool)
    for i in range(t.shape[0]):
        last = min((i + 1) * block_m, Lq) - 1
        lo = 0 if window is None else max(i * block_m - window, 0)
        for j in range(t.shape[1]):
            t[i, j] = j * block_n <= last and (j + 1) * block_n - 1 >= lo
    return t


WRONG_ANSWERS = {
    "check_merge": _merge_without_rescale,
    "check_tiles": _tiles_without_offset,
    "check_kv_head": lambda h, num_heads, num_kv_heads: h % num_kv_heads,
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
