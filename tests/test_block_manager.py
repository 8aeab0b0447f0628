"""The block manager and the scheduler without a model (minfer/block_manager.py, minfer/scheduler.py).

Sequences here have no tokenizer: their token ids are made up, and `append_token` plays the sampler. Every
test drives `BlockManager` or `Scheduler` directly and checks the bookkeeping: reference counts, the hash
chain, which blocks are hit, evicted, swapped and freed, and what each step schedules.
"""

import pytest

from minfer.block_manager import BlockManager, NoFreeBlocksError, block_hash
from minfer.sampling_params import SamplingParams
from minfer.scheduler import Scheduler
from minfer.sequence import Sequence, SequenceStatus
from minfer.swap import SwappingBlockManager, SwapPreemption

BS = 4  # tokens per block in every test


def make_seq(token_ids, max_tokens=8, rid="r"):
    return Sequence(rid, 0, list(token_ids), SamplingParams(max_tokens=max_tokens), max_model_len=4096)


def run_prefill(bm, seq):
    """What the scheduler does for a waiting sequence that runs its whole prompt in one step, then finish_step."""
    seq.num_computed_tokens = bm.allocate_prefix(seq)
    bm.append_slots(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.register_computed_blocks(seq)
    return seq


# -- reference counts ---------------------------------------------------------------------------------

def test_shared_prefix_blocks_are_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    a = run_prefill(bm, make_seq(prompt))
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    b = make_seq(prompt)
    assert bm.allocate_prefix(b) == 2 * BS
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    b.num_computed_tokens = 2 * BS
    bm.append_slots(b, 1)  # b's own last block
    assert b.block_table[2] != a.block_table[2]
    shared = a.block_table[:2]
    bm.free_seq(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert not any(i in bm.free for i in shared), "a block still used by b went back to the free list"
    bm.free_seq(b)
    assert [bm.blocks[i].ref_count for i in shared] == [0, 0]
    assert all(i in bm.free for i in shared)
    assert bm.num_free_blocks == 8
    # freed, but still named: a third request hits them
    c = make_seq(prompt + [7])
    assert bm.allocate_prefix(c) == 2 * BS and c.block_table == shared


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=BS)
    s = run_prefill(bm, make_seq(range(5)))
    table = list(s.block_table)
    bm.free_seq(s)
    s.block_table = table
    with pytest.raises(AssertionError):
        bm.free_seq(s)


# -- hash chain ---------------------------------------------------------------------------------------

def test_hash_chain_depends_on_parent():
    blk = (1, 2, 3, 4)
    first = block_hash(None, blk)
    assert block_hash(None, blk) == first  # deterministic
    assert block_hash(block_hash(None, (9, 9, 9, 9)), blk) != first  # same tokens, other prefix
    assert block_hash(first, blk) != first  # same tokens, one block further along
    assert block_hash(None, (1, 2, 4, 3)) != first  # order matters


def test_equal_prefixes_give_equal_chains():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    x = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    y = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 99, 10, 11, 12])
    hx, hy = ([h for h, _ in bm.prefix_cache.chain(t.all_token_ids)] for t in (x, y))
    assert len(hx) == 3 and len(hy) == 3  # full blocks only: the 13th token is not named
    assert hx[:2] == hy[:2] and hx[2] != hy[2]
    # a block equal to x's first block but at position 1 gets a different name
    z = make_seq([5, 5, 5, 5, 1, 2, 3, 4])
    assert bm.prefix_cache.chain(z.all_token_ids)[1][0] != hx[0]


def test_same_block_at_other_position_is_not_hit():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    run_prefill(bm, make_seq([1, 2, 3, 4, 0]))
    moved = make_seq([7, 7, 7, 7, 1, 2, 3, 4, 0])  # block (1, 2, 3, 4) again, after another block
    assert bm.allocate_prefix(moved) == 0


# -- hits ---------------------------------------------------------------------------------------------

def test_longest_cached_prefix_is_hit():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = run_prefill(bm, make_seq(list(range(12)) + [50]))  # 3 full blocks
    b = make_seq(list(range(8)) + [60, 61, 62, 63, 64, 65])  # shares 2 blocks, differs in the third
    assert bm.allocate_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert bm.prefix_queries == len(a) + len(b) and bm.prefix_hits == 8


def test_whole_prompt_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    run_prefill(bm, make_seq(range(13)))
    again = make_seq(range(8))  # exactly two cached full blocks
    cached = bm.allocate_prefix(again)
    assert cached < len(again)  # the last token must run to give logits
    assert cached == 4  # the last hit block is given up, not just one token
    assert len(again.block_table) == 1


