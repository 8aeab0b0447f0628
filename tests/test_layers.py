"""`Linear`'s decode layouts (K-major or not, split into column slices) compute exactly what nn.Linear does."""

import pytest
import torch
import torch.nn.functional as F

from minfer.model.layers import Linear, TiedEmbedding, process_weights_after_loading


@pytest.mark.parametrize("in_f,out_f", [(16, 48), (48, 16), (24, 24), (10, 15)])
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7])
def test_repacked_linear_equals_f_linear(in_f, out_f, splits, bias, tokens):
    torch.manual_seed(0)
    lin = Linear(in_f, out_f, bias=bias)
    w, b = torch.randn(out_f, in_f), torch.randn(out_f)
    lin.weight_loader(lin.weight, w)
    if bias:
        lin.weight_loader(lin.bias, b)
    x = torch.randn(tokens, in_f)
    expected = F.linear(x, w, b if bias else None)
    torch.testing.assert_close(lin(x), expected)
    lin.process_weights_after_loading(splits)
    assert lin.k_major == (out_f >= in_f)
    assert lin.splits == (splits if out_f % splits == 0 else 1)
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x.view(1, tokens, in_f)), expected.view(1, tokens, out_f), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, out_f - 1, out_f // 2, 1])
    assert torch.equal(lin.weight_rows(ids), w[ids])
    with pytest.raises(RuntimeError, match="already repacked"):
        lin.process_weights_after_loading(splits)


def test_merged_parts_land_in_their_rows_and_tied_embedding_reads_the_head():
    torch.manual_seed(0)
    parts = [torch.randn(6, 8), torch.randn(4, 8), torch.randn(2, 8)]
    lin = Linear(8, output_sizes=[6, 4, 2])
    for i, p in enumerate(parts):
        lin.weight_loader(lin.weight, p, i)
    emb = TiedEmbedding(lin)
    full = torch.cat(parts)
    process_weights_after_loading(lin)
    assert lin.splits == max(1, torch.get_num_threads()) or lin.splits == 1
    x = torch.randn(3, 8)
    torch.testing.assert_close(lin(x), x @ full.T, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[0, 11], [5, 6]])
    assert torch.equal(emb(ids), full[ids])
    assert torch.equal(emb.weight, full)
    with pytest.raises(RuntimeError, match="before process_weights_after_loading"):
        lin.weight_loader(lin.weight, parts[0], 0)
