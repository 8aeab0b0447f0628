"""Client libraries a vLLM user points at minfer, unchanged (issue 29): context-overflow errors as litellm and
LangChain recognise them, /tokenizer_info as lm-eval's remote tokenizer reads it, the chat-template controls,
strict tool schemas, a forced call cut by max_tokens, streamed `auto` tool answers, and the vLLM and HTTP
metrics a vLLM Grafana dashboard and Prometheus read.

Where a client library is a test dependency (openai, langchain-openai) it is called itself; where it is not
(litellm, lm-eval: heavy), the test checks the exact body the library matches on, quoting its code.

    pytest -q tests/test_serve_clients.py
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minfer.serve.protocol import TokenText
from minfer.serve.tools import ToolStreamChunks, answer_schema, parse_tools, strict_schema
from tests.serving import running_server

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 256

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    with running_server(["--max-model-len", str(MAX_MODEL_LEN), "--disable-log-requests",
                         "--uvicorn-log-level", "warning"], fake_engine_args=[MODEL, str(MAX_MODEL_LEN)]) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


# -- context overflow ------------------------------------------------------------------------------------------
# litellm (litellm/litellm_core_utils/exception_mapping_utils.py, `exception_type`) maps an OpenAI-compatible
# 400 to ContextWindowExceededError when:
#     "This model's maximum context length is" in error_str
#     or "string too long. Expected a string with maximum length" in error_str
#     or "model's maximum context limit" in error_str
LITELLM_CONTEXT_WINDOW = re.compile(r"This model's maximum context length is")


def test_overflow_has_openais_code_and_wording(client):
    long = "hello " * (MAX_MODEL_LEN + 10)
    for call in (lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}]),
                 lambda: client.completions.create(model=MODEL, prompt=long),
                 lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.code == "context_length_exceeded"
        assert LITELLM_CONTEXT_WINDOW.search(str(e.value)) and e.value.body["message"].startswith(
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens")
    with pytest.raises(openai.BadRequestError) as e:  # other 400s keep their own code
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.code != "context_length_exceeded"


# langchain_openai/chat_models/base.py, `_handle_openai_bad_request`:
#     if ("context_length_exceeded" in str(e) or "Input tokens exceed the configured limit" in e.message
#             or "prompt is too long" in e.message or "ContextWindowExceededError" in e.message):
#         raise OpenAIContextOverflowError(...)
def test_langchain_raises_its_context_overflow_error(server):
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server + "/v1", api_key="unused", model=MODEL, max_retries=0)
    with pytest.raises(ContextOverflowError):
        llm.invoke("hello " * (MAX_MODEL_LEN + 10))


# -- /tokenizer_info for lm-eval's RemoteTokenizer --------------------------------------------------------------
def test_tokenizer_info_as_lm_eval_reads_it(server):
    """lm-eval 0.4.13's `lm_eval.utils.RemoteTokenizer` does:
        tokenizer_info = GET {base}/tokenizer_info .json()
        eos_token = tokenizer_info.get("eos_token"); bos_token = ...get("bos_token"); pad_token = ...
        eos_token_id = self.encode(eos)[0]   # encode: POST /tokenize {"prompt": text, "add_special_tokens": False}
        decode: POST /detokenize {"tokens": ids} -> .json().get("prompt")
        apply_chat_template: env.from_string(tokenizer_info["chat_template"]).render(messages=...,
                                                                               add_generation_prompt=...)
    """
    import jinja2.sandbox

    info = httpx.get(server + "/tokenizer_info", timeout=30).json()
    assert isinstance(info["eos_token"], str) and info["model_max_length"] == MAX_MODEL_LEN

    def encode(text):
        return httpx.post(server + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=30).json()["tokens"]

    eos_id = encode(info["eos_token"])[0]
    assert eos_id in info["eos_token_ids"]
    ids = encode("The quick brown fox")
    assert httpx.post(server + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"] == \
        "The quick brown fox"
    # The template lm-eval renders on its side is the one the server renders with
    messages = [{"role": "user", "content": "Hi there"}]
    theirs = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(info["chat_template"]).render(
        messages=messages, add_generation_prompt=True)
    ours = httpx.post(server + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert encode(theirs) == ours


# -- chat-template controls ------------------------------------------------------------------------------------
def _tokenize(server, body):
    r = httpx.post(server + "/tokenize", json={**body, "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_continue_final_message_continues_the_assistant_turn(server, client):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    cont = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    tok = _tokenize(server, cont)
    assert "".join(tok["token_strs"]).endswith("My favourite color is")  # left open: no end-of-turn after it
    plain = _tokenize(server, {"messages": messages})
    assert tok["tokens"] != plain["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == tok["count"]  # the route renders what /tokenize renders
    # the continuation is the engine's greedy continuation of exactly those tokens
    raw = client.completions.create(model=MODEL, prompt=tok["tokens"], max_tokens=4, temperature=0)
    assert r.choices[0].message.content == raw.choices[0].text


def test_add_generation_prompt_false_and_template_kwargs(server, client):
    messages = [{"role": "user", "content": "Hello"}]
    with_prompt, without = (_tokenize(server, {"messages": messages, "add_generation_prompt": g})
                            for g in (True, False))
    assert without["count"] < with_prompt["count"]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == without["count"]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == with_prompt["count"]  # a variable this template does not read changes nothing


@pytest.mark.parametrize("extra, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt's default true
    ({"continue_final_message": True, "add_generation_prompt": False, "_last": "user"}, "messages"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_template_controls_refused_with_400(server, extra, param):
    extra = dict(extra)
    last = extra.pop("_last", "assistant")
    messages = [{"role": "user", "content": "Hi"}] + ([{"role": "assistant", "content": "Hel"}] if last == "assistant"
                                                      else [])
    for route in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(server + route, json={"messages": messages, "max_tokens": 2, **extra}, timeout=30)
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["param"] in (param, "messages")


# -- tools ------------------------------------------------------------------------------------------------------
def test_forced_call_schema_is_strict_unless_the_tool_opts_out():
    invented = {"name": "get_weather", "arguments": {"city": "Paris", "temperature": 25}}
    strict = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(invented, answer_schema(strict))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, answer_schema(strict))
    loose_tool = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    jsonschema.validate(invented, answer_schema(parse_tools({"tools": [loose_tool], "tool_choice": "required"})))
    # a free-form object and an explicit rule stay as they were
    assert strict_schema({"type": "object"}) == {"type": "object"}
    kept = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}}
    assert strict_schema(kept) == kept


def test_forced_call_has_no_invented_keys(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris, with "
                                                                "temperature, humidity and wind?"}],
                                       tools=[tool], tool_choice="required", temperature=0, max_tokens=60)
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert set(args) <= {"city", "unit"}


def test_forced_call_cut_by_max_tokens_returns_the_partial_call(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0].function.arguments
    r = client.chat.completions.create(**kwargs, max_tokens=12)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    call = c.message.tool_calls[0].function
    assert call.name == "get_weather" and full.startswith(call.arguments.rstrip()[:4]) and call.arguments != full
    chunks = list(client.chat.completions.create(**kwargs, max_tokens=12, stream=True))
    calls = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert [t.function.arguments for t in calls] == [call.arguments]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]


def _snap(text, n_tokens, finish=None):
    return SimpleNamespace(request_id="r-0", num_prompt_tokens=3, outputs=[SimpleNamespace(
        index=0, text=text, token_ids=list(range(n_tokens)), logprobs=None, finish_reason=finish)])


class _Tok:
    def decode(self, ids):
        return "x"


def test_streamed_auto_text_flows_as_generated_and_a_call_is_held():
    req = parse_tools({"tools": [WEATHER]})
    chunks = ToolStreamChunks("id", 0, MODEL, {"r-0": 0}, 1, 0, TokenText(_Tok()), chat=True, tool_request=req)
    sent = [chunks.on_snapshot(_snap(t, i + 1, "stop" if i == 3 else None))
            for i, t in enumerate([" The", " The sea", " The sea is", " The sea is blue."])]
    deltas = [json.loads(s[6:])["choices"][0]["delta"].get("content") for s in sent]
    assert deltas == [" The", " sea", " is", " blue."]  # each as it came, not one delta at the end
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    chunks = ToolStreamChunks("id", 0, MODEL, {"r-0": 0}, 1, 0, TokenText(_Tok()), chat=True, tool_request=req)
    held = [chunks.on_snapshot(_snap(call[:k], k)) for k in (1, 10, 30)]
    assert held == [None, None, None]
    last = json.loads(chunks.on_snapshot(_snap(call, 40, "stop"))[6:])["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


# -- metrics ----------------------------------------------------------------------------------------------------
def _samples(server) -> dict:
    out = {}
    for family in text_string_to_metric_families(httpx.get(server + "/metrics", timeout=30).text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_vllm_series_engine_label_and_http_metrics(server, client):
    before = _samples(server)
    # ignore_eos: both sequences run to max_tokens, so the longest has exactly 7 tokens
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, n=2, temperature=1, seed=1,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 14
    after = _samples(server)
    eng = (("engine", "0"),)

    def grew(name, labels=eng):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert ("vllm:cpu_cache_usage_perc", eng) in after and ("vllm:gpu_cache_usage_perc", eng) in after
    assert grew("vllm:request_params_n_count") == 1 and grew("vllm:request_params_n_sum") == 2
    assert grew("vllm:request_params_max_tokens_sum") == 7
    assert grew("vllm:request_max_num_generation_tokens_count") == 1
    assert grew("vllm:request_max_num_generation_tokens_sum") == 7
    assert all(dict(labels).get("engine") == "0" for (name, labels) in after if name.startswith("vllm:"))
    assert not any(dict(labels).get("engine") for (name, labels) in after if name.startswith("minfer:"))
    key = ("http_requests_total", (("handler", "/v1/completions"), ("method", "POST"), ("status", "2xx")))
    assert after[key] - before.get(key, 0) == 1
    assert any(name == "http_request_duration_seconds_count" and dict(labels).get("handler") == "/v1/completions"
               for name, labels in after)
