"""OpenAI's Responses API on the server (`minfer/serve/responses.py`): `POST /v1/responses`, streamed or not,
`previous_response_id` with `store`, `GET /v1/responses/{id}`, `text.format`, function tools, driven by the
official openai client (`responses.create`, `responses.stream`, `responses.retrieve`) and, where it is
installed (`pip install openai-agents`), by the OpenAI Agents SDK, whose default model speaks this API.

The oracle of each answer is the chat-completions route on the same conversation: the Responses API is chat
with other shapes, so at temperature 0 both must give the same text and count the same tokens.

    pytest -q tests/test_responses_api.py
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from minfer.serve.responses import ResponseStore
from tests.serving import running_server

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512

pytestmark = pytest.mark.timeout(300)

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def server():
    with running_server(["--max-model-len", str(MAX_MODEL_LEN), "--disable-log-requests",
                         "--uvicorn-log-level", "warning"], fake_engine_args=[MODEL, str(MAX_MODEL_LEN)]) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, messages, max_tokens):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_create_matches_chat_on_the_same_conversation(client):
    r = client.responses.create(model=MODEL, input="Name three colors.", instructions="Answer briefly.",
                                max_output_tokens=12, temperature=0)
    text, usage = _chat(client, [{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": "Name three colors."}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == text and text
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens
    if usage.completion_tokens == 12:  # cut by max_output_tokens
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_input_as_message_items_with_developer_role(client):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0)
    text, _ = _chat(client, [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "Name a fruit."}], 8)
    assert r.output_text == text


def test_stream_events_in_order_and_text_equal_to_non_stream(client):
    # room for the whole answer (25 tokens): a stream cut by max_output_tokens ends with response.incomplete
    # instead (test_streamed_response_cut_by_max_output_tokens_ends_incomplete)
    kwargs = dict(model=MODEL, input="Count from one to five.", max_output_tokens=40, temperature=0)
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # streamed as generated, not in one piece
    assert "".join(deltas) == final.output_text == plain.output_text
    assert final.id == events[0].response.id and final.usage.output_tokens == plain.usage.output_tokens
    assert final.status == plain.status


def test_previous_response_id_continues_the_stored_conversation(client, server):
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=10, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
    # the second turn ran on turn 1 (without its instructions, which are not carried over) + turn 1's answer
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    text, usage = _chat(client, conversation, 10)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text


def test_unknown_and_unstored_ids_get_clear_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.code == "previous_response_not_found" and "resp_nope" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for bad in ({"tools": [{"type": "web_search"}]}, {"background": True}, {"input": [{"type": "input_image"}]},
                {"truncation": "auto"}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 2, **bad})


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Pick a color.", temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                                                 "strict": True}})
    assert json.loads(r.output_text)["color"] in ("red", "green", "blue")
    assert r.text.format.type == "json_schema"


def test_forced_function_call_then_its_output_sent_back(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and r.status == "completed"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)  # strict: no invented keys
    # the call and its result go back as input items, as the agent loop does
    follow = client.responses.create(model=MODEL, tools=TOOLS, temperature=0, max_output_tokens=20, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}], tool_choice="none")
    assert follow.output and follow.output[0].type == "message" and follow.output_text


def test_streamed_function_call_events(client):
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=TOOLS, tool_choice="required",
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    i = kinds.index("response.function_call_arguments.done")
    assert kinds[i - 1] == "response.function_call_arguments.delta" and kinds[i + 1] == "response.output_item.done"
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments)["city"]


def test_raw_wire_format_of_a_stream(server):
    """Each event is `event: <type>` + `data: <json with the same type>`, as OpenAI sends them."""
    with httpx.stream("POST", server + "/v1/responses", timeout=60,
                      json={"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]


def test_store_is_bounded():
    store = ResponseStore(capacity=3)
    for i in range(5):
        store.put({"id": f"resp_{i}"}, [])
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]


def test_openai_agents_runs_on_the_responses_api(server):
    """The OpenAI Agents SDK (its default model class calls /v1/responses): a plain answer, then a tool the
    agent must call, whose result ends the run (`stop_on_first_tool`)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        seen.append(city)
        return f"Sunny in {city}"

    # room enough for the whole answer: the SDK takes a response cut by max_output_tokens as a failure
    plain = agents.Agent(name="a", instructions="Answer in one short sentence.", model=model,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=80))
    result = agents.Runner.run_sync(plain, "Say hello.")
    assert isinstance(result.final_output, str) and result.final_output
    tooled = agents.Agent(name="w", instructions="Use the tool.", model=model, tools=[get_weather],
                          tool_use_behavior="stop_on_first_tool",
                          model_settings=agents.ModelSettings(temperature=0, tool_choice="required"))
    result = agents.Runner.run_sync(tooled, "What is the weather in Paris?")
    assert len(seen) == 1 and result.final_output == f"Sunny in {seen[0]}"


# ----------------------------------------------------------------------------------------------------------
# Issue 40 on the real server (the rest, on the fake engine: tests/test_responses_limits.py)
# ----------------------------------------------------------------------------------------------------------
def test_tokenize_with_tools_counts_the_chat_prompt(server, client):
    """/tokenize renders tools as the chat route does: its count is chat's usage.prompt_tokens. Both for
    "required" (minfer's tool prompt shown to a template that ignores tools) and unset (vLLM's rule: the
    template decides, and SmolLM2's shows no tools)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    without = httpx.post(server + "/tokenize", json={"messages": messages}, timeout=60).json()["count"]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=chat_tools, max_tokens=1,
                                       tool_choice="required")
    with_tools = httpx.post(server + "/tokenize", json={"messages": messages, "tools": chat_tools,
                                                       "tool_choice": "required"}, timeout=60)
    assert with_tools.json()["count"] == r.usage.prompt_tokens > without
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=chat_tools, max_tokens=1)
    unset = httpx.post(server + "/tokenize", json={"messages": messages, "tools": chat_tools}, timeout=60)
    assert unset.json()["count"] == r.usage.prompt_tokens


def test_4mb_metadata_and_lone_surrogates_are_400s(server):
    r = httpx.post(server + "/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "metadata": {"k": "v" * 4_000_000}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text[:300]
    for stream in (False, True):
        raw = json.dumps({"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": stream,
                          "metadata": {"k": "\ud800"}})
        r = httpx.post(server + "/v1/responses", content=raw, headers={"Content-Type": "application/json"},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text[:300]


def test_streamed_response_cut_by_max_output_tokens_ends_incomplete(client):
    with client.responses.stream(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=4,
                                 temperature=0) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_input_items_delete_and_cancel_with_the_openai_client(client):
    r = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=2)
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]
    assert items.data[0].content[0].text == "Say hi." and items.has_more is False
    with pytest.raises(openai.BadRequestError) as e:  # not a background response, as OpenAI answers
        client.responses.cancel(r.id)
    assert "background" in e.value.message
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
