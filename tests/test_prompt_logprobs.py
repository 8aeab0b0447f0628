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


@pytest.mark.slow
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


# -- the server: scoring as lm-evaluation-harness sends it, and the sampling controls' fields -------------
@pytest.fixture(scope="module")
def server():
    from .serving import running_server

    with running_server(["--max-model-len", "512", "--disable-log-requests", "--uvicorn-log-level", "warning"],
                        fake_engine_args=["smollm2-135m-instruct", "512"]) as url:
        yield url


@needs_default_model
def test_echo_scoring_returns_prompt_logprobs(server, llm):
    import httpx

    body = {"model": "smollm2-135m-instruct", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0,
            "temperature": 0}
    r = httpx.post(server + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == PROMPT and r.json()["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    ids = llm.get_tokenizer().encode(PROMPT)
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == PROMPT and lp["text_offset"][0] == 0
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i][ids[i]], abs=1e-4)
        assert 2 <= len(lp["top_logprobs"][i]) <= 3
    # echo with generation: the prompt's logprobs, then the completion's
    body.update(max_tokens=3)
    choice = httpx.post(server + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["logprobs"]["tokens"]) == len(ids) + 3
    assert choice["logprobs"]["text_offset"][len(ids)] == len(PROMPT)


@needs_default_model
def test_server_sampling_controls(server):
    import httpx

    url = server + "/v1/completions"
    base = {"model": "smollm2-135m-instruct", "prompt": "red, red, red, red,", "max_tokens": 8, "temperature": 0}
    plain = httpx.post(url, json=base, timeout=120).json()["choices"][0]["text"]
    pen = httpx.post(url, json={**base, "presence_penalty": 1.5, "frequency_penalty": 1.0,
                                "repetition_penalty": 1.3}, timeout=120).json()["choices"][0]["text"]
    assert pen != plain
    r = httpx.post(url, json={**base, "min_tokens": 8, "logit_bias": {"2": 100}}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    for field, value in [("presence_penalty", 5), ("frequency_penalty", "x"), ("repetition_penalty", 0),
                         ("min_tokens", 100), ("logit_bias", {"a": 1}), ("logit_bias", {"1": 1000})]:
        r = httpx.post(url, json={**base, field: value}, timeout=60)
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == field, err
    r = httpx.post(url, json={**base, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
