"""Checks for notebook 12c (isolation): the KV tokens a MIG slice holds, and a MIG profile's share of a GPU."""

from __future__ import annotations

from fractions import Fraction

from minfer.course import expect_equal, passed
from minfer.memory import kv_bytes_per_token
from minfer.parallel.mig import (
    GPUS_GB,
    MIG_PROFILES,
    MODELS,
    WEIGHT_BYTES,
    num_parameters,
    replicas_per_slice,
    slice_bytes,
)


def check_kv_tokens(answer) -> None:
    """`answer(slice_gb, num_params, bytes_per_weight, num_layers, num_kv_heads, head_dim, kv_dtype_bytes,
    utilization)` is the most KV tokens one replica can keep in the slice (0 when the weights do not fit):
    one more token and `minfer.parallel.mig.replicas_per_slice` says the replica no longer fits."""
    cases = 0
    for p in MIG_PROFILES:
        if p.gpu not in ("A100-40GB", "H200-141GB"):
            continue
        for name, m in MODELS.items():
            for dt in ("bfloat16", "int4"):
                got = answer(slice_bytes(p) / 1e9, num_parameters(m), WEIGHT_BYTES[dt], m.num_hidden_layers,
                             m.num_key_value_heads, m.head_dim, 2, 0.9)
                what = f"KV tokens of {name} ({dt} weights) in {p.gpu} {p.name}"
                if not isinstance(got, int) or isinstance(got, bool):
                    raise AssertionError(f"Exercise 12c.1: {what} should be a whole number of tokens (int), got {got!r}")
                free = slice_bytes(p) * 0.9 - num_parameters(m) * WEIGHT_BYTES[dt]
                expect_equal("Exercise 12c.1", got, max(0, int(free // kv_bytes_per_token(m, "bfloat16"))), what=what)
                if got > 0:  # the same answer as minfer's replica arithmetic
                    assert replicas_per_slice(p, m, dt, kv_tokens=got) >= 1, what
                    assert replicas_per_slice(p, m, dt, kv_tokens=got + 1) == 0, what
                cases += 1
    passed(f"Exercise 12c.1 ({cases} slices and models)")


def check_profile_shares(answer) -> None:
    """`answer(profile_name, gpu_gb)` gives the profile's (memory fraction in eighths, SM fraction in sevenths)
    as Fractions, as NVIDIA's table (`minfer.parallel.mig.MIG_PROFILES`) has them."""
    for p in MIG_PROFILES:
        got = answer(p.name, GPUS_GB[p.gpu])
        expect_equal("Exercise 12c.2", tuple(got), (p.memory_fraction, p.sm_fraction),
                     what=f"(memory, SM) shares of {p.gpu} {p.name}")
    passed("Exercise 12c.2")


def _wrong_profile(name, gpu_gb):  # the memory share as GB / GB, not rounded to NVIDIA's eighths
    c, m = name.split(".")
    return Fraction(int(m[:-2]), gpu_gb), Fraction(int(c[:-1]), 7)


WRONG_ANSWERS = {
    # forgets the factor 2 (keys AND values)
    "check_kv_tokens": lambda gb, n, bpw, layers, kvh, hd, kvb=2, util=0.9: max(
        0, int((gb * 1e9 * util - n * bpw) // (layers * kvh * hd * kvb))),
    "check_profile_shares": _wrong_profile,
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
