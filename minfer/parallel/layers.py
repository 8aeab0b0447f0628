"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053; vLLM's `linear.py` and
`vocab_parallel_embedding.py`): each rank holds a slice of a weight matrix, and one all-reduce per block
puts the partial results together.

    column-parallel  W [out, in] split by rows (output features): rank r computes y[:, r-th slice]. No
                     communication: the next layer consumes the slice.            q|k|v, gate|up, lm_head
    row-parallel     W [out, in] split by columns (input features): rank r computes x[:, r-th slice] W_r^T,
                     a partial sum of the whole y; an all-reduce adds the tp parts.  o_proj, down_proj

A Llama block is column -> (attention on the rank's heads | SiLU on the rank's columns) -> row, so the only
communication is one all-reduce after attention and one after the MLP (Megatron's layout).

Each class is a `minfer.model.layers.Linear` built with its local shape, so any `LinearMethod` (the CPU
layouts, int8, int4) stores and multiplies the shard exactly as it would the whole matrix. Only the
`weight_loader` differs: it cuts the rank's slice out of the full checkpoint tensor before the method's
loader copies it in (the nano-vllm / vLLM pattern). With one rank every class is its plain layer.
"""

from __future__ import annotations

import torch
from torch import nn

from minfer.model.layers import Linear, LinearMethodBase, default_weight_loader
from minfer.parallel.parallel_state import (
    get_parallel_state,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def divide(n: int, d: int, what: str) -> int:
    """n / d, or ValueError naming `what` when d does not divide n."""
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class ColumnParallelLinear(Linear):
    """y_r = x W_r^T + b_r with W's output rows split over the TP ranks: input `[..., in]` (the whole x, as
    every rank has it), output `[..., out/tp]` (this rank's columns of y), or `[..., out]` with
    `gather_output` (an all-gather).

    `output_sizes` (merged projections such as gate|up): each part is split separately, so rank r holds
    gate_r|up_r and `silu(gate_r) * up_r` is this rank's slice of the activation.

    Raises:
        ValueError: a part whose size does not divide by tensor_parallel_size.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 method: LinearMethodBase | str | None = None, gather_output: bool = False):
        st = get_parallel_state()
        self.tp_rank, self.tp_size, self.gather_output = st.tp_rank, st.tp_size, gather_output
        self.full_output_sizes = list(output_sizes)
        local = [divide(s, st.tp_size, "an output size") for s in output_sizes]
        super().__init__(in_features, bias=bias, output_sizes=local, method=method)

    def shard_offset(self, shard: int) -> int:
        """Row of the full checkpoint part `shard` where this rank's slice starts."""
        return self.tp_rank * self.output_sizes[shard]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Checkpoint part `shard` (`[full_out_part, in]` or a bias `[full_out_part]`) -> this rank's rows."""
        s = shard or 0
        if loaded.shape[0] != self.full_output_sizes[s]:
            raise ValueError(f"shape mismatch: checkpoint part {tuple(loaded.shape)}, expected "
                             f"{self.full_output_sizes[s]} rows before the tensor-parallel split")
        super().weight_loader(param, loaded.narrow(0, self.shard_offset(s), self.output_sizes[s]), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return tensor_model_parallel_all_gather(y) if self.gather_output else y


def MergedColumnParallelLinear(in_features: int, output_sizes: list[int], bias: bool = False,
                               method: LinearMethodBase | str | None = None) -> ColumnParallelLinear:
    """gate|up as one column-parallel matmul (each part split over the ranks)."""
    return ColumnParallelLinear(in_features, output_sizes, bias=bias, method=method)


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v split by attention heads: rank r gets `num_heads/tp` query heads and `num_kv_heads/tp` KV heads,
    so its attention runs on its heads alone. When there are fewer KV heads than ranks (GQA), each KV head is
    replicated on `tp/num_kv_heads` ranks, as vLLM does: rank r holds KV head `r // (tp/num_kv_heads)`,
    the one its query heads read.

    Attributes: num_heads, num_kv_heads (this rank's), head_dim.

    Raises:
        ValueError: num_heads not divisible by tp, or num_kv_heads neither a multiple nor a divisor of tp.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 method: LinearMethodBase | str | None = None):
        st = get_parallel_state()
        tp = st.tp_size
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = st.tp_rank * self.num_kv_heads
        else:
            replicas = divide(tp, num_kv_heads, "tensor_parallel_size, with fewer KV heads than ranks,") \
                if tp % num_kv_heads == 0 else None
            if replicas is None:
                raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide tensor_parallel_size ({tp}) "
                                 "when it is smaller (each KV head is then replicated on tp/num_kv_heads ranks)")
            self.num_kv_heads, self.kv_head_start = 1, st.tp_rank // replicas
        self.head_dim = head_dim
        self.full_output_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.tp_rank, self.tp_size, self.gather_output = st.tp_rank, tp, False
        local = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        Linear.__init__(self, hidden_size, bias=bias, output_sizes=local, method=method)

    def shard_offset(self, shard: int) -> int:
        if shard == 0:
            return self.tp_rank * self.output_sizes[0]
        return self.kv_head_start * self.head_dim


