"""Who owns which KV block (article §3 paged KV, §11 prefix caching).

The KV pool is cut into fixed-size blocks of `block_size` token slots. A sequence owns a `block_table`:
the ids of its blocks in order, so token t of the sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size` (the `slot_mapping`). Reference counts say how
many sequences share a block (a cached prefix, a beam's continuations).

`BlockManager` allocates, shares and frees blocks, and composes two small classes for the rest:

    PrefixCache    (minfer/prefix_cache.py)   full blocks named by a hash chain, reused across sequences;
                                              the LRU of free named blocks; hit and eviction counters
    WindowPolicy   (below)                    leading blocks released behind a sliding window

Swap space (article §8-1) extends it from outside: `minfer.swap.SwappingBlockManager`.

A free block is reused unnamed ones first (the most recently freed), then the least recently freed named
one, which is evicted from the prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from minfer.prefix_cache import PrefixCache, block_hash
from minfer.sequence import Sequence

__all__ = ["Block", "BlockManager", "NoFreeBlocksError", "WindowPolicy", "block_hash", "first_visible_block"]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | tuple | None = None  # its key in `cached` (the hybrid KV cache's: (group, chain hash))
    token_ids: tuple = ()  # the tokens a hashed block holds, to rule out hash collisions


class NoFreeBlocksError(RuntimeError):
    """The pool has no block to give (the scheduler preempts before this can happen)."""


def first_visible_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """Index of the first block a query at position `num_tokens` (or any later one) can read through a
    `window`-token sliding window: it sees keys q - W + 1 .. q (`torch_ref.visibility_mask`), so every block
    whose last slot is below q - W + 1 is dead. 0 without a window."""
    return 0 if window is None else max(num_tokens - window + 1, 0) // block_size


class WindowPolicy:
    """The leading block-table entries of each sequence released behind its sliding window.

    A released entry stays in the table, pointing at block 0 (like the padding of a block table, which
    attention masks), so `position // block_size` still finds every live block. `freed[seq_id]` counts those
    entries, so a block is never released twice.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.freed: dict[int, int] = {}  # seq_id -> leading table entries released

    def num_freed(self, seq_id: int) -> int:
        return self.freed.get(seq_id, 0)

    def release_behind(self, seq_id: int, table: list[int], num_computed_tokens: int, window: int,
                       release: Callable[[int], None]) -> int:
        """Release (`release(block id)`) the entries of `table` no later query can see: with the next query at
        q = `num_computed_tokens`, the first (q - W + 1) // block_size. Returns blocks released."""
        dead = first_visible_block(num_computed_tokens, window, self.block_size)
        done = self.freed.get(seq_id, 0)
        for i in range(done, min(dead, len(table))):
            release(table[i])
            table[i] = 0
        if dead > done:
            self.freed[seq_id] = dead
        return max(dead - done, 0)

    def copy(self, parent_id: int, child_id: int) -> None:
        """A forked child's table has the parent's placeholders (beam search)."""
        if self.freed.get(parent_id, 0):
            self.freed[child_id] = self.freed[parent_id]

    def pop(self, seq_id: int) -> int:
        """Forget a sequence that gives its blocks up; returns its count of placeholders."""
        return self.freed.pop(seq_id, 0)


