"""The OpenAI API's shapes: what a request body may hold and what an answer looks like (article §9).

This is the part of the server that knows the OpenAI API reference (https://platform.openai.com/docs/api-reference,
/v1/completions and /v1/chat/completions) and nothing about threads or HTTP frameworks; vLLM keeps the same
knowledge in `vllm/entrypoints/openai/protocol.py` (as pydantic models). Everything here is a plain function of
its arguments:

- errors: `APIError`, answered as OpenAI's body `{"error": {"message", "type", "param", "code"}}`;
- requests: `parse_json_body`, `resolve_model`, `sampling_params` (a body -> `SamplingParams`),
  `fit_max_tokens` (an omitted max_tokens, per prompt), `parse_prompts` (the forms `prompt` may take) and
  `normalize_messages` (chat messages -> `[{role, content}]`);
- answers: `usage`, logprobs in the completions and the chat shape, `completion_response` (the whole JSON
  answer) and `StreamChunks` (the server-sent-event chunks of a streamed answer).

The snapshots the answers are made from are `engine_loop.RequestSnapshot`s (read by attribute only).
"""

from __future__ import annotations

import json
import re

from minfer.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat has none (up to max_model_len)


# ----------------------------------------------------------------------------------------------------------
# Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}
# ----------------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status.

    The message may quote what the client sent, so it is made safe to encode first: a lone surrogate
    ("\\ud800" in the JSON) cannot be written as UTF-8 and would turn the answer into a 500.

    Args:
        headers: extra response headers (`Allow` for a 405, `Connection: close` for a body left unread).
    """

    _TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
              500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        message = encodable(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or self._TYPES.get(status, "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def encodable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (lone surrogates) written as a backslash escape (`\\ud800`)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# Characters an echoed value must not carry raw: C0/C1 controls other than tab and newlines, and Unicode's
# format characters (category Cf), which hold the bidi overrides (U+202E turns the text after it around).
_UNSAFE_ECHO = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f"
                          "\u202a-\u202e\u2060-\u2069\ufeff\ufff9-\ufffb]")


def echo(value, limit: int = 100) -> str:
    """A client's value, quoted in an error message: safe to encode, cut to `limit` characters, and with
    control and bidi characters written as escapes (`\\u202e`), so a quoted id cannot reorder the text
    around it."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    text = _UNSAFE_ECHO.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return encodable(text)


MAX_ID_CHARS = 256  # an id minfer makes is "resp_" + 32 hex digits; a client's call_id is about as short


def check_id(value, param: str) -> str:
    """`value` as an id that is safe to store and echo: a string of 1 to `MAX_ID_CHARS` characters with no
    control, bidi or other format character and no lone surrogate.

    Raises:
        APIError(400, param=param): anything else (the value quoted with those characters escaped).
    """
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_CHARS:
        raise APIError(400, f"{param} must be a string of 1 to {MAX_ID_CHARS} characters, got {echo(value)}",
                       param=param)
    if _UNSAFE_ECHO.search(value) or _SURROGATE.search(value) or not value.isprintable():
        raise APIError(400, f"{param} must not hold control, bidi or other invisible characters, got {echo(value)}",
                       param=param)
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_utf8(value, param: str) -> None:
    """APIError(400) naming where a string inside `value` (a parsed JSON value) holds a lone surrogate.

    JSON may write a UTF-16 surrogate alone (`"\\ud800"`) and Python then reads a string UTF-8 cannot
    encode: echoed in an answer it would fail as the answer is written (a 500, or a streamed 200 cut empty),
    and a tokenizer refuses it with its own internal message. The location is given as a path
    (`metadata.k`, `messages[0].content`). Iterative: the depth is the body's, which `parse_json_body` bounds.
    """
    stack = [(value, param)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            found = _SURROGATE.search(v)
            if found:
                raise APIError(400, f"{echo(at, 200)} is not valid Unicode: it holds a lone UTF-16 surrogate "
                                    f"(\\u{ord(found.group()):04x}) at character {found.start()}, which UTF-8 "
                                    "cannot encode", param=param)
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    raise APIError(400, f"{echo(at, 200)} has a key that holds a lone UTF-16 surrogate ({echo(k)}), "
                                        "which UTF-8 cannot encode", param=param)
                stack.append((item, f"{at}.{k}" if isinstance(k, str) else at))
        elif isinstance(v, list):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(v))