def test_no_hits_without_prefix_caching():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = run_prefill(bm, make_seq(range(13)))
    assert all(bm.blocks[i].hash is None for i in a.block_table)
    assert bm.allocate_prefix(make_seq(range(13))) == 0


def test_only_computed_full_blocks_are_registered():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    s = make_seq(range(10))
    bm.allocate_prefix(s)
    bm.append_slots(s, 10)
    assert len(s.block_table) == 3
    s.num_computed_tokens = 6  # a first chunk of 6 tokens ran: one block is full
    bm.register_computed_blocks(s)
    assert [bm.blocks[i].hash is not None for i in s.block_table] == [True, False, False]
    assert len(bm.prefix_cache.cached) == 1
    s.num_computed_tokens = 10  # the rest ran: block 1 is full now, block 2 holds 2 of 4 tokens
    bm.register_computed_blocks(s)
    assert [bm.blocks[i].hash is not None for i in s.block_table] == [True, True, False]
    assert s.block_hashes == [h for h, _ in bm.prefix_cache.chain(s.all_token_ids)]


# -- LRU eviction -------------------------------------------------------------------------------------

def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = run_prefill(bm, make_seq([1, 1, 1, 1]))
    b = run_prefill(bm, make_seq([2, 2, 2, 2]))
    bm.free_seq(a)  # freed first: least recently used
    bm.free_seq(b)
    assert bm.num_evicted_blocks == 0 and len(bm.prefix_cache.cached) == 2
    c = make_seq(range(20, 32))  # needs 3 blocks: two never-named ones, then one cached block
    bm.allocate_prefix(c)
    bm.append_slots(c, 12)
    assert bm.num_evicted_blocks == 1
    assert bm.allocate_prefix(make_seq([1, 1, 1, 1, 9])) == 0  # a's block was evicted
    d = make_seq([2, 2, 2, 2, 9])
    d.num_computed_tokens = bm.allocate_prefix(d)
    assert d.num_computed_tokens == 4  # b's block survived
    assert bm.num_free_blocks == 0  # c holds 3 blocks, d the 4th
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(d, 1)


def test_unnamed_blocks_are_reused_before_named_ones():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = run_prefill(bm, make_seq([1, 2, 3, 4, 5, 6]))  # block 0 named, block 1 half full
    named, partial = a.block_table
    bm.free_seq(a)
    assert bm.free[0] == partial  # the unnamed block goes to the front of the free list
    assert bm.free[-1] == named  # the named one waits at the end
    c = make_seq(range(40, 52))
    bm.append_slots(c, 12)  # 3 blocks: all but the named one
    assert named not in c.block_table and bm.num_evicted_blocks == 0
    assert bm.allocate_prefix(make_seq([1, 2, 3, 4, 5])) == 4


def test_a_freed_prefix_is_evicted_from_its_tail():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = run_prefill(bm, make_seq(range(12)))  # three named blocks
    bm.free_seq(a)  # freed tail first: the first block is the most recently freed
    s = make_seq(range(50, 58))
    bm.append_slots(s, 8)  # the one unnamed block, then one eviction
    assert bm.num_evicted_blocks == 1
    assert bm.allocate_prefix(make_seq(range(13))) == 8  # the head of the chain is still cached


def test_eviction_count_grows_with_each_evicted_block():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    for k in range(4):  # four single-block prompts fill the cache
        bm.free_seq(run_prefill(bm, make_seq([k] * 4)))
    assert len(bm.prefix_cache.cached) == 4 and bm.num_free_blocks == 4
    s = make_seq(range(100, 112))
    bm.append_slots(s, 12)
    assert bm.num_evicted_blocks == 3 and len(bm.prefix_cache.cached) == 1
    assert bm.allocate_prefix(make_seq([3, 3, 3, 3, 0])) == 4  # the most recently freed one is left


# -- swap ---------------------------------------------------------------------------------------------

def test_swap_out_and_in_bookkeeping():
    bm = SwappingBlockManager(num_blocks=6, block_size=BS, num_cpu_blocks=3)
    s = run_prefill(bm, make_seq(range(10)))  # 3 blocks
    dev = list(s.block_table)
    assert bm.can_swap_out(s)
    out = bm.swap_out(s)
    assert [d for d, _ in out] == dev
    cpu = [c for _, c in out]
    assert len(set(cpu)) == 3 and bm.swap.cpu_free == [] and bm.swap.swapped[s.seq_id] == [cpu]
    assert s.block_table == [] and bm.num_free_blocks == 6
    assert bm.can_swap_in(s, 1)
    back = bm.swap_in(s)
    assert [c for c, _ in back] == cpu and [d for _, d in back] == s.block_table
    assert len(s.block_table) == 3 and bm.num_free_blocks == 3
    assert sorted(bm.swap.cpu_free) == sorted(cpu) and s.seq_id not in bm.swap.swapped


