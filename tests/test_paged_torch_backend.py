"""The paged torch backend (minfer/attention/torch_ref.py, the engine's reference attention) against `attend` run on
each sequence alone."""

import random

import pytest
import torch

from minfer.attention.base import Attention, ForwardContext
from minfer.attention.torch_ref import PagedTorchBackend, attend
from minfer.model.positions import alibi_slopes


def _pool_and_tables(lens, bs, kvh, d, seed=0):
    """A shuffled pool holding each sequence's K/V in its own scattered blocks; returns dense copies too."""
    g = torch.Generator().manual_seed(seed)
    nblks = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(nblks) + 3
    kv = torch.randn(2, num_blocks, bs, kvh, d, generator=g)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), max(nblks), dtype=torch.int32)
    dense = []
    for i, (n, nb) in enumerate(zip(lens, nblks)):
        blocks, ids = ids[:nb], ids[nb:]
        tables[i, :nb] = torch.tensor(blocks)
        dense.append((kv[0][blocks].flatten(0, 1)[:n], kv[1][blocks].flatten(0, 1)[:n]))
    return kv, tables, dense


@pytest.mark.parametrize("window,alibi", [(None, False), (7, False), (None, True), (20, True)])
@pytest.mark.parametrize("bs", [1, 16])
def test_decode_groups_equal_attend_per_sequence(window, alibi, bs):
    rng = random.Random(0)
    h, kvh, d = 6, 2, 16
    lens = [rng.randint(1, 90) for _ in range(19)]  # 19 sequences: three groups of at most 8
    kv, tables, dense = _pool_and_tables(lens, bs, kvh, d)
    layer = Attention(0, h, kvh, d, scale=d ** -0.5, sliding_window=window,
                      alibi_slopes=alibi_slopes(h) if alibi else None)
    q = torch.randn(len(lens), h, d)
    # The newest token of each sequence is already in the pool: store() rewrites it with the same values.
    last = torch.stack([dense[i][0][-1] for i in range(len(lens))]), torch.stack([dense[i][1][-1] for i in range(len(lens))])
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)])
    ctx = ForwardContext(attn_backend=PagedTorchBackend([kv]), positions=torch.tensor(lens) - 1,
                         cu_seqlens_q=torch.zeros(1, dtype=torch.int32), slot_mapping=slots, block_tables=tables,
                         context_lens=torch.tensor(lens, dtype=torch.int32))
    out = layer(q, last[0], last[1], ctx)
    for i in range(len(lens)):
        expected = attend(layer, q[i:i + 1], *dense[i])
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-5)
    # A second layer call in the same forward reuses the plan and the workspace and gives the same result.
    torch.testing.assert_close(layer(q, last[0], last[1], ctx), out)