def engine_error(exc: Exception, default_param: str = "prompt") -> APIError:
    """The 400 of a request the engine refused (`ValueError`/`TypeError` from `add_request`).

    A prompt too long for max_model_len (`minfer.sequence.CONTEXT_LENGTH_ERROR`) is answered as vLLM answers
    it: a message that starts with OpenAI's words "This model's maximum context length is N tokens." and
    OpenAI's code "context_length_exceeded". litellm raises its `ContextWindowExceededError` on those words
    (`exception_mapping_utils.exception_type`); LangChain its `ContextOverflowError` when
    "context_length_exceeded" is in the error's text (langchain_openai `_handle_openai_bad_request`), which
    newer openai clients make of the message alone, so the code is named in the message too. The engine's
    message arrives as text (from the engine process), so it is recognised by its wording.
    """
    from minfer.sequence import CONTEXT_LENGTH_ERROR

    message = str(exc)
    found = CONTEXT_LENGTH_ERROR.search(message)
    if found:
        return context_overflow(message, int(found.group(1)), default_param)
    return APIError(400, message, param=param_of(exc) or default_param)


def context_overflow(message: str, max_model_len: int, param: str = "prompt") -> APIError:
    """The 400 of a prompt that cannot fit in `max_model_len` tokens, in vLLM's and OpenAI's shape (see
    `engine_error`): "This model's maximum context length is N tokens. <message> (code: context_length_exceeded)"."""
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                         f"{message[:1].upper()}{message[1:]} (code: context_length_exceeded)",
                    param=param, code="context_length_exceeded")


def param_of(exc: Exception) -> str | None:
    """The field a SamplingParams/engine ValueError names ("SamplingParams.top_p must be ..." -> "top_p")."""
    m = re.search(r"SamplingParams\.(\w+)", str(exc))
    if m:
        return m.group(1)
    return "logit_bias" if str(exc).startswith("logit_bias") else None  # the engine's vocabulary check


# ----------------------------------------------------------------------------------------------------------
# Request parsing
# ----------------------------------------------------------------------------------------------------------
# Objects and arrays one body may hold. An empty one is the costliest JSON there is: "{}," is 3 bytes of body
# and 80 bytes of Python, so 16 MiB of them parsed to 436 MB. The largest real requests hold far fewer: 256
# token-id prompts are 257 arrays, a max_model_len-message chat one object per message and part, a tool's
# schema tens.
MAX_JSON_CONTAINERS = 65536
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def count_json_containers(raw: bytes) -> int:
    """How many objects and arrays the JSON text `raw` opens: its `{` and `[` outside strings.

    Counting the brackets is enough when there are few; only a body with many has its strings cut out first
    (a regular expression, one pass), since a prompt of code may hold brackets of its own.
    """
    naive = raw.count(b"{") + raw.count(b"[")
    if naive <= MAX_JSON_CONTAINERS:
        return naive
    bare = _JSON_STRING.sub(b"", raw)
    return bare.count(b"{") + bare.count(b"[")


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or APIError(400) saying why it is not one (or that it holds more than
    `MAX_JSON_CONTAINERS` objects and arrays, refused before parsing)."""
    containers = count_json_containers(raw)
    if containers > MAX_JSON_CONTAINERS:
        raise APIError(400, f"request body holds {containers} JSON objects and arrays; the server parses at most "
                            f"{MAX_JSON_CONTAINERS}")
    try:
        # RFC 8259 §8.1: JSON exchanged between systems is UTF-8 (a leading byte order mark may be ignored).
        # json.loads would also guess UTF-16 and UTF-32 from the first bytes; those are refused here.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not UTF-8 (RFC 8259 §8.1 requires it): {exc.reason} at byte "
                            f"{exc.start}") from None
    if "\x00" in text[:4]:  # UTF-16/32 ASCII text: its NULs decode as UTF-8 too
        raise APIError(400, "request body is not UTF-8 (RFC 8259 §8.1 requires it): it looks like UTF-16 or "
                            "UTF-32")
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # e.g. [[[[...]]]] thousands deep: valid JSON, but nothing a request needs
        raise APIError(400, "request body is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits (Python's int-parsing limit)
        raise APIError(400, f"request body holds a value that cannot be read: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def resolve_model(body: dict, names: list[str]) -> str:
    """The model name to report: the body's "model" if it is served (404 otherwise), else the first name."""
    model = body.get("model")
    if model is None:
        return names[0]
    if not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {echo(model)}", param="model")
    if model not in names:
        raise APIError(404, f"The model `{echo(model)}` does not exist. Served: {', '.join(names)}",
                       param="model", code="model_not_found")
    return model


