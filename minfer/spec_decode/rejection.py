"""Verifying drafts (Leviathan et al., 2023, arXiv:2211.17192, Algorithm 1; Chen et al., 2023).

For a sequence with drafts d_1..d_k the target gives k + 1 distributions p_1..p_{k+1} in one forward.

- Greedy: d_i is accepted while it equals argmax p_i; the first mismatch is replaced by argmax p_i, and when
  all k match, argmax p_{k+1} is a bonus token. The output is exactly the output without speculation.
- Sampling: d_i (drawn from the draft's q_i) is accepted with probability min(1, p_i(d_i) / q_i(d_i)); on the
  first rejection the token is drawn from norm(max(0, p_i - q_i)); when all are accepted, a bonus token is
  drawn from p_{k+1}. Each emitted token then has exactly the target's distribution p (the theorem of the
  paper). A deterministic proposer (n-gram) has q_i = one-hot(d_i): accept with p_i(d_i), else draw from p_i
  without d_i.

p is the distribution the sampler would draw from: temperature, top-k, top-p and min-p applied.
"""

from __future__ import annotations

import torch

from minfer.sampling import apply_min_p, apply_top_k_top_p
from minfer.sampling_params import SamplingParams

# SamplingParams fields (some added by other chapters) under which the target's distribution at a position
# depends on more than the tokens before it in a way this verifier does not reproduce (penalties count the
# output so far, min_tokens masks EOS up to a length): such requests decode normally. A grammar
# (guided_decoding) is reproduced: the engine verifies a guided row's drafts under the grammar's mask at each
# draft position (`StructuredOutputManager.spec_bitmasks`, llguidance's rollback), so guided requests speculate.
_UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
                "logit_bias": None, "allowed_token_ids": None, "bad_words": None, "logits_processors": None}


def speculation_supported(params: SamplingParams) -> bool:
    """False for a request whose sampling needs more than the target's logits (penalties, grammars, ...)."""
    return all(getattr(params, name, default) in (default, None, [], {}, ()) for name, default in _UNSUPPORTED.items())


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from, for rows of one request: float32 `[n, V]` -> `[n, V]`."""
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if params.top_k != -1 or params.top_p < 1:
        n = x.shape[0]
        top_k = torch.full((n,), vocab if params.top_k == -1 else min(params.top_k, vocab), device=x.device)
        x = apply_top_k_top_p(x, top_k, torch.full((n,), float(params.top_p), device=x.device))
    if params.min_p > 0:
        x = apply_min_p(x, torch.full((x.shape[0],), float(params.min_p), device=x.device))
    return x.softmax(dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs [V]` by the exponential race (as `minfer.sampling`)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: list[int], params: SamplingParams,
                     draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None) -> list[int]:
    """The tokens one speculating sequence emits this step: the accepted drafts, then one more.

    Args:
        target_logits: float32 `[k + 1, V]`, the target's logits after the last real token and after each draft.
        draft_token_ids: the k drafts.
        params: the request's sampling parameters (`greedy` decides the rule).
        draft_probs: float32 `[k, V]`, the draft's q_i (processed as p), or None for a deterministic proposer.
        generator: the request's random stream (None: torch's default).
    Returns:
        1 to k + 1 token ids: m accepted drafts and the correction (or the bonus token when m = k).
    """
    k = len(draft_token_ids)
    assert target_logits.shape[0] == k + 1, (target_logits.shape, k)
    drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=target_logits.device)
    if params.greedy:
        best = target_logits.argmax(dim=-1)
        m = int(torch.cumprod((best[:k] == drafts).long(), 0).sum()) if k else 0
        return draft_token_ids[:m] + [int(best[m])]
    p = processed_probs(target_logits, params)
    rows = torch.arange(k, device=p.device)
    p_d = p[rows, drafts]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs[rows, drafts].to(p_d)
    u = torch.rand(k, generator=generator, device=p.device) if k else p_d
    accepted = (u * q_d < p_d)  # u < min(1, p/q), without dividing by a zero q
    m = int(torch.cumprod(accepted.long(), 0).sum()) if k else 0
    if m == k:
        return draft_token_ids + [_draw(p[k], generator)]
    if draft_probs is None:
        residual = p[m].clone()
        residual[drafts[m]] = 0.0
    else:
        residual = (p[m] - draft_probs[m].to(p)).clamp_min(0.0)
    total = residual.sum()
    # p = q exactly leaves no residual mass; a rejection is then impossible in exact arithmetic, so draw from p.
    residual = residual / total if total > 0 else p[m]
    return draft_token_ids[:m] + [_draw(residual, generator)]
