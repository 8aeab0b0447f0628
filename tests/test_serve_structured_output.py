"""Structured output and tools through the server (`minfer/serve/guided.py`, `minfer/serve/tools.py`).

In-process (`TestClient`, the real SmolLM2-135M-Instruct):

- `response_format` json_schema / json_object and vLLM's `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar`: every answer parses / matches; a guided request running beside a plain one leaves the
  plain one's greedy text what it is alone;
- a bad schema, regex or grammar, two constraints at once, structured output with `use_beam_search`: 400 with
  OpenAI's error body naming the field, and nothing is left in the engine;
- tools: `tool_choice` "required" and a named function always answer a valid call in `tool_calls`
  (finish_reason "tool_calls"), streamed as one `tool_calls` delta; "auto" answers content or a call;
  "none" answers text; a conversation with an assistant call and a tool result renders; bad tools are 400s.

Through the real two-process server (`python -m minfer.serve`, engine in its own process): the openai client's
`response_format` and `tools`, and LangChain's `with_structured_output` and `bind_tools` (skipped without
langchain-openai).

    PYTHONPATH=$PWD python -m pytest -q tests/test_serve_structured_output.py
"""

from __future__ import annotations

import json
import re
import threading

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from fastapi.testclient import TestClient  # noqa: E402

from minfer.serve.routes import build_app  # noqa: E402

from .conftest import needs_default_model  # noqa: E402

pytestmark = [needs_default_model, pytest.mark.timeout(600)]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time of a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(build_app(llm.llm_engine, served_model_names=["m"], log_requests=False)) as c:
        yield c, llm.llm_engine


def _chat(c, **body):
    return c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 60, "temperature": 0, **body})


def _idle(engine):
    return not engine.has_unfinished_requests() and engine.all_blocks_free()


# -- response_format and guided_* -----------------------------------------------------------------------------
def test_response_format_json_schema_and_json_object(client):
    c, engine = client
    msgs = [{"role": "user", "content": "Give me a person as JSON."}]
    for temperature, seed in ((0, None), (0.9, 3)):
        r = _chat(c, messages=msgs, temperature=temperature, seed=seed,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), PERSON)
    r = _chat(c, messages=[{"role": "user", "content": 'Repeat this JSON object: {"a": 1, "b": [true]}'}],
              response_format={"type": "json_object"})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    assert _idle(engine)


def test_guided_fields_on_completions(client):
    c, _ = client
    cases = [({"guided_regex": r"[0-9]{4}-[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}", t)),
             ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
             # bounded, so that a sampled number must end within max_tokens (an unbounded /[0-9]+/ may not)
             ({"guided_grammar": 'start: "x=" /[0-9]{1,8}/ ";"'}, lambda t: re.fullmatch(r"x=[0-9]{1,8};", t)),
             ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down"))]
    for fields, ok in cases:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "The answer:", "max_tokens": 40,
                                             "temperature": 0.7, "seed": 1, **fields})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert ok(text), (fields, text)


def test_a_guided_request_leaves_a_plain_one_unchanged(client):
    c, _ = client
    plain = dict(messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=30)
    alone = _chat(c, **plain).json()["choices"][0]["message"]["content"]
    results = {}

    def guided(i):
        results[i] = _chat(c, messages=[{"role": "user", "content": f"Person {i} as JSON"}], temperature=0.8,
                           seed=i, response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})

    threads = [threading.Thread(target=guided, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    together = _chat(c, **plain).json()["choices"][0]["message"]["content"]
    for t in threads:
        t.join()
    assert together == alone
    for r in results.values():
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), PERSON)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # the second one named
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_values_are_400_and_nothing_is_lost(client, fields, param):
    c, engine = client
    r = _chat(c, messages=USER, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert _idle(engine)
    assert _chat(c, messages=USER, max_tokens=3).status_code == 200  # the server goes on


@pytest.mark.parametrize("fields", [{"guided_grammar": "start: start"}, {"guided_json": {"$ref": "#"}},
                                    {"guided_regex": "[^\\x00-\\x{10FFFF}]"}], ids=["grammar", "json", "regex"])
def test_a_grammar_that_matches_nothing_is_400(client, fields):
    # it compiles, but no output is in its language: refused before admission, not 200 with "" and "stop"
    c, engine = client
    r = _chat(c, messages=USER, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "matches no output" in err["message"] and err["param"] == "guided_decoding", err
    assert _idle(engine)
    assert _chat(c, messages=USER, max_tokens=3).status_code == 200


def test_a_grammar_that_cannot_be_completed_aborts_not_stops(client):
    # an object whose required "a" is that object again: it starts ('{"'), then the matcher is in error
    c, engine = client
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    r = _chat(c, messages=USER, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "abort", r.json()
    assert _idle(engine)
    assert _chat(c, messages=USER, max_tokens=3).status_code == 200


def test_beam_search_refuses_structured_output(client):
    c, _ = client
    r = c.post("/v1/completions", json={"model": "m", "prompt": "a", "use_beam_search": True, "n": 2,
                                         "guided_choice": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"


# -- tools ----------------------------------------------------------------------------------------------------
def _call(choice):
    assert choice["finish_reason"] == "tool_calls", choice
    msg = choice["message"]
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_tool_choice_required_and_named_always_call(client):
    c, engine = client
    for temperature in (0, 1.0):
        r = _chat(c, messages=USER, tools=[WEATHER, TIME], tool_choice="required", temperature=temperature, seed=2)
        name, args = _call(r.json()["choices"][0])
        tool = {"get_weather": WEATHER, "get_time": TIME}[name]
        jsonschema.validate(args, tool["function"]["parameters"])
    r = _chat(c, messages=USER, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
              n=2, temperature=1.0, seed=5)
    for choice in r.json()["choices"]:
        name, args = _call(choice)
        assert name == "get_time"
        jsonschema.validate(args, TIME["function"]["parameters"])
    assert _idle(engine)


def test_tool_call_streamed_as_one_delta(client):
    c, _ = client
    r = _chat(c, messages=USER, tools=[WEATHER], tool_choice="required", stream=True)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [ch["delta"] for e in events for ch in e["choices"]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0][0]["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert r.text.rstrip().endswith("data: [DONE]")


def test_tool_choice_auto_and_none(client):
    c, _ = client
    r = _chat(c, messages=USER, tools=[WEATHER])  # auto: the default with tools
    choice = r.json()["choices"][0]
    if choice["message"].get("tool_calls"):
        _call(choice)
    else:
        assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
    r = _chat(c, messages=USER, tools=[WEATHER], tool_choice="none")
    assert "tool_calls" not in r.json()["choices"][0]["message"]


def test_a_conversation_with_a_call_and_its_result(client):
    c, _ = client
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [{
                       "id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = _chat(c, messages=msgs, tools=[WEATHER], max_tokens=20)
    assert r.status_code == 200, r.text


# -- real clients against the real (two-process) server --------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from .serving import running_server

    with running_server(["--max-model-len", "1024", "--disable-log-requests", "--uvicorn-log-level", "warning"]) as url:
        yield url


@pytest.mark.slow
def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=USER, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A person as JSON"}], temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "foo"}}})


@pytest.mark.slow
def test_langchain_structured_output_and_bind_tools(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=150)

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        return "sunny"

    chat = ChatOpenAI(base_url=server + "/v1", api_key="unused", model="smollm2-135m-instruct", temperature=0,
                      max_tokens=60)
    person = chat.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person)
    msg = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather" and "city" in msg.tool_calls[0]["args"]
    msg = chat.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert msg.tool_calls[0]["name"] == "get_weather"