def _get(body: dict, name: str, default=None):
    """`body[name]`, with an explicit JSON null meaning "not given" (as OpenAI's clients send them)."""
    value = body.get(name)
    return default if value is None else value


def _get_bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    """`body[name]` as a JSON boolean; APIError(400) for anything else (`bool("false")` would be True)."""
    value = _get(body, name, default)
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean (true or false), got {echo(value)}", param=param or name)
    return value


def _reject_unsupported(body: dict, chat: bool) -> None:
    """Refuse OpenAI options minfer does not implement, rather than silently ignoring them."""
    def nonzero(v):
        return v not in (None, 0, 0.0, False, {}, [], "")

    checks = {"best_of": lambda v: v not in (None, 1) and v != body.get("n", 1),
              # vLLM's extra field; here the prompt's logprobs come from echo + logprobs on /v1/completions.
              "prompt_logprobs": lambda v: v is not None}
    if chat:  # `tools` and `response_format` are read by `serve.tools` and `serve.guided`
        checks.update({"functions": nonzero})
    else:
        checks.update({"suffix": nonzero})
    for name, is_set in checks.items():
        if name in body and is_set(body[name]):
            hint = ("; for the prompt's logprobs send echo: true with logprobs: N to /v1/completions"
                    if name == "prompt_logprobs" else "")
            raise APIError(400, f"'{name}' is not supported by minfer{hint}", param=name)


def _chat_logprobs_setting(body: dict) -> int | None:
    """Chat's `logprobs: bool` + `top_logprobs: int` as SamplingParams.logprobs (None: no logprobs)."""
    want_logprobs = _get_bool(body, "logprobs", False)
    top = _get(body, "top_logprobs")
    if top is not None and not want_logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise APIError(400, f"top_logprobs must be an integer in [0, 20], got {echo(top)}", param="top_logprobs")
    return (top or 0) if want_logprobs else None


