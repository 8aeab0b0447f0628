"""Penalties, min_tokens and logit_bias (article §7): minfer's batched logits processing against transformers'
logits processors (repetition penalty, min new tokens, sequence bias) and OpenAI's documented formula
(frequency/presence penalties), then through the engine.

    PYTHONPATH=$PWD python -m pytest -q tests/test_sampling_controls.py
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from minfer import SamplingParams
from minfer.sampling import Sampler, apply_logits_processors
from minfer.sequence import Sequence

from .conftest import needs_default_model

V = 50


def make_seq(prompt, output, **kw) -> Sequence:
    sp = SamplingParams(max_tokens=64, **kw).clone(_eos_token_ids=(0,))
    s = Sequence("r", 0, prompt, sp, 4096)
    s.output_token_ids = list(output)
    return s


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, V, generator=g) * 4


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(logits, penalty):
    seqs = [make_seq([1, 2, 3], [4, 4, 5], repetition_penalty=penalty),
            make_seq([7, 8], [9], repetition_penalty=penalty),
            make_seq([10, 11, 12, 13], [], repetition_penalty=penalty)]
    ours = apply_logits_processors(logits, seqs)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for i, s in enumerate(seqs):
        ref = proc(torch.tensor([s.all_token_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], ref)
    assert not torch.equal(ours, logits)


def test_frequency_and_presence_follow_openai_formula(logits):
    outs = [[4, 4, 4, 5], [9], []]
    pens = [(0.5, 1.5), (-1.0, 0.25), (2.0, 2.0)]
    seqs = [make_seq([1, 2], o, presence_penalty=p, frequency_penalty=f) for o, (p, f) in zip(outs, pens)]
    ours = apply_logits_processors(logits, seqs)
    ref = logits.clone()
    for i, (o, (p, f)) in enumerate(zip(outs, pens)):
        for t in set(o):  # mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence
            ref[i, t] -= o.count(t) * f + p
    torch.testing.assert_close(ours, ref)
    # The prompt is not penalized by frequency/presence (vLLM counts output tokens only).
    assert ours[0, 1] == logits[0, 1]


def test_min_tokens_equals_transformers(logits):
    seqs = [make_seq([1, 2], [3], min_tokens=3, stop_token_ids=[7]), make_seq([1, 2], [3, 4, 5], min_tokens=3)]
    ours = apply_logits_processors(logits[:2], seqs)
    for i, s in enumerate(seqs):
        proc = MinNewTokensLengthLogitsProcessor(2, 3, eos_token_id=sorted(s.stop_ids))
        ref = proc(torch.tensor([s.all_token_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], ref)
    assert ours[0, 0] == float("-inf") and ours[0, 7] == float("-inf") and ours[1, 0] == logits[1, 0]


def test_logit_bias_equals_transformers_sequence_bias(logits):
    bias = {3: 5.0, 17: -100.0, 42: 0.5}
    seqs = [make_seq([1], [], logit_bias=bias), make_seq([1], []), make_seq([1], [], logit_bias={"3": -2})]
    ours = apply_logits_processors(logits, seqs)
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1]]), logits[:1].clone())
    torch.testing.assert_close(ours[:1], ref)
    torch.testing.assert_close(ours[1], logits[1])
    assert ours[2, 3] == logits[2, 3] - 2


def test_greedy_sampler_follows_processed_logits_but_reports_raw_logprobs(logits):
    top = int(logits[0].argmax())
    seqs = [make_seq([1], [], temperature=0, logit_bias={top: -100.0}, logprobs=0)]
    tokens, chosen, _ = Sampler()(logits[:1], seqs)
    assert int(tokens[0]) != top
    assert float(chosen[0]) == pytest.approx(float(logits[0].log_softmax(-1)[int(tokens[0])]))


def test_mixed_batch_rows_are_independent(logits):
    plain = [make_seq([1], [2], temperature=0)]
    mixed = plain + [make_seq([1], [2], temperature=0, repetition_penalty=10.0, logit_bias={5: 50})]
    t_plain, _, _ = Sampler()(logits[:1], plain)
    t_mixed, _, _ = Sampler()(logits[:2], mixed)
    assert int(t_plain[0]) == int(t_mixed[0]) and int(t_mixed[1]) == 5


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                         ("repetition_penalty", 0), ("repetition_penalty", float("inf")),
                                         ("min_tokens", -1), ("min_tokens", 17), ("logit_bias", {1: 101}),
                                         ("logit_bias", {"x": 1}), ("logit_bias", [1, 2]),
                                         ("prompt_logprobs", 21), ("prompt_logprobs", -1),
                                         # 0 and inf in float32, where the sampler applies them
                                         ("repetition_penalty", 1e-39), ("repetition_penalty", 1e300),
                                         ("logit_bias", {"²": 1}), ("logit_bias", {"٤٢": 1}),
                                         ("logit_bias", {"5": 1, "05": 2})])
def test_bad_values_are_clear_errors(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


@needs_default_model
def test_engine_penalties_change_output_and_match_simple_path(llm):
    prompt = "List the colors: red, red, red, red, red,"
    base = SamplingParams(temperature=0, max_tokens=12)
    pen = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, frequency_penalty=0.5)
    a, b = llm.generate([prompt, prompt], [base, pen])
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
    simple, _ = llm.generate_simple(prompt, pen)
    assert simple.outputs[0].token_ids == b.outputs[0].token_ids
    red = llm.get_tokenizer().encode(" red")
    assert b.outputs[0].token_ids.count(red[0]) < a.outputs[0].token_ids.count(red[0])


@needs_default_model
def test_engine_min_tokens_and_logit_bias(llm):
    eos = llm.get_tokenizer().eos_token_ids
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                            logit_bias={eos[0]: 100.0}))[0].outputs[0]
    assert len(out.token_ids) == 8 and not set(out.token_ids) & set(eos)
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=8, logit_bias={eos[0]: 100.0}))[0].outputs[0]
    assert out.token_ids == [eos[0]] and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("Hi", SamplingParams(logit_bias={10 ** 7: 1.0}))


def test_min_tokens_past_max_model_len_is_a_clear_error():
    """With max_tokens None the output may run to max_model_len; a min_tokens past it can never be met."""
    from minfer.sequence import validate_prompt
    validate_prompt([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=13), max_model_len=16, vocab_size=32)
    with pytest.raises(ValueError, match="min_tokens .14. .* exceeds max_model_len .16.; at most 13"):
        validate_prompt([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=14), max_model_len=16, vocab_size=32)