class BlockManager:
    """Allocates, shares and frees the blocks of the KV pool, with a prefix cache and sliding-window freeing
    (module docstring).

    Args:
        num_blocks: blocks in the device pool. block_size: token slots per block.
        enable_prefix_caching: name full blocks and reuse them across sequences.

    Attributes:
        blocks: every `Block` (reference count, prefix-cache name). prefix_cache (`PrefixCache`),
        window (`WindowPolicy`): the composed parts.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free unnamed blocks, the next one to reuse first (a released one goes to the front); the free named
        # blocks wait in the prefix cache's LRU.
        self.free_unnamed: deque[int] = deque(range(num_blocks))
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = PrefixCache(self.blocks, block_size)
        self.window = WindowPolicy(block_size)

    # -- counting -------------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_unnamed) + len(self.prefix_cache.lru)

    @property
    def free(self) -> list[int]:
        """Every free block id, in the order allocation takes them (unnamed first, then the cached LRU)."""
        return list(self.free_unnamed) + list(self.prefix_cache.lru)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # counters (EngineStats, the server's metrics)
    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache."""
        return self.prefix_cache.queries

    @property
    def prefix_hits(self) -> int:
        """Of which were cached."""
        return self.prefix_cache.hits

    @property
    def num_evicted_blocks(self) -> int:
        return self.prefix_cache.num_evicted_blocks

    @property
    def cached(self) -> dict:
        """{prefix-cache key: block id} of every named block (`PrefixCache.cached`)."""
        return self.prefix_cache.cached

    @property
    def window_freed(self) -> dict[int, int]:
        """{seq_id: leading table entries released behind the window} (`WindowPolicy.freed`)."""
        return self.window.freed

    # -- low level ------------------------------------------------------------------------------------
    def _take_free(self) -> int:
        if self.free_unnamed:
            bid = self.free_unnamed.popleft()
        elif self.prefix_cache.lru:
            bid = self.prefix_cache.evict()  # its cached prefix is gone from now on
        else:
            raise NoFreeBlocksError("KV pool exhausted")
        self.blocks[bid].ref_count = 1
        return bid

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_count -= 1
        assert blk.ref_count >= 0, f"block {bid} freed twice"
        if blk.ref_count == 0:
            if blk.hash is None:
                self.free_unnamed.appendleft(bid)  # unnamed blocks are reused first
            else:
                self.prefix_cache.park(bid)  # named blocks wait at the end, still hittable

    def _hold(self, bid: int) -> None:
        """One more reference to a block (a prefix-cache hit, a fork); a free cached one leaves the LRU."""
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            self.prefix_cache.reuse(bid)
        blk.ref_count += 1

    # -- prefix cache ---------------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached chain that prefixes `seq` (never the whole sequence: the last
        token must still be computed to have logits to sample from)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt_logprobs need the logits of every prompt position: compute them all
        return self.prefix_cache.longest_prefix(seq)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Name the sequence's full blocks whose K/V are all computed, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        dead = self.window.num_freed(seq.seq_id)
        for i, parent, chunk in self.prefix_cache.new_full_blocks(seq):
            if i >= dead:  # below `dead`: released out of the window, the entry is a placeholder
                self.prefix_cache.name(seq.block_table[i], parent, chunk)

    # -- sequences ------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Could waiting `seq` get blocks for its cached prefix plus `num_new_tokens` more tokens?
        `hits` is `cached_prefix(seq)` when the caller already has it (the chain is hashed once)."""
        hits = self.cached_prefix(seq) if hits is None else hits
        hit_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return need <= self.num_free_blocks - hit_free

    def allocate_prefix(self, seq: Sequence, hits: list[int] | None = None) -> int:
        """Attach the cached prefix blocks to a waiting sequence; returns the number of cached tokens."""
        hits = self.cached_prefix(seq) if hits is None else hits
        if self.enable_prefix_caching:
            self.prefix_cache.record_lookup(len(seq), len(hits) * self.block_size)
        for bid in hits:
            self._hold(bid)
        seq.block_table = list(hits)
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        return len(hits) * self.block_size

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to hold `num_new_tokens` more tokens after the computed ones."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def free_out_of_window(self, seq: Sequence, window: int) -> int:
        """Release the leading blocks no later query of `seq` can see through a `window`-token window.

        The next forward's first query is at position `num_computed_tokens` = q; it sees keys q - W + 1 .. q
        (`torch_ref.visibility_mask`), and later queries see less of the past. So a block is dead iff its last
        slot is below q - W + 1: the first (q - W + 1) // block_size blocks (`WindowPolicy`). Call after
        `register_computed_blocks` (a released block keeps its prefix-cache name). Returns blocks released.
        """
        return self.window.release_behind(seq.seq_id, seq.block_table, seq.num_computed_tokens, window,
                                          self._release)

    def num_live_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds (its table minus the entries released out of the window)."""
        return len(seq.block_table) - self.window.num_freed(seq.seq_id)

    def num_live_tokens(self, seq: Sequence) -> int:
        """Token slots of `seq`'s live blocks that hold a token (what fragmentation counts as used)."""
        dead = self.window.num_freed(seq.seq_id)
        return min(len(seq), len(seq.block_table) * self.block_size) - dead * self.block_size

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's claim on its blocks (named blocks stay cached until evicted)."""
        dead = self.window.pop(seq.seq_id)
        for bid in reversed(seq.block_table[dead:]):  # tail first, so the prefix is evicted last
            self._release(bid)
        seq.block_table = []
        seq.block_hashes = []

    def free_tail(self, seq: Sequence, num_tokens: int) -> int:
        """Give back the blocks past the first `num_tokens` tokens (speculative decoding's rejected slots:
        they were allocated for drafts that were not accepted). Returns the number of blocks freed."""
        keep = self.blocks_needed(num_tokens)
        tail = seq.block_table[keep:]
        for bid in reversed(tail):
            self._release(bid)
        del seq.block_table[keep:]
        return len(tail)

    # -- forking (beam search) ------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks (beam search: a beam's continuations share its KV). Every block
        gains one reference; nothing is copied until a child writes into a shared block
        (`copy_on_write`). `child` must hold no blocks yet."""
        assert not child.block_table, "fork into a sequence that already holds blocks"
        dead = self.window.num_freed(parent.seq_id)  # placeholders released behind a window stay so
        for bid in parent.block_table[dead:]:
            self.blocks[bid].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        self.window.copy(parent.seq_id, child.seq_id)

    def copy_on_write(self, seq: Sequence, position: int) -> tuple[int, int] | None:
        """Make the block that holds token `position` of `seq` its own before the next forward writes there.

        A block shared with another sequence (reference count > 1, after a `fork`) is replaced in the block
        table by a fresh one; returns (source block, new block): the worker copies the source's K/V into
        the new block before the forward writes (vLLM's `blocks_to_copy`). Returns None when the block is
        already the sequence's alone. Only the last, partial block of a forked sequence is ever written, so
        this copies at most one block per beam per step.

        Raises:
            NoFreeBlocksError: no free block for the copy.
        """
        i = position // self.block_size
        bid = seq.block_table[i]
        if self.blocks[bid].ref_count <= 1:
            return None
        new = self._take_free()
        self._release(bid)
        seq.block_table[i] = new
        return bid, new

    def copies_before_write(self, seq: Sequence, position: int) -> list[tuple[int, int]]:
        """`copy_on_write` as a list of (source, new) copies: empty or one here, one per layer group that
        shares the block in the hybrid KV cache's manager. Raises NoFreeBlocksError as `copy_on_write`."""
        cow = self.copy_on_write(seq, position)
        return [] if cow is None else [cow]

    @property
    def num_block_tables(self) -> int:
        """Block tables a sequence holds (1; one per layer group in the hybrid KV cache's manager): growing
        a sequence by one block takes this many blocks."""
        return 1

    # -- observability --------------------------------------------------------------------------------
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1 - self.num_free_blocks / max(self.num_total_blocks, 1)
