"""Beam search (article §7): keep the `beam_width` most likely continuations instead of one.

The search follows Hugging Face transformers' beam search step for step, so its beams and scores can be
checked against `generate(num_beams=W, num_return_sequences=W)`:

1. Every running beam's next-token log-probabilities plus the beam's score (the sum of its tokens'
   log-probabilities) are ranked together; the best K = max(2, 1 + #EOS ids) x W candidates are kept.
2. A candidate ending in EOS (or reaching max_tokens), and ranked among the first W, is finished: its score
   is sum(logprobs) / len ** length_penalty (len = generated tokens, EOS included); the W best finished
   beams are kept.
3. The W best candidates that did not finish are the next running beams.
4. Stop when no running beam can beat the worst finished one any more (transformers' heuristic: the best
   running score divided by the current length's penalty), when every candidate finished, or, with
   early_stopping=True, as soon as W beams finished.

KV memory (article §3): a beam's continuations share its blocks. A new beam is a `BlockManager.fork` of its
parent's block table (reference counts +1, nothing copied); when the parents are dropped, a block that more
than one new beam still shares is copied only when a beam is about to write into it (`copy_on_write`: the
last, partial block). A beam that dies releases its references, so its blocks free as soon as no beam uses
them. The runner drives the executor itself, one step for all prompts' beams, outside the scheduler: it
runs while the engine has no other request (`LLM.beam_search` checks).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from minfer.block_manager import BlockManager
from minfer.outputs import BeamSearchOutput, BeamSearchSequence
from minfer.sampling_params import BeamSearchParams, SamplingParams
from minfer.scheduler import ScheduledBatch
from minfer.sequence import Sequence

_NEG = -1.0e9  # transformers' "minus infinity" for beam scores


class _Beam:
    """A running beam: its sequence (which holds the block table) and per-token logprobs."""

    def __init__(self, seq: Sequence, logprobs: list[float], score: float):
        self.seq, self.logprobs, self.score = seq, logprobs, score


class _Search:
    """The state of one prompt's search."""

    def __init__(self, request_id: str, prompt_ids: list[int], root: Sequence):
        self.request_id, self.prompt_ids = request_id, prompt_ids
        self.running = [_Beam(root, [], 0.0)]
        self.finished: list[tuple[float, list[int], list[float], bool]] = []  # (score, out ids, logprobs, eos)
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False