def test_swap_space_limits_and_free_returns_cpu_blocks():
    bm = SwappingBlockManager(num_blocks=8, block_size=BS, num_cpu_blocks=2)
    big = run_prefill(bm, make_seq(range(10)))  # 3 blocks > 2 CPU blocks
    assert not bm.can_swap_out(big)
    small = run_prefill(bm, make_seq(range(6)))  # 2 blocks
    bm.swap_out(small)
    assert bm.swap.cpu_free == []
    bm.free_seq(small)  # finished or aborted while swapped: its CPU blocks come back
    assert len(bm.swap.cpu_free) == 2 and small.seq_id not in bm.swap.swapped


def test_swap_in_needs_room_for_next_token():
    bm = SwappingBlockManager(num_blocks=3, block_size=BS, num_cpu_blocks=3)
    s = run_prefill(bm, make_seq(range(8)))  # exactly 2 full blocks
    bm.swap_out(s)
    other = make_seq(range(4))
    bm.append_slots(other, 4)  # 2 of 3 blocks left
    assert not bm.can_swap_in(s, 1)  # 2 blocks to restore + 1 for token 9
    bm.free_seq(other)
    assert bm.can_swap_in(s, 1)


def test_usage():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    assert bm.usage() == 0.0
    s = run_prefill(bm, make_seq(range(12)))
    assert bm.usage() == pytest.approx(0.3)
    bm.free_seq(s)
    assert bm.usage() == 0.0  # cached but unreferenced blocks count as free
    assert len(bm.prefix_cache.cached) == 3


# -- the scheduler ------------------------------------------------------------------------------------

def sched(num_blocks=64, max_num_seqs=256, max_num_batched_tokens=2048, chunked=False, mode="recompute",
          num_cpu_blocks=0, prefix=False):
    bm = SwappingBlockManager(num_blocks, BS, num_cpu_blocks, prefix)
    preemption = SwapPreemption(bm) if mode == "swap" else None
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, chunked, preemption), bm


def step(scheduler, token=7):
    """One engine step without a model: schedule, advance, give a token to each sequence at its end."""
    return complete(scheduler, scheduler.schedule(), token)


def complete(scheduler, batch, token=7):
    """The second half of a step: what the engine does after the forward."""
    scheduler.finish_step(batch)
    for seq in batch.seqs:
        if seq.num_computed_tokens == len(seq):
            seq.append_token(token)
            if seq.is_finished:
                scheduler.remove(seq)
    return batch


def test_max_num_seqs_is_respected():
    s, _ = sched(max_num_seqs=3)
    seqs = [make_seq(range(5), rid=str(i)) for i in range(7)]
    for q in seqs:
        s.add(q)
    for _ in range(4):
        batch = step(s)
        assert 0 < len(batch.seqs) <= 3
    assert [q.status for q in seqs[:3]] == [SequenceStatus.RUNNING] * 3
    assert all(q.status is SequenceStatus.WAITING for q in seqs[3:])
    s.max_num_seqs = 2  # fewer slots than running sequences: the batch still obeys the limit
    assert len(s.schedule().seqs) == 2


def test_max_num_batched_tokens_is_respected():
    s, _ = sched(max_num_batched_tokens=25)
    seqs = [make_seq(range(10), rid=str(i)) for i in range(5)]
    for q in seqs:
        s.add(q)
    b1 = step(s)
    assert b1.num_tokens == 20 and b1.seqs == seqs[:2]  # a third prompt of 10 would make 30
    b2 = s.schedule()
    assert b2.num_tokens == 22  # two decodes (2) + two prompts (20); a third prompt would make 32
    assert b2.num_new_tokens == [10, 10, 1, 1]  # prefills come before decodes in a batch
    assert b2.seqs == [seqs[2], seqs[3], seqs[0], seqs[1]]
    assert list(s.waiting) == [seqs[4]]


def test_chunked_prefill_splits_a_long_prompt():
    s, bm = sched(max_num_batched_tokens=16, chunked=True)
    long = make_seq(range(50))
    s.add(long)
    chunks = []
    for _ in range(10):  # bounded: a scheduler bug fails here instead of hanging
        if long.output_token_ids:
            break
        batch = step(s)
        chunks.append(batch.num_new_tokens[0])
    assert chunks == [16, 16, 16, 2]
    assert len(long.block_table) == bm.blocks_needed(50)


