"""The prefix cache (article §11; vLLM's automatic prefix caching): full KV blocks named by the tokens they
hold and everything before them, so a later sequence with the same prefix reuses them instead of computing
them again.

A FULL block is named by a hash chain, hash(parent block's hash, this block's token ids), so equal names
mean equal prefixes, not only equal blocks. A new sequence walks its prompt's chain and reuses every block
already cached. A named block that no sequence holds any more is not wiped: it waits in an LRU (least
recently freed first) and can still be hit, until allocation needs a block, finds no unnamed free one, and
evicts the least recently freed.

`BlockManager` composes a `PrefixCache`: the manager counts references; this class names blocks, finds
them again, and keeps the LRU of the free named ones and the hit counters.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable, Iterator

if TYPE_CHECKING:
    from minfer.block_manager import Block
    from minfer.sequence import Sequence


def block_hash(parent: int | None, token_ids: tuple) -> int:
    """The name of a full block: its tokens chained to everything before it (parent None = first block).

    Python hashes tuples of ints the same way in every process (only str/bytes hashing is salted), so the
    names are reproducible; None is replaced by 0 because its hash is its address on Python < 3.12.
    """
    return hash((0 if parent is None else parent, tuple(token_ids)))


class PrefixCache:
    """Named KV blocks: lookup by chain hash, the LRU of free named blocks, hit and eviction counters.

    Args:
        blocks: the pool's `Block`s (shared with the `BlockManager`; a named block's `hash` and `token_ids`
            are set here). block_size: token slots per block.

    Attributes:
        cached: {key: block id} of every named block, held or free. A key is a chain hash (the hybrid KV
            cache's manager uses (layer group, chain hash)).
        lru: the free named blocks, least recently freed first.
        queries, hits: prompt tokens looked up / found cached (`record_lookup`).
        num_evicted_blocks: named blocks that lost their name to a new allocation.
    """

    def __init__(self, blocks: list["Block"], block_size: int):
        self.blocks, self.block_size = blocks, block_size
        self.cached: dict[Hashable, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0
        self.num_evicted_blocks = 0

    # -- names ---------------------------------------------------------------------------------------------
    def chain(self, token_ids: list[int]) -> list[tuple[int, tuple]]:
        """(chain hash, token ids) of each full block of `token_ids`, first block first."""
        out, parent, bs = [], None, self.block_size
        for i in range(len(token_ids) // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk)
            out.append((parent, chunk))
        return out

    def lookup(self, key: Hashable, token_ids: tuple) -> int | None:
        """The block cached under `key` if it holds exactly `token_ids` (a hash collision is a miss), else None."""
        bid = self.cached.get(key)
        return bid if bid is not None and self.blocks[bid].token_ids == token_ids else None

    def longest_prefix(self, seq: "Sequence") -> list[int]:
        """Block ids of the longest cached chain that prefixes `seq`, never the whole sequence (its last token
        must still be computed to have logits to sample from)."""
        hits = []
        for h, toks in self.chain(seq.all_token_ids):
            bid = self.lookup(h, toks)
            if bid is None:
                break
            hits.append(bid)
        if hits and len(hits) * self.block_size >= len(seq):
            hits.pop()
        return hits

    def new_full_blocks(self, seq: "Sequence") -> Iterator[tuple[int, int, tuple]]:
        """Yield `(index, chain hash, token ids)` of each full block of `seq` whose K/V are computed and that has
        no hash yet, appending the hashes to `seq.block_hashes` as it goes (consume it whole)."""
        bs, hashes, toks = self.block_size, seq.block_hashes, seq.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), seq.num_computed_tokens // bs):
            chunk = tuple(toks[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk)
            hashes.append(parent)
            yield i, parent, chunk

    def name(self, block_id: int, key: Hashable, token_ids: tuple) -> None:
        """Cache held block `block_id` under `key` unless it already has a name or another block holds `key`."""
        blk = self.blocks[block_id]
        if blk.hash is None and key not in self.cached:
            blk.hash, blk.token_ids = key, token_ids
            self.cached[key] = block_id

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a sequence's admission: `num_tokens` looked up, `num_hit_tokens` of them cached."""
        self.queries += num_tokens
        self.hits += num_hit_tokens

    # -- the LRU of free named blocks ----------------------------------------------------------------------
    def park(self, block_id: int) -> None:
        """A named block lost its last reference: it waits at the LRU's end, still hittable."""
        self.lru[block_id] = None

    def reuse(self, block_id: int) -> None:
        """A parked block was hit: it is held again, so it leaves the LRU."""
        del self.lru[block_id]

    def evict(self) -> int:
        """Take the least recently freed named block for a new allocation: it loses its name. Returns its id.

        Raises:
            KeyError: the LRU is empty (the caller checks `len(lru)` first).
        """
        bid, _ = self.lru.popitem(last=False)
        blk = self.blocks[bid]
        if self.cached.get(blk.hash) == bid:
            del self.cached[blk.hash]
        blk.hash, blk.token_ids = None, ()
        self.num_evicted_blocks += 1
        return bid
