"""What happens to a running sequence's KV blocks besides allocation: freed behind a sliding window (article
§3), or moved to CPU swap space when the sequence is preempted (article §8). `BlockManager` composes one of
each; both only keep the books, the manager moves the blocks' reference counts.
"""

from __future__ import annotations

from typing import Callable


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


class SwapSpace:
    """CPU blocks that preempted sequences' KV is copied into, and which sequence holds which.

    Args:
        num_cpu_blocks: blocks of swap space (0 = no swapping).

    Attributes:
        cpu_free: free CPU block ids (taken from the end).
        swapped: {seq_id: its CPU blocks, one list per block table} of the sequences swapped out.
    """

    def __init__(self, num_cpu_blocks: int):
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free = list(range(num_cpu_blocks))
        self.swapped: dict[int, list[list[int]]] = {}

    @property
    def num_free(self) -> int:
        return len(self.cpu_free)

    def swap_out(self, seq_id: int, tables: list[list[int]]) -> list[tuple[int, int]]:
        """Give each device block of `tables` a CPU block; returns the (device block, CPU block) copies.
        The caller has checked `num_free`."""
        mapping, cpu_tables = [], []
        for table in tables:
            cpu = [self.cpu_free.pop() for _ in table]
            mapping.extend(zip(table, cpu))
            cpu_tables.append(cpu)
        self.swapped[seq_id] = cpu_tables
        return mapping

    def swap_in(self, seq_id: int) -> list[list[int]]:
        """The CPU blocks of a sequence coming back (one list per table); they are free again after the copy."""
        cpu_tables = self.swapped.pop(seq_id)
        for cpu in cpu_tables:
            self.cpu_free.extend(cpu)
        return cpu_tables

    def free(self, seq_id: int) -> None:
        """Drop a swapped sequence's CPU blocks (it finished or was aborted while swapped). No-op otherwise."""
        for cpu in self.swapped.pop(seq_id, []):
            self.cpu_free.extend(cpu)
