"""The parts `BlockManager` composes, and swap space, each on its own (minfer/prefix_cache.py,
minfer/block_manager.py, minfer/swap.py):

- `PrefixCache`: the hash chain, naming and finding blocks, the LRU of free named blocks, the counters;
- `WindowPolicy` / `first_visible_block`: which leading blocks a sliding window makes dead;
- `SwapSpace`: which CPU blocks a swapped-out sequence holds.

No model and no `BlockManager`: the tests hand the classes plain `Block`s and token lists and check the books.
"""

import pytest

from minfer.block_manager import Block, WindowPolicy, first_visible_block
from minfer.prefix_cache import PrefixCache, block_hash
from minfer.sampling_params import SamplingParams
from minfer.sequence import Sequence
from minfer.swap import SwapSpace

BS = 4


def make_seq(token_ids):
    return Sequence("r", 0, list(token_ids), SamplingParams(max_tokens=8), max_model_len=4096)


def make_cache(num_blocks=8):
    return PrefixCache([Block(i) for i in range(num_blocks)], BS)


# -- PrefixCache: names ---------------------------------------------------------------------------------

def test_chain_names_full_blocks_by_everything_before_them():
    cache = make_cache()
    tokens = list(range(10))  # two full blocks and two tokens left over
    chain = cache.chain(tokens)
    assert [toks for _, toks in chain] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # the partial block has no name
    assert chain[0][0] == block_hash(None, (0, 1, 2, 3))
    assert chain[1][0] == block_hash(chain[0][0], (4, 5, 6, 7))
    # The same block of tokens after another first block gets another name.
    other = cache.chain([9, 9, 9, 9, 4, 5, 6, 7])
    assert other[1][1] == chain[1][1] and other[1][0] != chain[1][0]
    assert cache.chain(tokens[:8]) == chain and cache.chain(tokens[:3]) == []


def test_name_and_lookup():
    cache = make_cache()
    (h0, t0), (h1, t1) = cache.chain(list(range(8)))
    cache.name(3, h0, t0)
    assert cache.lookup(h0, t0) == 3 and cache.blocks[3].hash == h0
    assert cache.lookup(h0, (7, 7, 7, 7)) is None  # same key, other tokens: a hash collision is a miss
    assert cache.lookup(h1, t1) is None
    cache.name(4, h0, t0)  # another block for a key already cached: stays unnamed
    assert cache.blocks[4].hash is None and cache.cached == {h0: 3}
    cache.name(3, h1, t1)  # a named block keeps its first name
    assert cache.blocks[3].hash == h0 and h1 not in cache.cached


def test_longest_prefix_stops_at_the_first_miss_and_never_covers_the_whole_sequence():
    cache = make_cache()
    chain = cache.chain(list(range(12)))
    for bid, (h, toks) in zip([5, 6, 7], chain):
        cache.name(bid, h, toks)
    assert cache.longest_prefix(make_seq(range(13))) == [5, 6, 7]
    assert cache.longest_prefix(make_seq(range(12))) == [5, 6]  # the last token must still be computed
    assert cache.longest_prefix(make_seq([0, 1, 2, 3, 99, 5, 6, 7, 8])) == [5]  # block 1 differs
    assert cache.longest_prefix(make_seq([1, 0, 2, 3, 4])) == []


def test_new_full_blocks_yields_each_computed_full_block_once():
    cache = make_cache()
    seq = make_seq(range(10))
    seq.num_computed_tokens = 5
    first = list(cache.new_full_blocks(seq))
    assert [(i, toks) for i, _, toks in first] == [(0, (0, 1, 2, 3))]
    assert list(cache.new_full_blocks(seq)) == []  # already hashed
    seq.num_computed_tokens = 10
    second = list(cache.new_full_blocks(seq))
    assert [(i, toks) for i, _, toks in second] == [(1, (4, 5, 6, 7))]
    assert seq.block_hashes == [h for h, _ in cache.chain(list(range(10)))]


def test_record_lookup_counts_tokens():
    cache = make_cache()
    cache.record_lookup(10, 8)
    cache.record_lookup(5, 0)
    assert (cache.queries, cache.hits) == (15, 8)


# -- PrefixCache: the LRU of free named blocks ------------------------------------------------------------

def test_lru_evicts_the_least_recently_freed_and_forgets_its_name():
    cache = make_cache()
    chain = cache.chain(list(range(12)))
    for bid, (h, toks) in zip([0, 1, 2], chain):
        cache.name(bid, h, toks)
    for bid in [2, 0, 1]:  # freed in this order
        cache.park(bid)
    cache.reuse(0)  # a hit: held again, out of the LRU
    assert list(cache.lru) == [2, 1]
    assert cache.evict() == 2
    assert cache.blocks[2].hash is None and cache.blocks[2].token_ids == ()
    assert cache.lookup(*chain[2]) is None and chain[2][0] not in cache.cached
    assert cache.lookup(*chain[1]) == 1  # still parked, still hittable
    assert cache.evict() == 1 and cache.num_evicted_blocks == 2
    with pytest.raises(KeyError):
        cache.evict()


# -- the sliding window -----------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 3, 4, 5, 9])
def test_first_visible_block_against_brute_force(window):
    for q in range(40):
        # a block is dead when none of its slots is a key the query at q (or later) sees: keys q-W+1 .. q
        dead = sum(1 for b in range(q // BS + 1) if b * BS + BS - 1 < q - window + 1)
        assert first_visible_block(q, window, BS) == dead, (q, window)
    assert first_visible_block(1000, None, BS) == 0


def test_window_policy_releases_each_dead_block_once():
    policy = WindowPolicy(BS)
    table = [10, 11, 12, 13]
    released = []
    assert policy.release_behind(7, table, 8, 4, released.append) == 1  # q = 8, W = 4: keys 5..8, block 0 dead
    assert table == [0, 11, 12, 13] and released == [10] and policy.num_freed(7) == 1
    assert policy.release_behind(7, table, 8, 4, released.append) == 0  # nothing twice
    assert policy.release_behind(7, table, 13, 4, released.append) == 1  # keys 10..13: block 1 dead too
    assert table == [0, 0, 12, 13] and released == [10, 11]
    policy.copy(7, 8)  # a fork shares the placeholders
    assert policy.num_freed(8) == 2
    assert policy.pop(7) == 2 and policy.num_freed(7) == 0
    policy.copy(99, 100)  # nothing freed: nothing recorded
    assert 100 not in policy.freed


# -- swap space -------------------------------------------------------------------------------------------

def test_swap_space_gives_distinct_cpu_blocks_and_takes_them_back():
    swap = SwapSpace(5)
    mapping = swap.swap_out(1, [[20, 21], [30]])
    cpu = [c for _, c in mapping]
    assert [d for d, _ in mapping] == [20, 21, 30] and len(set(cpu)) == 3 and swap.num_free == 2
    assert swap.swapped[1] == [cpu[:2], cpu[2:]]
    assert swap.swap_in(1) == [cpu[:2], cpu[2:]]
    assert swap.num_free == 5 and 1 not in swap.swapped
    swap.swap_out(2, [[40, 41, 42]])
    swap.free(2)  # finished while swapped
    swap.free(3)  # never swapped: nothing to do
    assert sorted(swap.cpu_free) == list(range(5)) and not swap.swapped
