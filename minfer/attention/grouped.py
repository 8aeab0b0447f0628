"""Attention over a hybrid KV cache (article §3; vLLM's hybrid KV cache): the layer groups of a model whose
layers mix sliding-window and full attention, and the backend wrapper that gives each layer its own group's
block table.

`hybrid_layout(cfg)` cuts the layers into groups of equal size (Gemma 3 270M: 3 global layers in one group,
15 local ones in five); `minfer.kv_cache_groups.HybridBlockManager` keeps one block table per group and
frees the local groups' blocks behind their window; the worker stacks the tables (`stacked_block_tables`)
into one `ForwardContext`, and `GroupedBackend` hands each layer its group's tables and slots. See
`minfer/kv_cache_groups.py` for the memory layout and why it makes freeing pay.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minfer.attention.base import Attention, AttentionBackend, ForwardContext
from minfer.config import ModelConfig

if TYPE_CHECKING:
    from minfer.sequence import Sequence


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table: their indices and their window (tokens; None = full attention)."""

    layers: tuple[int, ...]
    window: int | None


@dataclass(frozen=True)
class KVCacheLayout:
    """The layer groups of a hybrid model. `groups[0]` is a full-attention group (its table is
    `seq.block_table`, so everything that reads one table, the engine's statistics included, still sees the
    sequence's whole length); `groups[g]`, g >= 1, uses `seq.group_block_tables[g - 1]`."""

    groups: tuple[KVCacheGroup, ...]
    group_size: int
    num_layers: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Group index of each layer."""
        out = [0] * self.num_layers
        for g, grp in enumerate(self.groups):
            for layer in grp.layers:
                out[layer] = g
        return tuple(out)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """Which pool tensor each layer uses: its position inside its group."""
        out = [0] * self.num_layers
        for grp in self.groups:
            for j, layer in enumerate(grp.layers):
                out[layer] = j
        return tuple(out)

    def pool_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with `group_size` layers: what `KVCachePool`, `bytes_per_block` and `determine_num_blocks`
        size (one block = `group_size` layers' K/V)."""
        return dataclasses.replace(cfg, num_hidden_layers=self.group_size, layer_windows=())

    def layer_caches(self, pool_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The per-layer view the attention backends index by `layer.layer_idx` (tensors shared by groups)."""
        return [pool_tensors[j] for j in self.layer_slot]

    def block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """int32 `[num_groups, num_seqs, max_blocks]`: what the worker passes as `block_tables`."""
        return stacked_block_tables(seqs)

    def wrap_backend(self, inner: AttentionBackend) -> "GroupedBackend":
        """`inner` (built over `layer_caches`) run with each layer's own group's block table and slots."""
        return GroupedBackend(inner, self)

    def max_blocks_per_seq(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once: every token in a full group; in
        a local group the window plus one step's new tokens (written before the window moves past them),
        plus a partly covered block at each end."""
        full = -(-num_tokens // block_size)
        total = 0
        for grp in self.groups:
            if grp.window is None:
                total += full
            else:
                total += min(full, -(-(grp.window + max_num_batched_tokens) // block_size) + 1)
        return total


def hybrid_layout(cfg: ModelConfig) -> KVCacheLayout | None:
    """The layer groups of a model whose layers mix windows (Gemma 3), or None when every layer has the same
    kind: all full attention, or all windowed (then `BlockManager.free_out_of_window` frees per sequence).

    Layers with the same window form groups of `group_size` = gcd of the per-window layer counts, in layer
    order; the full-attention groups come first.
    """
    windows = tuple(cfg.layer_windows)
    kinds = {w for w in windows}
    if len(kinds) <= 1 or None not in kinds:
        return None  # one kind, or only windows (possibly different ones: the largest frees per sequence)
    by_window: dict = {}
    for i, w in enumerate(windows):
        by_window.setdefault(w, []).append(i)
    size = math.gcd(*(len(v) for v in by_window.values()))
    order = [None] + sorted(w for w in by_window if w is not None)
    groups = tuple(KVCacheGroup(tuple(by_window[w][i:i + size]), w)
                   for w in order for i in range(0, len(by_window[w]), size))
    return KVCacheLayout(groups, size, len(windows))


def stacked_block_tables(seqs: list[Sequence]) -> torch.Tensor:
    """int32 `[num_groups, num_seqs, max_blocks]`: every group's block table of each sequence, padded with 0
    (the worker's `block_tables` for a hybrid KV cache; `GroupedBackend.prepare` splits it)."""
    max_blocks = max(len(s.block_table) for s in seqs)
    num_groups = 1 + len(seqs[0].group_block_tables)
    return torch.tensor([[t + [0] * (max_blocks - len(t))
                          for t in (s.block_table if g == 0 else s.group_block_tables[g - 1] for s in seqs)]
                         for g in range(num_groups)], dtype=torch.int32)


class GroupedBackend(AttentionBackend):
    """An attention backend over a hybrid KV cache: each layer is run by `inner` with its own group's block
    table and slots.

    The forward's context carries every group's `block_tables` int32 `[G, B, max_blocks]` and `slot_mapping`
    int64 `[G, T]` (`stacked_block_tables`); `prepare` makes one `ForwardContext` per group (the inner
    backend prepares each once per forward, as it would a plain one) and a layer picks its group's.
    """

    def __init__(self, inner: AttentionBackend, layout: KVCacheLayout):
        super().__init__(inner.kv_caches)
        self.inner, self.layout = inner, layout
        self.name = inner.name
        self._layer_group = layout.layer_group

    def prepare(self, ctx: ForwardContext) -> list[ForwardContext]:
        return [dataclasses.replace(ctx, attn_backend=self.inner, block_tables=ctx.block_tables[g],
                                    slot_mapping=ctx.slot_mapping[g], attn_metadata=None)
                for g in range(self.layout.num_groups)]

    def _group_ctx(self, layer: Attention, ctx: ForwardContext) -> ForwardContext:
        return ctx.attn_metadata[self._layer_group[layer.layer_idx]]

    def store_kv(self, layer: Attention, k, v, ctx: ForwardContext) -> None:
        self.inner.store_kv(layer, k, v, self._group_ctx(layer, ctx))

    def attend(self, layer: Attention, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        return self.inner.attend(layer, q, k, v, self._group_ctx(layer, ctx))

    def forward(self, layer: Attention, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        return self.inner.forward(layer, q, k, v, self._group_ctx(layer, ctx))
