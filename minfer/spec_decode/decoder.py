"""What the engine does around a step when speculating: propose before scheduling, account after it.

    propose(running)     drafts for the running sequences that decode this step (`Sequence.spec_token_ids`)
    verified(batch)      after the forward: a verified row counts 1 computed token for now (the scheduler's
                         `finish_step` then names no block that holds a rejected draft)
    accept(seq, n)       after its n emitted tokens are appended: n - 1 accepted drafts become computed; the
                         blocks past them (rejected slots) go back to the pool
    clear(seqs)          no draft survives its step
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minfer.spec_decode.metrics import SpecDecodeMetrics
from minfer.spec_decode.rejection import speculation_supported

if TYPE_CHECKING:
    from minfer.block_manager import BlockManager
    from minfer.scheduler import ScheduledBatch
    from minfer.sequence import Sequence


class SpecDecoder:
    """Drives a proposer (`NgramProposer` or `DraftModelProposer`) for the engine.

    Args:
        proposer: the method's proposer. block_manager: the target's. k: num_speculative_tokens.
        max_num_seqs: proposals are made for at most this many running sequences (those the step can hold).
    """

    def __init__(self, method: str, proposer, block_manager: "BlockManager", k: int, max_num_seqs: int):
        self.method, self.proposer, self.bm, self.k, self.max_num_seqs = method, proposer, block_manager, k, max_num_seqs
        self.metrics = SpecDecodeMetrics()

    def _budget(self, seq: "Sequence") -> int:
        """Drafts worth proposing: at most k, one fewer than the tokens the sequence may still emit (the
        step emits one more than it accepts), and no position past max_model_len."""
        left = min(seq.max_tokens - len(seq.output_token_ids), seq.max_model_len - len(seq))
        return max(0, min(self.k, left - 1))

    def propose(self, running: list["Sequence"], guide=None) -> None:
        """Drafts for the running sequences that decode this step. `guide`: structured output's `DraftGuide`
        for a draft model (guided sequences draft under their grammar's mask), or None."""
        self.clear(running)  # drafts of a sequence the last step could not hold are stale
        seqs, ks = [], []
        for s in running[:self.max_num_seqs]:
            if len(s) - s.num_computed_tokens == 1 and speculation_supported(s.params):  # decoding
                k = self._budget(s)
                if k:
                    seqs.append(s)
                    ks.append(k)
        if not seqs:
            return
        if self.method == "ngram":
            for s, k in zip(seqs, ks):
                s.spec_token_ids, s.spec_token_probs = self.proposer.propose(s.all_token_ids, k), None
        else:
            drafts, probs = self.proposer.propose(seqs, ks, guide)
            for s, d, q in zip(seqs, drafts, probs):
                s.spec_token_ids, s.spec_token_probs = d, q

    def verified(self, batch: "ScheduledBatch") -> None:
        for j, s in enumerate(batch.seqs):
            if s.spec_token_ids:
                batch.num_new_tokens[j] = 1

    def accept(self, seq: "Sequence", num_emitted: int, num_proposed: int) -> None:
        """`num_emitted` tokens of a verified row were appended (fewer than returned if it finished)."""
        self.metrics.observe(num_proposed, num_emitted - 1)
        if seq.is_finished:
            return  # the scheduler frees all its blocks
        seq.num_computed_tokens += num_emitted - 1
        self.bm.register_computed_blocks(seq)
        self.bm.free_tail(seq, seq.num_computed_tokens)

    def clear(self, seqs) -> None:
        for s in seqs:
            s.spec_token_ids, s.spec_token_probs = [], None

    def release(self, seq_ids) -> None:
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(seq_ids)
