"""Admission control and connection limits of the server (minfer/serve/limits.py, connection.py, routes.py).

Each test is one finding of issue 17: something a client could make the server do, and the limit that now
refuses it. Most run the app on tests/fake_engine.py, in-process (`TestClient`) or under a real uvicorn in a
thread of this process (`server_in_thread`: the server's memory is this process's, read from /proc/self/status,
and slow clients are raw sockets). A few start `python -m minfer.serve` only to check flags (no model is
loaded), and one reads the default model's vocabulary.

    pytest -q tests/test_serve_admission.py
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import select
import socket
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from minfer.serve.connection import uvicorn_options
from minfer.serve.limits import ServerLimits, longest_token_chars
from minfer.serve.routes import build_app
from tests.fake_engine import FakeEngine, FakeTokenizer
from tests.serving import server_in_thread

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 256
JSON = {"Content-Type": "application/json"}

pytestmark = pytest.mark.timeout(120)


def _app(engine: FakeEngine | None = None, **kwargs):
    engine = engine or FakeEngine(max_model_len=MAX_MODEL_LEN, num_blocks=512, max_num_seqs=64)
    return build_app(engine, served_model_names=["fake"], log_requests=False, **kwargs)


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


# ----------------------------------------------------------------------------------------------------------
# Memory of this process, and a raw-socket client that sends a huge body no faster than the server reads it
# ----------------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@contextlib.contextmanager
def rss_growth():
    """Yield a dict that gets "mb": how far this process's resident memory rose above its start, at its peak.

    The kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs) catches a peak between two
    samples; a sampling thread (every 2 ms) stands in where the reset is not allowed.
    """
    start = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        hwm = True
    except OSError:
        hwm = False
    peak, stop = [start], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _status_kib("VmRSS"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out: dict = {}
    try:
        yield out
    finally:
        stop.set()
        sampler.join()
        top = max(peak[0], _status_kib("VmHWM") if hwm else 0)
        out["mb"] = (top - start) / 1024


def _read_response(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    """(status, body) of the HTTP response on `sock`, read until its Content-Length or EOF."""
    data = b""
    while time.time() < deadline:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            m = re.search(rb"content-length: *(\d+)", head, re.I)
            if m and len(body) >= int(m.group(1)):
                break
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            try:
                got = sock.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            data += got
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data.partition(b"\r\n\r\n")[2]


def _huge_body(total: int, chunked: bool):
    """`{"prompt": "alpha alpha ..."}` of exactly `total` bytes, 64 KiB at a time (chunk-framed if `chunked`)."""
    frame = (lambda data: b"%x\r\n%s\r\n" % (len(data), data)) if chunked else (lambda data: data)
    prefix, suffix, piece = b'{"prompt": "', b'"}', b"alpha " * (65536 // 6)
    yield frame(prefix)
    left = total - len(prefix) - len(suffix)
    while left > 0:
        yield frame(piece[:left])
        left -= len(piece[:left])
    yield frame(suffix)
    if chunked:
        yield b"0\r\n\r\n"


def _post_huge_prompt(url: str, total: int, chunked: bool, timeout: float = 60) -> tuple[int, bytes, float, int]:
    """POST a `total`-byte /v1/completions body over a raw socket as fast as the server takes it, stopping at
    its answer. Returns (status, body, seconds from the first byte to the answer, bytes written)."""
    host, port = url.removeprefix("http://").split(":")
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % total
    pending = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n\r\n" % framing
    pieces = _huge_body(total, chunked)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setblocking(False)
    sent, t0, deadline = 0, time.perf_counter(), time.time() + timeout
    try:
        while time.time() < deadline:
            readable, writable, _ = select.select([sock], [sock] if pending else [], [], 0.05)
            if not readable and writable:
                try:
                    n = sock.send(pending)
                except (BrokenPipeError, ConnectionResetError):  # the server closed: its answer is waiting
                    readable = [sock]
                else:
                    sent += n
                    pending = pending[n:] or next(pieces, b"")
            if readable:
                status, body = _read_response(sock, deadline)
                return status, body, time.perf_counter() - t0, sent
        return 0, b"", time.perf_counter() - t0, sent
    finally:
        sock.close()


# ----------------------------------------------------------------------------------------------------------
# 1. Request size: a body limit from Content-Length or while streaming; a prompt character limit
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_50_mib_prompt_refused_in_under_a_second_and_100_mb(chunked):
    limits = ServerLimits()
    with server_in_thread(_app(), **uvicorn_options(limits)) as url:
        assert httpx.post(url + "/v1/completions", json={"prompt": "alpha", "max_tokens": 2}).status_code == 200
        with rss_growth() as rss:
            status, body, seconds, sent = _post_huge_prompt(url, 50 * 2**20, chunked)
    seen = f"status {status} after {seconds:.2f} s, memory +{rss['mb']:.0f} MB: {body[:200]!r}"
    assert status == 413 and seconds < 1.0 and rss["mb"] < 100, seen
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and "--max-request-body-bytes" in err["message"], err
    assert sent < 50 * 2**20, "the whole body was taken before the answer"
    if chunked:  # no Content-Length to refuse from: read up to the limit, then cut off
        assert sent > limits.max_request_body_bytes


def test_prompt_over_the_char_limit_is_refused_before_tokenizing():
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, num_blocks=512)
    seen: list[int] = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text: seen.append(len(text)) or encode(text)
    limit = MAX_MODEL_LEN * FakeTokenizer.max_token_chars  # the bound: max_model_len x the longest token
    too_long = "alpha " * (limit // 6 + 1)
    with TestClient(_app(engine)) as c:
        for path, body, param in [
            ("/v1/completions", {"prompt": too_long}, "prompt"),
            ("/v1/completions", {"prompt": ["alpha", too_long]}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]}, "messages"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "text", "text": too_long[: limit // 2]}, {"type": "text", "text": too_long[limit // 2:]}]}]},
             "messages"),
        ]:
            err = _error(r := c.post(path, json=body))
            assert r.status_code == 400 and err["param"] == param and "--max-prompt-chars" in err["message"], err
        assert seen == [], "a refused prompt was tokenized"
        r = c.post("/v1/completions", json={"prompt": too_long[:limit], "max_tokens": 1})
        assert r.status_code == 400 and "max_model_len" in _error(r)["message"]  # at the limit: the engine's check
        assert c.post("/v1/completions", json={"prompt": "alpha beta", "max_tokens": 2}).status_code == 200
        assert c.get("/v1/stats").json()["limits"]["max_prompt_chars"] == limit
    assert ServerLimits(max_prompt_chars=50).resolve(engine.tokenizer, MAX_MODEL_LEN).max_prompt_chars == 50


def test_chat_roles_and_message_count_count_against_the_limits():
    """Many empty messages, or one huge role, passed a check that counted contents only: 500,000 empty messages
    (15 MB) were rendered and tokenized for 19 s, holding the GIL from everyone else. Roles count, roles are
    short, and more messages than max_model_len tokens cannot fit: all refused before rendering."""
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, num_blocks=512)
    rendered: list[int] = []
    render = engine.tokenizer.apply_chat_template
    engine.tokenizer.apply_chat_template = lambda messages, *a: rendered.append(len(messages)) or render(messages, *a)
    limit = MAX_MODEL_LEN * FakeTokenizer.max_token_chars
    with TestClient(_app(engine)) as c:
        for messages, words in [
            ([{"role": "a", "content": ""}] * (MAX_MODEL_LEN + 1), "messages; each costs at least one token"),
            ([{"role": "x" * 200, "content": "Hi"}], "role must have 1 to 64 characters"),
            ([{"role": "user", "content": "a"}] * (MAX_MODEL_LEN // 2) + [{"role": "user", "content": "b" * limit}],
             "--max-prompt-chars"),
        ]:
            err = _error(r := c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}))
            assert r.status_code == 400 and err["param"] == "messages" and words in err["message"], err
        assert rendered == [], "a refused conversation was rendered"
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "alpha"}] * 8,
                                                   "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_numbers_python_cannot_read_are_a_400():
    """An integer of more than 4300 digits makes json.loads raise a plain ValueError: a 400, not a 500."""
    with TestClient(_app()) as c:
        for path, body in [("/v1/completions", '{"prompt": "a", "seed": %s}' % ("9" * 5000)),
                           ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
                                                    '"max_tokens": %s}' % ("9" * 4400))]:
            r = c.post(path, content=body, headers=JSON)
            assert r.status_code == 400 and "cannot be read" in _error(r)["message"], r.text


def test_char_bound_holds_for_the_default_tokenizer(llm):
    """SmolLM2's longest token is 81 characters, and no token decodes to more (the bound's premise)."""
    tok = llm.tokenizer
    longest = longest_token_chars(tok)
    assert longest == 81
    assert max(len(tok.decode([i], skip_special_tokens=False)) for i in range(tok.vocab_size)) <= longest
    worst = "\n" + " " * 80  # that token: 81 characters each
    assert len(tok.encode(worst * 10, add_special_tokens=False)) >= 10


# ----------------------------------------------------------------------------------------------------------
# 3. Anything a client sends is safe to quote in an error
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": "\ud800", "prompt": "alpha"}, 404, "model"),
    ("/v1/chat/completions", {"model": "x\udfffy", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/completions", {"prompt": "alpha", "logprobs": "\ud800"}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "alpha", "ignore_eos": "\ud800"}, 400, "ignore_eos"),
    ("/v1/completions", {"model": ["\ud800"] * 5000, "prompt": "alpha"}, 400, "model"),
])
def test_lone_surrogates_are_safe_to_echo(path, body, status, param):
    raw = json.dumps(body)  # ensure_ascii: the JSON text holds the escape \ud800, valid JSON
    with TestClient(_app(), raise_server_exceptions=False) as c:
        r = c.post(path, content=raw, headers=JSON)
    assert r.status_code == status, r.text
    err = _error(r)
    assert err["param"] == param and len(err["message"]) < 400, err
    if status == 404:
        assert "\\ud" in err["message"] and err["code"] == "model_not_found"


# ----------------------------------------------------------------------------------------------------------
# 4. Fan-out: prompts x n per request
# ----------------------------------------------------------------------------------------------------------
def test_prompts_times_n_capped_per_request():
    with server_in_thread(_app(), **uvicorn_options(ServerLimits())) as url, \
            httpx.Client(base_url=url, timeout=10) as c:
        for body, param in [({"prompt": ["hi"] * 20000, "max_tokens": 1}, "prompt"),
                            ({"prompt": ["hi"] * 100, "n": 128, "max_tokens": 1}, "n"),
                            ({"prompt": ["hi"] * 257, "max_tokens": 1}, "prompt")]:
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json=body)
            err = _error(r)
            assert r.status_code == 400 and err["param"] == param, err
            assert "--max-seqs-per-request" in err["message"] and "256" in err["message"]
            assert time.perf_counter() - t0 < 2
        r = c.post("/v1/completions", json={"prompt": ["hi", "alpha"], "n": 128, "max_tokens": 1})  # 256: at the cap
        assert r.status_code == 200 and len(r.json()["choices"]) == 256, r.text
    with TestClient(_app(limits=ServerLimits(max_seqs_per_request=4))) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 5})
        assert r.status_code == 400 and _error(r)["param"] == "n"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 4,
                                                 "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


# ----------------------------------------------------------------------------------------------------------
# 6. Booleans are JSON booleans
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stream",
                                   "stream_options.include_usage", "chat:logprobs"])
@pytest.mark.parametrize("value", ["false", 0, 1, "true"])
def test_non_boolean_flags_refused(field, value):
    path, body = "/v1/completions", {"prompt": "alpha", "max_tokens": 2}
    if field.startswith("chat:"):
        path, body, field = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, field[5:]
    if field == "stream_options.include_usage":
        body.update(stream=True, stream_options={"include_usage": value})
        param = "stream_options"
    else:
        body[field] = value
        param = field
    with TestClient(_app()) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param and "boolean" in err["message"], err


# ----------------------------------------------------------------------------------------------------------
# 7. Methods: HEAD answers like GET without a body; 405 says what is allowed
# ----------------------------------------------------------------------------------------------------------
def test_head_answers_like_get_and_405_names_allowed_methods():
    with server_in_thread(_app(), **uvicorn_options(ServerLimits())) as url, \
            httpx.Client(base_url=url, timeout=10) as c:
        for path in ("/health", "/", "/metrics", "/v1/models", "/v1/stats"):
            get, head = c.get(path), c.head(path)
            assert head.status_code == get.status_code == 200, (path, head.status_code)
            assert head.content == b"" and get.content, path
            assert head.headers["content-type"] == get.headers["content-type"], path
        assert c.head("/").headers["content-length"] == c.get("/").headers["content-length"]
        for method, path, allowed in [
                ("DELETE", "/v1/completions", {"POST"}), ("GET", "/v1/chat/completions", {"POST"}),
                ("POST", "/health", {"GET", "HEAD"}), ("PUT", "/", {"GET", "HEAD"}),
                ("OPTIONS", "/v1/completions", {"POST"})]:
            r = c.request(method, path)
            assert r.status_code == 405, (method, path, r.status_code)
            assert {m.strip() for m in r.headers["allow"].split(",")} == allowed, (method, path, r.headers)
            assert _error(r)["message"]


# ----------------------------------------------------------------------------------------------------------
# 8. What is public: /health, /metrics and the page; the API docs are off by default and never use a CDN
# ----------------------------------------------------------------------------------------------------------
def test_docs_are_off_by_default_and_behind_the_key():
    with TestClient(_app()) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            assert c.get(path).status_code == 404, path
    key = {"Authorization": "Bearer sekret"}
    with TestClient(_app(api_key="sekret")) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/v1/stats", "/v1/models", "/no-such-page"):
            r = c.get(path)
            assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key", path
        for path in ("/health", "/metrics", "/"):
            assert c.get(path).status_code == 200, path
            assert c.head(path).status_code == 200, path
        assert c.get("/no-such-page", headers=key).status_code == 404
    with TestClient(_app(api_key="sekret", enable_docs=True)) as c:
        assert c.get("/openapi.json").status_code == 401
        r = c.get("/openapi.json", headers=key)
        assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
        for path in ("/docs", "/redoc"):  # Swagger UI and ReDoc would load their scripts from a CDN
            assert c.get(path, headers=key).status_code == 404, path


# ----------------------------------------------------------------------------------------------------------
# 9. Slow clients: header and body read timeouts, keep-alive
# ----------------------------------------------------------------------------------------------------------
def test_slow_clients_are_cut_off():
    """300 half-sent header sections, 50 bodies shorter than their Content-Length, silent and trickling clients
    and an idle kept-alive connection: all closed within the timeouts (1 s each here), the bodies with a 408."""
    limits = ServerLimits(header_read_timeout=1.0, body_read_timeout=1.0, timeout_keep_alive=1.0)
    partial_header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"
    short_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000\r\n\r\n{\"prompt\": \"al")
    with server_in_thread(_app(limits=limits), **uvicorn_options(limits)) as url:
        address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        groups: dict[str, list[socket.socket]] = {"header": [], "body": [], "silent": [], "trickle": [], "idle": []}
        try:
            opened: dict[socket.socket, float] = {}
            for kind, count, first in [("header", 300, partial_header), ("body", 50, short_body),
                                       ("silent", 5, b""), ("trickle", 3, b"G"),
                                       ("idle", 1, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")]:
                for _ in range(count):
                    s = socket.create_connection(address, timeout=5)
                    s.sendall(first)
                    s.setblocking(False)
                    groups[kind].append(s)
                    opened[s] = time.perf_counter()
            t0 = time.perf_counter()
            received = {s: b"" for ss in groups.values() for s in ss}
            closed_at: dict[socket.socket, float] = {}
            next_trickle = t0
            # every deadline is 1 s (+1 s grace for the protocol's body backstop); 8 s covers a loaded machine
            while len(closed_at) < len(received) and time.perf_counter() - t0 < 8:
                if time.perf_counter() >= next_trickle:  # one more header byte every 0.2 s: no deadline is pushed back
                    for s in groups["trickle"]:
                        if s not in closed_at:
                            with contextlib.suppress(OSError):
                                s.send(b"E")
                    next_trickle += 0.2
                open_ = [s for s in received if s not in closed_at]
                ready, _, _ = select.select(open_, [], [], 0.05)
                for s in ready:
                    try:
                        got = s.recv(65536)
                    except OSError:
                        got = b""
                    received[s] += got
                    if not got:
                        closed_at[s] = time.perf_counter() - opened[s]
        finally:
            for ss in groups.values():
                for s in ss:
                    s.close()
    for kind, socks in groups.items():
        still_open = sum(s not in closed_at for s in socks)
        assert still_open == 0, f"{still_open} of {len(socks)} {kind} connections still open after 8 s"
    for s in groups["body"]:
        assert received[s].startswith(b"HTTP/1.1 408 "), received[s][:200]
        assert b"--body-read-timeout" in received[s]
    assert received[groups["idle"][0]].startswith(b"HTTP/1.1 200 ")
    assert min(closed_at[s] for s in groups["header"] + groups["silent"]) >= 0.9  # not before the timeout either


def test_connection_limits_reach_uvicorn():
    limits = ServerLimits(header_read_timeout=3, body_read_timeout=4, timeout_keep_alive=2,
                          h11_max_incomplete_event_size=4096)
    opts = uvicorn_options(limits)
    assert opts["timeout_keep_alive"] == 2 and opts["h11_max_incomplete_event_size"] == 4096
    assert (opts["http"].header_read_timeout, opts["http"].body_read_timeout) == (3, 4)
    with server_in_thread(_app(limits=limits), **opts) as url:
        # h11 buffers at most 4096 bytes of an unfinished header section: past that, a 400 at once
        sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)
        with sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * 8000)
            sock.setblocking(False)
            t0 = time.perf_counter()
            status, _ = _read_response(sock, time.time() + 5)
        assert status == 400 and time.perf_counter() - t0 < 2
        assert httpx.get(url + "/health", timeout=10).status_code == 200


# ----------------------------------------------------------------------------------------------------------
# 10. Bodies must be declared JSON (no preflight-free cross-origin posts); no CORS headers at all
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_body_must_be_declared_json(path, content_type):
    body = json.dumps({"prompt": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    headers = {} if content_type is None else {"Content-Type": content_type}
    with TestClient(_app()) as c:
        r = c.post(path, content=body, headers=headers)
        assert r.status_code == 415, r.text
        err = _error(r)
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
        ok = c.post(path, content=body, headers={"Content-Type": "Application/JSON; charset=utf-8"})
        assert ok.status_code == 200, ok.text


def test_no_cors_headers():
    origin = {"Origin": "https://elsewhere.example"}
    with TestClient(_app()) as c:
        preflight = c.options("/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "content-type"})
        answers = [preflight, c.post("/v1/completions", json={"prompt": "alpha", "max_tokens": 2}, headers=origin),
                   c.get("/v1/models", headers=origin), c.get("/", headers=origin)]
    assert preflight.status_code == 405
    for r in answers:
        assert not any(h.lower().startswith("access-control-") for h in r.headers), r.headers


# ----------------------------------------------------------------------------------------------------------
# 11. An omitted max_tokens is capped to what fits in max_model_len
# ----------------------------------------------------------------------------------------------------------
def test_omitted_max_tokens_fits_what_is_left():
    long_prompt = " ".join(["alpha"] * (MAX_MODEL_LEN - 6))
    with TestClient(_app()) as c:
        r = c.post("/v1/completions", json={"prompt": long_prompt, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"prompt": [long_prompt, "alpha"], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6 + 16  # OpenAI's 16 still holds
        r = c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 16})  # given: not changed
        assert r.status_code == 400 and "max_model_len" in _error(r)["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_prompt}],
                                                 "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN, r.text


# ----------------------------------------------------------------------------------------------------------
# 12. A CUDA device without CUDA is a clear error (exit status 2 from the command line)
# ----------------------------------------------------------------------------------------------------------
def test_cuda_device_without_cuda_is_a_clear_error():
    import torch

    from minfer import LLM
    from minfer.config import EngineArgs

    for device in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(ValueError, match="device"):
            EngineArgs(device=device)
    EngineArgs(device="cpu")
    EngineArgs(device=None)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            EngineArgs(device=f"cuda:{torch.cuda.device_count()}")
        pytest.skip("this machine has CUDA; the rest checks a CPU-only torch")
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="CUDA"):
            EngineArgs(device=device)
    import minfer.engine

    def no_workers(*args, **kwargs):  # refused before any worker starts or any weight is read
        raise AssertionError("an executor was started for a refused configuration")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(minfer.engine, "make_executor", no_workers)
        with pytest.raises(ValueError, match="CUDA"):
            LLM(device="cuda")
    r = subprocess.run([sys.executable, "-m", "minfer.serve", "--device", "cuda"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "device" in r.stderr and "CUDA" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------------
# 15. The demo page: a CSP that allows only its own inline script and style, and no framing
# ----------------------------------------------------------------------------------------------------------
def _sha256_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


class _InlineCode(HTMLParser):
    """The text of each <script> and <style> element, as a browser's parser splits the page (comments apart)."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=False)
        self.blocks: dict[str, list[str]] = {"script": [], "style": []}
        self._open: str | None = None
        self.attributes: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.attributes += [name for name, _ in attrs]
        if tag in self.blocks:
            self._open = tag
            self.blocks[tag].append("")

    def handle_endtag(self, tag):
        self._open = None

    def handle_data(self, data):
        if self._open:
            self.blocks[self._open][-1] += data


