"""Checks for notebook 07b (speculative decoding): one step of the rejection rule, and the expected number of
tokens a verification round emits.

The rule is Leviathan et al. (2023), Algorithm 1, as `minfer.spec_decode.rejection.rejection_sample` applies it;
the expected tokens per round is the numerator of `minfer.bench.spec.predicted_speedup`.
"""

from __future__ import annotations

import torch

from minfer.course import expect_close, passed


def check_rejection_step(rejection_parts) -> None:
    """`rejection_parts(p [V], q [V], d: int) -> (accept: float, residual [V])`: the probability of accepting
    draft token d (min(1, p[d] / q[d])) and the distribution to draw from when it is rejected
    (max(0, p - q), normalised). Checked exactly, then checked to give back p: drawing d from q, accepting with
    `accept`, else drawing from `residual`, emits token x with probability p[x]."""
    from minfer.sampling_params import SamplingParams
    from minfer.spec_decode.rejection import processed_probs

    g = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.7):
        p = processed_probs(torch.randn(1, 8, generator=g, dtype=torch.float64) * 1.5,
                            SamplingParams(temperature=temperature))[0].double()
        q = torch.rand(8, generator=g, dtype=torch.float64) + 0.05
        q = q / q.sum()
        emitted = torch.zeros(8, dtype=torch.float64)
        for d in range(8):
            accept, residual = rejection_parts(p.clone(), q.clone(), d)
            accept = float(accept)
            residual = torch.as_tensor(residual, dtype=torch.float64)
            expect_close("Exercise 7b.1", accept, min(1.0, float(p[d] / q[d])), what=f"the accept probability of d={d}")
            want = (p - q).clamp_min(0)
            expect_close("Exercise 7b.1", residual, want / want.sum(), what="the residual distribution")
            onehot = torch.zeros(8, dtype=torch.float64)
            onehot[d] = 1.0
            emitted += q[d] * (accept * onehot + (1 - accept) * residual)
        expect_close("Exercise 7b.1", emitted, p, atol=1e-9, what="the distribution of the emitted token")
    passed("Exercise 7b.1")


def check_expected_tokens(expected_tokens) -> None:
    """`expected_tokens(alpha: float, k: int) -> float`: the expected number of tokens one verification round
    emits when each of the k drafts is accepted with probability alpha, independently, until the first
    rejection, plus the one token the target always adds (the correction or the bonus)."""
    from minfer.bench.spec import predicted_speedup

    for alpha in (0.0, 0.3, 0.6, 0.87, 0.99, 1.0):
        for k in (1, 2, 4, 8):
            expect_close("Exercise 7b.2", expected_tokens(alpha, k), predicted_speedup(alpha, k, 0.0),
                         what=f"the tokens per round for alpha={alpha}, k={k}")
    passed("Exercise 7b.2")


def _residual_not_normalised(p, q, d):
    """Forgets to normalise the residual."""
    return min(1.0, float(p[d] / q[d])), (p - q).clamp_min(0)


def _no_bonus_token(alpha, k):
    """Forgets the token the target adds: counts only the accepted drafts."""
    return sum(alpha ** i for i in range(1, k + 1))


WRONG_ANSWERS = {"check_rejection_step": _residual_not_normalised, "check_expected_tokens": _no_bonus_token}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
