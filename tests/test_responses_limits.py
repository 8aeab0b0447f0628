"""The Responses API and the routes beside it, bounded and exact (issue 40): OpenAI's limits on what a Response
echoes, the store bounded in bytes, the input_items / delete / cancel routes, lone surrogates and UTF-16 bodies,
`stop_token_ids` and `tool` messages, `guided_choice`'s cap, /tokenize with tools, the fallback and prefix-cache
series. On the fake engine (`tests/fake_engine.py`), in process: no model is loaded.

    pytest -q tests/test_responses_limits.py
"""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest
from fastapi.testclient import TestClient

from minfer.serve.guided import MAX_GUIDED_CHOICE_BYTES, MAX_GUIDED_CHOICES
from minfer.serve.responses import (
    ENTRY_OVERHEAD_BYTES,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_USER_CHARS,
    ResponseStore,
)
from minfer.serve.routes import build_app
from tests.fake_engine import FakeEngine

MAX_MODEL_LEN = 256
JSON_HEADERS = {"Content-Type": "application/json"}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def client():
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, num_blocks=512, max_num_seqs=64)
    with TestClient(build_app(engine, served_model_names=["fake"], log_requests=False),
                    raise_server_exceptions=False) as c:
        yield c


def _error(r, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _post_raw(client, path: str, body: dict):
    """`body` sent as json.dumps writes it (ASCII, a lone surrogate as the escape \\ud800: valid JSON)."""
    return client.post(path, content=json.dumps(body), headers=JSON_HEADERS)


def _max_metadata(tag: int) -> dict:
    return {f"{tag:04d}".ljust(MAX_METADATA_KEY_CHARS, "k")[:MAX_METADATA_KEY_CHARS - 2] + f"{i:02d}":
            "v" * MAX_METADATA_VALUE_CHARS for i in range(MAX_METADATA_PAIRS)}


# ----------------------------------------------------------------------------------------------------------
# The store: bounded in count and in bytes, oldest first
# ----------------------------------------------------------------------------------------------------------
def test_store_counts_bytes_and_drops_the_oldest():
    store = ResponseStore(capacity=100, max_bytes=20_000)
    for i in range(10):
        assert store.put({"id": f"resp_{i}", "text": "x" * 3000}, [{"role": "user", "content": "hi"}])
        assert store.nbytes == sum(e.nbytes for e in store.items.values()) <= store.max_bytes
    kept = list(store.items)
    assert kept == [f"resp_{i}" for i in range(10 - len(kept), 10)] and 4 <= len(kept) < 10  # the newest
    one = store.get("resp_9")
    assert one.nbytes == len(one.response_json) + len(one.input_items_json) + len(one.messages_json) \
        + ENTRY_OVERHEAD_BYTES and one.response()["text"] == "x" * 3000
    assert store.delete("resp_9") and store.get("resp_9") is None and not store.delete("resp_9")
    assert store.nbytes == sum(e.nbytes for e in store.items.values())
    assert not store.put({"id": "big", "text": "x" * 30_000}, [])  # larger than the whole store: not kept
    assert store.get("big") is None and store.nbytes <= store.max_bytes


def test_store_renders_before_storing():
    store = ResponseStore()
    with pytest.raises(UnicodeEncodeError):
        store.put({"id": "resp_bad", "metadata": {"k": "\ud800"}}, [])
    assert store.get("resp_bad") is None and store.nbytes == 0


def test_1024_maximal_responses_stay_under_the_memory_bound():
    """1,024 responses with every echoed field at its largest legal size (16 metadata pairs at 64/512
    characters, a 64-character user, 20 kB of input and output) hold at most max_bytes (128 MiB, the default)
    plus a few kB, measured with tracemalloc: under the 200 MB the issue allows above idle."""
    bound = 128 * 2**20
    store = ResponseStore(capacity=1024, max_bytes=bound)
    text = "é" * 10_000  # two UTF-8 bytes a character
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(1024):
        response = {"id": f"resp_{i:032x}", "metadata": _max_metadata(i), "user": "u" * MAX_USER_CHARS,
                    "instructions": text, "output": [{"type": "message", "content": [{"text": text}]}]}
        store.put(response, [{"role": "user", "content": text}, {"role": "assistant", "content": text}],
                  [{"type": "message", "content": [{"type": "input_text", "text": text}]}])
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(store.items) == 1024 and store.nbytes <= bound
    assert held <= store.nbytes * 1.05 + 2**20, (held, store.nbytes)  # what is counted is what is held
    assert held < 200 * 10**6


def test_store_evicts_by_bytes_before_count():
    store = ResponseStore(capacity=1024, max_bytes=1_000_000)
    for i in range(1024):
        store.put({"id": f"resp_{i}", "metadata": _max_metadata(i)}, [])
    per = store.get("resp_1023").nbytes
    assert len(store.items) == 1_000_000 // per and store.get("resp_0") is None


# ----------------------------------------------------------------------------------------------------------
# What a Response echoes: OpenAI's limits, valid Unicode, safe ids
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"metadata": {f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)}}, "metadata"),
    ({"metadata": {"k" * (MAX_METADATA_KEY_CHARS + 1): "v"}}, "metadata"),
    ({"metadata": {"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": ["k", "v"]}, "metadata"),
    ({"user": "u" * (MAX_USER_CHARS + 1)}, "user"),
    ({"user": 5}, "user"),
    ({"safety_identifier": "s" * (MAX_USER_CHARS + 1)}, "safety_identifier"),
    ({"text": "json"}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "object"}}}, "text.format.schema"),
    ({"previous_response_id": "resp_\u202eevil"}, "previous_response_id"),
    ({"previous_response_id": "resp_\x00"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c\u2067", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "input_image"}]}, "input"),
])
def test_echoed_fields_are_checked(client, extra, param):
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, **extra})
    err = _error(r)
    assert err["param"] == param, err
    assert "\u202e" not in r.text and "\u2067" not in r.text  # an id is quoted with its bidi controls escaped