def test_chunked_prefill_shares_steps_with_decodes():
    s, _ = sched(max_num_batched_tokens=16, chunked=True)
    short, long = make_seq(range(6), rid="a"), make_seq(range(40), rid="b")
    s.add(short)
    step(s)  # short's prompt runs
    s.add(long)
    batch = step(s)
    assert dict(zip([q.request_id for q in batch.seqs], batch.num_new_tokens)) == {"a": 1, "b": 15}


def test_without_chunking_a_prompt_runs_whole():
    s, _ = sched(max_num_batched_tokens=64, chunked=False)
    long = make_seq(range(50))
    s.add(long)
    assert s.schedule().num_new_tokens == [50]


def test_fcfs_admission_never_jumps_the_queue():
    s, _ = sched(max_num_batched_tokens=20)
    first, big, small = make_seq(range(15), rid="1"), make_seq(range(10), rid="2"), make_seq(range(3), rid="3")
    for q in (first, big, small):
        s.add(q)
    batch = s.schedule()
    assert batch.seqs == [first]  # `small` would fit the budget, but `big` is ahead of it
    assert list(s.waiting) == [big, small]


def test_fcfs_when_blocks_run_out():
    s, _ = sched(num_blocks=5)
    a, b, c = make_seq(range(12), rid="a"), make_seq(range(12), rid="b"), make_seq(range(2), rid="c")
    for q in (a, b, c):
        s.add(q)
    batch = s.schedule()
    assert batch.seqs == [a]  # b needs 3 blocks, 2 are left; c (1 block) waits behind b
    assert list(s.waiting) == [b, c]


def test_preemption_by_recompute_frees_blocks():
    s, bm = sched(num_blocks=4)
    a, b = make_seq(range(7), max_tokens=9, rid="a"), make_seq(range(7), max_tokens=9, rid="b")
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 2 blocks each, the pool is full
    assert bm.num_free_blocks == 0 and s.num_preemptions == 0
    step(s)  # tokens 8 fit in the second blocks
    batch = s.schedule()  # token 9 needs a new block: the newest sequence (b) is preempted
    assert batch.num_preempted == 1 and s.num_preemptions == 1
    assert batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and s.waiting[0] is b
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    complete(s, batch)
    # b comes back and is prefilled again, prompt and generated tokens together, once a finishes
    for _ in range(20):  # a grows to 16 tokens = the whole pool, then finishes
        if a.is_finished:
            break
        step(s)
    assert a.is_finished and bm.num_free_blocks == 4
    batch = s.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [len(b)]


def test_preemption_by_swap_keeps_computed_tokens():
    s, bm = sched(num_blocks=4, mode="swap", num_cpu_blocks=4)
    a, b = make_seq(range(7), max_tokens=9, rid="a"), make_seq(range(7), max_tokens=9, rid="b")
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    computed = b.num_computed_tokens
    batch = s.schedule()
    assert batch.num_preempted == 1
    assert b.status is SequenceStatus.OFFLOADED and list(s.preemption.swapped) == [b]
    assert len(batch.kv_transfer.swap_out) == 2 and len(bm.swap.cpu_free) == 2
    assert b.num_computed_tokens == computed  # nothing to recompute
    complete(s, batch)
    for _ in range(20):  # a grows to 16 tokens = the whole pool, then finishes
        if a.is_finished:
            break
        step(s)
    assert a.is_finished and bm.num_free_blocks == 4
    batch = s.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [1]  # straight back to decoding
    assert len(batch.kv_transfer.swap_in) == 2 and len(bm.swap.cpu_free) == 4


def test_all_blocks_free_after_a_workload():
    s, bm = sched(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=24, chunked=True, prefix=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] + [i] * (3 + i) for i in range(8)]
    seqs = [make_seq(p, max_tokens=5 + i, rid=str(i)) for i, p in enumerate(prompts)]
    for q in seqs:
        s.add(q)
    for _ in range(200):
        if not s.has_unfinished():
            break
        assert step(s)
    assert not s.has_unfinished()
    assert all(q.finish_reason == "length" for q in seqs)
    assert [len(q.output_token_ids) for q in seqs] == [5 + i for i in range(8)]
    assert bm.num_free_blocks == bm.num_total_blocks
    assert bm.prefix_hits > 0  # the shared 8-token prefix was reused
