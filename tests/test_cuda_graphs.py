"""CUDA graphs of decode steps (minfer/cuda_graphs.py, issue 31).

On any machine: the capture sizes and padding, which steps the graphs cover, and the static inputs: a decode
step run on the padded static buffers (what a replay reads) gives the eager step's hidden states for the real
rows and leaves the KV pool exactly as the eager step does (padding rows store nothing), with the Triton
backend (on the CPU under Triton's interpreter). A runner built off CUDA covers nothing.

On CUDA only (skipped elsewhere): a greedy decode through graph replays equals the eager one token for token,
over batch sizes that need padding, and steps the graphs do not cover come back as None.
"""

from __future__ import annotations

import pytest
import torch

from minfer.attention import ForwardContext, PagedTorchBackend
from minfer.attention.triton import TritonBackend
from minfer.cuda_graphs import CudaGraphRunner, StaticInputs, capturable, capture_batch_sizes, covers, padded_batch_size
from minfer.kernels import interpreter_active

BLOCK = 4


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(256)[-3:] == [240, 248, 256] and len(capture_batch_sizes(256)) == 35
    assert capture_batch_sizes(16, sizes=[4, 1, 4, 64]) == [1, 4]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_batch_sizes(0)
    with pytest.raises(ValueError, match="capture sizes"):
        capture_batch_sizes(8, sizes=[0, 2])


def test_padded_batch_size():
    sizes = capture_batch_sizes(20)  # 1 2 4 8 16 20
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert padded_batch_size(21, sizes) is None


def decode_ctx(backend, tables: list[list[int]], positions: list[int], width: int | None = None) -> ForwardContext:
    """A pure decode step: sequence i's new token at `positions[i]`, its blocks `tables[i]`."""
    width = width or max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, positions)]
    return ForwardContext(attn_backend=backend, positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                          block_tables=bt, context_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32),
                          logits_indices=torch.arange(len(tables)))


def test_covers_only_pure_decode_steps_that_fit():
    backend = object.__new__(PagedTorchBackend)
    backend.prepare = lambda ctx: None
    ctx = decode_ctx(backend, [[0, 1], [2]], [5, 2])
    assert covers(ctx, 2, max_size=4, max_blocks_per_seq=2)
    assert not covers(ctx, 2, max_size=1, max_blocks_per_seq=2)  # more sequences than the largest graph
    assert not covers(ctx, 2, max_size=4, max_blocks_per_seq=1)  # a wider block table than the static one
    assert not covers(ctx, 3, max_size=4, max_blocks_per_seq=2)  # more tokens than sequences (spec decode)
    prefill = ForwardContext(attn_backend=backend, positions=torch.arange(3), num_prefills=1, num_prefill_tokens=3,
                             block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             context_lens=torch.tensor([3], dtype=torch.int32))
    assert not covers(prefill, 3, max_size=4, max_blocks_per_seq=2)
    hybrid = decode_ctx(backend, [[0], [1]], [0, 0])
    hybrid.block_tables = hybrid.block_tables.unsqueeze(0)  # the hybrid cache's [G, B, W]
    assert not covers(hybrid, 2, max_size=4, max_blocks_per_seq=2)


def test_static_fill_pads_and_overwrites_stale_rows():
    backend = object.__new__(PagedTorchBackend)
    backend.prepare = lambda ctx: None
    st = StaticInputs.allocate(8, 5, "cpu")
    big = decode_ctx(backend, [[i, i + 1] for i in range(6)], [6] * 6)
    st.fill(torch.arange(10, 16), big, 8)
    small = decode_ctx(backend, [[3], [4, 9, 7]], [1, 9])
    st.fill(torch.tensor([7, 8]), small, 4)  # rows 2, 3 held the big step's tokens: now padding
    assert st.input_ids[:4].tolist() == [7, 8, 0, 0] and st.positions[:4].tolist() == [1, 9, 0, 0]
    assert st.slot_mapping[:4].tolist() == [3 * BLOCK + 1, 7 * BLOCK + 1, -1, -1]
    assert st.context_lens[:4].tolist() == [2, 10, 0, 0]
    assert st.block_tables[:2, :3].tolist() == [[3, 0, 0], [4, 9, 7]]
    ctx = st.context(backend, 4)
    assert ctx.num_prefills == 0 and ctx.positions.data_ptr() == st.positions.data_ptr()
    assert ctx.block_tables.shape == (4, 5)


def test_runner_off_cuda_covers_nothing():
    model = torch.nn.Linear(2, 2)
    backend = object.__new__(TritonBackend)
    runner = CudaGraphRunner.build(model, backend, max_num_seqs=4, max_blocks_per_seq=2)
    assert runner.sizes == [] and "not CUDA" in runner.why_not
    assert runner.run(torch.zeros(1, dtype=torch.long), decode_ctx(backend, [[0]], [0])) is None
    assert capturable(backend) and not capturable(object.__new__(PagedTorchBackend))


# -- a tiny random Llama over a paged pool ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from minfer.bench.parallel import save_random_llama

    return save_random_llama(tmp_path_factory.mktemp("llama"), layers=2, hidden=64, heads=4, kv_heads=2,
                             intermediate=128, vocab=64, max_positions=64)