def test_metadata_at_the_limits_is_accepted_and_echoed(client):
    meta = _max_metadata(0)
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "metadata": meta,
                                           "user": "u" * MAX_USER_CHARS})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == meta and client.get(f"/v1/responses/{r.json()['id']}").json()["metadata"] == meta


def test_a_4mb_metadata_value_is_a_400_and_not_stored(client):
    before = len(client.app.state.responses.items) if getattr(client.app.state, "responses", None) else 0
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "metadata": {"k": "v" * 4_000_000}})
    assert _error(r)["param"] == "metadata"
    assert len(client.app.state.responses.items) == before


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value, param", [
    ("metadata", {"k": "\ud800"}, "metadata"),
    ("metadata", {"\udfff": "v"}, "metadata"),
    ("user", "\ud800", "user"),
    ("instructions", "be \ud800 brief", "instructions"),
    ("input", "hi \ud800", "input"),
    ("input", [{"role": "user", "content": [{"type": "input_text", "text": "\udc00"}]}], "input"),
])
def test_lone_surrogates_are_a_400_naming_the_field(client, stream, field, value, param):
    r = _post_raw(client, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": stream, field: value})
    err = _error(r)
    assert err["param"] == param and "surrogate" in err["message"], err
    assert "TextEncodeInput" not in err["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}], "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages"),
    ("/v1/completions", {"prompt": "alpha \ud800", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["alpha", "\udbff"], "max_tokens": 2}, "prompt"),
    ("/tokenize", {"prompt": "alpha \ud800"}, "prompt"),
    ("/generate", {"prompt": "alpha \ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
])
def test_lone_surrogates_elsewhere_are_a_400_without_internals(client, path, body, param):
    err = _error(_post_raw(client, path, body))
    assert err["param"] == param and "surrogate" in err["message"] and "Union" not in err["message"], err


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_utf16_body_is_a_400(client, encoding):
    raw = json.dumps({"input": "hi", "max_output_tokens": 2}).encode(encoding)
    err = _error(client.post("/v1/responses", content=raw, headers=JSON_HEADERS))
    assert "UTF-8" in err["message"] and "RFC 8259" in err["message"]


def test_a_utf8_body_with_a_byte_order_mark_is_read(client):
    raw = b"\xef\xbb\xbf" + json.dumps({"input": "hi", "max_output_tokens": 2}).encode()
    assert client.post("/v1/responses", content=raw, headers=JSON_HEADERS).status_code == 200


def test_an_unknown_id_is_quoted_without_its_bidi_controls(client):
    r = client.get("/v1/responses/resp_\u202eabc")
    err = _error(r, 404)
    assert "\u202e" not in r.text and "\\u202e" in err["message"]


# ----------------------------------------------------------------------------------------------------------
# The routes: input_items, delete, cancel
# ----------------------------------------------------------------------------------------------------------
def test_input_items_list_delete_and_cancel(client):
    items = [{"role": "user", "content": "alpha"},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "beta"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "gamma"}]}]
    rid = client.post("/v1/responses", json={"input": items, "max_output_tokens": 2}).json()["id"]
    page = client.get(f"/v1/responses/{rid}/input_items").json()
    assert page["object"] == "list" and page["has_more"] is False
    data = page["data"]
    assert [d["type"] for d in data] == ["message", "function_call_output", "function_call", "message"]  # desc
    assert data[0]["content"] == [{"type": "input_text", "text": "gamma"}] and data[1]["output"] == "beta"
    assert (page["first_id"], page["last_id"]) == (data[0]["id"], data[-1]["id"])
    assert len({d["id"] for d in data}) == 4
    asc = client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [d["id"] for d in asc["data"]] == [data[3]["id"], data[2]["id"]] and asc["has_more"] is True
    rest = client.get(f"/v1/responses/{rid}/input_items",
                      params={"order": "asc", "after": asc["last_id"]}).json()
    assert [d["id"] for d in rest["data"]] == [data[1]["id"], data[0]["id"]] and rest["has_more"] is False
    for bad, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"),
                       ({"limit": "\u00b2"}, "limit"), ({"limit": "\u0664"}, "limit"), ({"limit": "9" * 4301}, "limit"),
                       ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        assert _error(client.get(f"/v1/responses/{rid}/input_items", params=bad))["param"] == param
    err = _error(client.post(f"/v1/responses/{rid}/cancel"))
    assert "background" in err["message"]
    assert client.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
    for r in (client.get(f"/v1/responses/{rid}"), client.delete(f"/v1/responses/{rid}"),
              client.get(f"/v1/responses/{rid}/input_items"), client.post(f"/v1/responses/{rid}/cancel")):
        _error(r, 404)


