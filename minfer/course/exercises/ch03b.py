"""Checks for notebook 03b (long context): which blocks a sliding window lets a sequence free, and how many it
still holds.

The reference is minfer's own books: `first_visible_block` and `BlockManager.free_out_of_window` /
`num_live_blocks` (`minfer/block_manager.py`), driven on a real `Sequence`.
"""

from __future__ import annotations

from minfer.block_manager import BlockManager, first_visible_block
from minfer.course import expect_equal, passed
from minfer.sampling_params import SamplingParams
from minfer.sequence import Sequence

CASES = [(q, w, bs) for bs in (1, 4, 16) for w in (1, 7, 15, 16, 17, 32) for q in (0, 1, 15, 16, 17, 31, 32, 33, 47, 100)]


def _live_after(num_tokens: int, window: int, block_size: int) -> tuple[int, int]:
    """(blocks freed, blocks still held) when minfer's block manager has computed `num_tokens` tokens."""
    bm = BlockManager(num_blocks=256, block_size=block_size)
    seq = Sequence("r", 0, list(range(max(num_tokens, 1))), SamplingParams(max_tokens=1), max_model_len=4096)
    bm.append_slots(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    freed = bm.free_out_of_window(seq, window)
    return freed, bm.num_live_blocks(seq)


def check_dead_blocks(dead_blocks) -> None:
    """`dead_blocks(num_computed_tokens, window, block_size) -> int`: how many leading blocks no later query
    can read (the next query sits at position num_computed_tokens and sees the newest `window` keys)."""
    for q, w, bs in CASES:
        expect_equal("Exercise 3b.1", dead_blocks(q, w, bs), first_visible_block(q, w, bs),
                     what=f"dead_blocks({q}, window={w}, block_size={bs})")
        freed, _ = _live_after(q, w, bs)
        expect_equal("Exercise 3b.1", dead_blocks(q, w, bs), min(freed, -(-q // bs)),
                     what=f"dead_blocks({q}, window={w}, block_size={bs}) against free_out_of_window")
    passed("Exercise 3b.1")


def check_live_blocks(live_blocks) -> None:
    """`live_blocks(num_tokens, window, block_size) -> int`: the blocks a sequence of `num_tokens` computed
    tokens still holds after freeing behind its window (the KV a window keeps)."""
    for q, w, bs in CASES:
        _, live = _live_after(q, w, bs)
        expect_equal("Exercise 3b.2", live_blocks(q, w, bs), live,
                     what=f"live_blocks({q}, window={w}, block_size={bs})")
    passed("Exercise 3b.2")


WRONG_ANSWERS = {
    # off by one at the window's edge: the key at q - W + 1 is still visible
    "check_dead_blocks": lambda q, w, bs: max(q - w, 0) // bs,
    # "the window's worth of blocks": forgets the block straddling the window's start, and short sequences
    "check_live_blocks": lambda q, w, bs: -(-w // bs),
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
