"""Freeing KV blocks behind a sliding window (minfer/block_manager.py `free_out_of_window`, scheduler.py, engine.py).

(a) The block manager against the attention mask itself: while a sequence grows token by token (and chunk by
    chunk), the blocks it still holds must be exactly those holding a key that the next query or any later
    one can see (`torch_ref.visibility_mask`), for block sizes 1 and 16 and windows at and around the block
    edges. Freeing one block too early or one too late fails.
(b) A random Mistral model whose every layer has a window, through the engine: greedy tokens equal
    transformers' on prompts longer than the window, with prefix caching, chunked prefill and preemption
    (recompute and swap), and the blocks in use stop growing at the window.
"""

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.attention.torch_ref import visibility_mask
from minfer.block_manager import BlockManager
from minfer.sampling_params import SamplingParams as SP
from minfer.sequence import Sequence
from tests.test_models_gpt2_bloom import hf_greedy, make_model, prompt


def needed_blocks(q: int, window: int, num_blocks: int, bs: int) -> set[int]:
    """Table indices holding a key visible to some query at position >= q (the mask decides, not a formula)."""
    queries = torch.arange(q, q + window + 2 * bs)  # later queries only see less of the past
    keys = torch.arange(num_blocks * bs)
    seen = visibility_mask(queries, keys, window).any(0)
    return {int(k) // bs for k in keys[seen]}


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("window", [1, 7, 15, 16, 17, 32])
@pytest.mark.parametrize("chunk", [1, 5])
def test_freed_blocks_are_exactly_the_unreadable_ones(bs, window, chunk):
    bm = BlockManager(num_blocks=200, block_size=bs, enable_prefix_caching=True)
    seq = Sequence("r", 0, list(range(3, 3 + 90)), SP(max_tokens=1), 4096)
    bm.allocate_prefix(seq)
    total = bm.num_free_blocks
    while seq.num_computed_tokens < 90:
        n = min(chunk, 90 - seq.num_computed_tokens)
        bm.append_slots(seq, n)
        seq.num_computed_tokens += n
        bm.register_computed_blocks(seq)
        bm.free_out_of_window(seq, window)
        q = seq.num_computed_tokens  # the next query's position
        held = {i for i, b in enumerate(seq.block_table) if i >= bm.window_freed.get(seq.seq_id, 0)}
        want = needed_blocks(q, window, len(seq.block_table), bs) & set(range(len(seq.block_table)))
        assert held == want, (q, sorted(set(held) ^ want))
        assert bm.num_live_blocks(seq) == total - bm.num_free_blocks
        for i in held:
            assert bm.blocks[seq.block_table[i]].ref_count == 1
    bm.free_seq(seq)
    assert bm.num_free_blocks == total and not bm.window_freed


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-window")
    return path, make_model(path, "mistral-window")  # window 7 on both layers


PROMPTS = [prompt(40 + i, n) for i, n in enumerate((3, 12, 29, 45, 29))]
N_NEW = 12
MIB = 1 << 20


@pytest.fixture(scope="module")
def reference(windowed):
    _, hf = windowed
    return [hf_greedy(hf, p, N_NEW) for p in PROMPTS]


CONFIGS = {
    "bs1": dict(block_size=1),
    "bs16": dict(block_size=16),
    "bs4-prefix-cache": dict(block_size=4, enable_prefix_caching=True, max_num_seqs=2),
    "bs4-chunked": dict(block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=8),
}
# With the window of 7, a sequence holds at most 3 blocks of 4 and nothing is ever preempted; a window of 24
# holds up to 7, so five sequences in a pool of 16 blocks (one 57-token sequence needs 15) must preempt.
PREEMPT = {
    "recompute": dict(block_size=4, kv_cache_memory_bytes=16 * 4 * 512, max_model_len=57),
    "swap": dict(block_size=4, kv_cache_memory_bytes=16 * 4 * 512, max_model_len=57, swap_space=0.001,
                 preemption_mode="swap"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_with_window_freeing_equals_transformers(windowed, reference, name):
    path, _ = windowed
    kw = {"kv_cache_memory_bytes": MIB, **CONFIGS[name]}
    llm = LLM(model=str(path), max_model_len=96, attention_backend="torch", device="cpu", **kw)
    assert llm.llm_engine.scheduler.sliding_window == 7
    prompts = PROMPTS + PROMPTS[2:3] if "prefix" in name else PROMPTS  # a repeated prompt hits the cache
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True))
    refs = reference + reference[2:3] if "prefix" in name else reference
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.llm_engine.all_blocks_free()


@pytest.mark.parametrize("mode", sorted(PREEMPT))
def test_preemption_with_window_freeing_equals_transformers(tmp_path, mode):
    hf = make_model(tmp_path, "mistral-window", sliding_window=24)
    llm = LLM(model=str(tmp_path), attention_backend="torch", device="cpu", **PREEMPT[mode])
    assert llm.llm_engine.scheduler.sliding_window == 24
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.all_blocks_free()


@pytest.mark.parametrize("bs", [1, 16])
def test_blocks_in_use_stop_growing_at_the_window(windowed, bs):
    path, _ = windowed
    llm = LLM(model=str(path), max_model_len=96, attention_backend="torch", device="cpu",
              kv_cache_memory_bytes=MIB, block_size=bs)
    eng = llm.llm_engine
    eng.add_request("a", prompt(7, 20), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    used = []
    while eng.has_unfinished_requests():
        eng.step()
        used.append(eng.block_manager.num_total_blocks - eng.block_manager.num_free_blocks)
        assert 0 <= eng.stats().fragmentation < 1  # released entries count as neither slots nor tokens
    # Window 7: the live tokens are at most the 7 keys of the next query, spread over at most
    # ceil(7 / bs) + 1 blocks; without freeing the sequence would hold ceil(80 / bs).
    assert max(used[:-1]) <= -(-7 // bs) + 1 < -(-80 // bs)


@pytest.mark.parametrize("bs", [1, 4])
def test_beam_search_frees_behind_the_window_and_equals_transformers(tmp_path, bs, monkeypatch):
    """Beam search on a model whose every layer has a window (Mistral-style, 7): each beam's blocks behind
    the window are released while the search runs, a fork keeps the placeholders as placeholders, and the
    beams and scores equal transformers'; every block comes back."""
    from minfer import BeamSearchParams

    hf = make_model(tmp_path, "mistral-window")
    released = []
    free = BlockManager.free_out_of_window
    monkeypatch.setattr(BlockManager, "free_out_of_window",
                        lambda self, seq, window: released.append(free(self, seq, window)) or released[-1])
    llm = LLM(model=str(tmp_path), max_model_len=96, kv_cache_memory_bytes=1 << 20, block_size=bs,
              attention_backend="torch", device="cpu")
    ids, width, n = prompt(5, 13), 3, 8
    ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), num_beams=width,
                      num_return_sequences=width, max_new_tokens=n, do_sample=False, early_stopping=False,
                      eos_token_id=2, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=width, max_tokens=n))[0]
    for k, beam in enumerate(out.sequences):
        assert beam.output_token_ids == ref.sequences[k, len(ids):].tolist()[:len(beam.output_token_ids)], k
        assert beam.score == pytest.approx(float(ref.sequences_scores[k]), abs=1e-3)
    assert sum(released) > 0
    assert llm.llm_engine.all_blocks_free() and not llm.llm_engine.block_manager.window_freed
