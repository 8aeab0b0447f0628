"""Tools requests checked the way OpenAI checks them (`minfer/serve/tools.py`): a malformed tool_choice name,
tool description or history tool call is a 400 naming the field; a forced call's grammar resolves the
parameters' `$defs` refs; an output with NaN or text beside its calls stays content.

    PYTHONPATH=$PWD python -m pytest -q tests/test_tools_validation.py
"""

from __future__ import annotations

import json

import pytest

from minfer.serve.protocol import APIError
from minfer.serve.tools import _messages, answer_schema, guided, parse_output, parse_tools

W = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
DEFS = {"type": "function", "function": {"name": "book", "parameters": {  # what pydantic emits
    "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                       "required": ["name"], "additionalProperties": False}},
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"},
                                     "also": {"type": "array", "items": {"$ref": "#/$defs/City"}, "maxItems": 2}},
    "required": ["city", "also"], "additionalProperties": False}}}


def _400(param, **body):
    with pytest.raises(APIError) as e:
        parse_tools(body)
    assert e.value.status == 400 and e.value.param == param, e.value
    return e.value


@pytest.mark.parametrize("name", [["get_weather"], {"n": "get_weather"}, None, 3])
def test_a_tool_choice_name_that_is_not_a_string_is_400(name):
    _400("tool_choice", tools=[W], tool_choice={"type": "function", "function": {"name": name}})


@pytest.mark.parametrize("description", [["d"], {"d": 1}, 3, True])
def test_a_description_that_is_not_a_string_is_400(description):
    tool = {"type": "function", "function": {**W["function"], "description": description}}
    _400("tools", tools=[tool])
    assert parse_tools({"tools": [{"type": "function", "function": {**W["function"], "description": "d"}}]})


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"P\"}"}}


@pytest.mark.parametrize("call, param", [
    ({"function": "x"}, "messages[1].tool_calls[0].id"),
    ({**CALL, "function": "x"}, "messages[1].tool_calls[0].function"),
    ({**CALL, "function": ["x"]}, "messages[1].tool_calls[0].function"),
    ({**CALL, "id": 1}, "messages[1].tool_calls[0].id"),
    ({**CALL, "type": "tool"}, "messages[1].tool_calls[0].type"),
    ({**CALL, "function": {"name": ["get_weather"], "arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
    ({**CALL, "function": {"name": "get_weather", "arguments": {"city": "P"}}},
     "messages[1].tool_calls[0].function.arguments"),
    ({**CALL, "function": {"name": "get_weather"}}, "messages[1].tool_calls[0].function.arguments"),
    ("call", "messages[1].tool_calls[0]"),
])
@pytest.mark.parametrize("native", [True, False])
def test_a_bad_history_tool_call_is_400_naming_the_field(call, param, native):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(APIError) as e:
        _messages(msgs, native)
    assert e.value.status == 400 and e.value.param == param, e.value
    with pytest.raises(APIError) as e:
        _messages([msgs[0], {**msgs[1], "tool_calls": "x"}], native)
    assert e.value.param == "messages[1].tool_calls"
    ok = _messages([msgs[0], {**msgs[1], "tool_calls": [CALL]}], native)
    assert native or json.loads(ok[1]["content"]) == {"name": "get_weather", "arguments": {"city": "P"}}


def test_forced_schema_resolves_defs_refs():
    jsonschema = pytest.importorskip("jsonschema")
    for choice in ("required", {"type": "function", "function": {"name": "book"}}):
        for parallel in (None, True):
            body = {"tools": [W, DEFS], "tool_choice": choice}
            if parallel:
                body["parallel_tool_calls"] = True
            schema = answer_schema(parse_tools(body))
            good = {"name": "book", "arguments": {"city": {"name": "Rome"}, "also": []}}
            jsonschema.validate(good, schema)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate({"name": "book", "arguments": {"city": {"nom": "Rome"}, "also": []}}, schema)


@pytest.mark.parametrize("params", [{"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}])
def test_parameters_that_only_refer_to_themselves_are_400(params):
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    with pytest.raises(APIError) as e:
        guided(parse_tools({"tools": [tool], "tool_choice": "required"}))
    assert e.value.status == 400 and e.value.param == "tools"


def test_a_forced_call_with_defs_generates_valid_calls(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from minfer import LLM, SamplingParams

    from .test_structured_output import ENGINE, save_char_tiny

    llm = LLM(model=save_char_tiny(tmp_path / "m"), **ENGINE)
    r = parse_tools({"tools": [W, DEFS], "tool_choice": {"type": "function", "function": {"name": "book"}}})
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, guided_decoding=guided(r)) for s in range(4)]
    for o in llm.generate(["ab"] * 4, params):
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", text
        content, calls = parse_output(text, r)
        assert content is None and len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), DEFS["function"]["parameters"])


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_an_output_with_nan_is_text_not_a_call(value):
    r = parse_tools({"tools": [W]})
    text = '{"name": "get_weather", "arguments": {"city": %s}}' % value
    assert parse_output(text, r) == (text, [])
    assert parse_output(f"<tool_call>{text}</tool_call>", r)[1] == []


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> and then prose',
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\nprose\n<tool_call>{"name": "get_weather", '
    '"arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {}}<tool_call>{"name": "get_weather", '
    '"arguments": {}}</tool_call>',  # the first block left open
])
def test_text_beside_tool_call_blocks_stays_content(text):
    assert parse_output(text, parse_tools({"tools": [W]})) == (text, [])


def test_tool_call_blocks_alone_still_parse():
    r = parse_tools({"tools": [W]})
    for text in ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n',
                 '<tool_call>\n{"name": "get_weather", "arguments": {}}'):  # the last block left open
        content, calls = parse_output(text, r)
        assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]