def test_demo_page_has_a_csp_and_cannot_be_framed():
    with TestClient(_app()) as c:
        r = c.get("/")
    html = r.text
    policy = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";") if d.strip())
    page = _InlineCode(html)
    assert len(page.blocks["script"]) == 1 and len(page.blocks["style"]) == 1
    assert policy["script-src"] == _sha256_source(page.blocks["script"][0])
    assert policy["style-src"] == _sha256_source(page.blocks["style"][0])
    assert (policy["default-src"], policy["connect-src"], policy["frame-ancestors"]) == ("'none'", "'self'", "'none'")
    assert "unsafe" not in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    # what such a policy would block, and what would let model text become markup
    assert not [a for a in page.attributes if a == "style" or a.startswith("on") or a == "src"], page.attributes
    assert "javascript:" not in html
    assert re.findall(r"\.innerHTML\s*=\s*([^;]+);", html) == ['""']
    assert "out.textContent = answer" in html


# ----------------------------------------------------------------------------------------------------------
# The flags: every limit is one, named in --help with its unit
# ----------------------------------------------------------------------------------------------------------
def _help_entry(help_text: str, flag: str) -> str:
    """The help of `flag` in argparse's output: its line and the continuation lines under it, on one line."""
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s+{re.escape(flag)}(\s|,|$)", line):
            entry = [line]
            for more in lines[i + 1:]:
                if not more.strip() or re.match(r"\s+-", more):
                    break
                entry.append(more)
            return " ".join(" ".join(entry).split())
    raise AssertionError(f"{flag} is not in --help")


