"""Admission control: what one request may ask of the server, refused before the work it would cost (article §15).

A server that tokenizes whatever arrives can be stalled by one client: a 50 MiB prompt took 170 s and 12 GB of
RAM before the engine said it was too long. Every check here runs before the work it protects, in the order a
request meets them (chapter 9 §9.8 lists each limit with its flag and default):

0. `FramingMiddleware`: the header section no bigger than `h11_max_incomplete_event_size` (431, whether it
   came in one write or many), and never both `Transfer-Encoding` and `Content-Length` (400, connection
   closed: the two framings disagree on where the body ends, which is how requests are smuggled past a proxy).
1. `read_body`: the body must be `application/json` (415: a page on another origin cannot post it without a
   CORS preflight, which minfer never grants), no bigger than `max_request_body_bytes` (413: refused from
   `Content-Length` before a byte is read, or cut off at the limit while a chunked body streams in) and sent
   within `body_read_timeout` seconds (408).
2. `check_fan_out`: prompts x n, the sequences one request adds, at most `max_seqs_per_request` (400).
3. `check_prompt_chars` / `check_message_chars` / `check_tool_chars`: no prompt longer than `max_prompt_chars`
   characters (400), checked before rendering and tokenizing (a chat's messages and tools count together);
   `prompt_char_limit` derives the default from the tokenizer's vocabulary.
4. `check_rendered_chars`: the chat prompt as the template wrote it, tools and all, checked again before it
   is tokenized, so no template or tool listing can hand the tokenizer more than the bound.

`ServerLimits` holds them all, the connection-level timeouts that `connection.py` enforces included.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from minfer.serve.protocol import APIError, context_overflow, parse_json_body

logger = logging.getLogger("minfer.serve")

# 413 and 408 leave the rest of the body unread on the socket: the connection cannot carry another request
_CLOSE = {"Connection": "close"}
_SECONDS = ("body_read_timeout", "header_read_timeout", "timeout_keep_alive")  # the others are counts


@dataclass(frozen=True)
class ServerLimits:
    """Every bound the server puts on a client; each field is a flag of `python -m minfer.serve`.

    Args:
        max_request_body_bytes: largest request body (bytes; `--max-request-body-bytes`). The default, 16 MiB,
            holds the largest request the other limits let through in its longest form: 256 prompts of 8,192
            token ids at up to 7 bytes an id ("49151, ") is 14.7 MB.
        max_prompt_chars: longest prompt, or all of a chat's message contents together (characters;
            `--max-prompt-chars`); None: `prompt_char_limit` of the served tokenizer, computed at start-up.
        max_seqs_per_request: most sequences one request adds, prompts x n (`--max-seqs-per-request`).
        body_read_timeout: most time from the end of the headers to the end of the body (seconds;
            `--body-read-timeout`); 30 s moves 16 MiB at 0.5 MB/s.
        header_read_timeout: most time to send a request's headers, from the connection's start or the first
            byte of the request (seconds; `--header-read-timeout`).
        timeout_keep_alive: how long an idle connection stays open between two requests (seconds;
            `--timeout-keep-alive`, uvicorn's option and default).
        h11_max_incomplete_event_size: largest header section, request line included (bytes;
            `--h11-max-incomplete-event-size`, h11's default, 16 KiB); a bigger one is a 431 from
            `FramingMiddleware` (h11 itself answers 400 only to one still unfinished at that size).
        max_stored_responses: most responses the Responses API keeps for `previous_response_id` and its
            GET routes (responses; `--max-stored-responses`); the oldest go first.
        max_response_store_bytes: most bytes those stored responses take together, as their JSON
            (`responses.ResponseStore`; bytes, `--max-response-store-bytes`); the oldest go first. The default,
            128 MiB, keeps the API process under 200 MB above idle however large the responses.

    Raises:
        ValueError: a limit that is not a positive number (the message names it).
    """

    max_request_body_bytes: int = 16 * 2**20
    max_prompt_chars: int | None = None
    max_seqs_per_request: int = 256
    body_read_timeout: float = 30.0
    header_read_timeout: float = 10.0
    timeout_keep_alive: float = 5.0
    h11_max_incomplete_event_size: int = 16 * 2**10
    max_stored_responses: int = 1024
    max_response_store_bytes: int = 128 * 2**20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_prompt_chars":  # left to `resolve`
                continue
            whole = f.name not in _SECONDS
            if (isinstance(value, bool) or not isinstance(value, int if whole else (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{f.name} must be a positive {'integer' if whole else 'number of seconds'}, "
                                 f"got {value!r}")

    def resolve(self, tokenizer, max_model_len: int) -> "ServerLimits":
        """These limits with `max_prompt_chars` filled in from `tokenizer` when it was left to the server."""
        if self.max_prompt_chars is not None:
            return self
        chars = prompt_char_limit(tokenizer, max_model_len)
        if chars is None:
            logger.warning("the tokenizer's vocabulary cannot be read: prompts are limited only by "
                           "--max-request-body-bytes; set --max-prompt-chars")
            return self
        return dataclasses.replace(self, max_prompt_chars=chars)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------
# The character bound on prompts
# ----------------------------------------------------------------------------------------------------------
def longest_token_chars(tokenizer) -> int | None:
    """The most characters of text one token can stand for, over the whole vocabulary; None if unknown.

    Read from the vocabulary's own strings (`convert_ids_to_tokens`), special and added tokens included
    ('<|im_start|>' is 12 characters). Such a string never has fewer characters than the text it matches:
    byte-level BPE (SmolLM2, Llama 3, Qwen) writes one character per byte ('Ġ' is a space) and a character is
    at least one byte; a SentencePiece piece writes one per character ('▁' is a space), and a byte-fallback
    piece ('<0x0A>') six for one byte. A tokenizer without that vocabulary (a test's fake) may say its bound
    in `max_token_chars`. SmolLM2's longest token is a newline and 80 spaces: 81.
    """
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and hasattr(hf, "convert_ids_to_tokens"):
        pieces = hf.convert_ids_to_tokens(list(range(len(hf))))
        return max((len(p) for p in pieces if isinstance(p, str)), default=None)
    return getattr(tokenizer, "max_token_chars", None)


def prompt_char_limit(tokenizer, max_model_len: int) -> int | None:
    """max_model_len x `longest_token_chars`: no prompt with more characters fits in max_model_len tokens.

    Each token stands for at most L characters, so a text of C characters needs at least C / L tokens, which is
    more than max_model_len when C > max_model_len x L. This needs a tokenizer that deletes no characters
    before it splits the text (true of every tokenizer minfer's supported models ship); one that does (say,
    one that collapses runs of spaces) may have a prompt refused that would have fitted: set
    `--max-prompt-chars` for it. For SmolLM2 at max_model_len 8192: 8192 x 81 = 663,552 characters.
    """
    longest = longest_token_chars(tokenizer)
    return None if longest is None else int(max_model_len) * int(longest)


# ----------------------------------------------------------------------------------------------------------
# The checks, in the order a request meets them
# ----------------------------------------------------------------------------------------------------------
def require_json(request: Request) -> None:
    """APIError(415) unless the request says its body is `application/json` (parameters such as charset allowed).

    Browsers send `text/plain` and form types cross-origin without a CORS preflight; JSON needs one, and minfer
    answers no preflight, so only same-origin pages (the demo page) can post to it.
    """
    given = request.headers.get("content-type")
    if given is None or given.split(";", 1)[0].strip().lower() != "application/json":
        shown = "none" if given is None else repr(given[:100])
        raise APIError(415, f"Content-Type must be application/json, got {shown}", code="unsupported_media_type")


OFF_LOOP_BYTES = 64 * 1024  # bodies from this size on are parsed (and their heavy checks run) off the event loop


async def read_json_body(request: Request, limits: ServerLimits) -> dict:
    """What every JSON route reads first: `require_json`, `read_body`, then the JSON object, parsed in a worker
    thread from `OFF_LOOP_BYTES` on, so the event loop (and /health with it) keeps answering while megabytes
    of JSON are read (parsed on the loop, 2 M stop ids or a 16 MB /detokenize body would hold /health up).

    Raises:
        APIError: as `require_json`, `read_body` and `parse_json_body`."""
    require_json(request)
    raw = await read_body(request, limits)
    return parse_json_body(raw) if len(raw) < OFF_LOOP_BYTES else await run_in_threadpool(parse_json_body, raw)


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The request body, refused as soon as it is known to be too big or too slow.

    Raises:
        APIError(413): `Content-Length` over `limits.max_request_body_bytes` (nothing is read), or more than
            that arrived (a chunked body is cut off there, so at most the limit is ever held).
        APIError(408): the body took longer than `limits.body_read_timeout` seconds.
        APIError(499): the client went away while sending it (nobody reads the answer).
        Both 413 and 408 answer with `Connection: close`, since the rest of the body stays unread.
    """
    limit = limits.max_request_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # h11 refuses a non-numeric Content-Length itself
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        with anyio.fail_after(limits.body_read_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(None, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_read_timeout:g} s "
                            f"(--body-read-timeout); {size} bytes came", code="request_timeout",
                       headers=_CLOSE) from None
    except ClientDisconnect:
        raise APIError(499, "the client disconnected while sending the request body") from None
    return b"".join(chunks)


def _too_large(declared: int | None, limit: int) -> APIError:
    size = f"{declared} bytes" if declared is not None else "more than that"
    return APIError(413, f"the request body is {size}; the server accepts at most {limit} bytes "
                         "(--max-request-body-bytes)", code="request_too_large", headers=_CLOSE)


def check_fan_out(num_prompts: int, n: int, limits: ServerLimits) -> None:
    """APIError(400) if prompts x n, the sequences this request would add, is over `max_seqs_per_request`.

    Each prompt is an engine request and each of its n completions a sequence with its own KV blocks; 20,000
    one-token prompts, or 100 prompts with n=128, would queue ahead of every other client's request.
    """
    total = num_prompts * n
    if total > limits.max_seqs_per_request:
        raise APIError(400, f"this request asks for {num_prompts} prompt(s) x n={n} = {total} sequences; the "
                            f"server takes at most {limits.max_seqs_per_request} per request "
                            "(--max-seqs-per-request): split it or lower n", param="n" if n > 1 else "prompt")


def _check_chars(chars: int, what: str, param: str, limits: ServerLimits, max_model_len: int) -> None:
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise context_overflow(f"{what} has {chars} characters; more than {limits.max_prompt_chars} cannot fit in "
                               f"max_model_len={max_model_len} tokens (--max-prompt-chars)", max_model_len, param)


def check_prompt_chars(prompts: list, limits: ServerLimits, max_model_len: int) -> None:
    """APIError(400) for a text prompt over `max_prompt_chars` characters (token-id prompts are the engine's)."""
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            _check_chars(len(p), "the prompt" if len(prompts) == 1 else f"prompt[{i}]", "prompt", limits,
                         max_model_len)


def message_chars(messages) -> int:
    """Characters of every message's role and content (a string, or the texts of its parts); anything else
    counts 0.

    The chat template writes each content into the prompt whole, and the role with it (or a marker in its
    place), so the prompt has at least this many characters, less at most the roles' length; roles are capped at
    `minfer.tokenizer.MAX_ROLE_CHARS`, so counting them can only refuse a request that also breaks that cap.
    """
    total = 0
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        role, content = m.get("role"), m.get("content")
        total += len(role) if isinstance(role, str) else 0
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            total += len(text) if isinstance(text, str) else 0
    return total


def json_text_chars(value) -> int:
    """Characters of every string in a parsed JSON value, object keys included (numbers and literals count 0).

    A tool's name, description and parameter schema are written into the chat prompt as JSON (by the template's
    `tojson`, or minfer's own listing, `serve.tools`), and every string of it appears there whole, so the prompt
    has at least this many characters. Iterative: the depth is the body's, which `parse_json_body` bounds.
    """
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += sum(len(k) for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def check_tool_chars(messages, tools, limits: ServerLimits, max_model_len: int) -> None:
    """APIError(400, param "tools") before rendering: the messages' characters (`message_chars`) and the tools'
    (`json_text_chars`) together over `max_prompt_chars`. 120 tools of 100,000-character descriptions were
    rendered and tokenized to 6 M tokens (1.15 GB) before the engine said the prompt was too long."""
    _check_chars(message_chars(messages) + json_text_chars(tools), "messages and tools together", "tools",
                 limits, max_model_len)


def check_rendered_chars(text: str, limits: ServerLimits, max_model_len: int, param: str = "messages") -> None:
    """APIError(400) for a rendered chat prompt over `max_prompt_chars` characters, before it is tokenized."""
    _check_chars(len(text), "the rendered prompt (chat template, messages and tools)", param, limits,
                 max_model_len)


def check_message_chars(messages, limits: ServerLimits, max_model_len: int) -> None:
    """APIError(400) before rendering: more messages than max_model_len (every chat template writes at least one
    token per message: its role marker), or more characters than `max_prompt_chars` (`message_chars`)."""
    if isinstance(messages, list) and len(messages) > max_model_len:
        raise context_overflow(f"messages has {len(messages)} messages; each costs at least one token, so more "
                               f"than max_model_len={max_model_len} cannot fit", max_model_len, "messages")
    _check_chars(message_chars(messages), "messages", "messages", limits, max_model_len)

# ----------------------------------------------------------------------------------------------------------
# The header section: its size and its framing, before any route runs
# ----------------------------------------------------------------------------------------------------------
def header_section_bytes(scope) -> int:
    """Bytes of the request line and header fields as sent ("METHOD target HTTP/1.1\\r\\n", "name: value\\r\\n"
    each, the blank line); the parsed fields drop only the spaces around a value, so this is within a few
    bytes per field of the wire."""
    target = scope.get("raw_path") or scope.get("path", "").encode()
    query = scope.get("query_string") or b""
    line = len(scope.get("method", "")) + 1 + len(target) + (1 + len(query) if query else 0) + 11
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or ()) + 2


def framing_error(scope, limits: ServerLimits) -> APIError | None:
    """The reason to refuse a request from its header section alone, or None.

    - 431 when the section is over `h11_max_incomplete_event_size`: h11 applies that limit only to a section
      still unfinished, so one that arrives whole in a single write (up to the socket's read size) got through.
    - 400 with `Connection: close` for both `Transfer-Encoding` and `Content-Length` (RFC 9112 §6.1: a server
      may refuse such a message, and must close the connection after it either way).
    """
    size, limit = header_section_bytes(scope), limits.h11_max_incomplete_event_size
    if size > limit:
        return APIError(431, f"the request's header section is {size} bytes; the server accepts at most {limit} "
                             "(--h11-max-incomplete-event-size)", code="request_header_fields_too_large",
                        headers=_CLOSE)
    names = {k.lower() for k, _ in scope.get("headers") or ()}
    if b"transfer-encoding" in names and b"content-length" in names:
        return APIError(400, "the request has both Transfer-Encoding and Content-Length; send one",
                        code="ambiguous_framing", headers=_CLOSE)
    return None


class FramingMiddleware:
    """ASGI middleware: `framing_error`, answered before authentication or any route reads the request.

    Args:
        app: the ASGI app to guard.
        limits: `ServerLimits` (its `h11_max_incomplete_event_size`).
        respond: `async respond(scope, receive, send, APIError)`: writes the error response (the app's error
            shape and metrics).
    """

    def __init__(self, app, limits: ServerLimits, respond):
        self.app, self.limits, self.respond = app, limits, respond

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            err = framing_error(scope, self.limits)
            if err is not None:
                await self.respond(scope, receive, send, err)
                return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------------------------------------
# What one admitted request can cost the API process at most (chapter 9 §9.8's table)
# ----------------------------------------------------------------------------------------------------------
# The most Python memory a byte of JSON becomes, once `protocol.parse_json_body` has refused bodies of more than
# MAX_JSON_CONTAINERS objects and arrays (16 MiB of "{}," parsed to 26 bytes a byte): a one-character string
# that CPython does not cache, '"Ā",' (5 bytes; a 76-byte str and its 8-byte list slot). Measured with CPython
# 3.11 on 16 MiB bodies: '"Ā",' 15.9 to 18.2 bytes a byte, "1.5," 11.5, "1000," 7.9, an object of distinct
# one-character keys 13.3; 22 leaves room for the allocator's rounding and fragmentation.
JSON_BYTES_PER_BODY_BYTE = 22
TOKEN_ID_BYTES = 36  # a Python int above 256 (28 bytes) and its list slot (8)
# A character is at most 4 UTF-8 bytes and a byte-level BPE (or byte-fallback) token at least one byte.
TOKENS_PER_CHAR = 4
# Peak bytes per token while a Hugging Face tokenizer encodes (its Encoding: ids, offsets, masks...), measured
# on SmolLM2's: 663,552 random CJK characters became 1.78 M tokens with the process up 389 MB at its peak.
TOKENIZE_BYTES_PER_TOKEN = 230


def request_memory_bound(limits: ServerLimits, max_model_len: int) -> dict[str, int]:
    """The most memory one request can make the API process hold before the engine takes it (bytes), by part.

    - `body`: the raw body, at most `max_request_body_bytes`, twice while its chunks are joined (freed once
      parsed);
    - `parsed`: its JSON as Python objects, at most `JSON_BYTES_PER_BODY_BYTE` per byte of body;
    - `tokenizing`: one prompt being tokenized (prompts are tokenized one at a time, each refused once it has
      max_model_len tokens): `max_prompt_chars` x `TOKENS_PER_CHAR` tokens x `TOKENIZE_BYTES_PER_TOKEN`;
    - `token_ids`: the prompts kept, `max_seqs_per_request` prompts of under max_model_len ids;
    - `peak`: the parts held at once, parsed + max(2 x body, tokenizing + token_ids).

    Needs `limits.max_prompt_chars` resolved (`ServerLimits.resolve`).
    """
    body = limits.max_request_body_bytes
    parsed = JSON_BYTES_PER_BODY_BYTE * body
    chars = limits.max_prompt_chars if limits.max_prompt_chars is not None else body
    tokenizing = chars * TOKENS_PER_CHAR * TOKENIZE_BYTES_PER_TOKEN
    token_ids = limits.max_seqs_per_request * max_model_len * TOKEN_ID_BYTES
    return {"body": body, "parsed": parsed, "tokenizing": tokenizing, "token_ids": token_ids,
            "peak": parsed + max(2 * body, tokenizing + token_ids)}
