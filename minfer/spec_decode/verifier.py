"""Verification of proposed tokens in the worker (chapter 7b): what a step's rows carrying drafts sample.

The worker holds a `RejectionVerifier` when the engine speculates (`minfer.extensions.load_verifier`) and
hands it the rows whose sequence carries drafts (`Sequence.spec_token_ids`).
"""

from __future__ import annotations

import torch

from minfer.sampling import apply_token_bitmask
from minfer.spec_decode.rejection import rejection_sample


class RejectionVerifier:
    """Rejection sampling over the k + 1 logits of each speculating row (Leviathan et al., 2023).

    Args:
        sampler: the worker's sampler (ordinary rows, and each row's seeded random stream).
        generator: the worker's default `torch.Generator`.
    """

    def __init__(self, sampler, generator: torch.Generator):
        self.sampler, self.generator = sampler, generator

    def __call__(self, logits: torch.Tensor, seqs: list, mask: torch.Tensor | None = None,
                 spec_masks: list | None = None) -> tuple[list[list[int]], list | None, list | None]:
        """A batch with speculating rows: ordinary rows go through the sampler (with their rows of the
        structured-output `mask`) and yield one token, each speculating row goes through `rejection_sample`
        over its k + 1 logits and yields 1 to k + 1. A guided speculating row's logits are masked first,
        position by position (`spec_masks[i]`, int32 `[k + 1, ceil(V/32)]`), so a draft the grammar refuses
        has p = 0 and every emitted token is one the grammar allows there; logprobs stay the raw model's.

        Args:
            logits: float32 `[sum over rows of (1 + k_i), V]`, each row's positions in order.
        Returns:
            `ModelRunnerOutput`'s (sampled_token_ids, logprobs, top_logprobs) for `seqs`.
        """
        sizes = [1 + len(s.spec_token_ids) for s in seqs]
        last = torch.cumsum(torch.tensor(sizes), 0) - 1
        plain = [i for i, s in enumerate(seqs) if not s.spec_token_ids]
        tokens: list = [None] * len(seqs)
        chosen: list | None = None
        tops: list | None = None
        want_lp = any(s.params.logprobs is not None for s in seqs)
        if want_lp:
            chosen, tops = [None] * len(seqs), [None] * len(seqs)
        if plain:
            t, c, tp = self.sampler(logits[last[plain]], [seqs[i] for i in plain],
                                    None if mask is None else mask[plain])
            for r, i in enumerate(plain):
                tokens[i] = [int(t[r])]
                if want_lp:
                    chosen[i] = [float(c[r]) if c is not None else 0.0]
                    tops[i] = [tp[r] if tp is not None else None]
        start = 0
        for i, (s, n) in enumerate(zip(seqs, sizes)):
            if s.spec_token_ids:
                rows = logits[start:start + n].float()
                guided = spec_masks[i] if spec_masks else None
                out = rejection_sample(rows if guided is None else apply_token_bitmask(rows, guided),
                                       s.spec_token_ids, s.params, s.spec_token_probs,
                                       self.sampler.generator_for(s, logits.device) or self.generator)
                tokens[i] = out
                if want_lp:
                    logp = rows[:len(out)].log_softmax(dim=-1)
                    ids = torch.tensor(out, device=logp.device)
                    lp = logp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
                    chosen[i] = lp
                    k = s.params.logprobs or 0
                    vals, top_ids = logp.topk(k, dim=-1) if k else (None, None)
                    tops[i] = [{**(dict(zip(top_ids[r].tolist(), vals[r].tolist())) if k else {}), out[r]: lp[r]}
                               for r in range(len(out))]
            start += n
        return tokens, chosen, tops
