"""A draft model proposes k tokens by k cheap decode steps of its own (Leviathan et al., 2023).

The draft has its own paged KV pool and block manager (given by the engine) and keeps, for each target
sequence, how many of that sequence's tokens its cache holds. Each proposal first catches the draft's cache
up with the sequence (the tokens accepted or generated since the last proposal: one chunk), then decodes k
tokens, all proposing sequences in one forward per step. After verification the draft's count is cut back to
the target's computed tokens, so the KV of rejected drafts is simply overwritten next time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minfer.sampling import apply_token_bitmask
from minfer.spec_decode.rejection import processed_probs

if TYPE_CHECKING:
    from minfer.block_manager import BlockManager
    from minfer.sequence import Sequence
    from minfer.worker import Worker


@dataclass
class _DraftSeq:
    """What the draft worker's `prepare_inputs` reads of a sequence (the same fields as `Sequence`)."""

    seq_id: int
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids

    def __len__(self) -> int:
        return len(self.all_token_ids)


@dataclass
class _Step:
    seqs: list
    num_new_tokens: list[int]


class DraftModelProposer:
    """Proposes with a draft `Worker` (KV pool initialised) over a `BlockManager` of that pool.

    A sequence for which the draft pool has no room gets no proposal this step (it decodes normally): the
    draft never preempts anything.
    """

    def __init__(self, worker: "Worker", block_manager: "BlockManager", num_speculative_tokens: int):
        self.worker, self.bm, self.k = worker, block_manager, num_speculative_tokens
        self.states: dict[int, _DraftSeq] = {}

    @torch.inference_mode()
    def propose(self, seqs: list["Sequence"], ks: list[int], guide=None
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts for each sequence (up to ks[i] tokens) and their q `[len, V]` (None for greedy requests).

        `guide`: structured output's `DraftGuide` (or None): a guided sequence's draft logits are masked by its
        grammar at each draft position, so its drafts are valid and q is the masked draft distribution (what
        Leviathan et al.'s rule needs: q is whatever the drafts were drawn from)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live, first = [], []
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if k < 1:
                continue
            st = self.states.get(s.seq_id)
            if st is None:
                st = self.states[s.seq_id] = _DraftSeq(s.seq_id, [])
            # What the draft computed is valid up to what the target kept (rejected drafts are past it).
            st.num_computed_tokens = min(st.num_computed_tokens, s.num_computed_tokens)
            st.all_token_ids = s.all_token_ids
            n = len(st) - st.num_computed_tokens
            if not self.bm.can_append(st, n + k - 1):
                continue
            self.bm.append_slots(st, n + k - 1)
            live.append(i)
            first.append(n)
        step_rows, step_n = live, first
        while step_rows:
            order = sorted(range(len(step_rows)), key=lambda j: step_n[j] == 1)  # chunks first, then decodes
            rows = [step_rows[j] for j in order]
            counts = [step_n[j] for j in order]
            states = [self.states[seqs[i].seq_id] for i in rows]
            ids, ctx, _ = self.worker.prepare_inputs(_Step(states, counts))
            hidden = self.worker.model(ids, ctx)
            logits = self.worker.model.compute_logits(hidden[ctx.logits_indices]).float()
            nxt = []
            if guide is not None:
                masks = guide.masks([seqs[i] for i in rows], [drafts[i] for i in rows])
                if masks is not None:
                    logits = apply_token_bitmask(logits, masks)
            for r, (i, st, n) in enumerate(zip(rows, states, counts)):
                params = seqs[i].params
                if params.greedy:
                    tok = int(logits[r].argmax())
                else:
                    q = processed_probs(logits[r:r + 1], params)[0]
                    tok = int(torch.multinomial(q, 1, generator=self.worker.generator))
                    probs[i].append(q)
                drafts[i].append(tok)
                st.num_computed_tokens += n
                st.all_token_ids = st.all_token_ids + [tok]
                if len(drafts[i]) < ks[i]:
                    nxt.append(i)
            step_rows, step_n = nxt, [1] * len(nxt)
        return drafts, [torch.stack(p) if p else None for p in probs]

    def release(self, seq_ids) -> None:
        """Free the draft blocks of retired sequences."""
        for sid in seq_ids:
            st = self.states.pop(sid, None)
            if st is not None:
                self.bm.free_seq(st)
