"""Checks for notebook 07 (decoding): the top-p (nucleus) mask, and temperature + top-k as a distribution.

Each check builds small seeded logits on the CPU and compares the learner's answer with minfer's sampler
(`minfer.sampling.apply_top_k_top_p`, `minfer.spec_decode.rejection.processed_probs`, the distribution the
sampler draws from).
"""

from __future__ import annotations

import torch

from minfer.course import expect_close, expect_equal, passed


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def check_top_p_mask(top_p_mask) -> None:
    """`top_p_mask(logits [B, V], p: float) -> logits [B, V]`: the tokens outside the nucleus set to -inf, the
    others unchanged (the smallest set of most likely tokens whose mass reaches p; the top token always stays)."""
    from minfer.sampling import apply_top_k_top_p

    logits = _logits()
    for p in (0.05, 0.3, 0.5, 0.9, 0.99):
        want = apply_top_k_top_p(logits, None, torch.full((logits.shape[0],), p))
        got = top_p_mask(logits.clone(), p)
        expect_equal("Exercise 7.1", torch.isinf(torch.as_tensor(got)), torch.isinf(want),
                     what=f"the mask (True = dropped) for p = {p}")
        keep = ~torch.isinf(want)
        expect_close("Exercise 7.1", torch.as_tensor(got)[keep], want[keep], what=f"the kept logits for p = {p}")
    passed("Exercise 7.1")


def check_temperature_top_k(temperature_top_k) -> None:
    """`temperature_top_k(logits [B, V], temperature: float, k: int) -> probs [B, V]`: the distribution the
    sampler draws from: logits / temperature, only the k largest kept, softmax."""
    from minfer.sampling_params import SamplingParams
    from minfer.spec_decode.rejection import processed_probs

    logits = _logits(seed=1)
    for t, k in ((1.0, 50), (0.5, 5), (1.5, 10), (0.8, 1)):
        want = processed_probs(logits, SamplingParams(temperature=t, top_k=k))
        got = temperature_top_k(logits.clone(), t, k)
        expect_close("Exercise 7.2", got, want, atol=1e-5, what=f"the probabilities for T = {t}, k = {k}")
    passed("Exercise 7.2")


def _top_p_forgets_crossing_token(logits, p):
    """Drops the token that crosses p too: keeps only tokens whose cumulative mass is < p."""
    s, order = logits.sort(-1, descending=True)
    drop = s.softmax(-1).cumsum(-1) > p
    return torch.full_like(logits, float("-inf")).scatter(-1, order, s.masked_fill(drop, float("-inf")))


def _top_k_before_temperature_softmax(logits, t, k):
    """Forgets the temperature: softmax of the top-k logits as they are."""
    kth = logits.topk(k, -1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


WRONG_ANSWERS = {"check_top_p_mask": _top_p_forgets_crossing_token,
                 "check_temperature_top_k": _top_k_before_temperature_softmax}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
