"""From logits to the next token (article §7, §13): logits processing (logit_bias, min_tokens, repetition,
frequency and presence penalties), then temperature, top-k, top-p, min-p, seeded draws, logprobs.

All rows of a batch are processed together with tensor ops; per-request settings become per-row tensors.
The draw uses the "exponential race": argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability
p_i (it is Gumbel-max in disguise), so a seeded request only needs its own stream of E's, and its tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from minfer.sampling_params import SamplingParams
from minfer.sequence import Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus (top-p). The most likely token of each row
    is always kept, so every row can still be sampled.

    Args:
        logits: float32 `[B, V]` (already divided by temperature).
        top_k: int64 `[B]` (V means off) or None. top_p: float32 `[B]` (1.0 means off) or None.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token if the mass strictly before it is < top_p: the smallest set reaching top_p.
        before = probs.cumsum(dim=-1) - probs
        drop = before >= top_p.unsqueeze(1)
        # A top_p of 0 (a tiny value rounded to float32) would drop the top token too, and a row of -inf
        # samples token 0: keep the top-1 whatever top_p is.
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the most likely token's (Nguyen et al., 2024)."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    """int64 `[B, max len]` of the rows, padded with `pad` (at least one column, so scatter has a shape)."""
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each row: int64 `[B, V]` (one scatter_add, no loop over tokens).
    Padding goes to an extra column `vocab` that is dropped."""
    ids = _padded(rows, vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """The penalties of vLLM's sampler, all rows at once.

    repetition (Keskar et al., 2019, CTRL; HF's `RepetitionPenaltyLogitsProcessor`): every token seen in
    the prompt or the output has its logit divided by the penalty if positive, multiplied if negative.
    frequency / presence (OpenAI's formula): `logit -= frequency * count + presence * (count > 0)`, counting
    the output tokens only.

    Args:
        logits: float32 `[B, V]`. prompt_ids / output_ids: B lists of token ids.
        presence, frequency: float32 `[B]` (0 = off). repetition: float32 `[B]` (1 = off).
    Returns: new float32 `[B, V]` logits.
    """
    vocab, dev = logits.shape[-1], logits.device
    out_counts = token_counts(output_ids, vocab, dev)
    seen = (token_counts(prompt_ids, vocab, dev) + out_counts) > 0
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency.unsqueeze(1) * out_counts - presence.unsqueeze(1) * (out_counts > 0)


def _cached(params: SamplingParams, key: str, make):
    """`make()` once per SamplingParams object (all `n` sequences of a request share theirs), kept on the
    object: per-request tensors are built when the request first samples, not again every step."""
    cache = vars(params).setdefault("_sampler_cache", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _by_params(seqs: list[Sequence], want) -> list[tuple[SamplingParams, list[int]]]:
    """(params, the batch rows that share it) for the rows where `want(seq)` holds, in first-row order."""
    groups: dict[int, tuple[SamplingParams, list[int]]] = {}
    for i, s in enumerate(seqs):
        if want(s):
            groups.setdefault(id(s.params), (s.params, []))[1].append(i)
    return list(groups.values())


def logit_bias_vector(params: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor:
    """float32 `[V]`: the request's `logit_bias` as a dense vector (ids >= V ignored), built once per request."""
    def make() -> torch.Tensor:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        keep = ids < vocab
        return torch.zeros(vocab).index_put_((ids[keep],), vals[keep], accumulate=True).to(device)

    return _cached(params, ("logit_bias", vocab, str(device)), make)


def stop_id_tensor(params: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor:
    """int64 `[S]`: the request's stop token ids below V (EOS included unless `ignore_eos`), built once."""
    return _cached(params, ("stop_ids", vocab, str(device)), lambda: torch.tensor(
        sorted(t for t in params.all_stop_token_ids if t < vocab), dtype=torch.long, device=device))


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logit_bias, min_tokens and the penalties of each row's SamplingParams (rows that need none are left
    as they are). Returns new float32 `[B, V]` logits; `logits` itself is not changed.

    min_tokens masks (to -inf) the row's stop token ids, EOS included unless `ignore_eos`, while the row
    has fewer than min_tokens output tokens (vLLM's `MinTokensLogitsProcessor`).

    The per-step cost does not grow with the size of a request's bias or stop-id list in Python: each
    request's bias vector and stop-id tensor are built once (`logit_bias_vector`, `stop_id_tensor`) and
    applied to all its rows with one tensor op, so `n=128` with a bias over the whole vocabulary costs a
    `[128, V]` add per step.
    """
    params = [s.params for s in seqs]
    dev, vocab = logits.device, logits.shape[-1]
    copied = False
    for p, rows in _by_params(seqs, lambda s: bool(s.params.logit_bias)):
        if not copied:
            logits, copied = logits.clone(), True
        logits[rows] += logit_bias_vector(p, vocab, dev)
    for p, rows in _by_params(seqs, lambda s: len(s.output_token_ids) < s.params.min_tokens):
        ids = stop_id_tensor(p, vocab, dev)
        if ids.numel():
            if not copied:
                logits, copied = logits.clone(), True
            r = torch.tensor(rows, dtype=torch.long, device=dev)
            logits[r.unsqueeze(1), ids.unsqueeze(0)] = float("-inf")
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        logits = apply_penalties(
            logits, [s.prompt_token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs],
            [s.output_token_ids for s in seqs],
            torch.tensor([p.presence_penalty for p in params], device=dev),
            torch.tensor([p.frequency_penalty for p in params], device=dev),
            torch.tensor([p.repetition_penalty for p in params], device=dev))
    return logits


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output's mask (`minfer.structured_output`): tokens whose bit is 0 get -inf, all rows at once.

    Args:
        logits: float32 `[B, V]`. bitmask: int32 `[B, ceil(V/32)]` (bit j of word w is token 32 w + j; an
            all-ones row, -1, allows everything), on any device.
    Returns: new float32 `[B, V]` logits; `logits` itself is not changed.
    """
    b, vocab = logits.shape
    # The int32 words as their little-endian bytes [B, 4W], each byte shifted by 0..7: [B, 4W, 8] of 0/1, one
    # byte per token (a quarter of the memory int32 bits would take), read as bools. No loop over the vocabulary.
    words = bitmask.to(logits.device).contiguous().view(torch.uint8)
    allowed = ((words.unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1).view(torch.bool).reshape(b, -1)
    if allowed.shape[1] < vocab:  # logits wider than the tokenizer's mask: the extra ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return torch.where(allowed[:, :vocab], logits, torch.tensor(float("-inf"), device=logits.device))


def request_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """A private random stream for a seeded request; completion `index` of `n` gets its own stream."""
    if params.seed is None or params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((params.seed * 1_000_003 + index) % (2 ** 63))
    return g


class Sampler:
    """Samples one token per sequence from `logits [B, V]` (float32).

    `generator` draws for unseeded requests; a seeded request draws from its own stream
    (`request_generator`), kept here by `seq_id` until `release` (so a `Sequence` stays plain data).
    Returns (tokens int64 `[B]`, chosen-token logprobs float32 `[B]`, per-row top-logprob dicts or None).
    Logprobs are those of the model's raw distribution (before penalties, logit_bias, temperature, top-k,
    top-p), as vLLM returns by default. Penalties, logit_bias and min_tokens change the greedy choice too.
    """

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator
        self._seeded: dict[int, torch.Generator] = {}

    def generator_for(self, seq: Sequence, device: torch.device) -> torch.Generator | None:
        """The seeded stream of `seq` (made on first use), or None for an unseeded or greedy request."""
        if seq.params.seed is None or seq.params.greedy:
            return None
        g = self._seeded.get(seq.seq_id)
        if g is None:
            g = self._seeded[seq.seq_id] = request_generator(seq.params, seq.index, device)
        return g

    def release(self, seq_ids: list[int]) -> None:
        """Forget the streams of retired sequences."""
        for i in seq_ids:
            self._seeded.pop(i, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], bitmask: torch.Tensor | None = None):
        """`bitmask`: structured output's int32 `[B, ceil(V/32)]` token mask (None: no row is guided),
        applied after the logits processors and before temperature, top-k and top-p."""
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        raw = logits
        if any(p.needs_logits_processing for p in params):
            logits = apply_logits_processors(logits, seqs)
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, seqs, params, greedy)
        want_lp = [p.logprobs for p in params]
        if all(k is None for k in want_lp):
            return tokens, None, None
        logp = raw.log_softmax(dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens, chosen, self.top_logprobs(raw, tokens, chosen, want_lp, logp)

    @staticmethod
    def top_logprobs(raw: torch.Tensor, tokens: torch.Tensor, chosen: torch.Tensor, want_lp: list[int | None],
                     logp: torch.Tensor | None = None) -> list[dict[int, float]]:
        """Each row's {token id: logprob} of its `want_lp[i]` most likely tokens under `raw` `[B, V]`, plus the
        chosen token (`tokens`, `chosen` `[B]`). `logp`: raw's log_softmax if already computed."""
        k_max = max(k or 0 for k in want_lp)
        top_vals = top_ids = None
        if k_max:
            top_vals, top_ids = (raw.log_softmax(dim=-1) if logp is None else logp).topk(k_max, dim=-1)
        tops = []
        for i in range(len(want_lp)):
            d = {}
            if want_lp[i]:
                d = dict(zip(top_ids[i, :want_lp[i]].tolist(), top_vals[i, :want_lp[i]].tolist()))
            d[int(tokens[i])] = float(chosen[i])
            tops.append(d)
        return tops

    def _sample(self, logits, seqs, params, greedy):
        # `logits` are already processed (penalties, bias): greedy rows of a mixed batch take their argmax.
        device = logits.device
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device)
        x = logits / temps.unsqueeze(1)
        vocab = logits.shape[-1]
        if any(p.top_k != -1 for p in params) or any(p.top_p < 1 for p in params):
            top_k = torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            x = apply_top_k_top_p(x, top_k, top_p)
        if any(p.min_p > 0 for p in params):
            x = apply_min_p(x, torch.tensor([p.min_p for p in params], device=device))
        probs = x.softmax(dim=-1)
        noise = torch.empty_like(probs)
        gens = [self.generator_for(s, device) for s in seqs]
        unseeded = [i for i, g in enumerate(gens) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_(
                generator=self.generator)
        for i, g in enumerate(gens):
            if g is not None:
                noise[i].exponential_(generator=g)
        tokens = (probs / noise).argmax(dim=-1)
        if any(greedy):
            g = torch.tensor(greedy, device=device)
            tokens = torch.where(g, logits.argmax(dim=-1), tokens)
        return tokens
