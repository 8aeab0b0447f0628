"""Checks for notebook 01 (prefill, decode and the KV cache): the KV-cache size formula, and one decode step of
attention over a cache."""

from __future__ import annotations

import torch

from minfer.attention import Attention, attend
from minfer.course import expect_close, expect_equal, passed
from minfer.memory import kv_cache_bytes

CONFIGS = [  # (layers, batch, seq_len, kv_heads, head_dim, dtype)
    (30, 1, 4096, 3, 64, "float32"),         # SmolLM2-135M, one full sequence, as minfer runs it on a CPU
    (32, 16, 8192, 8, 128, "bfloat16"),      # a Llama-3-8B shape, 16 sequences
    (2, 3, 7, 1, 16, "int8"),
]


def check_kv_bytes(kv_bytes) -> None:
    """`kv_bytes(layers, batch, seq_len, kv_heads, head_dim, bytes_per_element) -> int` against
    `minfer.memory.kv_cache_bytes`."""
    sizes = {"float32": 4, "bfloat16": 2, "int8": 1}
    for layers, batch, seq, kvh, d, dtype in CONFIGS:
        expect_equal("Exercise 1.1", int(kv_bytes(layers, batch, seq, kvh, d, sizes[dtype])),
                     kv_cache_bytes(layers, batch, seq, kvh, d, dtype),
                     what=f"the bytes for {layers} layers x batch {batch} x {seq} tokens x {kvh} KV heads x {d} in {dtype}")
    passed("Exercise 1.1")


def check_decode_attention(decode_attention) -> None:
    """`decode_attention(q, k_cache, v_cache) -> [H, D]`: the new token's query `[H, D]` over the cached keys and
    values `[T, KVH, D]` (its own row included) equals the last row of full causal attention over T tokens
    (`minfer.attention.attend`)."""
    g = torch.Generator().manual_seed(0)
    for T, H, KVH, D in ((1, 2, 2, 8), (7, 9, 3, 16), (33, 4, 1, 32)):
        q = torch.randn(T, H, D, generator=g)
        k, v = torch.randn(2, T, KVH, D, generator=g)
        layer = Attention(0, H, KVH, D, scale=D ** -0.5)
        expected = attend(layer, q, k, v)[-1]
        got = decode_attention(q[-1].clone(), k.clone(), v.clone())
        expect_close("Exercise 1.2", got, expected, atol=1e-5,
                     what=f"the output for T={T}, {H} query heads over {KVH} KV heads")
    passed("Exercise 1.2")


def _unscaled(q, k, v):
    rep = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = torch.softmax(torch.einsum("hd,thd->ht", q, k), -1)        # forgets the 1/sqrt(head_dim) scale
    return torch.einsum("ht,thd->hd", w, v)


WRONG_ANSWERS = {
    "check_kv_bytes": lambda layers, batch, seq, kvh, d, b: layers * batch * seq * kvh * d * b,  # K only, no V
    "check_decode_attention": _unscaled,
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
