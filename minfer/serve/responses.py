"""OpenAI's Responses API (`/v1/responses`) for text generation, as vLLM serves it.

| route | answers |
| --- | --- |
| POST /v1/responses | a Response object, or (`"stream": true`) its events |
| GET /v1/responses/{id} | a stored Response; 404 for an id not stored |
| GET /v1/responses/{id}/input_items | OpenAI's list of the input items of a stored response (`limit`, `order`, `after`, `before`) |
| DELETE /v1/responses/{id} | removes it: `{"id", "object": "response", "deleted": true}`; 404 for an id not stored |
| POST /v1/responses/{id}/cancel | 400: only background responses can be cancelled, and minfer runs none; 404 for an id not stored |

The Responses API is chat with other shapes: `input` (a string, or a list of message, `function_call` and
`function_call_output` items) plus `instructions` in; a list of output items (`message` with `output_text`
parts, `function_call`) out. So this module only translates: the request into a chat-completions body, which
`routes.serve_chat` runs (template, tools, structured output, fallbacks and all), and the chat answer back into
a Response object, or, streamed, the chat chunks into the Responses event sequence:

    response.created, response.in_progress,
    [response.output_item.added (message), response.content_part.added,
     response.output_text.delta ..., response.output_text.done, response.content_part.done,
     response.output_item.done],
    [response.output_item.added (function_call), response.function_call_arguments.delta,
     response.function_call_arguments.done, response.output_item.done] ...,
    response.completed, or response.incomplete (status "incomplete", incomplete_details.reason
    "max_output_tokens") when max_output_tokens cut it, as OpenAI ends such a stream

| request field | chat-completions field |
| --- | --- |
| `input`, `instructions` | `messages` (`instructions` as the first, system, message; not carried to the next turn) |
| `max_output_tokens`, `temperature`, `top_p` (and vLLM's `top_k`, `min_p`, `seed`, `repetition_penalty`, `stop_token_ids`...) | the same sampling fields |
| `text.format` (`json_schema`, `json_object`, `text`) | `response_format` |
| `tools` (`{"type": "function", "name", "parameters", "strict"}`), `tool_choice`, `parallel_tool_calls` | `tools`, `tool_choice`, `parallel_tool_calls` |
| `previous_response_id` | the stored conversation of that response, then `input` |

What is echoed back is checked first, with OpenAI's limits (`check_request`): `metadata` at most 16 pairs of
string keys of at most 64 characters and string values of at most 512; `user` and `safety_identifier` at
most 64 characters (OpenAI's bound on `safety_identifier`, which replaces `user`); ids without control or
bidi characters; every string valid Unicode (no lone surrogate, which UTF-8 cannot encode); `text` an object
and a `json_schema` format with its `schema`; each `function_call_output` answering a `function_call` of the
input or of the previous response.

`store` (default true, as OpenAI's) keeps the response, its input items and its conversation in memory, in a
store bounded in count and in bytes (`ResponseStore`: `--max-stored-responses`, `--max-response-store-bytes`;
the oldest go first), for `previous_response_id` and the routes above; an id that is not there is a 404 there
and a 400 (`previous_response_not_found`) as a `previous_response_id`. A response is stored as the JSON it is
served as, rendered first: what cannot be served is never stored. Built-in tools (web search, file search...),
background mode and truncation "auto" are refused with a 400. An omitted `max_output_tokens` is filled in as
chat fills in an omitted `max_tokens` (what is left of max_model_len after the prompt).
Source: https://platform.openai.com/docs/api-reference/responses and vLLM's
`vllm/entrypoints/openai/serving_responses.py`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from minfer.serve.protocol import APIError, check_id, check_utf8, echo, sampling_params

logger = logging.getLogger("minfer.serve")
router = APIRouter()

MAX_STORED_RESPONSES = 1024  # stored responses kept for previous_response_id; the oldest go first
MAX_RESPONSE_STORE_BYTES = 128 * 2**20  # their JSON together (bytes); the oldest go first
# What one stored entry costs beside its JSON (bytes): the OrderedDict slot, its key, the entry object and three
# bytes objects' headers, measured with tracemalloc at about 310 bytes; rounded up.
ENTRY_OVERHEAD_BYTES = 1024
# OpenAI's limits (API reference, "metadata" and "safety_identifier" of POST /v1/responses)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_USER_CHARS = 64
_SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                    "stop_token_ids")
_REFUSED = {"background": "background mode", "conversation": "conversations", "prompt": "prompt templates"}


def _render(value) -> bytes:
    """`value` as the UTF-8 JSON it is served as (raises UnicodeEncodeError for a lone surrogate)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class StoredResponse:
    """One stored response, as the JSON it is served as: the Response object, its input items and the
    conversation after it (chat messages, its output included). Kept as bytes so that what is counted is what
    is held (a parsed dict of short strings costs several times its JSON)."""

    __slots__ = ("response_json", "input_items_json", "messages_json")

    def __init__(self, response_json: bytes, input_items_json: bytes, messages_json: bytes):
        self.response_json, self.input_items_json = response_json, input_items_json
        self.messages_json = messages_json

    @property
    def nbytes(self) -> int:
        """What it holds: its three JSON texts and `ENTRY_OVERHEAD_BYTES` (bytes)."""
        return len(self.response_json) + len(self.input_items_json) + len(self.messages_json) + ENTRY_OVERHEAD_BYTES

    def response(self) -> dict:
        return json.loads(self.response_json)

    def input_items(self) -> list[dict]:
        return json.loads(self.input_items_json)

    def messages(self) -> list[dict]:
        return json.loads(self.messages_json)


