"""Checks for notebook 12 (tensor and pipeline parallelism).

- `check_tp_mlp(tp_mlp)`: the per-rank partial outputs of a column-parallel then row-parallel MLP, compared with
  what minfer's `ColumnParallelLinear` / `RowParallelLinear` shards compute, and their sum (the all-reduce)
  with the unsplit MLP.
- `check_gpipe_schedule(gpipe_events)`: a GPipe schedule of p stages and m micro-batches as timeline events,
  checked for its dependencies and measured with `minfer.parallel.timeline.bubble_fraction` against
  `gpipe_bubble(p, m)` = (p - 1) / (m + p - 1).
"""

from __future__ import annotations

from minfer.course import expect_close, expect_equal, passed


def _minfer_shards(W1, W2, rank: int, tp: int):
    """Rank `rank`'s shards of W1 (column-parallel) and W2 (row-parallel), cut by minfer's weight loaders."""
    from minfer.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from minfer.parallel.parallel_state import ParallelState, set_parallel_state

    prev = set_parallel_state(ParallelState(tp_size=tp, tp_rank=rank))
    try:
        col = ColumnParallelLinear(W1.shape[1], [W1.shape[0]], method="nn")
        row = RowParallelLinear(W2.shape[1], W2.shape[0], method="nn")
    finally:
        set_parallel_state(prev)
    col.weight_loader(col.weight, W1)
    row.weight_loader(row.weight, W2)
    return col.weight.data, row.weight.data


def check_tp_mlp(tp_mlp) -> None:
    """`tp_mlp(x, W1, W2, tp) -> [partial output of rank 0, ..., rank tp-1]` for y = relu(x W1^T) W2^T."""
    import torch

    g = torch.Generator().manual_seed(12)
    for tp, (hidden, inter, tokens) in ((2, (16, 64, 3)), (4, (8, 32, 5)), (2, (12, 24, 1))):
        W1 = torch.randn(inter, hidden, generator=g)
        W2 = torch.randn(hidden, inter, generator=g)
        x = torch.randn(tokens, hidden, generator=g)
        partials = list(tp_mlp(x, W1, W2, tp))
        expect_equal("Exercise 12.1", len(partials), tp, what=f"the number of partial outputs at tp={tp}")
        for r, got in enumerate(partials):
            w1, w2 = _minfer_shards(W1, W2, r, tp)
            want = torch.relu(x @ w1.T) @ w2.T
            expect_close("Exercise 12.1", got, want, atol=1e-4,
                         what=f"rank {r}'s partial output (tp={tp}; it holds W1 rows and W2 columns "
                              f"{r * inter // tp}..{(r + 1) * inter // tp - 1})")
        expect_close("Exercise 12.1", sum(partials), torch.relu(x @ W1.T) @ W2.T, atol=1e-4,
                     what=f"the all-reduced sum of the partials (tp={tp})")
    passed("Exercise 12.1")


def check_gpipe_schedule(gpipe_events) -> None:
    """`gpipe_events(p, m) -> [{"stage", "micro_batch", "start", "end"}, ...]`: every stage runs every
    micro-batch once, for one time unit, in order; stage s starts micro-batch i only after stage s - 1 has
    finished it, and as early as that allows. Its idle share must be GPipe's (p - 1) / (m + p - 1)."""
    from minfer.parallel.timeline import bubble_fraction, gpipe_bubble

    for p, m in ((2, 1), (2, 4), (3, 3), (4, 8), (5, 2)):
        ev = [dict(e) for e in gpipe_events(p, m)]
        pairs = sorted((e["stage"], e["micro_batch"]) for e in ev)
        expect_equal("Exercise 12.2", pairs, [(s, i) for s in range(p) for i in range(m)],
                     what=f"the (stage, micro_batch) pairs of your schedule for p={p}, m={m}")
        at = {(e["stage"], e["micro_batch"]): e for e in ev}
        for (s, i), e in at.items():
            expect_close("Exercise 12.2", e["end"] - e["start"], 1.0, what=f"the length of stage {s}, micro-batch {i}")
            ready = max(at[(s - 1, i)]["end"] if s else 0.0, at[(s, i - 1)]["end"] if i else 0.0)
            expect_close("Exercise 12.2", e["start"], ready,
                         what=(f"the start of stage {s}, micro-batch {i} (as soon as its input is ready, from "
                               f"stage {s - 1} or the batch, and stage {s} is free)"))
        full = [dict(step=1, tp_rank=0, num_tokens=1, **{k: e[k] for k in ("stage", "micro_batch", "start", "end")})
                for e in ev]
        expect_close("Exercise 12.2", bubble_fraction(full), gpipe_bubble(p, m), atol=1e-9,
                     what=f"the idle share of your schedule for p={p}, m={m}")
    passed("Exercise 12.2")


def _partials_without_activation(x, W1, W2, tp):
    """Wrong: leaves the activation for after the all-reduce, so each partial is linear in its slice."""
    n = W1.shape[0] // tp
    return [(x @ W1[r * n:(r + 1) * n].T) @ W2[:, r * n:(r + 1) * n].T for r in range(tp)]


def _all_stages_at_once(p, m):
    """Wrong: every stage starts micro-batch 0 at time 0, as if it did not need the previous stage's output."""
    return [dict(stage=s, micro_batch=i, start=float(i), end=float(i + 1)) for s in range(p) for i in range(m)]


WRONG_ANSWERS = {"check_tp_mlp": _partials_without_activation, "check_gpipe_schedule": _all_stages_at_once}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
