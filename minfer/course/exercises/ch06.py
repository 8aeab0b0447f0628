"""Checks for notebook 06 (continuous batching, chunked prefill).

- `check_plan_step(plan_step)`: one step of a chunked-prefill scheduler under a token budget and a sequence
  budget, compared with what `minfer.scheduler.Scheduler.schedule` decides in the same state.
- `check_padding_waste(padding_waste)`: the share of a static batch's token slots that are padding or waiting,
  compared with `minfer.bench.engine.static_batch_slots`.
"""

from __future__ import annotations

import random

from minfer.course import expect_close, expect_equal, passed


def scheduler_states(prompt_lens: list[int], output_lens: list[int], token_budget: int, max_num_seqs: int,
                     max_steps: int = 200) -> list[tuple[list, list, dict]]:
    """Drive minfer's real `Scheduler` (chunked prefill, a pool with room for everyone, no model) over fake
    requests and record, before every step, the state a scheduler sees and what it decided:
    (running [(request id, tokens it still wants)], waiting [(request id, prompt tokens)], {request id: tokens
    scheduled}). A sequence that finished its prompt gets a fake token per step until its output length."""
    from minfer.block_manager import BlockManager
    from minfer.sampling_params import SamplingParams
    from minfer.scheduler import Scheduler
    from minfer.sequence import Sequence

    bm = BlockManager(num_blocks=4096, block_size=16)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget, enable_chunked_prefill=True)
    outs = {}
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens)):
        seq = Sequence(f"r{i}", 0, [3] * p, SamplingParams(max_tokens=o), max_model_len=4096)
        outs[seq.request_id] = o
        sched.add(seq)
    states = []
    while sched.has_unfinished() and len(states) < max_steps:
        running = [(s.request_id, len(s) - s.num_computed_tokens) for s in sched.running]
        waiting = [(s.request_id, len(s)) for s in sched.waiting]
        batch = sched.schedule()
        states.append((running, waiting, {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)}))
        sched.finish_step(batch)
        for s in list(batch.seqs):
            if s.num_computed_tokens >= len(s):  # the prompt (or the last token) is in the cache: sample one
                s.output_token_ids.append(7)
                if len(s.output_token_ids) >= outs[s.request_id]:
                    sched.remove(s)
    return states


def check_plan_step(plan_step) -> None:
    """`plan_step(running, waiting, token_budget, max_num_seqs) -> {request id: tokens}` must decide every step
    of three simulated workloads exactly as minfer's scheduler does."""
    rng = random.Random(6)
    cases = [([54, 95, 104, 22, 119, 22], [5, 11, 5, 4, 3, 7], 64, 4)]
    for _ in range(2):
        n = rng.randint(4, 8)
        cases.append(([rng.randint(5, 150) for _ in range(n)], [rng.randint(1, 12) for _ in range(n)],
                      rng.choice([32, 48, 96]), rng.choice([2, 3, 5])))
    for prompts, outputs, budget, seqs in cases:
        for step, (running, waiting, want) in enumerate(scheduler_states(prompts, outputs, budget, seqs)):
            got = plan_step(list(running), list(waiting), budget, seqs)
            expect_equal("Exercise 6.1", dict(got or {}), want,
                         what=(f"your plan for step {step} (budget {budget} tokens, {seqs} sequences; running "
                               f"{running}, waiting {waiting})"))
    passed("Exercise 6.1")


def check_padding_waste(padding_waste) -> None:
    """`padding_waste(prompt_lens, output_lens, batch_size) -> float` (0..1) must equal the wasted share of
    `minfer.bench.engine.static_batch_slots`."""
    from minfer.bench.engine import static_batch_slots

    rng = random.Random(0)
    cases = [([81, 68, 37, 70, 81, 46, 36, 86], [21, 22, 12, 27, 36, 29, 39, 8], 4),
             ([10, 10, 10], [5, 5, 5], 2), ([100], [1], 8)]
    for _ in range(3):
        n = rng.randint(3, 20)
        cases.append(([rng.randint(8, 200) for _ in range(n)], [rng.randint(1, 100) for _ in range(n)],
                      rng.choice([2, 4, 16])))
    for prompts, outputs, b in cases:
        want = static_batch_slots(prompts, outputs, b)["wasted_share"]
        expect_close("Exercise 6.2", float(padding_waste(prompts, outputs, b)), want, atol=1e-9,
                     what=f"the wasted share for prompts {prompts}, outputs {outputs}, batches of {b}")
    passed("Exercise 6.2")


def _plan_without_chunks(running, waiting, token_budget, max_num_seqs):
    """Wrong: no chunked prefill, a prompt that does not fit the budget left waits for a later step."""
    plan = {}
    for rid, want in list(running) + list(waiting):
        if len(plan) >= max_num_seqs or want > token_budget:
            break
        plan[rid] = want
        token_budget -= want
    return plan


def _waste_of_prompts_only(prompt_lens, output_lens, batch_size):
    """Wrong: counts the prompts' padding but forgets the rows that wait for the batch's longest output."""
    pad = sum(len(prompt_lens[i:i + batch_size]) * max(prompt_lens[i:i + batch_size])
              for i in range(0, len(prompt_lens), batch_size))
    return 1 - sum(prompt_lens) / pad


WRONG_ANSWERS = {"check_plan_step": _plan_without_chunks, "check_padding_waste": _waste_of_prompts_only}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