class ResponseStore:
    """Stored responses, id -> `StoredResponse`, bounded in count and in bytes.

    Args:
        capacity: most responses kept (`--max-stored-responses`).
        max_bytes: most bytes their JSON and entries take together (`StoredResponse.nbytes`;
            `--max-response-store-bytes`). Adding one past either bound drops the oldest first; one larger
            than `max_bytes` alone is not stored (`put` returns False).

    Raises:
        ValueError: a bound that is not a positive integer.
    """

    def __init__(self, capacity: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_RESPONSE_STORE_BYTES):
        for name, v in (("capacity", capacity), ("max_bytes", max_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ResponseStore {name} must be a positive integer, got {v!r}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def put(self, response: dict, messages: list[dict], input_items: list[dict] | None = None) -> bool:
        """Render and store `response` (its conversation `messages`, its `input_items`); True if stored.

        Rendered first: a value UTF-8 cannot encode raises here (UnicodeEncodeError) and nothing is stored.
        """
        entry = StoredResponse(_render(response), _render(input_items or []), _render(messages))
        self.delete(response["id"])
        if entry.nbytes > self.max_bytes:
            logger.warning("response %s is %d bytes, more than the whole store (--max-response-store-bytes %d): "
                           "not stored", response["id"], entry.nbytes, self.max_bytes)
            return False
        self.items[response["id"]] = entry
        self.nbytes += entry.nbytes
        while len(self.items) > self.capacity or self.nbytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self.items.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self.items.pop(response_id, None)
        if old is not None:
            self.nbytes -= old.nbytes
        return old is not None


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "responses", None) is None:
        limits = getattr(getattr(state, "serving", None), "limits", None)
        state.responses = ResponseStore(getattr(limits, "max_stored_responses", MAX_STORED_RESPONSES),
                                        getattr(limits, "max_response_store_bytes", MAX_RESPONSE_STORE_BYTES))
    return state.responses


# -- what is echoed back, checked ------------------------------------------------------------------------
def check_request(body: dict) -> None:
    """The fields a Response echoes, checked against OpenAI's limits (see the module docstring).

    Raises:
        APIError(400) naming the field: a lone surrogate in any string of the body, `metadata` not an object of
            at most 16 string pairs (keys <= 64, values <= 512 characters), `user` / `safety_identifier` not a
            string of at most 64 characters, a `previous_response_id` with control or bidi characters, `text`
            not an object.
    """
    for name, value in body.items():
        check_utf8(value, name)
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise APIError(400, f"metadata must be an object of string keys and values, got {echo(meta)}",
                           param="metadata")
        if len(meta) > MAX_METADATA_PAIRS:
            raise APIError(400, f"metadata has {len(meta)} pairs; at most {MAX_METADATA_PAIRS} are allowed",
                           param="metadata")
        for k, v in meta.items():
            if len(k) > MAX_METADATA_KEY_CHARS:
                raise APIError(400, f"metadata key {echo(k)} has {len(k)} characters; at most "
                                    f"{MAX_METADATA_KEY_CHARS} are allowed", param="metadata")
            if not isinstance(v, str):
                raise APIError(400, f"metadata.{echo(k)} must be a string, got {echo(v)}", param="metadata")
            if len(v) > MAX_METADATA_VALUE_CHARS:
                raise APIError(400, f"metadata.{echo(k)} has {len(v)} characters; at most "
                                    f"{MAX_METADATA_VALUE_CHARS} are allowed", param="metadata")
    for name in ("user", "safety_identifier"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_CHARS):
            raise APIError(400, f"{name} must be a string of at most {MAX_USER_CHARS} characters, got "
                                f"{echo(value)}", param=name)
    if body.get("previous_response_id") is not None:
        check_id(body["previous_response_id"], "previous_response_id")
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise APIError(400, f"text must be an object such as {{\"format\": {{\"type\": \"text\"}}}}, got "
                            f"{echo(body['text'])}", param="text")


# -- the request -> a chat body --------------------------------------------------------------------------------
def _text_of(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (`input_text`, `output_text`, `text`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}[{j}]: only text parts are supported (input_text, output_text), "
                                    f"got {echo(kind)}", param="input")
        return "".join(texts)
    raise APIError(400, f"{where} must be a string or a list of text parts, got {echo(content)}", param="input")


def input_messages(value, history: list[dict] | None = None) -> list[dict]:
    """`input` as chat messages: a string is one user message; a list holds messages (`{"role", "content"}`,
    with or without `"type": "message"`), `function_call` items (an assistant turn's tool calls, consecutive
    ones joined) and `function_call_output` items (tool results). `reasoning` items are dropped.

    Args:
        history: the conversation before it (chat messages), whose tool calls a `function_call_output` may
            answer.

    Raises:
        APIError(400, param="input"): anything else; a `call_id` that is not a safe id (`protocol.check_id`);
            a `function_call_output` whose `call_id` no `function_call` of the input or of `history` has
            (OpenAI: "No tool call found for function call output with call_id ...").
    """
    calls = {c.get("id") for m in history or () for c in m.get("tool_calls") or () if isinstance(c, dict)}
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object, got {echo(item)}", param="input")
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {echo(role)}",
                               param="input")
            # "developer" is the Responses API's name for system instructions; chat templates know "system"
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(x, str) for x in (name, args, call_id)):
                raise APIError(400, f"{where}: a function_call needs string name, arguments and call_id",
                               param="input")
            check_id(call_id, f"{where}.call_id")
            calls.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call_output needs a string call_id", param="input")
            check_id(call_id, f"{where}.call_id")
            if call_id not in calls:
                raise APIError(400, f"{where}: no tool call found for function call output with call_id "
                                    f"{echo(call_id)}: send the function_call item before it, or the "
                                    "previous_response_id of the response that made the call", param="input")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # minfer's models write no separate reasoning; nothing to show the template
        else:
            raise APIError(400, f"{where}: input items of type {echo(kind)} are not supported (message, "
                                "function_call, function_call_output)", param="input")
    if not out:
        raise APIError(400, "input holds no message", param="input")
    return out


