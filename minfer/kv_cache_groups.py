"""A hybrid KV cache (article §3; vLLM's hybrid KV cache manager): one block table per layer group, so the KV of
sliding-window layers is freed while the sequence runs even when other layers attend to everything.

Gemma 3 270M has 18 layers: 15 local (a 512-token window) and 3 global. With one block table for all layers,
a block can be freed only when no layer reads it, and a global layer reads every block: nothing is ever freed.
Here the layers are cut into groups of equal size `group_size` (the gcd of the local and global counts: 3
for Gemma 3, so 5 local groups and 1 global group), each group only of one kind (one window, or full):

    group 0 (full)   layers  5, 11, 17      seq.block_table           keeps every block
    group 1 (local)  layers  0,  1,  2      seq.group_block_tables[0]  frees blocks behind its window
    ...
    group 5 (local)  layers 12, 13, 14      seq.group_block_tables[4]

The pool is `group_size` tensors `[2, num_blocks, block_size, KVH, D]`; layer l reads and writes tensor
`layer_slot[l]` (its position in its group) through its group's block table. So a block id names
`group_size` layers' worth of memory, and one free list serves every group: a block released by a local
group can next hold a global group's tokens. That is what makes freeing pay: with per-layer tensors and one
id space, a block freed in the local layers would still be allocated in the global ones.

Every group's table has the same length (a local group's released entries stay, pointing at block 0 like
`BlockManager.free_out_of_window`'s, and attention masks them as out of the window), so growing a sequence
by `n` tokens needs `num_groups x` the blocks one table would: that is what admission and `can_append` count.

What is not built for a hybrid model: the prefix cache (the engine turns it off with a log line, as vLLM
did at first: a hit would need the local groups' blocks of the prefix, which were freed) and beam search's
fork (a clear error). Swapping and recompute preemption work: every group's table goes out and comes back.
"""

from __future__ import annotations

import logging

from minfer.attention.grouped import KVCacheLayout
from minfer.block_manager import BlockManager, NoFreeBlocksError
from minfer.sequence import Sequence

logger = logging.getLogger("minfer.kv_cache_groups")


def hybrid_block_manager(layout: KVCacheLayout, num_blocks: int, block_size: int, num_cpu_blocks: int,
                         enable_prefix_caching: bool) -> "HybridBlockManager":
    """The block manager of a hybrid model; a request for the prefix cache is refused with a log line."""
    if enable_prefix_caching:
        logger.warning("prefix caching is off for this model: its layers mix sliding-window and full "
                       "attention (a hybrid KV cache), and the local layers' prefix blocks are freed")
    return HybridBlockManager(num_blocks, block_size, layout, num_cpu_blocks)


