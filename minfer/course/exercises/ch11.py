"""Checks for notebook 11 (prefix caching): the chained block hashes of a prompt, and the tokens a second prompt
reuses from the first one's cached blocks.

- `check_chain_hashes(fn)`: `fn(token_ids, block_size) -> list[int]` must equal the names minfer gives the full
  blocks (`minfer.prefix_cache.PrefixCache.chain`, built on `block_hash`).
- `check_cached_tokens(fn)`: `fn(first, second, block_size) -> int` must equal the cached tokens
  `BlockManager.allocate_prefix` attaches to `second` after `first` ran in a prefix-caching block manager.
"""

from __future__ import annotations

import random
from typing import Callable

from minfer.course import expect_equal, passed


def _prompts(seed: int) -> list[tuple[list[int], list[int], int]]:
    """Pairs of prompts that share a prefix of a random length (sometimes all of one, sometimes nothing)."""
    rng = random.Random(seed)
    cases = []
    for block_size in (1, 4, 16):
        for shared in (0, block_size - 1, block_size, 3 * block_size + 1, 5 * block_size):
            shared = max(shared, 0)
            head = [rng.randrange(1000) for _ in range(shared)]
            a = head + [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 2 * block_size + 3))]
            b = head + [rng.randrange(2000, 3000) for _ in range(rng.randrange(0, 2 * block_size + 3))]
            if a and b:
                cases.append((a, b, block_size))
    # the same tokens at the same place after a different first block must not match
    cases.append(([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 9, 9, 9, 5, 6, 7, 8, 9], 4))
    cases.append((list(range(40)), list(range(40)), 8))  # the very same prompt again
    return cases


def check_chain_hashes(chain_hashes: Callable) -> None:
    """Exercise 11.1: the name of each full block is the hash of its parent's name and its own tokens."""
    from minfer.prefix_cache import PrefixCache

    for a, _, block_size in _prompts(11):
        expected = [h for h, _ in PrefixCache([], block_size).chain(a)]
        expect_equal("Exercise 11.1", list(chain_hashes(a, block_size)), expected,
                     what=f"chain_hashes(<{len(a)} tokens>, block_size={block_size})")
    passed("Exercise 11.1")


def _engine_cached_tokens(first: list[int], second: list[int], block_size: int) -> int:
    """Run `first` through a prefix-caching BlockManager (its K/V computed, its full blocks named, then freed),
    and return how many tokens of `second` come from the cache."""
    from minfer.block_manager import BlockManager
    from minfer.sampling_params import SamplingParams
    from minfer.sequence import Sequence

    bm = BlockManager(num_blocks=64, block_size=block_size, enable_prefix_caching=True)
    s1 = Sequence("a", 0, first, SamplingParams(max_tokens=1), max_model_len=1024)
    s1.num_computed_tokens = bm.allocate_prefix(s1)
    bm.append_slots(s1, len(s1) - s1.num_computed_tokens)
    s1.num_computed_tokens = len(s1)
    bm.register_computed_blocks(s1)
    bm.free_seq(s1)
    s2 = Sequence("b", 0, second, SamplingParams(max_tokens=1), max_model_len=1024)
    return bm.allocate_prefix(s2)


def check_cached_tokens(cached_tokens: Callable) -> None:
    """Exercise 11.2: how many tokens of the second prompt the prefix cache serves after the first one ran."""
    for a, b, block_size in _prompts(12):
        expect_equal("Exercise 11.2", cached_tokens(a, b, block_size), _engine_cached_tokens(a, b, block_size),
                     what=f"cached_tokens(<{len(a)} tokens>, <{len(b)} tokens>, block_size={block_size})")
    passed("Exercise 11.2")


def _wrong_chain(token_ids, block_size):
    """Hashes each block on its own, forgetting the parent: equal blocks after different prefixes collide."""
    from minfer.prefix_cache import block_hash

    return [block_hash(None, tuple(token_ids[i:i + block_size]))
            for i in range(0, len(token_ids) // block_size * block_size, block_size)]


def _wrong_cached(first, second, block_size):
    """Counts every shared full block, forgetting that the last token must still be computed."""
    n = 0
    while (n + 1) * block_size <= min(len(first), len(second)) and \
            first[n * block_size:(n + 1) * block_size] == second[n * block_size:(n + 1) * block_size]:
        n += 1
    return n * block_size


WRONG_ANSWERS = {"check_chain_hashes": _wrong_chain, "check_cached_tokens": _wrong_cached}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