def load_tiny(path, device, dtype):
    from minfer.model.loader import load_model

    loaded = load_model(path, dtype=dtype, device=device, fused_ops=False)
    cfg = loaded.config
    num_blocks = 40
    pools = [torch.randn(2, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype,
                         generator=torch.Generator().manual_seed(i)).to(device) for i in range(cfg.num_hidden_layers)]
    return loaded.model, pools


def on(ctx: ForwardContext, device) -> ForwardContext:
    for name in ("positions", "slot_mapping", "block_tables", "context_lens", "logits_indices"):
        setattr(ctx, name, getattr(ctx, name).to(device))
    return ctx


@pytest.mark.skipif(not interpreter_active(), reason="needs Triton's interpreter on the CPU")
def test_padded_static_step_equals_eager_step_on_the_cpu(tiny_llama_dir):
    """What a replay computes, without a GPU: the model over the padded static buffers (3 sequences padded
    to 4, a static block table wider than the step's) against the same step eagerly."""
    model, pools = load_tiny(tiny_llama_dir, "cpu", torch.float32)
    tables, positions = [[5, 6, 7], [11], [20, 3]], [9, 2, 4]
    ids = torch.tensor([3, 17, 42])
    eager_pools = [p.clone() for p in pools]
    eager_backend = TritonBackend(eager_pools)
    with torch.inference_mode():
        want = model(ids, decode_ctx(eager_backend, tables, positions))
        backend = TritonBackend(pools)
        st = StaticInputs.allocate(8, 6, "cpu")
        st.fill(torch.arange(30, 38), decode_ctx(backend, [[1, 2]] * 8, [6] * 8), 8)  # stale rows to pad over
        st.fill(ids, decode_ctx(backend, tables, positions), 4)
        got = model(st.input_ids[:4], st.context(backend, 4))
    torch.testing.assert_close(got[:3], want, rtol=2e-4, atol=2e-4)
    assert got[3].isfinite().all()
    for a, b in zip(pools, eager_pools):  # the padding row stored nothing (slot -1)
        assert torch.equal(a, b)


# -- on CUDA: replay against eager, token for token --------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def greedy_decode(model, backend, prompts: list[list[int]], steps: int, step_fn) -> list[list[int]]:
    """Feed each prompt one token per step (every step a pure decode step), then `steps` greedy tokens.
    Sequence i owns blocks [8i, 8i + 8). `step_fn(ids, ctx)` returns the hidden states."""
    device = backend.kv_caches[0].device
    seqs = [list(p) for p in prompts]
    done = [0] * len(seqs)  # tokens whose K/V are stored
    target = [len(p) + steps for p in prompts]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(seqs))]
    while any(d < t for d, t in zip(done, target)):
        rows = [i for i in range(len(seqs)) if done[i] < target[i]]
        ids = torch.tensor([seqs[i][done[i]] for i in rows], device=device)
        ctx = on(decode_ctx(backend, [tables[i] for i in rows], [done[i] for i in rows]), device)
        hidden = step_fn(ids, ctx)
        nxt = model.compute_logits(hidden).argmax(-1).tolist()
        for i, t in zip(rows, nxt):
            done[i] += 1
            if done[i] == len(seqs[i]) and len(seqs[i]) < target[i]:
                seqs[i].append(t)
    return seqs


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_token_for_token(tiny_llama_dir, dtype):
    model, pools = load_tiny(tiny_llama_dir, "cuda", dtype)
    prompts = [[3, 9, 4], [7, 7, 1, 2, 8], [5], [11, 12]]  # 4, 3, 2 then 1 sequences: padded to 4, 4, 2, 1
    eager_backend = TritonBackend([p.clone() for p in pools])
    graph_backend = TritonBackend(pools)
    with torch.inference_mode():
        want = greedy_decode(model, eager_backend, prompts, 12, lambda ids, ctx: model(ids, ctx))
        runner = CudaGraphRunner.build(model, graph_backend, max_num_seqs=4, max_blocks_per_seq=8, sizes=[1, 2, 4])
        assert runner.sizes == [1, 2, 4], runner.why_not
        replays = []

        def step(ids, ctx):
            out = runner.run(ids, ctx)
            assert out is not None
            replays.append(ids.shape[0])
            return out.clone()

        got = greedy_decode(model, graph_backend, prompts, 12, step)
    assert got == want
    assert 3 in replays and 1 in replays  # padded (3 -> 4) and exact sizes both replayed


@cuda_only
def test_runner_declines_what_it_does_not_cover(tiny_llama_dir):
    model, pools = load_tiny(tiny_llama_dir, "cuda", torch.float32)
    backend = TritonBackend(pools)
    with torch.inference_mode():
        runner = CudaGraphRunner.build(model, backend, max_num_seqs=2, max_blocks_per_seq=2)
        assert runner.sizes == [1, 2]
        ids = torch.tensor([1, 2, 3], device="cuda")
        assert runner.run(ids, on(decode_ctx(backend, [[0], [1], [2]], [0, 0, 0]), "cuda")) is None  # 3 > 2
        wide = on(decode_ctx(backend, [[0, 1, 2]], [9]), "cuda")
        assert runner.run(ids[:1], wide) is None  # wider than the static table
        other = on(decode_ctx(TritonBackend(pools), [[0]], [0]), "cuda")
        assert runner.run(ids[:1], other) is None  # another backend (another pool)
        torch_backend = PagedTorchBackend(pools)
        assert CudaGraphRunner.build(model, torch_backend, max_num_seqs=2, max_blocks_per_seq=2).sizes == []
