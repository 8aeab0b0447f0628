"""Beam search (article §7): beams and scores equal transformers' `generate(num_beams=W,
num_return_sequences=W)` on the same weights; beams share KV blocks through forks with copy-on-write
(checked in the block manager and by the absence of leaks); prefix caching does not change the beams.

    PYTHONPATH=$PWD python -m pytest -q tests/test_beam_search.py
"""

from __future__ import annotations

import pytest
import torch

from minfer import BeamSearchParams
from minfer.block_manager import BlockManager
from minfer.sampling_params import SamplingParams
from minfer.sequence import Sequence

from .conftest import needs_default_model


def _seq(n_tokens: int) -> Sequence:
    return Sequence("r", 0, list(range(1, n_tokens + 1)), SamplingParams(max_tokens=8), 1024)


def test_fork_shares_blocks_and_copy_on_write_copies_only_the_shared_partial_block():
    bm = BlockManager(16, 4)
    parent = _seq(6)
    bm.append_slots(parent, 6)  # blocks for tokens 0..5: two blocks, the second partial
    parent.num_computed_tokens = 6
    a, b = _seq(6), _seq(6)
    bm.fork(parent, a)
    bm.fork(parent, b)
    assert a.block_table == b.block_table == parent.block_table
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [3, 3]
    bm.free_seq(parent)
    assert bm.num_free_blocks == 14
    # a writes token 6 into the shared partial block: it gets its own copy; b then owns the original.
    cow = bm.copy_on_write(a, 6)
    assert cow is not None and cow[0] == b.block_table[1] and a.block_table[1] == cow[1]
    assert a.block_table[0] == b.block_table[0] and bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.copy_on_write(b, 6) is None
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 16 and all(blk.ref_count == 0 for blk in bm.blocks)


@pytest.mark.parametrize("kw,field", [({"beam_width": 0}, "beam_width"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"temperature": -1}, "temperature"),
                                      ({"length_penalty": float("nan")}, "length_penalty"),
                                      ({"length_penalty": 1e300}, "length_penalty"),
                                      ({"length_penalty": -11}, "length_penalty"),
                                      ({"early_stopping": "sometimes"}, "early_stopping")])
def test_bad_params_are_clear_errors(kw, field):
    args = {"beam_width": 2, "max_tokens": 4, **kw}
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**args)


def _prompts(tok):
    return [tok.encode_chat([{"role": "user", "content": "What is 2+2? Answer with one number."}]),
            tok.encode("The capital of France is")]


@pytest.mark.slow
@needs_default_model
@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (4, 1.0), (4, 0.5)])
def test_beams_and_scores_equal_transformers(llm, hf_oracle, width, length_penalty):
    tok = llm.get_tokenizer()
    eos = list(tok.eos_token_ids)
    prompts = _prompts(tok)
    free = llm.stats().num_free_blocks
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty))
    assert llm.stats().num_free_blocks == free  # no block leaks
    for ids, out in zip(prompts, outs):
        ref = hf_oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 num_beams=width, num_return_sequences=width, max_new_tokens=10, do_sample=False,
                                 length_penalty=length_penalty, early_stopping=False, eos_token_id=eos,
                                 pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True)
        assert len(out.sequences) == width
        for k, beam in enumerate(out.sequences):
            hf_ids = ref.sequences[k, len(ids):].tolist()
            if beam.finish_reason == "stop":  # transformers pads a finished beam with EOS
                hf_ids = hf_ids[:len(beam.output_token_ids)]
            assert beam.output_token_ids == hf_ids, k
            assert beam.score == pytest.approx(float(ref.sequences_scores[k]), abs=1e-3)
            assert beam.tokens == ids + beam.output_token_ids
            assert beam.cum_logprob == pytest.approx(beam.score * len(beam.output_token_ids) ** length_penalty)
    assert any(b.finish_reason == "stop" for b in outs[0].sequences)


@pytest.mark.slow
@needs_default_model
def test_prefix_caching_gives_identical_beams_and_frees_every_block(llm):
    from minfer import LLM

    params = BeamSearchParams(beam_width=3, max_tokens=8)
    prompts = _prompts(llm.get_tokenizer())
    plain = llm.beam_search(prompts, params)
    cached_llm = LLM(max_model_len=1024, seed=0, enable_prefix_caching=True, block_size=4)
    first = cached_llm.beam_search(prompts, params)
    again = cached_llm.beam_search(prompts, params)  # now the prompts' blocks are cache hits
    assert cached_llm.stats().prefix_cache_hits > 0
    for a, b, c in zip(plain, first, again):
        assert [s.output_token_ids for s in a.sequences] == [s.output_token_ids for s in b.sequences] \
            == [s.output_token_ids for s in c.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in c.sequences], abs=1e-4)
    st = cached_llm.stats()
    assert st.num_free_blocks == st.num_total_blocks
    # and ordinary requests still run on the same engine afterwards, greedy = the simple path
    out = cached_llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.outputs[0].token_ids == cached_llm.generate_simple(
        prompts[1], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids


@needs_default_model
def test_beam_width_1_is_greedy_and_bad_input_is_refused(llm):
    prompt = llm.get_tokenizer().encode("Once upon a time")
    beam = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0].sequences[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert beam.output_token_ids == greedy.token_ids and beam.finish_reason == "length"
    with pytest.raises(TypeError):
        llm.beam_search([prompt], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=5000))


def test_hybrid_kv_cache_counts_window_groups_by_their_window(tmp_path):
    """On the hybrid KV cache (a random Gemma 3: two local layers with a window of 8, one global layer, one
    table each) the bound counts a local group's table as the prompt (the prefill) or the window's blocks per
    beam, not as a full table: a 90-token prompt fits a 24-block pool (block size 16; the old bound said 27
    for one beam), and the blocks the search really holds stay within the bound."""
    from minfer import LLM
    from minfer.beam_search import BeamSearchRunner
    from tests.test_models_gpt2_bloom import make_model, prompt

    make_model(tmp_path, "gemma3")
    llm = LLM(model=str(tmp_path), max_model_len=128, attention_backend="torch", device="cpu",
              kv_cache_memory_bytes=24 * 2048, block_size=16)  # 2048 bytes a block: K,V x 16 x 16 dims x 4 bytes
    eng = llm.llm_engine
    bm = eng.block_manager
    assert bm.num_total_blocks == 24 and bm.num_block_tables == 3
    ids = prompt(5, 90)
    out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=1, max_tokens=5))[0]
    assert len(out.sequences[0].output_token_ids) == 5 and eng.all_blocks_free()

    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    runner = BeamSearchRunner(bm, eng.executor, eng.max_model_len, eng.tokenizer.eos_token_ids,
                              eng.scheduler.sliding_window)
    bound = runner.blocks_needed(len(ids), params)
    assert bound == 12 + 6 + 6  # global: 6 prompt + 2 x 3; each local: max(6 prompt, 2 x (1 window + 2))
    peak = []
    for name in ("append_slots", "copies_before_write"):  # where a step takes blocks
        orig = getattr(bm, name)

        def wrapped(*a, _orig=orig, **k):
            r = _orig(*a, **k)
            peak.append(bm.num_total_blocks - bm.num_free_blocks)
            return r
        setattr(bm, name, wrapped)
    out = llm.beam_search([{"prompt_token_ids": ids}], params)[0]
    assert len(out.sequences) == 2 and all(len(s.output_token_ids) == 10 for s in out.sequences)
    assert 0 < max(peak) <= bound and eng.all_blocks_free()
