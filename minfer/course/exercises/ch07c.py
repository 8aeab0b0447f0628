"""Checks for notebook 07c (structured output): applying a packed token bitmask to logits, and the tokens a
choice constraint allows next.

The bitmask layout is llguidance's and minfer's (`minfer.sampling.apply_token_bitmask`): int32 words, bit j of
word w is token 32 w + j, a set bit allows the token.
"""

from __future__ import annotations

import torch

from minfer.course import expect_close, expect_equal, passed


def check_apply_bitmask(apply_bitmask) -> None:
    """`apply_bitmask(logits [B, V] float32, bitmask [B, ceil(V/32)] int32) -> logits [B, V]`: disallowed tokens
    set to -inf, allowed ones unchanged."""
    from minfer.sampling import apply_token_bitmask
    from minfer.structured_output import bitmask_width

    g = torch.Generator().manual_seed(0)
    for vocab in (64, 100):
        logits = torch.randn(3, vocab, generator=g)
        mask = torch.randint(-2**31, 2**31 - 1, (3, bitmask_width(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
        mask[0] = -1                      # all allowed
        mask[1, 0] = 1 << 5               # token 5 only, in the first word
        want = apply_token_bitmask(logits, mask)
        got = torch.as_tensor(apply_bitmask(logits.clone(), mask.clone()))
        expect_equal("Exercise 7c.1", torch.isinf(got), torch.isinf(want), what=f"the disallowed tokens (V={vocab})")
        keep = ~torch.isinf(want)
        expect_close("Exercise 7c.1", got[keep], want[keep], what="the allowed logits")
    passed("Exercise 7c.1")


VOCAB = ["a", "b", "c", "ab", "ba", "cat", "do", "dog", "g", "yes", "y", "es", "no", "n", "o", "s", " ", "\""]


def _reference_allowed(prefix: str, choices: list[str], vocab: list[str]) -> list[int]:
    return [i for i, t in enumerate(vocab) if any(c.startswith(prefix + t) for c in choices)]


def check_allowed_tokens(allowed_tokens) -> None:
    """`allowed_tokens(prefix: str, choices: list[str], vocab: list[str]) -> list[int]`: the ids of the tokens
    t (strings of `vocab`, id = index) such that `prefix + t` still begins one of the choices: the mask a
    `guided_choice` grammar gives at this step, computed by brute force over the vocabulary."""
    cases = [("", ["yes", "no"]), ("y", ["yes", "no"]), ("ye", ["yes", "no"]), ("", ["cat", "dog", "do"]),
             ("do", ["cat", "dog", "do"]), ("x", ["yes"]), ("", ["ab", "ba"])]
    for prefix, choices in cases:
        got = sorted(int(i) for i in allowed_tokens(prefix, list(choices), list(VOCAB)))
        expect_equal("Exercise 7c.2", got, _reference_allowed(prefix, choices, VOCAB),
                     what=f"the allowed ids after {prefix!r} for choices {choices}")
    passed("Exercise 7c.2")


def _big_endian_bits(logits, bitmask):
    """Reads the bits of each word from the top (bit 31 first)."""
    bits = (bitmask.unsqueeze(-1).long() >> torch.arange(31, -1, -1)) & 1
    allowed = bits.reshape(logits.shape[0], -1)[:, : logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def _prefix_of_token(prefix, choices, vocab):
    """Checks that the token begins a choice, forgetting the text already generated."""
    return [i for i, t in enumerate(vocab) if any(c.startswith(t) for c in choices)]


WRONG_ANSWERS = {"check_apply_bitmask": _big_endian_bits, "check_allowed_tokens": _prefix_of_token}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
