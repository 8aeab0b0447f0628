"""Tools (function calling) in /v1/chat/completions: OpenAI's `tools` and `tool_choice`, with `tool_calls` in
the answer.

    parse_tools(body) ─► render_prompt ─► [grammar for "required" / a named function] ─► engine ─► parse_output
     (tools, choice)     (the template's       (the output IS a call:                                   (text ->
                          tool support, or      {"name": ..., "arguments": {...}})                        tool_calls)
                          minfer's own prompt)

`tool_choice`:

- "none": the tools are not shown to the model; the answer is text.
- "auto" (the default when tools are given): the tools are shown; the output is free, and a reply that is a
  call (`{"name": <a tool>, "arguments": {...}}`, bare or inside `<tool_call>...</tool_call>` as Hermes-style
  templates write it) is returned as `tool_calls`, anything else as `content`.
- "required" / `{"type": "function", "function": {"name": ...}}`: structured output constrains the output to
  the JSON of one call of any tool / of that tool (its `parameters` schema for the arguments), so the answer
  is always a valid call (`minfer.structured_output`).

A chat template that renders `tools` (Qwen's, Llama 3.1's, Hermes') is given them. One that ignores them
(SmolLM2-135M-Instruct's: the render is the same with and without) gets them in a system message that
minfer writes, `TOOL_PROMPT`, when `writes_tool_prompt` says so (the server's `--tool-prompt`):

| tool_choice | `template` (the default, as vLLM) | `minfer` |
| --- | --- | --- |
| "auto" (or unset) | none: the prompt is the request's without tools | minfer's, within a token budget (*) |
| "required", a named function | minfer's (the guided call needs the tools' descriptions) | minfer's |

(*) `--tool-prompt-max-tokens` (default `DEFAULT_TOOL_PROMPT_MAX_TOKENS`, 1,024): a tool prompt over it is
left out, as under `template`, and a warning is logged (`routes._render_chat`).

vLLM hands `tools` to the chat template and nothing else, so a template that ignores them leaves the prompt
as it is without tools. Open WebUI attaches its 36 built-in tools to every chat without a tool_choice:
minfer's listing of them makes a 35-token chat 6,601 tokens. A past assistant turn's `tool_calls` are
written as the JSON text of each call whenever the template does not render tools, whatever the mode.

More than one call per answer (OpenAI's `parallel_tool_calls`, true by default): an output that is a JSON
array of calls, several `<tool_call>` blocks, or one call object per line becomes several `tool_calls`, in
order; with `parallel_tool_calls: false` only the first is returned. A forced tool_choice constrains the output
to one call, or, when the request says `parallel_tool_calls: true` explicitly, to one call or a non-empty array
of calls (left out, the forced grammar stays one call: a small model offered the array tends to repeat calls).
A streamed answer with tools streams its text as it is generated once the output cannot be a call any more
(`is_text`: it starts with prose); a call (or text that began like one) is sent in one delta when the output
is complete (vLLM's tool parsers stream the arguments as they grow).

Strictness: a forced call's grammar closes every object schema that lists its `properties`
(`"additionalProperties": false`, `strict_schema`), as xgrammar's strict mode (vLLM's default) does, so the
model cannot invent keys; a function with `"strict": false` opts out (JSON Schema's own rule: extra keys
allowed). A forced call cut by `max_tokens` is returned in `tool_calls` with its arguments as written so far
(not valid JSON) and finish_reason "length", as vLLM does (`partial_call`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from minfer.sampling_params import GuidedDecodingParams
from minfer.serve.protocol import APIError, StreamChunks, echo

TOOL_PROMPT = ("You can call functions. To call one, reply with only a JSON object "
               "{{\"name\": <function name>, \"arguments\": {{<its arguments>}}}} and nothing else.{auto}{parallel}\n"
               "Functions:\n{functions}")
MAX_TOOLS = 128  # OpenAI's limit
TOOL_PROMPT_MODES = ("template", "minfer")  # --tool-prompt: see the module docstring
# --tool-prompt-max-tokens: the most tokens minfer's tool prompt may add to an "auto" request under
# `--tool-prompt minfer`. 1,024 tokens is about a dozen tools with short schemas (Open WebUI's 36 built-in
# tools are 6,566), and about 1.5 s of prefill on 2 CPU cores for SmolLM2-135M (lab notes 9b (chapters/lab/09b-cpu-performance.md)).
DEFAULT_TOOL_PROMPT_MAX_TOKENS = 1024


@dataclass
class ToolRequest:
    """A request's tools: `tools` (OpenAI's function objects), `choice` ("none", "auto", "required" or
    "function"), `name` (the forced function's name)."""

    tools: list[dict]
    choice: str
    name: str | None = None
    functions: dict[str, dict] = field(default_factory=dict)  # name -> {"name", "description", "parameters"}
    parallel: bool = True  # parallel_tool_calls: more than one call may be returned
    parallel_explicit: bool = False  # the request said parallel_tool_calls: true (the forced grammar takes arrays)
    loose: set = field(default_factory=set)  # names of functions whose `strict` is false (JSON Schema's own rules)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")


def parse_tools(body: dict) -> ToolRequest | None:
    """The body's `tools` and `tool_choice`, checked; None when no tool may be called.

    Raises:
        APIError(400): a malformed tool or tool_choice, a duplicate or unknown name, tool_choice without tools.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, f"parallel_tool_calls must be a boolean, got {echo(parallel)}", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} function tools", param="tools")
    functions: dict[str, dict] = {}
    loose = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"parameters\": {{...}}}}}}, got {echo(t)}", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(400, f"tools[{i}].function.description must be a string, got {echo(fn['description'])}",
                           param="tools")
        if fn["name"] in functions:
            raise APIError(400, f"tools[{i}]: the function name {echo(fn['name'])} is used twice", param="tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise APIError(400, f"tools[{i}].function.strict must be a boolean, got {echo(fn['strict'])}",
                           param="tools")
        if fn.get("strict") is False:
            loose.add(fn["name"])
        functions[fn["name"]] = {"name": fn["name"], "description": fn.get("description") or "",
                                 "parameters": params}
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in functions:  # a list or dict name is unhashable: check first
            raise APIError(400, f"tool_choice names no given function: {echo(choice)}", param="tool_choice")
        req = ToolRequest(tools, "function", name, functions)
    elif choice in ("none", "auto", "required"):
        req = ToolRequest(tools, choice, None, functions)
    else:
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, got {echo(choice)}", param="tool_choice")
    req.parallel, req.parallel_explicit = parallel is not False, parallel is True
    req.loose = loose
    return None if req.choice == "none" else req


_NOT_SCHEMAS = ("const", "enum", "default", "examples")  # values, not subschemas: a "$ref" in them is data


_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> subschema


def _rebase(schema, base: str, names: bool = False):
    """`schema` with its local refs ("#", "#/...") pointing below `base` ("#/$defs/<key>"), where the schema
    is moved: the parameters' own `$defs` / `definitions` move with it and still resolve. `names`: the dict's
    keys are property / definition names (a property called "default" is a subschema), not keywords."""
    if isinstance(schema, list):
        return [_rebase(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {k: _rebase(v, base) for k, v in schema.items()}
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        else:
            out[k] = v if k in _NOT_SCHEMAS else _rebase(v, base, names=k in _NAMED)
    return out


def _pointer(schema, ref: str):
    """What the local ref `ref` ("#/a/b") points at in `schema`, or None."""
    node = schema
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _ref_loop(schema) -> bool:
    """Whether the schema is only a `$ref` chain back to itself ({"$ref": "#"}): it matches nothing, and the
    grammar would start a call it cannot finish (finish_reason "abort")."""
    seen, node = set(), schema
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") \
            and not set(node) - {"$ref", "$defs", "definitions", "title", "description", "$schema"}:
        if node["$ref"] in seen:
            return True
        seen.add(node["$ref"])
        node = _pointer(schema, node["$ref"])
    return False


def strict_schema(schema):
    """`schema` with `"additionalProperties": false` on every object schema that lists its `properties` and
    says nothing about others, as xgrammar's strict mode (vLLM's default) compiles it and as OpenAI's strict
    function calling requires: without it the model may add keys of its own (`{"city": "Paris",
    "temperature": 25}`). An object that sets `additionalProperties`, `patternProperties` or
    `unevaluatedProperties` keeps its rule; one without `properties` (a free-form `{"type": "object"}`) stays
    open; the parts of an `allOf` are left open (each closed, their union could match nothing)."""
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _NOT_SCHEMAS:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: strict_schema(sub) for name, sub in v.items()}
        elif k == "allOf" and isinstance(v, list):
            out[k] = [{kk: strict_schema(vv) if kk not in _NOT_SCHEMAS else vv for kk, vv in part.items()}
                      if isinstance(part, dict) else part for part in v]
        else:
            out[k] = strict_schema(v)
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def _call_parts(req: ToolRequest) -> tuple[dict, dict]:
    """(the schema of one call without its `$defs`, those `$defs`). Each tool's parameters live in the root's
    `$defs` (refs rebased), not nested under properties.arguments, where "#/$defs/City" would not resolve."""
    names = [req.name] if req.choice == "function" else list(req.functions)
    defs, alts = {}, []
    for k, n in enumerate(names):
        key = f"minfer_tool_{k}"
        params = req.functions[n]["parameters"]
        defs[key] = _rebase(params if n in req.loose else strict_schema(params), f"#/$defs/{key}")
        alts.append({"type": "object", "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/{key}"}},
                     "required": ["name", "arguments"], "additionalProperties": False})
    return (alts[0] if len(alts) == 1 else {"anyOf": alts}), defs


def call_schema(req: ToolRequest) -> dict:
    """The JSON schema of one call: {"name": const, "arguments": the tool's parameters}, any tool's
    ("required") or the named one's."""
    one, defs = _call_parts(req)
    return {**one, "$defs": defs}


def answer_schema(req: ToolRequest) -> dict:
    """The JSON schema of a forced answer: one call (`call_schema`), or, with an explicit
    `parallel_tool_calls: true`, one call or a non-empty array of calls."""
    one, defs = _call_parts(req)
    if not (req.parallel and req.parallel_explicit):
        return {**one, "$defs": defs}
    return {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}], "$defs": defs}