def test_a_string_input_is_one_user_item(client):
    rid = client.post("/v1/responses", json={"input": "alpha", "max_output_tokens": 2}).json()["id"]
    (item,) = client.get(f"/v1/responses/{rid}/input_items").json()["data"]
    assert item["role"] == "user" and item["content"] == [{"type": "input_text", "text": "alpha"}]


def test_function_call_output_answering_the_previous_response(client):
    """A call made in an earlier turn may be answered by id alone (previous_response_id), as the Agents SDK
    does; an output for a call nobody made is refused."""
    first = client.post("/v1/responses", json={"input": [
        {"role": "user", "content": "alpha"},
        {"type": "function_call", "call_id": "call_9", "name": "f", "arguments": "{}"}], "max_output_tokens": 2})
    assert first.status_code == 200, first.text
    ok = client.post("/v1/responses", json={"previous_response_id": first.json()["id"], "max_output_tokens": 2,
                                            "input": [{"type": "function_call_output", "call_id": "call_9",
                                                       "output": "beta"}]})
    assert ok.status_code == 200, ok.text
    err = _error(client.post("/v1/responses", json={"previous_response_id": first.json()["id"], "max_output_tokens": 2,
                                                    "input": [{"type": "function_call_output", "call_id": "call_8",
                                                               "output": "beta"}]}))
    assert "call_8" in err["message"] and err["param"] == "input"


# ----------------------------------------------------------------------------------------------------------
# max_output_tokens: a cut response is "incomplete", streamed or not
# ----------------------------------------------------------------------------------------------------------
def _events(text: str) -> list[dict]:
    return [json.loads(block.split("\ndata: ", 1)[1]) for block in text.strip().split("\n\n")]


def test_a_response_cut_by_max_output_tokens_ends_incomplete(client):
    body = {"input": "alpha beta", "max_output_tokens": 3}
    plain = client.post("/v1/responses", json=body).json()
    assert plain["status"] == "incomplete" and plain["incomplete_details"] == {"reason": "max_output_tokens"}
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = _events(r.read().decode())
    assert events[-1]["type"] == "response.incomplete"
    assert "response.completed" not in [e["type"] for e in events]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    # the cut message item is "incomplete" too, as OpenAI marks it
    assert [it["status"] for it in plain["output"] if it["type"] == "message"] == ["incomplete"]
    assert [it["status"] for it in final["output"] if it["type"] == "message"] == ["incomplete"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "message"]
    assert [it["status"] for it in done] == ["incomplete"]
    assert client.get(f"/v1/responses/{final['id']}").json()["status"] == "incomplete"