class BeamSearchRunner:
    """Runs beam search for a group of prompts over the engine's block manager and executor.

    Args:
        block_manager: the engine's `BlockManager`. No other sequence may be scheduled while a search runs
            (the runner steps the executor itself); cached prefixes are shared with later requests.
        executor: has `compute_logits(ScheduledBatch) -> (rows, float32 [rows, V] logits)`.
        max_model_len: the length limit; eos_token_ids: the ids that end a beam.
        sliding_window: the scheduler's (`Scheduler.sliding_window`); when set, each beam's blocks behind the
            window are released after every step, as the scheduler does (per layer group on a hybrid KV cache).
    """

    def __init__(self, block_manager: BlockManager, executor, max_model_len: int, eos_token_ids,
                 sliding_window: int | None = None):
        self.bm, self.executor, self.max_model_len = block_manager, executor, max_model_len
        self.eos = set(eos_token_ids)
        self.sliding_window = sliding_window

    def blocks_needed(self, prompt_len: int, params: BeamSearchParams) -> int:
        """An upper bound on the blocks one prompt's search holds at once: the shared prompt, then every beam
        with its own copy of all generated tokens, plus one copy-on-write block per beam."""
        bs = self.bm.block_size
        gen = -(-(min(prompt_len + params.max_tokens, self.max_model_len) - prompt_len + bs) // bs)
        prompt = self.bm.blocks_needed(prompt_len)
        full = prompt + params.beam_width * (gen + 1)
        # One table per layer group on a hybrid KV cache (Gemma 3). A windowed table (`_forward` frees each
        # beam's blocks behind the window after every step) holds the whole prompt only during the prefill,
        # then per beam at most the window's blocks, +1 for a partial block at each end (+1 copy-on-write).
        return sum(full if w is None else min(full, max(prompt, params.beam_width * (-(-w // bs) + 2)))
                   for w in self._table_windows())

    def _table_windows(self) -> list[int | None]:
        """The window each block table of a sequence is freed behind (None: kept whole), one per table."""
        if self.sliding_window is None:  # no freeing at all
            return [None] * self.bm.num_block_tables
        layout = getattr(self.bm, "layout", None)  # the hybrid manager: each group has its own window
        if layout is not None:
            return [g.window for g in layout.groups]
        return [self.sliding_window] * self.bm.num_block_tables

    def run(self, prompts: list[list[int]], params: BeamSearchParams) -> list[list[tuple]]:
        """Search every prompt; returns per prompt up to beam_width (score, output ids, logprobs, eos?) tuples,
        best first. All blocks taken are released, also when a step raises."""
        sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        searches = [_Search(str(i), ids, Sequence(str(i), 0, ids, sp, self.max_model_len))
                    for i, ids in enumerate(prompts)]
        try:
            self._prefill(searches)
            self.select(searches, params)
            while not all(s.done for s in searches):
                self._decode([s for s in searches if not s.done])
                self.select(searches, params)
        finally:
            for s in searches:
                for b in s.running:
                    self.bm.free_seq(b.seq)
                s.running = []
        return [s.finished for s in searches]

    # -- the steps ------------------------------------------------------------------------------------
    def _prefill(self, searches: list[_Search]) -> None:
        batch = ScheduledBatch()
        for s in searches:
            seq = s.running[0].seq
            hits = self.bm.cached_prefix(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = self.bm.allocate_prefix(seq, hits)
            n = len(seq) - seq.num_computed_tokens
            self.bm.append_slots(seq, n)
            batch.seqs.append(seq), batch.num_new_tokens.append(n)
        self._forward(searches, batch)

    def _decode(self, searches: list[_Search]) -> None:
        batch = ScheduledBatch()
        for s in searches:
            for b in s.running:
                seq = b.seq
                self.bm.append_slots(seq, 1)
                batch.copy.extend(self.bm.copies_before_write(seq, seq.num_computed_tokens))
                batch.seqs.append(seq), batch.num_new_tokens.append(1)
        self._forward(searches, batch)

    def _forward(self, searches: list[_Search], batch: ScheduledBatch) -> None:
        order = sorted(range(len(batch.seqs)), key=lambda j: -batch.num_new_tokens[j])  # prefills first
        batch.seqs = [batch.seqs[j] for j in order]
        batch.num_new_tokens = [batch.num_new_tokens[j] for j in order]
        rows, logits = self.executor.compute_logits(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.bm.register_computed_blocks(seq)
            if self.sliding_window is not None:
                self.bm.free_out_of_window(seq, self.sliding_window)
        # Kept for `select`, which reads each search's rows of this step's logits.
        row_of = {batch.seqs[j].seq_id: k for k, j in enumerate(rows)}
        self._logits = (logits, row_of)

    def step_scores(self, s: _Search, params: BeamSearchParams) -> torch.Tensor:
        """float32 `[beams, V]`: each running beam's score plus its next-token log-probabilities."""
        logits, row_of = self._logits
        x = logits[[row_of[b.seq.seq_id] for b in s.running]]
        if params.temperature > 0:
            x = x / params.temperature
        return x.log_softmax(dim=-1)

    def select(self, searches: list[_Search], params: BeamSearchParams) -> None:
        """Steps 1-4 of the module docstring for every unfinished search, after a forward."""
        for s in searches:
            if not s.done:
                self._select_one(s, params)

    def _select_one(self, s: _Search, params: BeamSearchParams) -> None:
        w, lp = params.beam_width, params.length_penalty
        logp = self.step_scores(s, params)
        vocab = logp.shape[-1]
        acc = logp + torch.tensor([b.score for b in s.running], device=logp.device).unsqueeze(1)
        eos = set() if params.ignore_eos else self.eos
        k = max(2, 1 + len(eos)) * w
        k = min(k, acc.numel())
        top_scores, top_idx = acc.flatten().topk(k)
        top_scores, top_idx = top_scores.tolist(), top_idx.tolist()
        gen_len = len(s.running[0].seq.output_token_ids) + 1  # tokens each candidate has generated
        at_limit = gen_len >= params.max_tokens or len(s.prompt_ids) + gen_len >= self.max_model_len
        cands = []
        for rank, (score, flat) in enumerate(zip(top_scores, top_idx)):
            parent, token = divmod(flat, vocab)
            stops = token in eos or at_limit
            cands.append((rank, score, parent, token, stops, float(logp[parent, token])))
        # 2. finished candidates among the first W (transformers' top_num_beam_mask), unless the search
        #    already cannot improve, or is full and early_stopping is True.
        full = len(s.finished) >= w
        if s.improvable and not (full and params.early_stopping is True):
            for rank, score, parent, token, stops, tok_lp in cands:
                if stops and rank < w:
                    b = s.running[parent]
                    s.finished.append((score / gen_len ** lp, b.seq.output_token_ids + [token],
                                       b.logprobs + [tok_lp], token in eos))
            s.finished.sort(key=lambda f: -f[0])  # stable: earlier entries win ties, as topk over the concat
            del s.finished[w:]
        # 3. the next running beams: the W best candidates that did not finish.
        live = [c for c in cands if not c[4]][:w]
        old = s.running
        new = []
        for rank, score, parent, token, stops, tok_lp in live:
            p = old[parent]
            child = Sequence(s.request_id, len(new), p.seq.prompt_token_ids, p.seq.params, self.max_model_len)
            child.output_token_ids = p.seq.output_token_ids + [token]
            self.bm.fork(p.seq, child)
            child.num_computed_tokens = p.seq.num_computed_tokens
            new.append(_Beam(child, p.logprobs + [tok_lp], score))
        for b in old:  # the parents die: their blocks stay only where a child shares them
            self.bm.free_seq(b.seq)
        s.running = new
        # 4. stop?
        if not new:  # every candidate finished (max_tokens reached)
            s.done = True
            return
        full = len(s.finished) >= w
        length = params.max_tokens if params.early_stopping == "never" and lp > 0 else gen_len
        best_possible = new[0].score / length ** lp
        s.improvable = s.improvable and (not full or best_possible > s.finished[-1][0])
        s.done = not s.improvable or (full and params.early_stopping is True)
        if s.done:
            for b in s.running:
                self.bm.free_seq(b.seq)
            s.running = []


def beam_search(runner: BeamSearchRunner, prompts: list[list[int]], params: BeamSearchParams,
                decode) -> list[BeamSearchOutput]:
    """Run `runner` over `prompts` and shape the results as vLLM's outputs; `decode(ids) -> str`."""
    results = runner.run(prompts, params)
    outs = []
    for ids, finished in zip(prompts, results):
        seqs = [BeamSearchSequence(tokens=ids + out, output_token_ids=out, logprobs=lps, cum_logprob=sum(lps),
                                   score=score, text=decode(out[:-1] if eos else out),
                                   finish_reason="stop" if eos else "length", stop_reason=None)
                for score, out, lps, eos in finished]
        outs.append(BeamSearchOutput(seqs))
    return outs


def run_beam_search(engine, prompts: list[list[int]], params: BeamSearchParams, decode,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Beam search of validated token-id `prompts` on an idle `LLMEngine` (what `LLM.beam_search` and the
    server's `use_beam_search` run); `decode(ids) -> str`. Prompts run together in groups that fit in the KV
    pool at the worst case (no two beams sharing a generated block).

    Raises:
        ValueError: a prompt whose beams could never fit in the KV pool (the message says what to lower).
        RuntimeError: the engine has unfinished requests (the runner steps the executor itself).
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("beam_search needs an idle engine; finish or abort the running requests first")
    runner = BeamSearchRunner(engine.block_manager, engine.executor, engine.max_model_len,
                              engine.tokenizer.eos_token_ids, engine.scheduler.sliding_window)
    free = engine.block_manager.num_free_blocks
    groups, need = [[]], 0
    for p in prompts:
        n = runner.blocks_needed(len(p), params)
        if n > free:
            raise ValueError(f"beam search of a {len(p)}-token prompt with beam_width={params.beam_width} and "
                             f"max_tokens={params.max_tokens} may need {n} KV blocks; the pool has {free}. "
                             "Lower beam_width or max_tokens, or enlarge the pool (kv_cache_memory_bytes).")
        if need + n > free:
            groups.append([])
            need = 0
        groups[-1].append(p)
        need += n
    outs = []
    for group in tqdm(groups, desc="Beam search", disable=not use_tqdm):
        outs.extend(beam_search(runner, group, params, decode))
    return outs


def llm_beam_search(llm, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """`LLM.beam_search` (vLLM's, scores as transformers' `generate(num_beams=...)`): for each prompt (the
    forms `LLM.generate` takes) its `beam_width` best beams, best score first. `LLM` offers it as a method
    through `minfer.extensions.LLM_METHODS`.

    The beams share their prompt's and common prefix's KV blocks. Prompts run together in groups that fit in
    the KV pool at the worst case (no two beams sharing a generated block).

    Raises:
        TypeError: `params` is not a BeamSearchParams, or a prompt of the wrong type.
        ValueError: a bad or too long prompt, or one whose beams could never fit in the KV pool.
        RuntimeError: the engine is serving other requests (beam search steps the executor itself).
    """
    from minfer.sequence import prompt_list, validate_prompt

    with llm._lock:  # the LLM's calls run one at a time (minfer.llm)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        engine = llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("beam_search needs an idle engine; finish or abort the running requests first")
        ids = []
        check = SamplingParams(max_tokens=params.max_tokens)
        for p in prompt_list(prompts):
            ids.append(engine.tokenize_prompt(p)[1])
            validate_prompt(ids[-1], check, engine.max_model_len, engine.model_config.vocab_size)
        return run_beam_search(engine, ids, params, llm.tokenizer.decode, use_tqdm=use_tqdm)