def input_items(value) -> list[dict]:
    """`input` (checked by `input_messages`) as the items `GET /v1/responses/{id}/input_items` lists, each with
    an id, as OpenAI lists them: a string is one user `message` with an `input_text` part."""
    items = [value] if isinstance(value, str) else list(value)
    out = []
    for item in items:
        if isinstance(item, str) or item.get("type") in (None, "message"):
            role = "user" if isinstance(item, str) else item.get("role")
            content = item if isinstance(item, str) else item.get("content")
            kind = "output_text" if role == "assistant" else "input_text"
            parts = ([{"type": kind, "text": content}] if isinstance(content, str) else
                     [{"type": kind, "text": p} if isinstance(p, str) else p for p in content])
            out.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": role, "content": parts,
                        "status": "completed"})
        elif item["type"] == "function_call":
            out.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": item["call_id"],
                        "name": item["name"], "arguments": item["arguments"], "status": "completed"})
        elif item["type"] == "function_call_output":
            out.append({"type": "function_call_output", "id": f"fco_{uuid.uuid4().hex}", "call_id": item["call_id"],
                        "output": item.get("output"), "status": "completed"})
    return out


def _chat_tools(tools) -> list[dict] | None:
    """Responses function tools (`{"type": "function", "name", "description", "parameters", "strict"}`) as
    chat tools; APIError(400) for built-in tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise APIError(400, f"tools[{i}]: only function tools are supported, got {echo(kind)}", param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice is None or isinstance(choice, str):
        return choice
    raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                        f"\"name\": ...}}, got {echo(choice)}", param="tool_choice")


def _response_format(text) -> dict | None:
    """`text.format` as chat's `response_format`.

    Raises:
        APIError(400): `text` not an object, a format of another type, a `json_schema` format without a
            `schema` object (OpenAI requires it) or with a `name` that is not a string.
    """
    if text is None:
        return None
    if not isinstance(text, dict):
        raise APIError(400, f"text must be an object such as {{\"format\": {{\"type\": \"text\"}}}}, got "
                            f"{echo(text)}", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, f"text.format.schema is required for a json_schema format: a JSON schema object, got "
                            f"{echo(fmt.get('schema'))}", param="text.format.schema")
    if fmt.get("name") is not None and not isinstance(fmt["name"], str):
        raise APIError(400, f"text.format.name must be a string, got {echo(fmt['name'])}", param="text.format.name")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response",
                                                   "schema": fmt.get("schema"), "strict": fmt.get("strict")}}


def chat_body(body: dict, history: list[dict]) -> dict:
    """The chat-completions body of a Responses request, after the stored conversation `history`."""
    for name, what in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise APIError(400, f"{what} ('{name}') are not supported by minfer", param=name)
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, "truncation must be \"disabled\": minfer does not drop context to fit",
                       param="truncation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, f"instructions must be a string, got {echo(instructions)}", param="instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history \
        + input_messages(body.get("input"), history)
    chat = {"messages": messages, "stream": body.get("stream", False)}
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("parallel_tool_calls", "parallel_tool_calls"), *((k, k) for k in _SAMPLING_EXTRAS)):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    elif body.get("tool_choice") not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    rf = _response_format(body.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    return chat


# -- the answer -------------------------------------------------------------------------------------------
def _usage(u: dict | None) -> dict | None:
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def _status(finish_reason: str | None) -> tuple[str, dict | None]:
    if finish_reason in ("stop", "tool_calls", None):
        return "completed", None
    reason = "max_output_tokens" if finish_reason == "length" else finish_reason
    return "incomplete", {"reason": reason}


class Shell:
    """The fields of a Response that do not depend on the output: the request's settings, echoed."""

    def __init__(self, body: dict, model: str):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.body, self.model = body, model

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: dict | None = None, error: dict | None = None) -> dict:
        b = self.body
        text = b.get("text") if isinstance(b.get("text"), dict) else {}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": error, "incomplete_details": incomplete, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "model": self.model, "output": output,
                "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": b.get("previous_response_id"), "reasoning": None,
                "store": b.get("store", True), "temperature": b.get("temperature", 1.0),
                "text": {"format": text.get("format") or {"type": "text"}},
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "top_p": b.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
                "user": b.get("user"), "metadata": b.get("metadata") or {}}