class HybridBlockManager(BlockManager):
    """`BlockManager` with one block table per layer group over one free list (see the module docstring).

    `seq.block_table` is group 0's (full attention), `seq.group_block_tables` the others'. Prefix caching is
    off. `group_freed[seq_id][g]` counts the leading entries of group g released behind its window.
    """

    def __init__(self, num_blocks: int, block_size: int, layout: KVCacheLayout, num_cpu_blocks: int = 0):
        super().__init__(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching=False)
        self.layout = layout
        self.group_freed: dict[int, list[int]] = {}
        self.swapped_groups: dict[int, list[list[int]]] = {}  # seq_id -> per group, its CPU blocks

    # -- tables -----------------------------------------------------------------------------------------
    def tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block table of every group, group 0 first (all of the same length)."""
        return [seq.block_table, *seq.group_block_tables]

    def _freed(self, seq: Sequence) -> list[int]:
        return self.group_freed.get(seq.seq_id) or [0] * self.layout.num_groups

    # -- sequences --------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        return self.layout.num_groups * self.blocks_needed(num_new_tokens) <= self.num_free_blocks

    def allocate_prefix(self, seq: Sequence, hits: list[int] | None = None) -> int:
        seq.block_table, seq.block_hashes = [], []
        seq.group_block_tables = [[] for _ in range(self.layout.num_groups - 1)]
        return 0

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return self.layout.num_groups * need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > 0 and self.layout.num_groups * need > self.num_free_blocks:
            raise NoFreeBlocksError("KV pool exhausted")  # checked first: no group is left half grown
        for table in self.tables(seq):
            for _ in range(need):
                table.append(self._take_free())

    def free_out_of_window(self, seq: Sequence, window: int | None = None) -> int:
        """Release, in every windowed group, the leading blocks no later query of `seq` can see through that
        group's own window (`window` is ignored: each group has its own). The rule is
        `BlockManager.free_out_of_window`'s: with the next query at q = num_computed_tokens, the first
        (q - W + 1) // block_size blocks are dead. Full-attention groups keep everything. Returns blocks
        released."""
        freed = self._freed(seq)
        released = 0
        for g, (grp, table) in enumerate(zip(self.layout.groups, self.tables(seq))):
            if grp.window is None:
                continue
            dead = min(max(seq.num_computed_tokens - grp.window + 1, 0) // self.block_size, len(table))
            for i in range(freed[g], dead):
                self._release(table[i])
                table[i] = 0
            if dead > freed[g]:
                released += dead - freed[g]
                freed[g] = dead
        if released:
            self.group_freed[seq.seq_id] = freed
        return released

    def num_live_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds in all groups (table entries minus those released behind a window)."""
        return sum(len(t) for t in self.tables(seq)) - sum(self._freed(seq))

    def num_live_tokens(self, seq: Sequence) -> int:
        filled = min(len(seq), len(seq.block_table) * self.block_size)
        return sum(filled - dead * self.block_size for dead in self._freed(seq))

    def free_seq(self, seq: Sequence) -> None:
        freed = self.group_freed.pop(seq.seq_id, None) or [0] * self.layout.num_groups
        for table, dead in zip(self.tables(seq), freed):
            for bid in reversed(table[dead:]):
                self._release(bid)
        seq.block_table, seq.block_hashes, seq.group_block_tables = [], [], []
        self.free_swapped(seq)

    def free_tail(self, seq: Sequence, num_tokens: int) -> int:
        """Every group's blocks past the first `num_tokens` tokens (speculative decoding's rejected slots).
        Entries released behind a window are all below the computed tokens, never in the tail."""
        keep = self.blocks_needed(num_tokens)
        n = 0
        for table in self.tables(seq):
            for bid in reversed(table[keep:]):
                self._release(bid)
            n += len(table[keep:])
            del table[keep:]
        return n

    def check_can_fork(self) -> None:
        """Raises ValueError: beam search's shared blocks are not built for a hybrid KV cache."""
        raise ValueError("beam search is not built for models whose layers mix sliding-window and full "
                         "attention (a hybrid KV cache, e.g. Gemma 3): use sampling or greedy decoding")

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.check_can_fork()

    # -- swapping ---------------------------------------------------------------------------------------
    # Every group's entries go out, released ones too (placeholders, never read), and come back as fresh
    # blocks that the next step's `free_out_of_window` releases again, as `BlockManager.swap_out` does.
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.layout.num_groups * len(seq.block_table) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        freed = self.group_freed.pop(seq.seq_id, None) or [0] * self.layout.num_groups
        mapping, cpu_tables = [], []
        for table, dead in zip(self.tables(seq), freed):
            cpu = [self.cpu_free.pop() for _ in table]
            mapping.extend(zip(table, cpu))
            cpu_tables.append(cpu)
            for bid in table[dead:]:
                self._release(bid)
        self.swapped_groups[seq.seq_id] = cpu_tables
        self.swapped_tables[seq.seq_id] = cpu_tables[0]  # the base class's "is it swapped" bookkeeping
        seq.block_table, seq.block_hashes, seq.group_block_tables = [], [], []
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        n = len(self.swapped_groups[seq.seq_id][0])
        extra = max(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - n, 0)
        return self.layout.num_groups * (n + extra) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        cpu_tables = self.swapped_groups.pop(seq.seq_id)
        self.swapped_tables.pop(seq.seq_id, None)
        tables = [[self._take_free() for _ in cpu] for cpu in cpu_tables]
        seq.block_table, seq.group_block_tables, seq.block_hashes = tables[0], tables[1:], []
        mapping = []
        for cpu, table in zip(cpu_tables, tables):
            self.cpu_free.extend(cpu)
            mapping.extend(zip(cpu, table))
        return mapping

    def free_swapped(self, seq: Sequence) -> None:
        self.swapped_tables.pop(seq.seq_id, None)
        for cpu in self.swapped_groups.pop(seq.seq_id, []):
            self.cpu_free.extend(cpu)