def guided(req: ToolRequest) -> GuidedDecodingParams | None:
    """The structured-output constraint of a "required" or named tool_choice (None for "auto").

    Raises:
        APIError(400, param="tools"): a parameters schema the grammar library cannot compile.
    """
    if not req.constrained:
        return None
    from minfer.serve.guided import check

    for f in [req.functions[req.name]] if req.choice == "function" else req.functions.values():
        if _ref_loop(f["parameters"]):
            raise APIError(400, f"the parameters of {echo(f['name'])} only refer to themselves ($ref): "
                                "no arguments match them", param="tools")
    g = GuidedDecodingParams(json=answer_schema(req))
    check(g, "tools")
    return g


# -- the prompt ---------------------------------------------------------------------------------------------
_RENDERS_TOOLS: dict[int, bool] = {}


def template_renders_tools(hf_tokenizer) -> bool:
    """Whether the chat template shows `tools` at all (rendered with and without a probe tool)."""
    key = id(hf_tokenizer)
    if key not in _RENDERS_TOOLS:
        probe = [{"type": "function", "function": {"name": "probe_fn_x", "description": "d",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        msgs = [{"role": "user", "content": "hi"}]
        try:
            with_tools = hf_tokenizer.apply_chat_template(msgs, tools=probe, tokenize=False, add_generation_prompt=True)
            plain = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            _RENDERS_TOOLS[key] = with_tools != plain
        except Exception:  # noqa: BLE001  a template that fails on tools does not support them
            _RENDERS_TOOLS[key] = False
    return _RENDERS_TOOLS[key]


def _check_calls(calls, i: int) -> None:
    """A history assistant turn's `tool_calls` as OpenAI takes them: a list of {"id": str, "type": "function",
    "function": {"name": str, "arguments": str}}; APIError(400) naming the first bad field."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list of tool calls, got {echo(calls)}", param=where)
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(c, dict):
            raise APIError(400, f"{at} must be an object, got {echo(c)}", param=at)
        if not isinstance(c.get("id"), str):
            raise APIError(400, f"{at}.id must be a string, got {echo(c.get('id'))}", param=f"{at}.id")
        if c.get("type") != "function":
            raise APIError(400, f"{at}.type must be \"function\", got {echo(c.get('type'))}", param=f"{at}.type")
        fn = c.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"{at}.function must be an object {{\"name\": ..., \"arguments\": ...}}, "
                                f"got {echo(fn)}", param=f"{at}.function")
        for key in ("name", "arguments"):
            if not isinstance(fn.get(key), str):
                raise APIError(400, f"{at}.function.{key} must be a string, got {echo(fn.get(key))}",
                               param=f"{at}.function.{key}")


def _call_text(call: dict) -> str:
    fn = call["function"]  # checked by _check_calls
    args = fn["arguments"]
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)


def _messages(raw: list, native: bool) -> list[dict]:
    """Chat messages for the template: assistant `tool_calls` as the template expects them (native) or as
    the JSON text of the call (minfer's prompt); `tool` results as their content."""
    from minfer.tokenizer import normalize_messages

    def plain(m):
        if not isinstance(m, dict):
            return m
        d = {k: v for k, v in m.items() if k in ("role", "content")}
        if m.get("tool_calls"):
            d.setdefault("content", None)  # a call-only assistant turn may leave content out
        return d

    if not isinstance(raw, list):
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    base = normalize_messages([plain(m) for m in raw])
    out = []
    for i, (m, b) in enumerate(zip(raw, base)):
        calls = m.get("tool_calls")  # m is a dict: normalize_messages checked it
        if calls is not None:
            _check_calls(calls, i)
        if calls:
            if native:
                b["tool_calls"] = [{"type": "function", "function": {
                    "name": c["function"]["name"], "arguments": json.loads(_call_text(c))["arguments"]}}
                                   for c in calls]
            else:
                b["content"] = (b["content"] + "\n" if b["content"] else "") + "\n".join(
                    _call_text(c) for c in calls)
        if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            b["tool_call_id"] = m["tool_call_id"]
        out.append(b)
    return out


def writes_tool_prompt(req: ToolRequest, native: bool, mode: str = "template") -> bool:
    """Whether minfer writes its own tool prompt (`TOOL_PROMPT`) for `req`: never when the template renders
    tools (`native`); for a forced tool_choice always; for "auto" only under `mode` "minfer" (the module
    docstring's table; the token budget of that mode is the caller's, `routes._render_chat`).

    Raises:
        ValueError: a mode not in `TOOL_PROMPT_MODES`.
    """
    if mode not in TOOL_PROMPT_MODES:
        raise ValueError(f"tool prompt mode must be one of {', '.join(TOOL_PROMPT_MODES)}, got {mode!r}")
    return not native and (req.constrained or mode == "minfer")


def tool_prompt_text(req: ToolRequest) -> str:
    """minfer's system text listing `req`'s functions (`TOOL_PROMPT`), for a template that ignores tools."""
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in req.functions.values())
    auto = " If no function fits, answer in plain text." if req.choice == "auto" else ""
    parallel = " To call several, reply with a JSON array of such objects." if req.parallel_explicit else ""
    return TOOL_PROMPT.format(auto=auto, parallel=parallel, functions=listing)


def render_prompt(tokenizer, raw_messages, req: ToolRequest, options: dict | None = None,
                  mode: str = "template") -> list[int]:
    """The prompt's token ids (`render_text`, then tokenized).

    Raises:
        ValueError: messages the template cannot render, an unknown `mode`.
    """
    return tokenizer.encode(render_text(tokenizer, raw_messages, req, options, mode)[0], add_special_tokens=False)


def render_text(tokenizer, raw_messages, req: ToolRequest, options: dict | None = None,
                mode: str = "template") -> tuple[str, str | None]:
    """(the prompt's text, minfer's tool prompt in it or None): the tools go to a template that renders them,
    or into minfer's system message where `writes_tool_prompt(req, ..., mode)` says so (see the module
    docstring). The server checks the text's length before tokenizing it (`limits.check_rendered_chars`).
    `options`: the chat-template controls (`protocol.chat_template_options`).

    Raises:
        ValueError: messages the template cannot render, an unknown `mode`.
    """
    options = options or {}
    native = template_renders_tools(tokenizer.hf)
    msgs = _messages(raw_messages, native)
    if native:
        return tokenizer.apply_chat_template(msgs, tools=req.tools, normalize=False, **options), None
    if not writes_tool_prompt(req, native, mode):
        return tokenizer.apply_chat_template(msgs, **options), None
    system = tool_prompt_text(req)
    if msgs and msgs[0]["role"] == "system":
        msgs = [{"role": "system", "content": msgs[0]["content"] + "\n\n" + system}] + msgs[1:]
    else:
        msgs = [{"role": "system", "content": system}] + msgs
    return tokenizer.apply_chat_template(msgs, **options), system


# -- the answer ---------------------------------------------------------------------------------------------
def _as_call(obj, req: ToolRequest) -> dict | None:
    """OpenAI's tool call of `{"name": <a given tool>, "arguments": {...}}` (or "parameters"), else None."""
    if not (isinstance(obj, dict) and obj.get("name") in req.functions):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _json_values(body: str) -> list | None:
    """The JSON values of `body`: one value, or several one after another (whitespace between); None if any
    part is not JSON."""
    decoder, values, i = json.JSONDecoder(parse_constant=_no_constant), [], 0
    try:
        while i < len(body):
            value, i = decoder.raw_decode(body, i)
            values.append(value)
            while i < len(body) and body[i].isspace():
                i += 1
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError, as is _no_constant's
        return None
    return values


def _no_constant(name: str):
    """NaN / Infinity / -Infinity: Python's json reads them, but they are not JSON, and arguments holding
    them would be passed on as invalid JSON text: such an output is text, not a call."""
    raise ValueError(f"{name} is not JSON")


def parse_output(text: str, req: ToolRequest) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an output. Calls of given tools become OpenAI tool calls (arguments as JSON
    text), in order: a bare call object, a JSON array of them, several objects one after another, or each in
    `<tool_call>...</tool_call>` tags. Anything else (or any part that is not a call) stays content: an
    output with text beside its calls (`{...} and then prose`, `<tool_call>{...}</tool_call> prose`) is all
    content, nothing of it dropped. With `parallel_tool_calls: false` only the first call is kept."""
    body = text.strip()
    if body.startswith("<tool_call>"):
        blocks = body.split("<tool_call>")[1:]
        parts = []
        for k, block in enumerate(blocks):
            inside, closed, after = block.partition("</tool_call>")
            # text after a block, or a block left open before the last one: not only calls
            if after.strip() or (not closed and k != len(blocks) - 1):
                return text, []
            parts.append(inside.strip())
        values = [_json_values(p) for p in parts]
        if any(v is None or len(v) != 1 for v in values):
            return text, []
        values = [v[0] for v in values]
    else:
        values = _json_values(body)
        if values is None or not values:
            return text, []
        if len(values) == 1 and isinstance(values[0], list):
            values = values[0]
    calls = [_as_call(v, req) for v in values]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls if req.parallel else calls[:1]


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def partial_call(text: str, req: ToolRequest) -> dict | None:
    """The call a forced tool_choice was writing when max_tokens cut it, as vLLM returns it: a tool call
    whose `arguments` is the JSON text written so far (not valid JSON), with `finish_reason` "length". None
    when the output got no further than the function's name (then it stays `content`)."""
    if not req.constrained:
        return None
    found = _NAME.search(text)
    name = found.group(1) if found else None
    if name not in req.functions:
        return None
    args = _ARGUMENTS.search(text, found.end())
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text[args.end():] if args else ""}}


def rewrite_response(resp: dict, req: ToolRequest) -> dict:
    """A chat.completion answer with each choice's call moved from `content` to `tool_calls`
    (finish_reason "tool_calls"; a forced call cut by max_tokens: `partial_call`, finish_reason "length")."""
    for c in resp["choices"]:
        content, calls = parse_output(c["message"]["content"] or "", req)
        if not calls and c["finish_reason"] == "length":
            cut = partial_call(c["message"]["content"] or "", req)
            content, calls = (None, [cut]) if cut is not None else (content, calls)
        if calls:
            c["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            if c["finish_reason"] == "stop":
                c["finish_reason"] = "tool_calls"
    return resp


def is_text(text: str) -> bool:
    """Whether an output, from what has been written of it, can no longer become a call: it starts with
    something other than `{`, `[` or (a prefix of) `<tool_call>`. Until then a stream holds it back."""
    head = text.lstrip()[:len("<tool_call>")]
    return bool(head) and not head.startswith(("{", "[")) and not "<tool_call>".startswith(head) \
        and not head.startswith("<tool_call>")


class ToolStreamChunks(StreamChunks):
    """`StreamChunks` for a request with tools. With tool_choice "auto", an output that `is_text` streams its
    text as it is generated; one that may be a call is held until it is complete, then sent in one delta, as
    `tool_calls` (finish_reason "tool_calls") if it is a call, else as `content`. A forced call cut by
    max_tokens is sent as `partial_call` (finish_reason "length")."""

    def __init__(self, *args, tool_request: ToolRequest, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_request = tool_request
        self.streaming_text: set[tuple] = set()  # choices known to be text: streamed as plain chunks

    def _choice_delta(self, request_id: str, o) -> dict | None:
        key = (request_id, o.index)
        if key in self.finished:
            return None
        if key in self.streaming_text or (not self.tool_request.constrained and is_text(o.text)):
            self.streaming_text.add(key)
            return super()._choice_delta(request_id, o)
        self.completion_tokens[key] = len(o.token_ids)
        if o.finish_reason is None:
            return None
        self.finished.add(key)
        index = self.prompt_index[request_id] * self.n + o.index
        content, calls = parse_output(o.text, self.tool_request)
        if not calls and o.finish_reason == "length":
            cut = partial_call(o.text, self.tool_request)
            calls = [cut] if cut is not None else []
        if calls:
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
            finish = "tool_calls" if o.finish_reason == "stop" else o.finish_reason
        else:
            delta, finish = ({"content": o.text} if o.text else {}), o.finish_reason
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
