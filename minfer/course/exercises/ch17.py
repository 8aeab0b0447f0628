"""Checks for notebook 17 (the recap): the output budget under max_model_len (§10), and how many replicas a
set of GPUs makes at a tensor-parallel size (§14)."""

from __future__ import annotations

from minfer.course import expect_equal, passed
from minfer.sampling_params import SamplingParams
from minfer.sequence import validate_prompt
from minfer.serve.router import num_replicas


def _engine_max_new_tokens(max_model_len: int, prompt_len: int) -> int:
    """The largest max_tokens `validate_prompt` accepts (0 when it refuses the prompt itself)."""
    ids = [1] * prompt_len
    best = 0
    for m in (max_model_len - prompt_len, max_model_len - prompt_len + 1):
        if m < 1:
            continue
        try:
            validate_prompt(ids, SamplingParams(max_tokens=m), max_model_len, vocab_size=10)
            best = max(best, m)
        except ValueError:
            pass
    return best


def check_max_new_tokens(max_new_tokens) -> None:
    """`max_new_tokens(max_model_len, prompt_len) -> int` against what minfer's admission rule accepts."""
    for mml, p in ((4096, 3000), (2048, 39), (4096, 4095), (4096, 4096), (512, 600)):
        expect_equal("Exercise 17.1", int(max_new_tokens(mml, p)), _engine_max_new_tokens(mml, p),
                     what=f"the budget for a {p}-token prompt under max_model_len={mml}")
    passed("Exercise 17.1")


def check_replicas(replicas) -> None:
    """`replicas(num_gpus, tp_size) -> int` against `minfer.serve.router.num_replicas`."""
    for gpus, tp in ((8, 1), (8, 2), (8, 4), (8, 8), (16, 4), (4, 4)):
        got = replicas(gpus, tp)
        if not isinstance(got, int):
            raise AssertionError(f"Exercise 17.2: a count of replicas is a whole number (int), got {got!r}")
        expect_equal("Exercise 17.2", got, num_replicas(gpus, tp), what=f"the replicas of {gpus} GPUs at TP={tp}")
    for gpus, tp in ((8, 3), (6, 4)):
        try:
            got = replicas(gpus, tp)
        except ValueError:
            continue
        raise AssertionError(f"Exercise 17.2: {gpus} GPUs at TP={tp} leave GPUs idle (TP must divide the GPUs, "
                             f"as minfer's num_replicas says); raise ValueError instead of returning {got!r}")
    passed("Exercise 17.2")


WRONG_ANSWERS = {
    "check_max_new_tokens": lambda mml, p: mml - p,        # negative for a prompt longer than the budget
    "check_replicas": lambda gpus, tp: gpus // 2,           # ignores the TP size
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