def test_a_finished_stream_ends_completed(client):
    with client.stream("POST", "/v1/responses", json={"input": "alpha", "max_output_tokens": 200,
                                                      "stream": True}) as r:
        events = _events(r.read().decode())
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "completed"


# ----------------------------------------------------------------------------------------------------------
# Sampling fields and chat messages
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
    ("/generate", {"prompt": "hi"}),
])
@pytest.mark.parametrize("ids", [[1e30], [2.5], [-1], [50000], [10**12], ["7"]])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(client, path, body, ids):
    err = _error(client.post(path, json={**body, "max_tokens": 2, "stop_token_ids": ids}))
    assert err["param"] == "stop_token_ids", err


def test_stop_token_ids_inside_the_vocabulary_are_accepted(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "stop_token_ids": [0, 49999]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("tool_message", [{"role": "tool", "content": "sunny"},
                                          {"role": "tool", "content": "sunny", "tool_call_id": None},
                                          {"role": "tool", "content": "sunny", "tool_call_id": ""}])
def test_a_tool_message_needs_its_tool_call_id(client, tool_message):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
                tool_message]
    err = _error(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}))
    assert err["param"] == "messages[2].tool_call_id", err
    ok = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": messages[:2] + [
        {**tool_message, "tool_call_id": "call_1"}]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_guided_choice_is_capped_in_count_and_bytes(client, field):
    def body(choices):
        value = {"choice": choices} if field == "structured_outputs" else choices
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}

    t0 = time.perf_counter()
    err = _error(client.post("/v1/chat/completions", json=body([f"c{i}" for i in range(10**5)])))
    assert err["param"] == field and str(MAX_GUIDED_CHOICES) in err["message"]
    assert time.perf_counter() - t0 < 10  # refused before anything is compiled
    long = ["x" * (MAX_GUIDED_CHOICE_BYTES // 10 + 1)] * 10
    err = _error(client.post("/v1/chat/completions", json=body(long)))
    assert err["param"] == field and str(MAX_GUIDED_CHOICE_BYTES) in err["message"]


# ----------------------------------------------------------------------------------------------------------
# /tokenize renders as the chat route does (its count against chat's: tests/test_responses_api.py, on the
# real tokenizer and template)
# ----------------------------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in alpha?"}]


@pytest.mark.parametrize("extra, param", [
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
    ({"tools": "get_weather"}, "tools"),
])
def test_tokenize_refuses_what_it_cannot_honour(client, extra, param):
    assert _error(client.post("/tokenize", json={"messages": MESSAGES, **extra}))["param"] == param
    if param == "chat_template":  # the chat route does not ignore it either
        err = _error(client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, **extra}))
        assert err["param"] == param


def test_tokenize_refuses_tools_with_a_prompt(client):
    assert _error(client.post("/tokenize", json={"prompt": "alpha", "tools": TOOLS}))["param"] == "tools"


def test_tokenize_applies_the_chat_size_checks_to_tools(client):
    huge = [{"type": "function", "function": {"name": "f", "description": "d" * 2_000_000}}]
    err = _error(client.post("/tokenize", json={"messages": MESSAGES, "tools": huge}))
    assert err["param"] == "tools" and err["code"] == "context_length_exceeded"


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------
def test_fallback_and_prefix_cache_series_are_exported(client):
    text = client.get("/metrics").text
    for kind in ("shed", "timeout", "truncate_prompt_tokens", "max_tokens_capped"):
        assert f'minfer:request_fallbacks_total{{kind="{kind}",model_name="fake"}}' in text
    for name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
        assert f"# TYPE {name}_total counter" in text and f'{name}_total{{engine="0",model_name="fake"}}' in text


def test_truncate_prompt_tokens_is_counted_as_a_fallback(client):
    def count():
        line = next(l for l in client.get("/metrics").text.splitlines()
                    if l.startswith('minfer:request_fallbacks_total{kind="truncate_prompt_tokens"'))
        return float(line.rsplit(" ", 1)[1])

    before = count()
    r = client.post("/v1/completions", json={"prompt": "alpha beta gamma delta", "max_tokens": 1,
                                             "truncate_prompt_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2, r.text
    assert count() == before + 1