def output_items(message: dict, finish_reason: str | None = None) -> list[dict]:
    """A chat answer's message as Response output items: its text as a `message` ("incomplete" when the answer
    was cut, as OpenAI marks it), then each tool call as a `function_call`."""
    items = []
    if message.get("content"):
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], _status(finish_reason)[0]))
    items += [_call_item(c) for c in message.get("tool_calls") or []]
    return items


def conversation_after(messages: list[dict], output: list[dict]) -> list[dict]:
    """The chat messages of a finished turn (its `instructions` left out) with its output appended, as the
    next turn's history."""
    out = [dict(m) for m in messages]
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    turn = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return out + [turn]


# -- the routes -------------------------------------------------------------------------------------------
@router.post("/v1/responses")
async def create_response(request: Request):
    from minfer.serve.routes import _read, serve_chat

    serving, body, model = await _read(request)
    check_request(body)
    store = _store(request)
    history: list[dict] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        found = store.get(prev)
        if found is None:
            raise APIError(400, f"Previous response with id {echo(prev)} not found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = found.messages()
    if body.get("store") is not None and not isinstance(body.get("store"), bool):
        raise APIError(400, f"store must be a boolean, got {echo(body['store'])}", param="store")
    if body.get("n") not in (None, 1):
        raise APIError(400, "the Responses API returns one output: n must be 1", param="n")
    chat = chat_body(body, history)
    params = sampling_params(chat, chat=True, defaults=serving.default_sampling_params)
    shell = Shell(body, model)
    instructions = 1 if body.get("instructions") else 0
    turn = chat["messages"][instructions:]
    keep = body.get("store", True)
    items = input_items(body["input"]) if keep else None
    answer = await serve_chat(request, serving, chat, model, params)
    if chat["stream"]:
        from minfer.serve.serving import _SSEResponse

        headers = {k: v for k, v in answer.headers.items() if k.lower() in ("cache-control", "x-accel-buffering",
                                                                             "x-max-tokens-capped")}
        events = _events(answer.body_iterator, shell, turn, store if keep else None, items)
        return _SSEResponse(events, media_type="text/event-stream", headers=headers)
    headers = {}
    if isinstance(answer, JSONResponse):
        headers = {k: v for k, v in answer.headers.items() if k.lower().startswith("x-")}
        answer = json.loads(answer.body)
    elif not isinstance(answer, dict):  # the client left (499): nobody reads it
        return answer
    choice = answer["choices"][0]
    output = output_items(choice["message"], choice.get("finish_reason"))
    status, incomplete = _status(choice["finish_reason"])
    response = shell.response(status, output, _usage(answer.get("usage")), incomplete)
    rendered = _render(response)  # before it is stored: what cannot be served is not kept
    if keep:
        store.put(response, conversation_after(turn, output), items)
    return Response(rendered, media_type="application/json", headers=headers)


def _stored(request: Request, response_id: str) -> StoredResponse:
    """The stored response `response_id`, or APIError(404) in OpenAI's words (the id quoted safely)."""
    found = _store(request).get(response_id)
    if found is None:
        raise APIError(404, f"Response with id {echo(response_id)} not found.", param="response_id",
                       type="not_found_error")
    return found


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str):
    return Response(_stored(request, response_id).response_json, media_type="application/json")


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    """OpenAI's deletion object; 404 for an id not stored (already deleted, evicted or never stored)."""
    _stored(request, response_id)
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str):
    """OpenAI cancels only a response created with `background: true`; minfer runs none (it refuses
    `background`), so every stored response is a 400, as OpenAI answers for one that was not background."""
    _stored(request, response_id)
    raise APIError(400, "Only responses created with background=true can be cancelled; this response was not "
                        "(minfer does not run background responses)", param="response_id")


