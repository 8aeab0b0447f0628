"""prompt_logprobs (vLLM's semantics): every prompt token's log-probability given the tokens before it, checked
against transformers' logits on the same weights, whole and chunked, with prefix caching on.

    PYTHONPATH=$PWD python -m pytest -q tests/test_prompt_logprobs.py
"""

from __future__ import annotations

import pytest
import torch

from minfer import SamplingParams

from .conftest import needs_default_model

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy cat."


def reference(hf_oracle, ids):
    with torch.no_grad():
        logits = hf_oracle(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def check(out, ref, ids, k):
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for p in range(1, len(ids)):
        d = lps[p]
        assert d[ids[p]] == pytest.approx(float(ref[p - 1, ids[p]]), abs=2e-3)
        if k:
            top = ref[p - 1].topk(k).indices.tolist()
            assert len(d) in (k, k + 1) and set(top) <= set(d)


@needs_default_model
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_transformers(llm, hf_oracle, k):
    ids = llm.get_tokenizer().encode(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k))[0]
    check(out, reference(hf_oracle, ids), ids, k)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.prompt_logprobs is None


@needs_default_model
def test_chunked_and_prefix_cached(hf_oracle):
    from minfer import LLM

    llm = LLM(max_model_len=256, seed=0, enable_chunked_prefill=True, max_num_batched_tokens=7,
              enable_prefix_caching=True, block_size=4)
    ids = llm.get_tokenizer().encode(PROMPT)
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))  # fills the prefix cache
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                                           SamplingParams(temperature=0, max_tokens=2)])
    check(outs[0], reference(hf_oracle, ids), ids, 1)
    assert outs[1].num_cached_tokens > 0 and outs[0].num_cached_tokens == 0
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
