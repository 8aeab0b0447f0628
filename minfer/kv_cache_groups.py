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

Prefix caching (article §11; the idea of vLLM's hybrid allocator, where the hit is the longest prefix that every
group can serve). A full block is named per group, `(group, chain hash)`: group g's block holds other layers'
K/V than group h's for the same tokens. A prefix of k blocks (L = k * block_size tokens) is a hit when

    full groups    blocks 0 .. k-1 are all cached (their table is the usual chain)
    local groups   blocks (L - W + 1) // block_size .. k-1 are cached: only what the query at position L and
                   later ones can see through the window W; the blocks before it were (or would have been)
                   freed, so the new sequence gets placeholders there (block 0, counted in `group_freed`)

A prefix of a full group's hit is a hit; a local group's is not (the window's blocks of a shorter prefix may be
gone), so `cached_prefix` takes the full groups' longest chain and walks down from it to the longest k that
every local group serves too. The local groups' blocks released behind the window keep their names (they stay
hittable until evicted), so a second request sharing a long prefix finds the window's blocks still cached.

Beam search forks every group's table: each live entry gains a reference, placeholders stay placeholders,
and copy-on-write copies the written block of every group that shares it (`copies_before_write`).
Swapping and recompute preemption work: swapping moves only the live entries of every group (placeholders stay
placeholders, so a swapped-in sequence never names a block that holds no K/V).
"""

from __future__ import annotations

from minfer.attention.grouped import KVCacheLayout
from minfer.block_manager import BlockManager, NoFreeBlocksError
from minfer.block_policies import first_visible_block
from minfer.sequence import Sequence


def hybrid_block_manager(layout: KVCacheLayout, num_blocks: int, block_size: int, num_cpu_blocks: int,
                         enable_prefix_caching: bool) -> "HybridBlockManager":
    """The block manager of a hybrid model (one block table per layer group of `layout`)."""
    return HybridBlockManager(num_blocks, block_size, layout, num_cpu_blocks, enable_prefix_caching)


class HybridBlockManager(BlockManager):
    """`BlockManager` with one block table per layer group over one free list (see the module docstring).

    `seq.block_table` is group 0's (full attention), `seq.group_block_tables` the others'.
    `group_freed[seq_id][g]` counts the leading entries of group g that are placeholders: released behind its
    window, or never held because a prefix-cache hit started past them (the per-group form of the base
    class's `WindowPolicy`). The prefix cache's keys are (group, chain hash); `seq.block_hashes` holds the
    chain hashes (the same for every group). Swap space keeps one CPU table per group.
    """

    def __init__(self, num_blocks: int, block_size: int, layout: KVCacheLayout, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = False):
        super().__init__(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching)
        self.layout = layout
        self.group_freed: dict[int, list[int]] = {}
        self.swapped_freed: dict[int, list[int]] = {}  # seq_id -> its group_freed while swapped out

    @property
    def num_block_tables(self) -> int:
        return self.layout.num_groups

    # -- tables -----------------------------------------------------------------------------------------
    def tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block table of every group, group 0 first (all of the same length)."""
        return [seq.block_table, *seq.group_block_tables]

    def _freed(self, seq: Sequence) -> list[int]:
        return self.group_freed.get(seq.seq_id) or [0] * self.layout.num_groups

    def _first_visible(self, g: int, num_tokens: int) -> int:
        """Index of group g's first block a query at position `num_tokens` (or later) can read."""
        return first_visible_block(num_tokens, self.layout.groups[g].window, self.block_size)

    # -- prefix cache -----------------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[tuple[int, ...]]:
        """The longest cached prefix every group can serve, as one entry per block: the block id of each group
        there (0 in a local group where the block lies behind the window at the hit point). Never the whole
        sequence: its last token must be computed for logits."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        cache = self.prefix_cache
        chain = cache.chain(seq.all_token_ids)[:(len(seq) - 1) // self.block_size]
        # ids[g][i]: group g's cached block for chain block i, or None
        ids = [[cache.lookup((g, h), toks) for h, toks in chain] for g in range(self.layout.num_groups)]
        full = [g for g, grp in enumerate(self.layout.groups) if grp.window is None]
        k = len(chain)
        for g in full:
            k = min(k, next((i for i, b in enumerate(ids[g]) if b is None), k))
        local = [g for g in range(self.layout.num_groups) if g not in full]
        # run[g][i]: cached blocks of group g ending at block i (inclusive), so the window's blocks
        # first_visible .. k-1 are all cached iff run[g][k-1] >= k - first_visible.
        runs = {}
        for g in local:
            run, n = [], 0
            for b in ids[g]:
                n = n + 1 if b is not None else 0
                run.append(n)
            runs[g] = run
        while k > 0 and not all(runs[g][k - 1] >= k - self._first_visible(g, k * self.block_size) for g in local):
            k -= 1
        hits = []
        for i in range(k):
            hits.append(tuple(ids[g][i] if i >= self._first_visible(g, k * self.block_size) else 0
                              for g in range(self.layout.num_groups)))
        return hits

    def _hit_blocks(self, hits: list[tuple[int, ...]]) -> list[int]:
        """The real blocks of a hit (placeholders left out), every group's."""
        k = len(hits)
        return [row[g] for i, row in enumerate(hits) for g in range(self.layout.num_groups)
                if i >= self._first_visible(g, k * self.block_size)]

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Name every group's full, computed blocks `(group, chain hash)`; placeholders are skipped."""
        if not self.enable_prefix_caching or len(seq.block_hashes) >= seq.num_computed_tokens // self.block_size:
            return
        freed, tables = self._freed(seq), self.tables(seq)
        for i, parent, chunk in self.prefix_cache.new_full_blocks(seq):
            for g, table in enumerate(tables):
                if i >= freed[g]:  # below freed[g]: a placeholder, not a block holding these tokens
                    self.prefix_cache.name(table[i], (g, parent), chunk)

    # -- sequences --------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list | None = None) -> bool:
        hits = self.cached_prefix(seq) if hits is None else hits
        hit_free = sum(1 for b in self._hit_blocks(hits) if self.blocks[b].ref_count == 0)
        need = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return self.layout.num_groups * need <= self.num_free_blocks - hit_free

    def allocate_prefix(self, seq: Sequence, hits: list | None = None) -> int:
        """Attach a cached prefix (`cached_prefix`) to a waiting sequence; returns its cached tokens."""
        hits = self.cached_prefix(seq) if hits is None else hits
        if self.enable_prefix_caching:
            self.prefix_cache.record_lookup(len(seq), len(hits) * self.block_size)
        for bid in self._hit_blocks(hits):
            self._hold(bid)
        tables = [[row[g] for row in hits] for g in range(self.layout.num_groups)]
        seq.block_table, seq.group_block_tables = tables[0], tables[1:]
        seq.block_hashes = [self.blocks[b].hash[1] for b in tables[0]]
        freed = [self._first_visible(g, len(hits) * self.block_size) if hits else 0
                 for g in range(self.layout.num_groups)]
        if any(freed):
            self.group_freed[seq.seq_id] = freed
        return len(hits) * self.block_size

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
        released (a released block keeps its prefix-cache name: call after `register_computed_blocks`)."""
        freed = self._freed(seq)
        released = 0
        for g, table in enumerate(self.tables(seq)):
            if self.layout.groups[g].window is None:
                continue
            dead = min(self._first_visible(g, seq.num_computed_tokens), len(table))
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
        """Blocks `seq` holds in all groups (table entries minus the placeholders)."""
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
        Placeholders are all below the computed tokens, never in the tail."""
        keep = self.blocks_needed(num_tokens)
        n = 0
        for table in self.tables(seq):
            for bid in reversed(table[keep:]):
                self._release(bid)
            n += len(table[keep:])
            del table[keep:]
        return n

    # -- forking (beam search) --------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` every group's blocks of `parent` (one more reference each; placeholders stay)."""
        assert not child.block_table, "fork into a sequence that already holds blocks"
        freed = self._freed(parent)
        tables = [list(t) for t in self.tables(parent)]
        for table, dead in zip(tables, freed):
            for bid in table[dead:]:
                self.blocks[bid].ref_count += 1
        child.block_table, child.group_block_tables = tables[0], tables[1:]
        child.block_hashes = list(parent.block_hashes)
        if any(freed):
            self.group_freed[child.seq_id] = list(freed)

    def copies_before_write(self, seq: Sequence, position: int) -> list[tuple[int, int]]:
        """`BlockManager.copy_on_write` in every group: the block holding `position` is made `seq`'s own
        wherever it is shared; returns the (source, new) copies for the worker.

        Raises:
            NoFreeBlocksError: fewer free blocks than the groups that need a copy (nothing is taken then).
        """
        i = position // self.block_size
        tables = self.tables(seq)
        shared = [t for t in tables if self.blocks[t[i]].ref_count > 1]
        if len(shared) > self.num_free_blocks:
            raise NoFreeBlocksError("KV pool exhausted")
        out = []
        for table in shared:
            bid, new = table[i], self._take_free()
            self._release(bid)
            table[i] = new
            out.append((bid, new))
        return out

    def copy_on_write(self, seq: Sequence, position: int) -> tuple[int, int] | None:
        raise TypeError("a hybrid KV cache copies one block per group: call copies_before_write")

    # -- swapping ---------------------------------------------------------------------------------------
    # Only live entries go out (and come back as fresh blocks); placeholders stay placeholders, so the prefix
    # cache never names a swapped-in block that holds no K/V.
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.num_live_blocks(seq) <= self.swap.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        freed = self.group_freed.pop(seq.seq_id, None) or [0] * self.layout.num_groups
        live = [table[dead:] for table, dead in zip(self.tables(seq), freed)]
        mapping = self.swap.swap_out(seq.seq_id, live)
        for table in live:
            for bid in table:
                self._release(bid)
        self.swapped_freed[seq.seq_id] = freed
        seq.block_table, seq.block_hashes, seq.group_block_tables = [], [], []
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        cpu_tables, freed = self.swap.swapped[seq.seq_id], self.swapped_freed[seq.seq_id]
        n = len(cpu_tables[0]) + freed[0]  # table length
        extra = max(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - n, 0)
        return sum(len(c) for c in cpu_tables) + self.layout.num_groups * extra <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        cpu_tables, freed = self.swap.swap_in(seq.seq_id), self.swapped_freed.pop(seq.seq_id)
        mapping, tables = [], []
        for cpu, dead in zip(cpu_tables, freed):
            live = [self._take_free() for _ in cpu]
            tables.append([0] * dead + live)
            mapping.extend(zip(cpu, live))
        seq.block_table, seq.group_block_tables, seq.block_hashes = tables[0], tables[1:], []
        if any(freed):
            self.group_freed[seq.seq_id] = list(freed)
        return mapping

    def free_swapped(self, seq: Sequence) -> None:
        self.swap.free(seq.seq_id)
        self.swapped_freed.pop(seq.seq_id, None)