MAX_LIST_LIMIT = 100  # OpenAI's: `limit` is 1 to 100, default 20


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str):
    """OpenAI's list of a response's input items (`{"object": "list", "data", "first_id", "last_id",
    "has_more"}`): query `limit` (1-100, default 20), `order` ("desc", the default, or "asc"), `after` / `before`
    (an item id: the list starts after it / ends before it, in that order). Its instructions are not items."""
    q = request.query_params
    limit = q.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and len(limit) <= 3) or not 1 <= int(limit) <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be an integer in [1, {MAX_LIST_LIMIT}], got {echo(limit)}", param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be \"asc\" or \"desc\", got {echo(order)}", param="order")
    items = _stored(request, response_id).input_items()
    if order == "desc":
        items.reverse()
    ids = [it.get("id") for it in items]
    for name in ("after", "before"):
        cursor = q.get(name)
        if cursor is None:
            continue
        if cursor not in ids:
            raise APIError(400, f"{name} must be the id of an input item of this response, got {echo(cursor)}",
                           param=name)
        i = ids.index(cursor)
        items, ids = (items[i + 1:], ids[i + 1:]) if name == "after" else (items[:i], ids[:i])
    page = items[:int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


# -- streaming ------------------------------------------------------------------------------------------------
def _event(kind: str, seq: int, **fields) -> str:
    """One server-sent event of the Responses stream: its type named twice, as OpenAI sends it."""
    data = json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n"


async def _events(chat_chunks, shell: Shell, turn: list[dict], store: ResponseStore | None,
                  items: list[dict] | None = None):
    """The Responses events of a streamed answer, from the chat chunks (`serving._stream`) it is made of; the
    finished response is stored in `store` (with its input `items`) before its last event is sent."""
    seq = 0

    def ev(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    output: list[dict] = []
    message: dict | None = None  # the open message item
    finish, usage, error = None, None, None
    yield ev("response.created", response=shell.response("in_progress", []))
    yield ev("response.in_progress", response=shell.response("in_progress", []))

    def close_message():
        nonlocal message
        if message is None:
            return
        i, text = len(output), message["content"][0]["text"]
        part = message["content"][0]
        done = {**message, "status": _status(finish)[0]}  # "incomplete" once the answer was cut
        output.append(done)
        message = None
        yield ev("response.output_text.done", item_id=done["id"], output_index=i, content_index=0, text=text,
                 logprobs=[])
        yield ev("response.content_part.done", item_id=done["id"], output_index=i, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=i, item=done)

    try:
        async for raw in chat_chunks:
            if not raw.startswith("data: {"):
                continue
            chunk = json.loads(raw[6:])
            if "error" in chunk:
                error = chunk["error"]
                yield ev("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                if delta.get("content"):
                    if message is None:
                        message = _message_item(f"msg_{uuid.uuid4().hex}", "", status="in_progress")
                        i = len(output)
                        yield ev("response.output_item.added", output_index=i,
                                 item={**message, "content": []})
                        yield ev("response.content_part.added", item_id=message["id"], output_index=i,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []})
                    message["content"][0]["text"] += delta["content"]
                    yield ev("response.output_text.delta", item_id=message["id"], output_index=len(output),
                             content_index=0, delta=delta["content"], logprobs=[])
                for call in delta.get("tool_calls") or []:
                    for e in close_message():
                        yield e
                    item = _call_item(call)
                    i = len(output)
                    yield ev("response.output_item.added", output_index=i,
                             item={**item, "arguments": "", "status": "in_progress"})
                    yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                             delta=item["arguments"])
                    yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             name=item["name"], arguments=item["arguments"])
                    yield ev("response.output_item.done", output_index=i, item=item)
                    output.append(item)
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
        for e in close_message():
            yield e
        if error is not None:
            yield ev("response.failed", response=shell.response("failed", output, _usage(usage), error={
                "code": error.get("code") or "server_error", "message": error.get("message")}))
            return
        status, incomplete = _status(finish)
        response = shell.response(status, output, _usage(usage), incomplete)
        last = ev("response.incomplete" if status == "incomplete" else "response.completed", response=response)
        if store is not None:  # rendered (the event) before it is stored
            store.put(response, conversation_after(turn, output), items)
        # OpenAI ends a stream cut by max_output_tokens with `response.incomplete`, not `response.completed`
        # (the Agents SDK tells a truncated turn by it; the openai client's `get_final_response()` then raises)
        yield last
    finally:
        aclose = getattr(chat_chunks, "aclose", None)
        if aclose is not None:
            await aclose()
