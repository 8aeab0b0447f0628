"""Continuous batching (article §3, §6-4): what runs in each engine step.

Every step the scheduler builds one batch under two budgets, `max_num_seqs` sequences and
`max_num_batched_tokens` tokens:

1. running sequences first, in arrival order: one token each when decoding, or the next chunk of a prompt;
2. then sequences a preemption policy holds outside the pool (swap, `minfer/swap.py`), brought back when
   blocks allow;
3. then waiting sequences, admitted as soon as there is room, taking turns across requests: the next one
   admitted is the first waiting sequence of the request that holds the fewest sequences (running or
   held outside the pool), earliest request first among equals. With one sequence per request this is FCFS (a request
   never jumps one that waits); a request with many sequences (`n`) shares the free slots with the requests
   behind it instead of taking them all, so a later request waits for one slot to free, not for every
   earlier sequence to be admitted. A turn is never skipped: if the sequence whose turn it is does not fit,
   nothing more is admitted this step.

With chunked prefill a prompt larger than what is left of the token budget is cut into chunks, so decodes of
running sequences keep flowing while it is prefilled. Without it a prompt runs whole, in one step.

When the pool runs out of blocks, the most recently arrived running sequence is preempted: by recompute
(its blocks are freed; it goes back to the head of the waiting queue and is prefilled again later, prompt and
generated tokens together), or by the scheduler's preemption policy when it has one (`minfer/swap.py`: its
blocks are copied to CPU memory and back later).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import ItemsView
from dataclasses import dataclass, field
from typing import Any

from minfer.block_manager import BlockManager
from minfer.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: sequences with how many new tokens each computes, and block copies to do first
    (copy-on-write of shared blocks, and what a preemption policy moves: `kv_transfer`).

    `seqs` are ordered prefill chunks first (num_new > 1), then decodes (num_new == 1). A sequence verifying
    k proposed tokens (`seq.spec_token_ids`, vLLM's name) is a (k + 1)-token chunk: its last token and those.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks: copy-on-write
    kv_transfer: object = None  # block moves a preemption policy asks the pool for (`minfer.swap.SwapTransfer`)
    num_preempted: int = 0
    # int32 [len(seqs), ceil(V/32)]: the tokens each row may sample (bit j of word w is token 32 w + j), or
    # None for no constraint; set by an engine extension after scheduling (structured output)
    token_bitmask: object = None
    # {batch row: int32 [k + 1, ceil(V/32)]}: the masks a row's proposed tokens are verified under, or None
    verify_token_bitmasks: object = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class WaitingQueue:
    """The waiting sequences, grouped by request: requests in arrival order, each request's sequences in order.

    It reads like a deque of sequences (`len`, `in`, iteration, `[i]`, `append`, `appendleft`, `remove`) and
    also gives the requests (`requests()`) so that admission can take turns across them without walking
    every waiting sequence. `appendleft` puts a sequence (a preempted one) at the very front: its request
    moves to the head of the queue.
    """

    def __init__(self):
        self._requests: OrderedDict[str, deque[Sequence]] = OrderedDict()
        self._len = 0

    def append(self, seq: Sequence) -> None:
        self._requests.setdefault(seq.request_id, deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        self._requests.setdefault(seq.request_id, deque()).appendleft(seq)
        self._requests.move_to_end(seq.request_id, last=False)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out (O(1) for the first of its request's). Raises ValueError if it is not waiting."""
        group = self._requests.get(seq.request_id)
        if group is None or seq not in group:
            raise ValueError("WaitingQueue.remove(seq): seq is not waiting")
        group.remove(seq)
        if not group:
            del self._requests[seq.request_id]
        self._len -= 1

    def requests(self) -> "ItemsView[str, deque[Sequence]]":
        """(request id, its waiting sequences) for each waiting request, in queue order."""
        return self._requests.items()

    def __contains__(self, seq) -> bool:
        group = self._requests.get(getattr(seq, "request_id", None))
        return group is not None and seq in group

    def __iter__(self):
        for group in self._requests.values():
            yield from group

    def __getitem__(self, i: int) -> Sequence:
        if not 0 <= i < self._len:
            raise IndexError("WaitingQueue index out of range")
        return next(itertools.islice(self, i, None))

    def __len__(self) -> int:
        return self._len