# -- through the server (TestClient, the real SmolLM2-135M-Instruct) -------------------------------------------
@pytest.fixture(scope="module")
def client(llm):
    pytest.importorskip("llguidance")
    from fastapi.testclient import TestClient

    from minfer.serve.routes import build_app

    with TestClient(build_app(llm.llm_engine, served_model_names=["m"], log_requests=False)) as c:
        yield c, llm.llm_engine


USER = [{"role": "user", "content": "Book a trip to Rome."}]


@pytest.mark.parametrize("body, param", [
    ({"tools": [W], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}}, "tool_choice"),
    ({"tools": [W], "tool_choice": {"type": "function", "function": {"name": {"x": 1}}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {**W["function"], "description": ["d"]}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [W], "messages": USER + [{"role": "assistant", "content": None, "tool_calls": [{"function": "x"}]}]},
     "messages[1].tool_calls[0].id"),
    ({"tools": [W], "messages": USER + [{"role": "assistant", "content": None,
                                         "tool_calls": [{**CALL, "function": "x"}]}]},
     "messages[1].tool_calls[0].function"),
])
@pytest.mark.timeout(600)
def test_bad_tools_requests_are_400_and_nothing_is_lost(client, body, param):
    c, engine = client
    r = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 20, "messages": USER, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert not engine.has_unfinished_requests() and engine.all_blocks_free()
    assert c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3, "messages": USER}).status_code == 200


@pytest.mark.timeout(600)
def test_a_forced_call_with_defs_through_the_server(client):
    jsonschema = pytest.importorskip("jsonschema")
    c, engine = client
    r = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 80, "temperature": 0, "messages": USER,
                                              "tools": [W, DEFS],
                                              "tool_choice": {"type": "function", "function": {"name": "book"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "book"
    jsonschema.validate(json.loads(call["arguments"]), DEFS["function"]["parameters"])
    assert not engine.has_unfinished_requests() and engine.all_blocks_free()


def test_refs_are_rebased_in_subschemas_not_in_values():
    from minfer.serve.tools import _rebase

    schema = {"properties": {"default": {"$ref": "#/$defs/A"}, "x": {"const": {"$ref": "#"}, "default": {"$ref": "#"}}},
              "$defs": {"A": {"items": [{"$ref": "#"}]}}, "$ref": "other.json"}
    assert _rebase(schema, "#/$defs/t") == {
        "properties": {"default": {"$ref": "#/$defs/t/$defs/A"},
                       "x": {"const": {"$ref": "#"}, "default": {"$ref": "#"}}},
        "$defs": {"A": {"items": [{"$ref": "#/$defs/t"}]}}, "$ref": "other.json"}
