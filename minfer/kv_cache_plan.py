"""The KV cache's plan, decided once when an engine starts (a seam, like `minfer.platform`): how many blocks
the pool gets, which block manager keeps its books, how a preempted sequence is kept, and the pool's layer
groups. The core asks here and names none of the variants:

    determine_num_blocks  how many blocks fit the memory budget (`bytes_per_block` each)
    plan_kv_cache(...)    the pool's size; `BlockManager`, or the hybrid one (several layer groups,
                          `minfer.kv_cache_groups`) or one with swap space (`minfer.swap`); the preemption
                          policy (None: recompute); the sliding window freed per sequence
    make_kv_pool(...)     the worker's `KVCachePool`, or one with CPU swap tensors
    kv_cache_groups(cfg)  the layer groups when there are several (Gemma 3), else None
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minfer.attention.grouped import KVCacheLayout, hybrid_layout
from minfer.attention.kv_quant import kv_cache_spec
from minfer.block_manager import BlockManager
from minfer.config import EngineArgs, ModelConfig
from minfer.kv_cache import KVCachePool
from minfer.memory import human_bytes, kv_cache_bytes, physical_memory_bytes

CPU_DEFAULT_KV_BYTES = 1 << 30  # on a CPU, 1 GiB of KV unless kv_cache_memory_bytes says otherwise


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block takes across all layers: layers x 2 x block_size x kv_heads x (head_dim x elem + scale)
    (`memory.kv_cache_bytes`), for a model computing in `dtype` with the pool of `kv_cache_dtype`."""
    spec = kv_cache_spec(kv_cache_dtype, dtype)
    return kv_cache_bytes(cfg.num_hidden_layers, 1, block_size, cfg.num_key_value_heads, cfg.head_dim, spec.dtype,
                          spec.scale_bytes)


def own_memory_in_use(device: torch.device) -> int:
    """Bytes this process has allocated on a CUDA device (its own, not other processes')."""
    return torch.cuda.memory_reserved(device)


def determine_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                         kv_cache_memory_bytes: int | None, gpu_memory_utilization: float,
                         max_model_len: int, kv_cache_dtype: str = "auto") -> int:
    """How many blocks the pool gets (a quantized `kv_cache_dtype` fits more of them in the same bytes).

    - `kv_cache_memory_bytes` given: that many bytes, on any device.
    - CUDA: `gpu_memory_utilization x total - what this process already holds` (weights plus the peak of a
      profiling forward, measured by the caller before this is called). Other processes' memory is not
      subtracted, so it can never drive the count to zero on its own.
    - CPU: 1 GiB.

    Raises:
        ValueError: the pool cannot hold one sequence of `max_model_len` tokens (states the numbers and the
            option to change).
    """
    per_block = bytes_per_block(cfg, block_size, dtype, kv_cache_dtype)
    if kv_cache_memory_bytes is not None:
        budget, knob = int(kv_cache_memory_bytes), "kv_cache_memory_bytes"
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * gpu_memory_utilization) - max(own_memory_in_use(device),
                                                           torch.cuda.max_memory_allocated(device))
        knob = "gpu_memory_utilization"
    else:
        budget, knob = CPU_DEFAULT_KV_BYTES, "kv_cache_memory_bytes"
    if device.type == "cpu":
        ram = physical_memory_bytes()
        if budget > ram:
            raise ValueError(f"{knob} asks for {human_bytes(budget)} of KV cache but this machine has "
                             f"{human_bytes(ram)} of memory. Lower {knob}.")
    num_blocks = max(budget, 0) // per_block
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(
            f"the KV pool has room for {num_blocks} blocks ({human_bytes(max(budget, 0))}, "
            f"{human_bytes(per_block)} per block of {block_size} tokens), but one sequence of max_model_len="
            f"{max_model_len} tokens needs {need} blocks ({human_bytes(need * per_block)}). "
            f"Raise {knob} or lower max_model_len.")
    return int(num_blocks)


def make_kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 num_cpu_blocks: int = 0,
                 kv_cache_dtype: str = "auto") -> KVCachePool:
    """The worker's pool: `KVCachePool`, or with `num_cpu_blocks` of swap space `minfer.swap.SwappingKVCachePool`."""
    if not num_cpu_blocks:
        return KVCachePool(cfg, num_blocks, block_size, dtype, device, kv_cache_dtype)
    from minfer.swap import SwappingKVCachePool

    return SwappingKVCachePool(cfg, num_blocks, block_size, dtype, device, num_cpu_blocks, kv_cache_dtype)


def kv_cache_groups(cfg: ModelConfig) -> KVCacheLayout | None:
    """The layer groups of `cfg`'s KV cache when there are several (a model mixing sliding-window and full
    layers), else None: every layer shares each sequence's one block table."""
    return hybrid_layout(cfg)