def _completion_logprobs_setting(body: dict) -> int | None:
    """Completions' `logprobs: int` (how many alternatives per token) as SamplingParams.logprobs."""
    logprobs = _get(body, "logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= 20):
        raise APIError(400, f"logprobs must be an integer in [0, 20], got {echo(logprobs)}", param="logprobs")
    return logprobs


def echo_setting(body: dict) -> tuple[bool, bool]:
    """Completions' `echo` as (echo the prompt, score only). Scoring as evaluation harnesses send it
    (lm-evaluation-harness's loglikelihood): `echo: true, logprobs: N, max_tokens: 0` answers the prompt and
    its tokens' logprobs and generates nothing (the engine runs one token, which is dropped).

    Raises:
        APIError(400): echo not a boolean, echo with stream (not built), max_tokens 0 without echo.
    """
    echo_on = _get_bool(body, "echo", False)
    if echo_on and _get(body, "stream", False) is True:
        raise APIError(400, "echo is not supported with stream=true", param="echo")
    score_only = echo_on and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    return echo_on, score_only


def _check_stream_fields(body: dict) -> None:
    stream = _get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError(400, "stream_options can only be set when stream=true", param="stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object such as {\"include_usage\": true}",
                       param="stream_options")
    if options is not None:
        _get_bool(options, "include_usage", False, param="stream_options")


def sampling_params(body: dict, *, chat: bool, defaults: dict | None = None) -> SamplingParams:
    """The body's sampling fields as `SamplingParams`; APIError(400) naming the field if one is invalid.

    The two endpoints differ in two fields: chat takes `max_completion_tokens` (or the older `max_tokens`)
    and `logprobs: bool` + `top_logprobs`; completions take `max_tokens` and `logprobs: int`. An omitted
    `max_tokens` stays None here: its default depends on the prompt's length (`fit_max_tokens`). `defaults`:
    the server's values for omitted `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` (vLLM's
    `default_sampling_params`, `minfer.config.diff_sampling_param`); a field the body sets keeps its value.
    """
    _reject_unsupported(body, chat)
    d = defaults or {}
    extra = {}
    if chat:
        max_tokens = _get(body, "max_completion_tokens", _get(body, "max_tokens"))
        logprobs = _chat_logprobs_setting(body)
    else:
        max_tokens = _get(body, "max_tokens")
        logprobs = _completion_logprobs_setting(body)
        echo_on, score_only = echo_setting(body)
        if score_only:
            max_tokens = 1
        if echo_on and logprobs is not None:
            extra["prompt_logprobs"] = logprobs
    _check_stream_fields(body)
    from minfer.serve.guided import guided_decoding_params

    guided, _ = guided_decoding_params(body)  # response_format, guided_*: compiled here, before admission
    if guided is not None:
        extra["guided_decoding"] = guided
    try:
        return SamplingParams(
            n=_get(body, "n", 1),
            temperature=_get(body, "temperature", d.get("temperature", 1.0)),
            top_p=_get(body, "top_p", d.get("top_p", 1.0)),
            top_k=_get(body, "top_k", d.get("top_k", -1)),
            min_p=_get(body, "min_p", d.get("min_p", 0.0)),
            seed=_get(body, "seed"),
            max_tokens=max_tokens,
            stop=_get(body, "stop"),
            stop_token_ids=_get(body, "stop_token_ids"),
            ignore_eos=_get_bool(body, "ignore_eos", False),
            logprobs=logprobs,
            include_stop_str_in_output=_get_bool(body, "include_stop_str_in_output", False),
            skip_special_tokens=_get_bool(body, "skip_special_tokens", True),
            presence_penalty=_get(body, "presence_penalty", 0.0),
            frequency_penalty=_get(body, "frequency_penalty", 0.0),
            repetition_penalty=_get(body, "repetition_penalty", d.get("repetition_penalty", 1.0)),
            min_tokens=_get(body, "min_tokens", 0),
            logit_bias=_get(body, "logit_bias"),
            **extra,
        )
    except (ValueError, TypeError) as exc:
        param = param_of(exc)
        msg = str(exc).replace("SamplingParams.", "") if param else f"invalid sampling parameters: {exc}"
        if param == "max_tokens" and chat and "max_completion_tokens" in body:
            param = "max_completion_tokens"
        raise APIError(400, msg, param=param) from None


def fit_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int,
                   default: int | None) -> SamplingParams:
    """`params` for one prompt, an omitted `max_tokens` filled in as vLLM does: the endpoint's `default` (None:
    no default), but never more than what max_model_len leaves after the prompt. A given one is kept as is.

    Without the cap, an 8,191-token prompt and no max_tokens (completions' default 16) is refused for a length
    the client never asked for. A prompt that leaves no room at all is left as it is, for the engine to refuse.
    """
    room = max_model_len - prompt_len
    if params.max_tokens is not None or room < 1:
        return params
    try:
        return params.clone(max_tokens=room if default is None else min(default, room))
    except ValueError as exc:  # e.g. min_tokens above the max_tokens filled in here: the client's field is wrong
        param = "min_tokens" if "min_tokens" in str(exc) else "max_tokens"
        raise APIError(400, f"{str(exc).replace('SamplingParams.', '')} (max_tokens was not given; it defaults "
                       f"to {room if default is None else min(default, room)} here)", param=param) from None


