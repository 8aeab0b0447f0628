"""Checks for notebook 03 (the paged KV cache): blocks a sequence needs, the slot of a token, and the time to
move a sequence's KV against recomputing it.

The references are minfer's own: `BlockManager.blocks_needed` and `append_slots` (`minfer/block_manager.py`),
and `PagedTorchBackend.store` / `gather` (`minfer/attention/torch_ref.py`), which write through the slot
mapping and read back through the block table.
"""

from __future__ import annotations

import torch

from minfer.attention.torch_ref import PagedTorchBackend
from minfer.block_manager import BlockManager
from minfer.course import expect_equal, passed
from minfer.sampling_params import SamplingParams
from minfer.sequence import Sequence


def check_blocks_needed(blocks_needed) -> None:
    """`blocks_needed(num_tokens, block_size) -> int`: the blocks a sequence of that many tokens holds."""
    for bs in (1, 4, 16, 32):
        bm = BlockManager(num_blocks=64, block_size=bs)
        for n in (0, 1, bs - 1, bs, bs + 1, 3 * bs, 3 * bs + 1, 100):
            if bm.blocks_needed(n) > 64:
                continue
            seq = Sequence("r", 0, list(range(max(n, 1))), SamplingParams(max_tokens=1), max_model_len=4096)
            bm.append_slots(seq, n)  # what the engine does: grow the table for n tokens
            expect_equal("Exercise 3.1", blocks_needed(n, bs), len(seq.block_table),
                         what=f"blocks_needed({n}, block_size={bs})")
            bm.free_seq(seq)
    passed("Exercise 3.1")


def check_slot(slot) -> None:
    """`slot(block_table, t, block_size) -> int`: the flat pool index token t of a sequence is written to.
    Checked by writing each token's number through your slots with minfer's `store` and reading the sequence
    back with minfer's `gather`, which follows the block table."""
    for bs, table, length in ((16, [7, 2, 9, 0], 57), (4, [3, 1, 6, 5, 0, 2], 23), (1, [4, 0, 2, 1, 3], 5)):
        nb = max(table) + 1
        pool = torch.full((2, nb, bs, 1, 1), -1.0)
        slots = torch.tensor([slot(table, t, bs) for t in range(length)], dtype=torch.long)
        if slots.min() < 0 or slots.max() >= nb * bs:
            raise AssertionError(f"Exercise 3.2: slots {slots.tolist()[:8]}... fall outside a pool of {nb * bs}")
        vals = torch.arange(length, dtype=torch.float32).view(length, 1, 1)
        PagedTorchBackend.store(pool, vals, vals, slots)
        back = PagedTorchBackend.gather(pool[0], torch.tensor(table), length).flatten()
        expect_equal("Exercise 3.2", back.long().tolist(), list(range(length)),
                     what=f"the tokens read back through block table {table} (block_size {bs})")
    passed("Exercise 3.2")


def check_move_vs_recompute(seconds) -> None:
    """`seconds(num_tokens, kv_bytes_per_token, flops_per_token, link_bytes_per_s, device_flops) ->
    (move_s, recompute_s)`: moving a sequence's KV out and back in over a link (two transfers) against
    recomputing its prefill (num_tokens × flops_per_token at device_flops)."""
    cases = [(4096, 46080, 2 * 135e6, 64e9, 100e12), (32768, 131072, 2 * 8e9, 7e9, 400e12), (1, 1000, 1e6, 1e9, 1e12)]
    for n, b, f, link, dev in cases:
        move, rec = seconds(n, b, f, link, dev)
        exp_move, exp_rec = 2 * n * b / link, n * f / dev
        for what, got, exp in (("move_s", move, exp_move), ("recompute_s", rec, exp_rec)):
            if abs(got - exp) > 1e-9 + 1e-6 * exp:
                raise AssertionError(f"Exercise 3.3: {what} for {n} tokens is {got:.6g} s, expected {exp:.6g} s")
    passed("Exercise 3.3")


WRONG_ANSWERS = {
    "check_blocks_needed": lambda n, bs: n // bs,  # rounds down: the partly filled last block is forgotten
    "check_slot": lambda table, t, bs: t,  # as if the sequence's blocks were contiguous from block 0
    # one transfer instead of two (out AND back in)
    "check_move_vs_recompute": lambda n, b, f, link, dev: (n * b / link, n * f / dev),
}


from minfer.course.exercises import guard_checks  # noqa: E402

guard_checks(globals())
