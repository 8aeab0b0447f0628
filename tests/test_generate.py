"""The real SmolLM2 GGUF through minfer (minfer/generate.py, llm.py, sequence.py, tokenizer.py) vs transformers."""

import pytest
import torch

from minfer import SamplingParams
from minfer.generate import SimpleGenerator
from minfer.sequence import Sequence
from minfer.tokenizer import IncrementalDetokenizer, find_stop, held_back

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are"]


def test_prompt_logits_match_transformers_gguf(llm, hf_oracle):
    ids = llm.tokenizer.encode("Paged attention stores the KV cache in fixed-size blocks, so")
    gen = SimpleGenerator(llm.llm_engine.model)
    ours = gen.prefill_logits(ids, gen.new_cache(len(ids)))
    with torch.no_grad():
        ref = hf_oracle(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_32_tokens_identical_to_transformers(llm, hf_oracle, prompt):
    ids = llm.tokenizer.encode(prompt)
    ours, _ = llm.generate_simple(ids, SamplingParams(temperature=0, max_tokens=32))
    with torch.no_grad():  # both stop at the same EOS, or both run 32 tokens
        ref = hf_oracle.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    assert ours.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_chat_names_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=48))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not on the length cap


def test_engine_generate_matches_simple_path(llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate(PROMPTS, params)
    for p, o in zip(PROMPTS, outs):
        ref, _ = llm.generate_simple(p, params)
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids
        assert o.prompt == p and o.prompt_token_ids == llm.tokenizer.encode(p)
    assert llm.llm_engine.all_blocks_free()


def test_multiple_eos_ids_each_stop(llm):
    """Models list several EOS ids; generation stops on whichever comes first."""
    prompt = llm.tokenizer.encode("1, 2, 3, 4, 5,")
    free_run, _ = llm.generate_simple(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    third = free_run.outputs[0].token_ids[2]
    eos = (llm.tokenizer.eos_token_ids[0], third)
    params = SamplingParams(temperature=0, max_tokens=8).clone(_eos_token_ids=eos)
    seq = Sequence("t", 0, prompt, params, llm.tokenizer, 1024)
    SimpleGenerator(llm.llm_engine.model).generate(seq)
    assert seq.output_token_ids == free_run.outputs[0].token_ids[:3]
    assert seq.finish_reason == "stop"


def test_stop_token_ids(llm):
    prompt = "1, 2, 3, 4, 5,"
    free_run = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    toks = free_run.token_ids
    j = next(j for j in range(2, len(toks)) if toks[j] not in toks[:j])  # first time this id appears
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[toks[j]]))[0]
    assert out.outputs[0].token_ids == toks[:j + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == toks[j]


def test_stop_string_across_token_boundaries(llm):
    prompt = "1, 2, 3, 4, 5,"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    # " 7, 8" spans several tokens (" ", "7", ",", " ", "8"): found anyway and cut from the text.
    assert " 7, 8" in free.text
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[" 7, 8"]))[0].outputs[0]
    assert out.text == free.text[:free.text.index(" 7, 8")]
    assert out.finish_reason == "stop" and out.stop_reason == " 7, 8"
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[" 7, 8"],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text.endswith(" 7, 8")


def test_stop_string_inside_one_token(llm):
    free = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    word = free.text.split()[0]  # "Paris." or similar: stop on a piece inside that token
    piece = word[1:3]
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, stop=[piece]))[0]
    assert out.outputs[0].text == free.text[:free.text.index(piece)]


def test_find_stop_and_hold_back():
    assert find_stop("hello wor", ["world"], 3) is None
    assert find_stop("hello world", ["world"], 2) == (6, "world")
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["xyz"]) == 0


def test_incremental_detokenizer_equals_full_decode(llm):
    tok = llm.tokenizer
    text = "Ünïcödé → 中文 emoji 🙂 and spaces   done."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], True)
    assert "".join(detok.step([i]) for i in ids) == tok.decode(ids)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(min_p=2.0), "min_p"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="x"), "seed"),
])
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_length_errors_state_the_numbers(llm):
    long_prompt = [100] * 1030
    with pytest.raises(ValueError, match=r"1030 tokens.*max_model_len is 1024"):
        llm.generate([long_prompt], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"prompt \(1000 tokens\) \+ max_tokens \(100\) = 1100 exceeds max_model_len \(1024\)"):
        llm.generate([[100] * 1000], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10 ** 9]], SamplingParams(max_tokens=4))
    # a bad prompt in a batch queues nothing and leaks nothing
    with pytest.raises(ValueError):
        llm.generate(["fine", [100] * 1030], SamplingParams(max_tokens=4))
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.all_blocks_free()


def test_max_tokens_none_runs_to_max_model_len(llm):
    ids = [1] + llm.tokenizer.encode(" a b c") * 335  # 1006 tokens: 18 left under max_model_len=1024
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(ids) + len(out.outputs[0].token_ids) == 1024
    assert out.outputs[0].finish_reason == "length"


def test_logprobs_and_n(llm):
    out = llm.generate("Hello", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5, logprobs=3))[0]
    assert len(out.outputs) == 2
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert tok in lp and len(lp) >= 3 and all(v <= 0 for v in lp.values())
    again = llm.generate("Hello", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