class Scheduler:
    """Builds each step's `ScheduledBatch` (module docstring).

    Args:
        block_manager: the `BlockManager` of the pool. max_num_seqs, max_num_batched_tokens: the step's
            budgets. enable_chunked_prefill: cut long prompts into chunks.
        preemption: how a preempted sequence is kept: None to recompute it later, or a policy object that
            holds its KV outside the pool (`minfer.swap.SwapPreemption`: `preempt`, `resume`, `has_waiting`,
            `remove`).
        sliding_window: every layer's window (the largest, when they differ), or None.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, preemption: Any = None, sliding_window: int | None = None):
        self.bm = block_manager
        # Every layer's window (the largest, when they differ) or None: blocks behind it are freed each step.
        # With a hybrid KV cache (minfer/kv_cache_groups.py) the block manager frees per layer group instead.
        self.sliding_window = sliding_window
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.preemption = preemption
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._held: dict[str, int] = {}  # request id -> its sequences running or held outside (admission's turns)

    # -- queues ----------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._held_outside())

    def _held_outside(self) -> bool:
        """True while the preemption policy holds a sequence that waits to come back."""
        return self.preemption is not None and self.preemption.has_waiting()

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and free all its blocks."""
        # Only the queue its status names is searched: a finishing sequence is not looked for among the
        # thousands of waiting ones (and an aborted request's waiting sequences come off their group's head).
        queue = {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running}.get(seq.status)
        if queue is not None and seq in queue:
            queue.remove(seq)
            if queue is not self.waiting:
                self._hold(seq, -1)
        elif seq.status is SequenceStatus.OFFLOADED and self.preemption.remove(seq):
            self._hold(seq, -1)
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
            if seq.spec_token_ids:
                want = self._fit_proposed(seq, want, budget)
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
        # 2. sequences held outside the pool come back before new requests (FCFS), not in a step that preempted.
        if self._held_outside() and not batch.num_preempted:
            budget = self.preemption.resume(self, batch, budget)
        # 3. waiting sequences, taking turns across requests, while both budgets and the pool allow.
        while (self.waiting and not self._held_outside() and not batch.num_preempted and budget > 0
               and len(batch.seqs) < self.max_num_seqs):
            seq = self._next_waiting()
            hits = self.bm.cached_prefix(seq)
            want = len(seq) - len(hits) * self.bm.block_size
            n = min(want, budget) if self.chunked else want
            if n > budget or not self.bm.can_allocate(seq, n, hits):
                break
            self.waiting.remove(seq)
            self._hold(seq, +1)
            seq.num_computed_tokens = self.bm.allocate_prefix(seq, hits)
            if seq.num_cached_tokens == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            budget -= self.admit(seq, n, batch)
        # Prefill chunks first, then decodes: the layout the attention backends expect.
        order = sorted(range(len(batch.seqs)), key=lambda j: batch.num_new_tokens[j] == 1)
        batch.seqs = [batch.seqs[j] for j in order]
        batch.num_new_tokens = [batch.num_new_tokens[j] for j in order]
        return batch

    def _fit_proposed(self, seq: Sequence, want: int, budget: int) -> int:
        """A decoding sequence with k proposed tokens wants 1 + k slots; they are dropped (the sequence
        decodes plainly) rather than outgrow the token budget or take blocks another sequence would lose to
        preemption."""
        spec = seq.spec_token_ids
        del spec[max(0, min(len(spec), budget - want)):]
        if spec and not self.bm.can_append(seq, want + len(spec)):
            spec.clear()
        if not spec:
            seq.spec_token_probs = None
        elif seq.spec_token_probs is not None:
            seq.spec_token_probs = seq.spec_token_probs[:len(spec)]
        return want + len(spec)

    def _next_waiting(self) -> Sequence:
        """Whose turn it is: the first waiting sequence of the request holding the fewest running (or held
        outside) sequences, the earliest request among equals.

        The walk stops at the first request holding none, so it visits at most one request more than there
        are requests holding sequences (<= the running and held ones), however long the queue is.
        """
        best, fewest = None, None
        for request_id, group in self.waiting.requests():
            held = self._held.get(request_id, 0)
            if best is None or held < fewest:
                best, fewest = group[0], held
                if held == 0:
                    break
        return best

    def _hold(self, seq: Sequence, change: int) -> None:
        """Count `seq` in (+1) or out (-1) of its request's running (or held outside) sequences."""
        held = self._held.get(seq.request_id, 0) + change
        if held:
            self._held[seq.request_id] = held
        else:
            self._held.pop(seq.request_id, None)

    def admit(self, seq: Sequence, n: int, batch: ScheduledBatch) -> int:
        """Give a (newly admitted or returning) sequence slots for n tokens and run it this step."""
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
        seq.spec_token_ids, seq.spec_token_probs = [], None
        self.num_preemptions += 1
        batch.num_preempted += 1
        if self.preemption is None or not self.preemption.preempt(seq, batch):  # recompute
            self.bm.free_seq(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._hold(seq, -1)
            self.waiting.appendleft(seq)

    def finish_step(self, batch: ScheduledBatch) -> None:
        """After the forward: advance computed counts and name newly full blocks for the prefix cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.bm.register_computed_blocks(seq)
            if self.sliding_window is not None:
                self.bm.free_out_of_window(seq, self.sliding_window)