def check_stop_token_ids(params: SamplingParams, vocab_size: int | None) -> None:
    """APIError(400, param="stop_token_ids") for a stop token id outside the vocabulary [0, vocab_size): the
    model can never emit it, so the client meant something else (SamplingParams has already refused what is
    not a non-negative integer, such as 1e30)."""
    if vocab_size is None:
        return
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab_size}) (the model's vocabulary), got "
                            f"{echo(bad[:5])}", param="stop_token_ids")


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompts(body: dict) -> list:
    """`prompt` as a list of engine prompts: a string, a list of strings, token ids, or lists of token ids."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if _is_ids(p):
            return [p]
        if all(_is_ids(x) for x in p):
            return [list(x) for x in p]
    if p is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids (non-empty)", param="prompt")


def chat_template_options(body: dict) -> dict:
    """vLLM's chat-template controls of a chat body, checked, as keyword arguments of
    `Tokenizer.apply_chat_template` (those that differ from its defaults): `add_generation_prompt` (default
    true), `continue_final_message` (default false; not with add_generation_prompt) and
    `chat_template_kwargs` (an object).

    Raises:
        APIError(400): a non-boolean control, both controls true, or bad chat_template_kwargs.
    """
    from minfer.tokenizer import check_chat_template_kwargs

    gen = _get_bool(body, "add_generation_prompt", True)
    cont = _get_bool(body, "continue_final_message", False)
    if gen and cont:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: set "
                            "add_generation_prompt to false to continue the last message",
                       param="continue_final_message")
    try:
        kwargs = check_chat_template_kwargs(body.get("chat_template_kwargs"))
    except ValueError as exc:
        raise APIError(400, str(exc), param="chat_template_kwargs") from None
    options = {"add_generation_prompt": gen, "continue_final_message": cont, "chat_template_kwargs": kwargs}
    return {k: v for k, v in options.items() if v != _TEMPLATE_DEFAULTS[k]}  # the defaults go without saying


_TEMPLATE_DEFAULTS = {"add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {}}


def normalize_messages(messages) -> list[dict]:
    """Chat `messages` as `[{"role", "content": str}]` by the engine's rule (`minfer.tokenizer.normalize_messages`:
    text parts joined, a null content read as ""); APIError(400, param="messages") when it refuses them."""
    from minfer.tokenizer import normalize_messages as normalize

    try:
        return normalize(messages)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None


# ----------------------------------------------------------------------------------------------------------
# Shaping outputs
# ----------------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TokenText:
    """token id -> its text, cached (for logprobs)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            try:
                s = self.tokenizer.decode([tid])
            except Exception:  # noqa: BLE001
                s = f"<{tid}>"
            if len(self.cache) < 200_000:
                self.cache[tid] = s
        return s


def _chosen_logprob(d: dict, tid: int) -> float:
    v = d.get(tid)
    return float(v) if v is not None else -9999.0


def _completion_logprobs(tok: TokenText, token_ids: list[int], logprobs: list[dict], k: int,
                         offset: int = 0) -> dict:
    """The completions API's logprobs: parallel lists, `top_logprobs` always holding the chosen token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, logprobs):
        s = tok(tid)
        tokens.append(s)
        token_lps.append(_chosen_logprob(d, tid))
        top = sorted(d.items(), key=lambda kv: -kv[1])[: max(k, 1)]
        if tid not in dict(top) and tid in d:
            top.append((tid, d[tid]))
        tops.append({tok(t): float(lp) for t, lp in top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tok: TokenText, token_ids: list[int], logprobs: list[dict], k: int) -> dict:
    """The chat API's logprobs: one object per token, with its UTF-8 bytes and its top `k` alternatives."""
    content = []
    for tid, d in zip(token_ids, logprobs):
        s = tok(tid)
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
        content.append({"token": s, "logprob": _chosen_logprob(d, tid), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": tok(t), "logprob": float(lp),
                                          "bytes": list(tok(t).encode("utf-8"))} for t, lp in top]})
    return {"content": content}


