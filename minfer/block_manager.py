"""Who owns which KV block (article §3 paged KV, §8 swap, §11 prefix caching).

The KV pool is cut into fixed-size blocks of `block_size` token slots. A sequence owns a `block_table`:
the ids of its blocks in order, so token t of the sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size` (the `slot_mapping`).

Prefix caching: a FULL block is named by a hash chain, hash(parent block's hash, this block's token ids),
so equal names mean equal prefixes, not only equal blocks. A new sequence walks its prompt's chain and
reuses every block already cached; reference counts say how many sequences share a block. A block whose
count drops to zero is not wiped: it joins the free list with its hash intact and can still be hit, until
allocation needs it (least recently freed first) and it is evicted.

Sliding windows (article §3): when every layer attends only to the newest W tokens, a block whose tokens
are all older than the window of the NEXT query can never be read again. `free_out_of_window` releases
such leading blocks while the sequence runs; their table entries stay (pointing at block 0, like the
padding of a block table, which attention masks) so that `position // block_size` still finds every live
block. `window_freed[seq_id]` counts them, so a block is never released twice.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from minfer.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | tuple | None = None  # its key in `cached` (the hybrid KV cache's: (group, chain hash))
    token_ids: tuple = ()  # the tokens a hashed block holds, to rule out hash collisions


def block_hash(parent: int | None, token_ids: tuple) -> int:
    """The name of a full block: its tokens chained to everything before it (parent None = first block).

    Python hashes tuples of ints the same way in every process (only str/bytes hashing is salted), so the
    names are reproducible; None is replaced by 0 because its hash is its address on Python < 3.12.
    """
    return hash((0 if parent is None else parent, tuple(token_ids)))


class NoFreeBlocksError(RuntimeError):
    """The pool has no block to give (the scheduler preempts before this can happen)."""


class BlockManager:
    """Allocates, shares and frees the blocks of the KV pool; tracks prefix-cache hits and swap space.

    Args:
        num_blocks: blocks in the device pool. block_size: token slots per block.
        num_cpu_blocks: blocks of CPU swap space (0 = no swapping).
        enable_prefix_caching: name full blocks and reuse them across sequences.
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in the order they were freed: the first is the least recently used.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.enable_prefix_caching = enable_prefix_caching
        self.cpu_free = list(range(num_cpu_blocks))
        self.num_cpu_blocks = num_cpu_blocks
        self.swapped_tables: dict[int, list[int]] = {}  # seq_id -> its CPU blocks
        self.window_freed: dict[int, int] = {}  # seq_id -> leading table entries released (out of window)
        # statistics
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached
        self.num_evicted_blocks = 0

    # -- counting -------------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- low level ------------------------------------------------------------------------------------
    def _take_free(self) -> int:
        if not self.free:
            raise NoFreeBlocksError("KV pool exhausted")
        bid, _ = self.free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash is not None:  # evict: its cached prefix is gone from now on
            if self.cached.get(blk.hash) == bid:
                del self.cached[blk.hash]
            blk.hash, blk.token_ids = None, ()
            self.num_evicted_blocks += 1
        blk.ref_count = 1
        return bid

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_count -= 1
        assert blk.ref_count >= 0, f"block {bid} freed twice"
        if blk.ref_count == 0:
            if blk.hash is None:
                self.free[bid] = None
                self.free.move_to_end(bid, last=False)  # unnamed blocks are reused first
            else:
                self.free[bid] = None  # named blocks wait at the end, still hittable

    # -- prefix cache ---------------------------------------------------------------------------------
    def _prompt_hashes(self, seq: Sequence) -> list[tuple[int, tuple]]:
        """(hash, tokens) of each full block of the sequence's tokens so far."""
        out, parent, bs = [], None, self.block_size
        toks = seq.all_token_ids
        for i in range(len(toks) // bs):
            chunk = tuple(toks[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk)
            out.append((parent, chunk))
        return out

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached chain that prefixes `seq` (never the whole sequence: the last
        token must still be computed to have logits to sample from)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt_logprobs need the logits of every prompt position: compute them all
        hits = []
        for h, toks in self._prompt_hashes(seq):
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != toks:
                break
            hits.append(bid)
        if hits and len(hits) * self.block_size >= len(seq):
            hits.pop()
        return hits

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Name the sequence's full blocks whose K/V are all computed, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        dead = self.window_freed.get(seq.seq_id, 0)
        for i, parent, chunk in self._new_full_blocks(seq):
            if i >= dead:  # below `dead`: released out of the window, the entry is a placeholder
                self._name_block(seq.block_table[i], parent, chunk)

    def _new_full_blocks(self, seq: Sequence):
        """Yield `(index, chain hash, token ids)` of each full block whose K/V are computed and that has no
        hash yet, appending the hashes to `seq.block_hashes` as it goes (consume it whole)."""
        bs, hashes, toks = self.block_size, seq.block_hashes, seq.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), seq.num_computed_tokens // bs):
            chunk = tuple(toks[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk)
            hashes.append(parent)
            yield i, parent, chunk

    def _name_block(self, block_id: int, key, chunk: tuple[int, ...]) -> None:
        """Cache block `block_id` under `key` unless it already has a name or another block holds `key`."""
        blk = self.blocks[block_id]
        if blk.hash is None and key not in self.cached:
            blk.hash, blk.token_ids = key, chunk
            self.cached[key] = block_id

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
            self.prefix_queries += len(seq)
            self.prefix_hits += len(hits) * self.block_size
        for bid in hits:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self.free[bid]
            blk.ref_count += 1
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
        slot is below q - W + 1: the first (q - W + 1) // block_size blocks. Call after
        `register_computed_blocks` (a released block keeps its prefix-cache name). Returns blocks released.
        """
        dead = max(seq.num_computed_tokens - window + 1, 0) // self.block_size
        done = self.window_freed.get(seq.seq_id, 0)
        for i in range(done, min(dead, len(seq.block_table))):
            self._release(seq.block_table[i])
            seq.block_table[i] = 0
        if dead > done:
            self.window_freed[seq.seq_id] = dead
        return max(dead - done, 0)

    def num_live_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds (its table minus the entries released out of the window)."""
        return len(seq.block_table) - self.window_freed.get(seq.seq_id, 0)

    def num_live_tokens(self, seq: Sequence) -> int:
        """Token slots of `seq`'s live blocks that hold a token (what fragmentation counts as used)."""
        dead = self.window_freed.get(seq.seq_id, 0)
        return min(len(seq), len(seq.block_table) * self.block_size) - dead * self.block_size

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's claim on its blocks (named blocks stay cached until evicted)."""
        dead = self.window_freed.pop(seq.seq_id, 0)
        for bid in reversed(seq.block_table[dead:]):  # tail first, so the prefix is evicted last
            self._release(bid)
        seq.block_table = []
        seq.block_hashes = []
        self.free_swapped(seq)

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
        dead = self.window_freed.get(parent.seq_id, 0)  # placeholders released behind a window stay so
        for bid in parent.block_table[dead:]:
            self.blocks[bid].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        if dead:
            self.window_freed[child.seq_id] = dead

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

    # -- swapping (article §8-1) ----------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to CPU swap space; returns (device block, cpu block) copies to do."""
        cpu = [self.cpu_free.pop() for _ in seq.block_table]
        mapping = list(zip(seq.block_table, cpu))
        self.swapped_tables[seq.seq_id] = cpu
        # Entries released out of the window are copied too (placeholders, never read) and come back as fresh
        # blocks, released again after the next step: simpler than a table with holes in swap space.
        for bid in seq.block_table[self.window_freed.pop(seq.seq_id, 0):]:
            self._release(bid)
        seq.block_table, seq.block_hashes = [], []
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        n = len(self.swapped_tables[seq.seq_id])
        extra = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - n
        return n + max(extra, 0) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh device blocks; returns (cpu block, device block) copies."""
        cpu = self.swapped_tables.pop(seq.seq_id)
        seq.block_table = [self._take_free() for _ in cpu]
        seq.block_hashes = []
        self.cpu_free.extend(cpu)
        return list(zip(cpu, seq.block_table))

    def free_swapped(self, seq: Sequence) -> None:
        cpu = self.swapped_tables.pop(seq.seq_id, None)
        if cpu:
            self.cpu_free.extend(cpu)

    # -- observability --------------------------------------------------------------------------------
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1 - self.num_free_blocks / max(self.num_total_blocks, 1)
