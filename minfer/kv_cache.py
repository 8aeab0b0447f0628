"""The KV pool (article §3): one allocation of fixed-size blocks per layer.

Per layer the pool is a tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K and V), allocated
once at start-up; the block manager hands out block ids and the attention backend reads and writes slots.
A quantized pool (`kv_cache_dtype` "int8"/"fp8*", `minfer.attention.kv_quant`) holds 8-bit codes there and,
beside them, float32 scales `[2, num_blocks, block_size, num_kv_heads]` per layer: every block copy (copy-on-write,
or a move to and from CPU memory) moves a block's codes and its scales together.
"""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

import torch

from minfer.attention.kv_quant import SCALE_DTYPE, KVCacheSpec, kv_cache_spec, raw
from minfer.config import ModelConfig

if TYPE_CHECKING:
    from minfer.scheduler import ScheduledBatch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool = False) -> torch.Tensor:
    """A zeroed tensor of `shape` and `dtype` on `device`.

    In CPU memory (not pinned) it is a private anonymous mapping (mmap(2)): the kernel hands out zero pages
    on first write, so a pool takes resident memory only for the parts that were ever written, and it goes
    back to the system whole (munmap) when the tensor dies, not into the allocator's free lists. On Linux the
    mapping asks for transparent huge pages (madvise MADV_HUGEPAGE, which the kernel honours in its default
    "madvise" mode): decode attention reads each sequence's blocks from wherever the block manager put them,
    and with 2 MB pages instead of 4 KB ones those scattered reads miss the TLB far less (lab notes 9b
    §9b.17). Resident memory then grows 2 MB at a time. On a GPU, or pinned, it is `torch.zeros`.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or pin_memory or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    if hasattr(mmap, "MAP_PRIVATE"):  # POSIX: private (Python's default is a shared mapping, which THP skips)
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        mapping = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only; a kernel built without THP refuses it: 4 KB pages then
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    # frombuffer keeps a reference to the mapping: it is unmapped when the last view of it is gone.
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


class KVCachePool:
    """The device KV tensors, with block copies between them.

    Attributes:
        layers: per layer `[2, num_blocks, block_size, KVH, D]` of `spec.dtype` (K and V).
        scales: per layer float32 `[2, num_blocks, block_size, KVH]` for a quantized pool, else None.
        spec: the `KVCacheSpec` of `kv_cache_dtype` ("auto": the model's `dtype`).
        num_cpu_blocks: blocks of CPU memory beside the pool (0 here; `minfer.swap.SwappingKVCachePool`).
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto"):
        self.spec: KVCacheSpec = kv_cache_spec(kv_cache_dtype, dtype)
        n, store = cfg.num_hidden_layers, self.spec.dtype
        heads = (block_size, cfg.num_key_value_heads)
        # Zeroed, not torch.empty: attention masks unused slots of a partly filled block with -inf, but a
        # probability of 0 times a NaN left in uninitialised memory is still NaN.
        self.layers = [zeros((2, num_blocks, *heads, cfg.head_dim), store, device) for _ in range(n)]
        self.scales = None
        if self.spec.quantized:
            self.scales = [zeros((2, num_blocks, *heads), SCALE_DTYPE, device) for _ in range(n)]
        self.num_blocks, self.block_size, self.num_cpu_blocks = num_blocks, block_size, 0

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool: codes (or K/V) plus scales."""
        return sum(t.numel() * t.element_size() for t in self.layers + (self.scales or []))

    def before_forward(self, batch: "ScheduledBatch") -> None:
        """The block copies a step asks for before its forward writes (`ScheduledBatch.copy`)."""
        self.copy_blocks(batch.copy)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to other device blocks: mapping of (source block, destination block). Used for
        the copy-on-write of a block shared by forked sequences (beam search)."""
        if not mapping:
            return
        dev = self.layers[0].device
        src = torch.tensor([m[0] for m in mapping], device=dev)
        dst = torch.tensor([m[1] for m in mapping], device=dev)
        for layer in [raw(t) for t in self.layers] + (self.scales or []):
            layer[:, dst] = layer[:, src]