@dataclass
class KVCachePlan:
    """How the engine's KV cache is laid out: what `plan_kv_cache` decides once, before the pool is allocated.

    Attributes:
        num_blocks: device blocks in the pool. num_cpu_blocks: blocks of CPU swap space (0: none).
        block_manager: a `BlockManager` (one block table per sequence), or a `HybridBlockManager` (one per
            layer group: a model mixing sliding-window and full layers, Gemma 3).
        preemption: the scheduler's preemption policy: None to recompute, or `minfer.swap.SwapPreemption`.
        sliding_window: tokens behind which a sequence's blocks are freed each step (every layer has a
            window), or None.
    """

    num_blocks: int
    num_cpu_blocks: int
    block_manager: BlockManager
    preemption: object
    sliding_window: int | None


def plan_kv_cache(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  model: torch.nn.Module | None, max_len: int, max_num_batched_tokens: int) -> KVCachePlan:
    """Size the KV pool (and swap space) for `cfg` computing in `dtype` on `device`, and pick its block
    manager: the plain one for one layer group, the hybrid one for several (module docstring).

    Args:
        args: the `EngineArgs` (block_size, kv_cache_memory_bytes, gpu_memory_utilization, kv_cache_dtype,
            swap_space in GiB, preemption_mode, enable_prefix_caching). model: the loaded model on a CPU (its
            weights share the machine's memory with the pool), or None.

    Raises:
        ValueError: the pool cannot hold one sequence of `max_len` tokens, or the weights, pool and swap space
            do not fit in the machine's memory, or swap_space is more than the machine has.
    """
    layout = hybrid_layout(cfg)
    pool_cfg = cfg if layout is None else layout.pool_config(cfg)
    num_blocks = determine_num_blocks(pool_cfg, args.block_size, dtype, device, args.kv_cache_memory_bytes,
                                      args.gpu_memory_utilization, max_len, args.kv_cache_dtype)
    per_block = bytes_per_block(pool_cfg, args.block_size, dtype, args.kv_cache_dtype)
    if layout is not None and num_blocks < layout.max_blocks_per_seq(max_len, args.block_size, max_num_batched_tokens):
        need = layout.max_blocks_per_seq(max_len, args.block_size, max_num_batched_tokens)
        raise ValueError(f"the KV pool has room for {num_blocks} blocks, but one sequence of max_model_len="
                         f"{max_len} tokens needs {need} across the {layout.num_groups} layer groups of this "
                         "model's hybrid KV cache. Raise kv_cache_memory_bytes or lower max_model_len.")
    num_cpu_blocks = int(args.swap_space * (1 << 30)) // per_block
    ram = physical_memory_bytes()
    if args.swap_space * (1 << 30) > ram:
        raise ValueError(f"swap_space={args.swap_space} GiB is more than this machine's memory "
                         f"({ram / (1 << 30):.1f} GiB); lower swap_space")
    if device.type == "cpu" and model is not None:
        # The weights, the pool and its swap space share one memory: all must fit before the pool is taken.
        weights = sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
        pool, swap = num_blocks * per_block, num_cpu_blocks * per_block
        if weights + pool + swap > ram:
            gib = 1 << 30
            raise ValueError(f"the weights ({weights / gib:.2f} GiB), the KV pool ({pool / gib:.2f} GiB) and the "
                             f"swap space ({swap / gib:.2f} GiB) need {(weights + pool + swap) / gib:.2f} GiB, "
                             f"more than this machine's {ram / gib:.1f} GiB: lower kv_cache_memory_bytes or "
                             "swap_space, or quantize the weights")
    mode = args.preemption_mode or ("swap" if num_cpu_blocks else "recompute")
    preemption = None  # recompute
    if layout is not None:
        from minfer.kv_cache_groups import hybrid_block_manager

        bm = hybrid_block_manager(layout, num_blocks, args.block_size, num_cpu_blocks, args.enable_prefix_caching)
    elif num_cpu_blocks:
        from minfer.swap import SwappingBlockManager

        bm = SwappingBlockManager(num_blocks, args.block_size, num_cpu_blocks, args.enable_prefix_caching)
    else:
        bm = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
    if mode == "swap":
        from minfer.swap import SwapPreemption

        preemption = SwapPreemption(bm)
    # KV behind the window is freed per sequence when EVERY layer has one (a full-attention layer reads it
    # all), and per layer group by the hybrid block manager (which applies each group's own window).
    local = [w for w in cfg.layer_windows if w is not None]
    window = max(local) if local and (layout is not None or len(local) == len(cfg.layer_windows)) else None
    return KVCachePlan(num_blocks, num_cpu_blocks, bm, preemption, window)