class RowParallelLinear(Linear):
    """y = all_reduce(x_r W_r^T) + b with W's input columns split: input `[..., in/tp]` (this rank's slice,
    what a column-parallel layer or this rank's heads produced), output `[..., out]`, the same on every rank.

    The bias is added once: rank 0 holds it and the other ranks hold zeros, so the all-reduce sums it once.

    Raises:
        ValueError: in_features not divisible by tensor_parallel_size.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethodBase | str | None = None, reduce_results: bool = True):
        st = get_parallel_state()
        self.tp_rank, self.tp_size, self.reduce_results = st.tp_rank, st.tp_size, reduce_results
        self.full_in_features = in_features
        super().__init__(divide(in_features, st.tp_size, "an input size"), out_features, bias=bias, method=method)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        """The weight `[out, in]` -> this rank's columns `[out, in/tp]`; the bias whole on rank 0, zeros elsewhere."""
        if loaded.dim() == 1:
            super().weight_loader(param, loaded if self.tp_rank == 0 else torch.zeros_like(loaded), shard)
            return
        if loaded.shape[1] != self.full_in_features:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, expected "
                             f"{self.full_in_features} columns before the tensor-parallel split")
        super().weight_loader(param, loaded.narrow(1, self.tp_rank * self.in_features, self.in_features), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return tensor_model_parallel_all_reduce(y) if self.reduce_results else y


class ParallelLMHead(ColumnParallelLinear):
    """The LM head, column-parallel over the vocabulary: rank r holds rows `[r*V_p, (r+1)*V_p)` of the
    `[vocab, hidden]` table, `V_p = ceil(vocab/tp)`; the last rank's rows past the vocabulary are zeros
    (padding, so every rank's shard has one shape). `forward` gathers the logits `[..., vocab]`."""

    def __init__(self, vocab_size: int, hidden_size: int, method: LinearMethodBase | str | None = None):
        st = get_parallel_state()
        self.vocab_size = vocab_size
        per = -(-vocab_size // st.tp_size)
        self.vocab_start = st.tp_rank * per
        self.num_real_rows = max(0, min(per, vocab_size - self.vocab_start))
        super().__init__(hidden_size, [per * st.tp_size], bias=False, method=method, gather_output=True)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, expected {self.vocab_size} rows")
        rows = self.output_sizes[0]
        part = loaded.new_zeros((rows, *loaded.shape[1:]))
        part[:self.num_real_rows] = loaded[self.vocab_start:self.vocab_start + self.num_real_rows]
        Linear.weight_loader(self, param, part, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., :self.vocab_size]


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the vocabulary like `ParallelLMHead`: each rank looks up the ids in its
    range, writes zeros for the others, and an all-reduce assembles `[num_tokens, hidden]`.

    `tied_head`: read the table from that `ParallelLMHead` (tie_word_embeddings: one table for both, read
    through `Linear.weight_rows` whatever the head's layout), instead of holding a `weight` of its own.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tied_head: ParallelLMHead | None = None):
        super().__init__()
        st = get_parallel_state()
        self.tp_size, self.vocab_size = st.tp_size, vocab_size
        self.per = -(-vocab_size // st.tp_size)
        self.vocab_start = st.tp_rank * self.per
        self.num_real_rows = max(0, min(self.per, vocab_size - self.vocab_start))
        if tied_head is not None:
            self.lm_head = [tied_head]  # a list, so the head is not registered (and loaded) twice
            tied_head.keep_rows = True
        else:
            self.lm_head = None
            self.weight = nn.Parameter(torch.empty(self.per, hidden_size), requires_grad=False)
            self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, expected {self.vocab_size} rows")
        part = loaded.new_zeros((self.per, *loaded.shape[1:]))
        part[:self.num_real_rows] = loaded[self.vocab_start:self.vocab_start + self.num_real_rows]
        default_weight_loader(param, part)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head[0].weight_rows(ids)
        return self.weight[ids]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids `[T]` int64 -> `[T, hidden]`."""
        if self.tp_size == 1:
            return self._rows(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_real_rows)
        x = self._rows(local.masked_fill(outside, 0))
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(x.contiguous())
