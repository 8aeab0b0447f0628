"""Checks for notebook 12b (replicas behind a router): replicas from GPUs and TP size, prefix-aware routing."""

from __future__ import annotations

import random

from minfer.course import expect_equal, passed
from minfer.serve.router import PrefixAwarePolicy, num_replicas


def check_replicas(answer) -> None:
    """`answer(num_gpus, tensor_parallel_size, pipeline_parallel_size)` gives minfer's `num_replicas`, and
    raises ValueError where devices would sit idle."""
    for gpus, tp, pp in [(8, 2, 1), (8, 1, 1), (8, 4, 1), (8, 2, 2), (16, 8, 1), (4, 4, 1), (24, 3, 2)]:
        got = answer(gpus, tp, pp)
        if not isinstance(got, int):
            raise AssertionError(f"Exercise 12b.1: a count of replicas is a whole number (int), got {got!r}")
        expect_equal("Exercise 12b.1", got, num_replicas(gpus, tp, pp), what=f"replicas for {gpus} GPUs, TP={tp}, PP={pp}")
    for gpus, tp, pp in [(8, 3, 1), (6, 2, 2)]:
        try:
            got = answer(gpus, tp, pp)
        except ValueError:
            continue
        raise AssertionError(f"Exercise 12b.1: {gpus} GPUs with TP={tp}, PP={pp} leave devices idle; raise "
                             f"ValueError instead of returning {got!r}")
    passed("Exercise 12b.1")


def _workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(40)] for _ in range(6)]
    prompts = []
    for _ in range(40):
        if rng.random() < 0.15:  # a prompt shorter than one block: nothing to cache, routed by load
            prompts.append([rng.randrange(1000) for _ in range(rng.randrange(1, 16))])
        else:
            prompts.append(systems[rng.randrange(len(systems))] + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))])
    return prompts


def check_route(answer) -> None:
    """`answer(prompts, num_replicas, block_size, num_prefix_blocks)` routes like minfer's `PrefixAwarePolicy`
    when no request is in flight (load 0 everywhere)."""
    for n, block_size, blocks in [(2, 16, 2), (3, 16, 2), (4, 8, 1)]:
        prompts = _workload(n)
        policy = PrefixAwarePolicy(block_size=block_size, num_prefix_blocks=blocks)
        want = [policy.choose(p, [0] * n, list(range(n))) for p in prompts]
        got = list(answer(prompts, n, block_size, blocks))
        expect_equal("Exercise 12b.2", got, want,
                     what=f"the replicas chosen ({n} replicas, blocks of {block_size}, {blocks} prefix blocks)")
    passed("Exercise 12b.2")


WRONG_ANSWERS = {
    "check_replicas": lambda gpus, tp, pp=1: gpus // tp,  # forgets PP and never refuses an idle split
    "check_route": lambda prompts, n, block_size=16, num_prefix_blocks=2: [hash(tuple(p)) % n for p in prompts],
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
