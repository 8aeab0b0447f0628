"""Continuous batching (article §3, §6-4): what runs in each engine step.

Every step the scheduler builds one batch under two budgets, `max_num_seqs` sequences and
`max_num_batched_tokens` tokens:

1. running sequences first, in arrival order: one token each when decoding, or the next chunk of a prompt;
2. then swapped-out sequences, brought back when blocks allow;
3. then waiting requests, admitted as soon as there is room (FCFS: a request never jumps one that waits).

With chunked prefill a prompt larger than what is left of the token budget is cut into chunks, so decodes of
running sequences keep flowing while it is prefilled. Without it a prompt runs whole, in one step.

When the pool runs out of blocks, the most recently arrived running sequence is preempted: by recompute
(its blocks are freed; it goes back to the head of the waiting queue and is prefilled again later, prompt and
generated tokens together) or by swap (its blocks are copied to CPU swap space and back later).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minfer.block_manager import BlockManager
from minfer.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: sequences with how many new tokens each computes, and block copies to do first.

    `seqs` are ordered prefill chunks first (num_new > 1), then decodes (num_new == 1).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, preemption_mode: str = "recompute"):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0

    # -- queues ----------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and free all its blocks."""
        for q in (self.waiting, self.swapped):
            if seq in q:
                q.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED

    # -- one step --------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # 1. running sequences, oldest first. Preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            want = len(seq) - seq.num_computed_tokens
            n = min(want, budget) if (self.chunked or want == 1) else (want if want <= budget else 0)
            if n <= 0 or len(batch.seqs) >= self.max_num_seqs:
                i += 1
                continue
            while not self.bm.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq itself was preempted: everyone after it already was
            self.bm.append_slots(seq, n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        # 2. swapped sequences come back before new requests (FCFS), and not in a step that preempted.
        while self.swapped and not batch.num_preempted and budget > 0 and len(batch.seqs) < self.max_num_seqs:
            seq = self.swapped[0]
            want = len(seq) - seq.num_computed_tokens
            # A sequence swapped out in the middle of a chunked prefill resumes it chunk by chunk.
            n = min(want, budget) if (self.chunked or want == 1) else want
            if n > budget or not self.bm.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            batch.swap_in.extend(self.bm.swap_in(seq))
            budget -= self._admit(seq, n, batch)
        # 3. waiting requests, in order, while both budgets and the pool allow.
        while (self.waiting and not self.swapped and not batch.num_preempted and budget > 0
               and len(batch.seqs) < self.max_num_seqs):
            seq = self.waiting[0]
            hits = self.bm.cached_prefix(seq)
            want = len(seq) - len(hits) * self.bm.block_size
            n = min(want, budget) if self.chunked else want
            if n > budget or not self.bm.can_allocate(seq, n, hits):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = self.bm.allocate_prefix(seq, hits)
            if seq.num_cached_tokens == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            budget -= self._admit(seq, n, batch)
        # Prefill chunks first, then decodes: the layout the attention backends expect.
        order = sorted(range(len(batch.seqs)), key=lambda j: batch.num_new_tokens[j] == 1)
        batch.seqs = [batch.seqs[j] for j in order]
        batch.num_new_tokens = [batch.num_new_tokens[j] for j in order]
        return batch

    def _admit(self, seq: Sequence, n: int, batch: ScheduledBatch) -> int:
        """Give a (swapped-in or newly admitted) sequence slots for n tokens and run it this step."""
        self.bm.append_slots(seq, n)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        return n

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        # The victim is never in this step's batch yet: schedule() preempts the newest running sequence,
        # which is the one it is placing or one it has not reached (it walks oldest first).
        assert seq not in batch.seqs, "preempting a sequence already scheduled in this step"
        self.running.remove(seq)
        self.num_preemptions += 1
        batch.num_preempted += 1
        if self.preemption_mode == "swap" and self.bm.can_swap_out(seq):
            batch.swap_out.extend(self.bm.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
        else:
            self.bm.free_seq(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def finish_step(self, batch: ScheduledBatch) -> None:
        """After the forward: advance computed counts and name newly full blocks for the prefix cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.bm.register_computed_blocks(seq)