def test_help_names_every_limit_with_its_unit():
    r = subprocess.run([sys.executable, "-m", "minfer.serve", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    for flag, unit in [("--max-request-body-bytes", "bytes"), ("--max-prompt-chars", "characters"),
                       ("--max-seqs-per-request", "sequences"), ("--body-read-timeout", "seconds"),
                       ("--header-read-timeout", "seconds"), ("--timeout-keep-alive", "seconds"),
                       ("--h11-max-incomplete-event-size", "bytes"), ("--enable-fastapi-docs", "/openapi.json"),
                       ("--disable-fastapi-docs", "default"), ("--allowed-origins", "CORS"),
                       ("--api-key", "/health")]:
        entry = _help_entry(r.stdout, flag)
        assert unit in entry and "default" in entry, (flag, entry)


def test_limit_flags_map_onto_server_limits():
    from minfer.serve.__main__ import build_parser, limits_from

    args = build_parser().parse_args([
        "--max-request-body-bytes", "1M", "--max-prompt-chars", "1000", "--max-seqs-per-request", "32",
        "--body-read-timeout", "2.5", "--header-read-timeout", "3", "--timeout-keep-alive", "4",
        "--h11-max-incomplete-event-size", "8K"])
    assert limits_from(args) == ServerLimits(
        max_request_body_bytes=2**20, max_prompt_chars=1000, max_seqs_per_request=32, body_read_timeout=2.5,
        header_read_timeout=3, timeout_keep_alive=4, h11_max_incomplete_event_size=8192)
    assert limits_from(build_parser().parse_args([])) == ServerLimits()
    for flags in (["--max-seqs-per-request", "0"], ["--body-read-timeout", "0"], ["--max-request-body-bytes", "0"],
                  ["--header-read-timeout", "inf"], ["--allowed-origins", "*"]):
        with pytest.raises(ValueError, match=flags[0].lstrip("-").replace("-", "_") + "|allowed"):
            limits_from(build_parser().parse_args(flags))
    r = subprocess.run([sys.executable, "-m", "minfer.serve", "--max-seqs-per-request", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "max_seqs_per_request" in r.stderr and "Traceback" not in r.stderr, r.stderr