def format_logprobs(tok: TokenText, token_ids: list[int], logprobs: list[dict], k: int, *, chat: bool,
                    offset: int = 0) -> dict:
    """Logprobs of `token_ids` in the endpoint's shape; `offset`: where their text starts (completions)."""
    if chat:
        return _chat_logprobs(tok, token_ids, logprobs, k)
    return _completion_logprobs(tok, token_ids, logprobs, k, offset=offset)


def _choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None, *, chat: bool,
            delta: bool) -> dict:
    """One entry of "choices": `text` for completions, a `message` (or, streamed, a `delta`) for chat."""
    if not chat:
        content = {"text": text}
    elif delta:
        content = {"delta": {"content": text} if text else {}}
    else:
        content = {"message": {"role": "assistant", "content": text}}
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}


def prompt_logprobs_part(tok: TokenText, prompt_ids: list[int], prompt_logprobs: list | None, k: int) -> dict:
    """The completions `logprobs` of an echoed prompt: its tokens, `token_logprobs` (None for the first, which
    has no context), `top_logprobs` (None first, then the chosen token and the top `k`) and `text_offset`."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for i, tid in enumerate(prompt_ids):
        s = tok(tid)
        d = prompt_logprobs[i] if prompt_logprobs else None
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:
            token_lps.append(None), tops.append(None)
            continue
        token_lps.append(_chosen_logprob(d, tid))
        top = sorted(d.items(), key=lambda kv: -kv[1])[:max(k, 1)]
        if tid not in dict(top):
            top.append((tid, d[tid]))
        tops.append({tok(t): float(lp) for t, lp in top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _echoed(tok: TokenText, snap, o, k: int, prompt_text: str, score_only: bool) -> tuple[str, dict | None]:
    """(text, logprobs) of a completion with `echo`: the prompt, then (unless score_only) the output."""
    lp = None
    if o.logprobs is not None:
        lp = prompt_logprobs_part(tok, snap.prompt_token_ids, snap.prompt_logprobs, k)
        if not score_only:
            out = _completion_logprobs(tok, o.token_ids, o.logprobs, k, offset=len(prompt_text))
            for key in lp:
                lp[key] += out[key]
    return prompt_text + ("" if score_only else o.text), lp


def completion_response(req_id: str, created: int, model: str, snapshots: list, n: int, k: int, tok: TokenText,
                        *, chat: bool, echo_prompts: list[str] | None = None, score_only: bool = False) -> dict:
    """The JSON answer of a non-streamed request from the final snapshot of each of its prompts (in order).

    Choice `i * n + j` is completion `j` of prompt `i`, as OpenAI numbers them. `echo_prompts` (completions'
    `echo`): each prompt's text, put before its completions' text (and its tokens' logprobs before theirs);
    `score_only` (`max_tokens: 0`): the prompt alone, no completion tokens.
    """
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for prompt_index, snap in enumerate(snapshots):
        prompt_tokens += snap.num_prompt_tokens
        for o in snap.outputs:
            text, lp = o.text, None
            if echo_prompts is not None:
                text, lp = _echoed(tok, snap, o, k, echo_prompts[prompt_index], score_only)
            elif o.logprobs is not None:
                lp = format_logprobs(tok, o.token_ids, o.logprobs, k, chat=chat)
            completion_tokens += 0 if score_only else len(o.token_ids)
            finish = "length" if score_only else o.finish_reason
            choices.append(_choice(prompt_index * n + o.index, text, lp, finish, chat=chat, delta=False))
    choices.sort(key=lambda c: c["index"])
    return {"id": req_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def sse(obj) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"  # OpenAI's end-of-stream event


def _stable_text(text: str, finished: bool) -> str:
    """Hold back a trailing replacement char (half a UTF-8 character) until the next token completes it."""
    if finished:
        return text
    return text.rstrip("\ufffd")


class StreamChunks:
    """The server-sent events of one streamed request: each snapshot -> one chunk of only what is new.

    OpenAI streams deltas: each chunk holds, per choice, the text (and logprobs) added since the last chunk,
    and the finish reason once. A chat stream starts with a chunk giving each choice its role.

    Args:
        prompt_index: engine request id -> the index of its prompt in the request (choice = that * n + j).
    """

    def __init__(self, req_id: str, created: int, model: str, prompt_index: dict[str, int], n: int, k: int,
                 tok: TokenText, *, chat: bool):
        self.req_id, self.created, self.model = req_id, created, model
        self.prompt_index, self.n, self.k, self.tok, self.chat = prompt_index, n, k, tok, chat
        self.sent_text: dict[tuple, str] = {}
        self.sent_tokens: dict[tuple, int] = {}
        self.finished: set[tuple] = set()
        self.prompt_tokens: dict[str, int] = {}
        self.completion_tokens: dict[tuple, int] = {}

    def _chunk(self, choices: list[dict], **extra) -> str:
        return sse({"id": self.req_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": choices, **extra})

    def first(self) -> str | None:
        """The chunk before any output: chat's role chunk (OpenAI's first chunk), none for completions."""
        if not self.chat:
            return None
        return self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(len(self.prompt_index) * self.n)])

    def on_snapshot(self, snap) -> str | None:
        """The chunk for what `snap` adds, or None when it adds nothing to send."""
        self.prompt_tokens[snap.request_id] = snap.num_prompt_tokens
        choices = [c for c in (self._choice_delta(snap.request_id, o) for o in snap.outputs) if c is not None]
        return self._chunk(choices) if choices else None

    def _choice_delta(self, request_id: str, o) -> dict | None:
        key = (request_id, o.index)
        if key in self.finished:
            return None
        done = o.finish_reason is not None
        text = _stable_text(o.text, done)
        old = self.sent_text.get(key, "")
        # A stream cannot take text back: a text that no longer extends what was sent (its tail rewritten,
        # e.g. a stop string cut off) adds nothing
        delta = text[len(old):] if text.startswith(old) else ""
        if delta:
            self.sent_text[key] = text
        self.completion_tokens[key] = len(o.token_ids)
        lp = None
        if o.logprobs is not None and (delta or done):
            start = self.sent_tokens.get(key, 0)
            ids, lps = o.token_ids[start:], o.logprobs[start:]
            self.sent_tokens[key] = len(o.token_ids)
            if ids:
                lp = format_logprobs(self.tok, ids, lps, self.k, chat=self.chat, offset=len(old))
        if not delta and not done and lp is None:
            return None
        if done:
            self.finished.add(key)
        index = self.prompt_index[request_id] * self.n + o.index
        return _choice(index, delta, lp, o.finish_reason, chat=self.chat, delta=True)

    def finish_unfinished(self, request_ids: list[str], reason: str) -> str | None:
        """One chunk ending every choice not finished yet with `reason` (a request cut by its time limit);
        None when all had finished."""
        choices = []
        for rid in request_ids:
            for j in range(self.n):
                if (rid, j) not in self.finished:
                    self.finished.add((rid, j))
                    choices.append(_choice(self.prompt_index[rid] * self.n + j, "", None, reason, chat=self.chat,
                                           delta=True))
        return self._chunk(choices) if choices else None

    def usage_chunk(self) -> str:
        """The last chunk when `stream_options.include_usage`: no choices, the usage of the whole request."""
        return self._chunk([], usage=usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())))
