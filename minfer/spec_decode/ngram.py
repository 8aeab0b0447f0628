"""Prompt lookup decoding (Saxena, 2023; vLLM's `ngram` method): the draft is what followed the latest
earlier occurrence of the sequence's suffix n-gram. Free to compute, and right whenever the output copies
its input (rewriting, editing code, quoting a passage)."""

from __future__ import annotations

import torch


class NgramProposer:
    """Propose up to k tokens by matching the sequence's last n tokens earlier in it.

    n is tried from `prompt_lookup_max` down to `prompt_lookup_min`; the first n with a match wins (the
    longest suffix found), and of its matches the latest one. The proposal is the (up to k) tokens after
    the match; an empty list when nothing matches.

    Example: tokens [1, 2, 3, 4, 2, 3], min 2, max 3, k 4: the suffix [2, 3] occurs at 1, so it proposes
    [4, 2, 3] (only three tokens follow the match).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k, self.max_n, self.min_n = num_speculative_tokens, prompt_lookup_max, prompt_lookup_min

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Args: token_ids, the whole sequence (prompt + output); k, at most this many (default: the config's)."""
        k = self.k if k is None else k
        n_tok = len(token_ids)
        if k < 1 or n_tok < self.min_n + 1:
            return []
        t = torch.tensor(token_ids, dtype=torch.long)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = t[n_tok - n:]
            windows = t[:n_tok - 1].unfold(0, n, 1)  # every n-gram that ends before the last token
            hits = (windows == suffix).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return t[start:start + k].tolist()
        return []
