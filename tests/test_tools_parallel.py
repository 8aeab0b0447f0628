"""More than one tool call per answer (OpenAI's `parallel_tool_calls`, `minfer/serve/tools.py`): outputs with
several calls (a JSON array, several `<tool_call>` blocks, objects one after another) become several
`tool_calls` in OpenAI's shape, in order, streamed with one index each; `parallel_tool_calls: false` keeps
the first; a bad value is a 400; with an explicit `parallel_tool_calls: true` a forced tool_choice's grammar
takes an array of calls, and guided generation under it on a tiny model always parses into valid calls.

    PYTHONPATH=$PWD python -m pytest -q tests/test_tools_parallel.py
"""

from __future__ import annotations

import json

import pytest

from minfer.serve.protocol import APIError
from minfer.serve.tools import ToolStreamChunks, answer_schema, parse_output, parse_tools

jsonschema = pytest.importorskip("jsonschema")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
TWO = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]


def req(**body):
    return parse_tools({"tools": TOOLS, **body})


@pytest.mark.parametrize("text", [
    json.dumps(TWO),
    "\n".join(json.dumps(c) for c in TWO),
    "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in TWO),
])
def test_several_calls_become_several_tool_calls_in_order(text):
    content, calls = parse_output(text, req())
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    _, first = parse_output(text, req(parallel_tool_calls=False))
    assert [c["function"]["name"] for c in first] == ["get_weather"]


@pytest.mark.parametrize("text", [
    json.dumps(TWO[0]) + " and then some words",
    json.dumps([TWO[0], {"name": "unknown_tool", "arguments": {}}]),
    json.dumps([]),
    "<tool_call>" + json.dumps(TWO[0]) + "</tool_call><tool_call>not json</tool_call>",
])
def test_anything_that_is_not_all_calls_stays_content(text):
    assert parse_output(text, req()) == (text, [])


def test_one_call_still_parses_as_before():
    content, calls = parse_output(json.dumps(TWO[0]), req())
    assert content is None and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("bad", ["yes", 1, {}])
def test_bad_parallel_tool_calls_is_a_400(bad):
    with pytest.raises(APIError) as e:
        req(parallel_tool_calls=bad)
    assert e.value.status == 400 and e.value.param == "parallel_tool_calls"


def test_forced_grammar_takes_an_array_only_when_asked():
    single = answer_schema(req(tool_choice="required"))
    jsonschema.validate(TWO[0], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(TWO, single)
    for r in (req(tool_choice="required", parallel_tool_calls=False),):
        assert answer_schema(r) == single
    many = answer_schema(req(tool_choice="required", parallel_tool_calls=True))
    jsonschema.validate(TWO, many)
    jsonschema.validate(TWO[0], many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], many)
    named = answer_schema(req(tool_choice={"type": "function", "function": {"name": "get_time"}},
                              parallel_tool_calls=True))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(TWO, named)  # a named tool_choice: every call is of that tool
    jsonschema.validate([TWO[1], TWO[1]], named)


def test_stream_sends_every_call_with_its_index():
    class Out:
        index, token_ids, finish_reason, text = 0, [1, 2], "stop", json.dumps(TWO)

    chunks = ToolStreamChunks.__new__(ToolStreamChunks)
    chunks.tool_request, chunks.finished, chunks.completion_tokens, chunks.streaming_text = req(), set(), {}, set()
    chunks.prompt_index, chunks.n = {"r": 0}, 1
    d = chunks._choice_delta("r", Out())
    assert d["finish_reason"] == "tool_calls"
    assert [(c["index"], c["function"]["name"]) for c in d["delta"]["tool_calls"]] == [(0, "get_weather"), (1, "get_time")]


def test_guided_parallel_answers_parse_into_valid_calls(tmp_path):
    pytest.importorskip("llguidance")
    from minfer import LLM, SamplingParams
    from minfer.serve.tools import guided

    from .test_structured_output import ENGINE, save_char_tiny

    llm = LLM(model=save_char_tiny(tmp_path / "m"), **ENGINE)
    r = req(tool_choice="required", parallel_tool_calls=True)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, guided_decoding=guided(r)) for s in range(6)]
    for o in llm.generate(["ab"] * 6, params):
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", text
        content, calls = parse_output(text, r)
        assert content is None and calls, text
        for c in calls:
            fn = next(t["function"] for t in TOOLS if t["function"]["name"] == c["function"]["name"])
            jsonschema.validate(json.loads(c["function"]["arguments"]), fn["parameters"])
