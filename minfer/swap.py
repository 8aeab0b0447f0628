"""Preemption by swapping (article §8-1): a preempted sequence's KV blocks go to CPU memory and come back.

The core preempts by recompute: the victim's blocks are freed and its tokens prefilled again later. With
`swap_space` (GiB of CPU memory) the engine attaches this module instead, in three parts that mirror the
core's three owners of KV:

    SwappingBlockManager   the block manager with a `SwapSpace`: which CPU blocks hold whose KV
    SwapPreemption         the scheduler's preemption policy: swap the victim out (if the CPU space has
                           room, else recompute); bring swapped sequences back before new requests (FCFS)
    SwappingKVCachePool    the pool with CPU tensors beside the device ones; copies the blocks the step's
                           `SwapTransfer` names before the forward

A swapped sequence keeps its computed tokens: it resumes decoding (or its chunked prefill) where it stopped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from minfer.attention.kv_quant import SCALE_DTYPE, raw
from minfer.block_manager import BlockManager
from minfer.kv_cache import KVCachePool, zeros
from minfer.sequence import Sequence, SequenceStatus


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


class SwappingBlockManager(BlockManager):
    """`BlockManager` with CPU swap space (`swap`, a `SwapSpace`).

    Args:
        num_blocks, block_size, enable_prefix_caching: as `BlockManager`'s.
        num_cpu_blocks: blocks of CPU swap space.
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = False):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.swap = SwapSpace(num_cpu_blocks)

    @property
    def num_cpu_blocks(self) -> int:
        return self.swap.num_cpu_blocks

    @property
    def cpu_free(self) -> list[int]:
        return self.swap.cpu_free

    def free_seq(self, seq: Sequence) -> None:
        super().free_seq(seq)
        self.free_swapped(seq)

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.swap.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to CPU swap space; returns (device block, cpu block) copies to do."""
        mapping = self.swap.swap_out(seq.seq_id, [seq.block_table])
        # Entries released out of the window are copied too (placeholders, never read) and come back as fresh
        # blocks, released again after the next step: simpler than a table with holes in swap space.
        for bid in seq.block_table[self.window.pop(seq.seq_id):]:
            self._release(bid)
        seq.block_table, seq.block_hashes = [], []
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        n = len(self.swap.swapped[seq.seq_id][0])
        extra = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - n
        return n + max(extra, 0) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh device blocks; returns (cpu block, device block) copies."""
        cpu = self.swap.swap_in(seq.seq_id)[0]
        seq.block_table = [self._take_free() for _ in cpu]
        seq.block_hashes = []
        return list(zip(cpu, seq.block_table))

    def free_swapped(self, seq: Sequence) -> None:
        self.swap.free(seq.seq_id)


@dataclass
class SwapTransfer:
    """A step's block copies between the device pool and the CPU swap space (`ScheduledBatch.kv_transfer`):
    (device block, cpu block) pairs out, then (cpu block, device block) pairs in, before the forward."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


def transfer_of(batch) -> SwapTransfer:
    """The batch's `SwapTransfer`, made on first use."""
    if batch.kv_transfer is None:
        batch.kv_transfer = SwapTransfer()
    return batch.kv_transfer


class SwapPreemption:
    """The scheduler's preemption policy with swap space (`Scheduler(preemption=...)`).

    Attributes:
        swapped: the swapped-out sequences, the next to come back first.
    """

    def __init__(self, block_manager: SwappingBlockManager):
        self.bm = block_manager
        self.swapped: deque[Sequence] = deque()

    def has_waiting(self) -> bool:
        """True while a swapped sequence waits to come back (new requests wait behind it)."""
        return bool(self.swapped)

    def preempt(self, seq: Sequence, batch) -> bool:
        """Swap `seq` out if the swap space has room (True); False leaves it to recompute."""
        if not self.bm.can_swap_out(seq):
            return False
        transfer_of(batch).swap_out.extend(self.bm.swap_out(seq))
        seq.status = SequenceStatus.OFFLOADED
        self.swapped.appendleft(seq)
        return True

    def resume(self, scheduler, batch, budget: int) -> int:
        """Bring swapped sequences back, oldest first, while the budgets and the pool allow; returns the
        token budget left."""
        while self.swapped and budget > 0 and len(batch.seqs) < scheduler.max_num_seqs:
            seq = self.swapped[0]
            want = len(seq) - seq.num_computed_tokens
            # A sequence swapped out in the middle of a chunked prefill resumes it chunk by chunk.
            n = min(want, budget) if (scheduler.chunked or want == 1) else want
            if n > budget or not self.bm.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            transfer_of(batch).swap_in.extend(self.bm.swap_in(seq))
            budget -= scheduler.admit(seq, n, batch)
        return budget

    def remove(self, seq: Sequence) -> bool:
        """Forget `seq` (finished or aborted while swapped); True if it was swapped out."""
        if seq in self.swapped:
            self.swapped.remove(seq)
            return True
        return False


class SwappingKVCachePool(KVCachePool):
    """`KVCachePool` with CPU swap tensors (`cpu_layers`, and `cpu_scales` for a quantized pool) of
    `num_cpu_blocks` blocks, pinned when the device is CUDA."""

    def __init__(self, cfg, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 num_cpu_blocks: int = 0, kv_cache_dtype: str = "auto"):
        super().__init__(cfg, num_blocks, block_size, dtype, device, kv_cache_dtype)
        n, store = cfg.num_hidden_layers, self.spec.dtype
        heads = (block_size, cfg.num_key_value_heads)
        pin, cpu = device.type == "cuda", torch.device("cpu")
        self.cpu_layers = [zeros((2, num_cpu_blocks, *heads, cfg.head_dim), store, cpu, pin) for _ in range(n)]
        self.cpu_scales = ([zeros((2, num_cpu_blocks, *heads), SCALE_DTYPE, cpu, pin) for _ in range(n)]
                           if self.spec.quantized else None)
        self.num_cpu_blocks = num_cpu_blocks

    def before_forward(self, batch) -> None:
        transfer = batch.kv_transfer
        if transfer is not None:
            self.swap_out(transfer.swap_out)
            self.swap_in(transfer.swap_in)
        super().before_forward(batch)

    def _pairs(self):
        """(device tensor, cpu tensor) of every layer's K/V (as raw bytes when 1-byte) and of its scales."""
        pairs = [(raw(d), raw(c)) for d, c in zip(self.layers, self.cpu_layers)]
        if self.scales is not None:
            pairs += list(zip(self.scales, self.cpu_scales))
        return pairs

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: mapping of (device block, cpu block)."""
        if not mapping:
            return
        src = torch.tensor([m[0] for m in mapping], device=self.layers[0].device)
        dst = torch.tensor([m[1] for m in mapping])
        for dev, cpu in self._pairs():
            cpu[:, dst] = dev[:, src].to("cpu")

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks: mapping of (cpu block, device block)."""
        if not mapping:
            return
        src = torch.tensor([m[0] for m in mapping])
        dst = torch.tensor([m[1] for m in mapping], device=self.layers[0].device)
        for dev, cpu in self._pairs():
            dev[:, dst] = cpu[:, src].to(dev.device)
