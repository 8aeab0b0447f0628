"""Bounded memory for every request and every config (issue 33): one test per finding, each a small version
of the attack that shows the bound: a 4xx, or this process's memory measured (`rss_growth`) under a stated
amount, with another request completing afterwards; the config cases a ValueError in under a second.

The server tests run the app on tests/fake_engine.py under a real uvicorn in a thread of this process (its
memory is this process's), and raw sockets where the attack is in the framing.

    pytest -q tests/test_bounds.py
"""

from __future__ import annotations

import json
import math
import socket
import time
import types

import httpx
import pytest

from minfer.config import MODEL_SIZE_BOUNDS
from minfer.sampling_params import MAX_LOGIT_BIAS_TOKENS, MAX_STOP_TOKEN_IDS, SamplingParams
from minfer.sequence import Sequence
from minfer.serve.connection import uvicorn_options
from minfer.serve.limits import ServerLimits, request_memory_bound
from minfer.serve.routes import build_app
from tests.conftest import SHARED
from tests.fake_engine import FakeEngine, FakeTokenizer
from tests.serving import server_in_thread
from tests.test_serve_admission import rss_growth

MAX_MODEL_LEN = 256
pytestmark = pytest.mark.timeout(180)


def _engine() -> FakeEngine:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, num_blocks=512, max_num_seqs=64)
    engine.tokenizer.hf = types.SimpleNamespace()  # no chat template of its own: minfer's tool listing is used
    return engine


def _app(engine=None, **kwargs):
    return build_app(engine or _engine(), served_model_names=["fake"], log_requests=False, **kwargs)


def _ok(url: str) -> None:
    """Another request completes."""
    r = httpx.post(url + "/v1/completions", json={"prompt": "alpha beta", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text


class _Spy:
    """Wraps a tokenizer method and records the length of what it was given."""

    def __init__(self, obj, name: str):
        self.seen: list[int] = []
        inner = getattr(obj, name)

        def spy(first, *a, **kw):
            self.seen.append(len(first))
            return inner(first, *a, **kw)

        setattr(obj, name, spy)


# ----------------------------------------------------------------------------------------------------------
# Row 1: tools get around --max-prompt-chars
# ----------------------------------------------------------------------------------------------------------
def _tools(count: int, description_chars: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "description": "d" * description_chars,
                                              "parameters": {"type": "object", "properties": {}}}}
            for i in range(count)]


def test_tools_count_against_the_prompt_bound_before_rendering():
    """The issue's attack, whole: 120 tools of 100,000-character descriptions (12 MB) were rendered and
    tokenized to 6 M tokens (+750 MB). Now a 400 naming tools and the flag, nothing rendered or tokenized,
    the process up less than 200 MB (the 12 MB body and its parsed copy), and the next request served."""
    engine = _engine()
    render, encode = _Spy(engine.tokenizer, "apply_chat_template"), _Spy(engine.tokenizer, "encode")
    body = {"messages": [{"role": "user", "content": "alpha"}], "tools": _tools(120, 100_000), "max_tokens": 2}
    with server_in_thread(_app(engine), **uvicorn_options(ServerLimits())) as url:
        _ok(url)
        encode.seen.clear()
        with rss_growth() as rss:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools" and "--max-prompt-chars" in err["message"], r.text
        assert rss["mb"] < 200, f"memory +{rss['mb']:.0f} MB"
        assert render.seen == [] and encode.seen == [], "a refused request was rendered or tokenized"
        _ok(url)


def test_the_rendered_prompt_is_checked_before_it_is_tokenized():
    """Messages and tools under the bound whose rendering (the template's text around them) is over it: the
    rendered text is refused before the tokenizer sees it."""
    engine = _engine()
    limit = MAX_MODEL_LEN * FakeTokenizer.max_token_chars
    encode = _Spy(engine.tokenizer, "encode")
    # --tool-prompt minfer: minfer writes its tool prompt for tool_choice "auto" too (the default, template,
    # writes none for it), and the rendered prompt is checked before that prompt's token budget is counted
    with server_in_thread(_app(engine, tool_prompt="minfer"), **uvicorn_options(ServerLimits())) as url:
        # one tool of (limit - 200) characters: the tool-use instructions minfer writes push it over
        tools = _tools(1, limit - 200)
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "alpha"}], "tools": tools, "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and "rendered prompt" in err["message"] and err["param"] == "tools", r.text
        assert all(n < limit for n in encode.seen), "the over-long rendered prompt reached the tokenizer"
        small = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "alpha"}], "tools": _tools(1, 20), "max_tokens": 2})
        assert small.status_code == 200, small.text


def test_prompts_are_refused_one_at_a_time_once_one_cannot_fit():
    """256 prompts that each tokenize to more than max_model_len: tokenizing stops at the first."""
    engine = _engine()
    encode = _Spy(engine.tokenizer, "encode")
    prompt = "alpha " * MAX_MODEL_LEN  # MAX_MODEL_LEN tokens: no room for output
    with server_in_thread(_app(engine), **uvicorn_options(ServerLimits())) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": [prompt] * 256, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400 and "prompt[0] has 256 tokens" in r.json()["error"]["message"].lower(), r.text
        assert len(encode.seen) == 1
        _ok(url)


# ----------------------------------------------------------------------------------------------------------
# Row 2: stop_token_ids grows with n
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, limit", [
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), MAX_STOP_TOKEN_IDS),
    ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}, MAX_LOGIT_BIAS_TOKENS),
])
def test_token_id_lists_are_capped_with_a_400_naming_field_and_limit(field, value, limit):
    with server_in_thread(_app(), **uvicorn_options(ServerLimits())) as url:
        for path, extra in [("/v1/completions", {"prompt": "a"}), ("/generate", {"prompt": "a"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})]:
            r = httpx.post(url + path, json={**extra, "n": 16, "max_tokens": 4, field: value}, timeout=30)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == field and str(limit) in err["message"], (path, r.text)
        # the attack at its full size: 1.9 M stop ids (15 MB of JSON) and n=16
        body = b'{"prompt": "a", "n": 16, "max_tokens": 4, "min_tokens": 1, "ignore_eos": true, "stop_token_ids": [%s]}' % (
            ", ".join(map(str, range(1_900_000))).encode())
        with rss_growth() as rss:
            r = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                           timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text[:300]
        # the body (15 MB) parsed to 1.9 M ints (28 + 8 bytes each, 68 MB): no per-sequence copies
        assert rss["mb"] < 150, f"memory +{rss['mb']:.0f} MB"
        _ok(url)
    assert len(SamplingParams(**{field: value[:limit] if isinstance(value, list) else
                                 dict(list(value.items())[:limit])}).__dict__[field]) == limit


def test_a_requests_sequences_share_one_stop_set():
    """n sequences hold the same stop-id set (and SamplingParams, so the same logit_bias), not n copies."""
    params = SamplingParams(n=16, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
                            logit_bias={1: 2.0}).clone(_eos_token_ids=(0,))
    seqs = [Sequence("r", i, [1, 2, 3], params, 64) for i in range(params.n)]
    assert all(s.stop_ids is seqs[0].stop_ids for s in seqs)
    assert all(s.params.logit_bias is seqs[0].params.logit_bias for s in seqs)
    assert seqs[0].stop_ids == frozenset(range(MAX_STOP_TOKEN_IDS))  # EOS 0 is in the list already
    assert params.clone(ignore_eos=True, stop_token_ids=[5]).all_stop_token_ids == {5}
    assert SamplingParams(stop_token_ids=[5]).clone(_eos_token_ids=(2,)).all_stop_token_ids == {2, 5}


# ----------------------------------------------------------------------------------------------------------
# Rows 3-5 and raw errors: configs
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.test_llama import make_hf_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model(path, "LlamaConfig", {})
    return path


def _with_config(hf_dir, tmp_path, **changes):
    """A copy of `hf_dir` (the weights linked) with `changes` written into its config.json."""
    for f in hf_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _refused_fast(path, match: str, **load_kwargs):
    from minfer.model.loader import load_model

    with rss_growth() as rss:
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=match):
            load_model(str(path), dtype="float32", device="cpu", **load_kwargs)
        seconds = time.perf_counter() - t0
    assert seconds < 1.0, f"{seconds:.2f} s"
    assert rss["mb"] < 50, f"memory +{rss['mb']:.0f} MB"


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 1_000_000}, r"config.json: num_hidden_layers = 1000000: must be an integer in \[1, 1024\]"),
    ({"vocab_size": 10**9}, r"vocab_size = 1000000000: must be an integer in \[1, 2097152\]"),
    ({"max_position_embeddings": 10**8}, r"max_position_embeddings = 100000000: must be an integer in \[1, 16777216\]"),
    ({"hidden_size": 0}, r"hidden_size must be a positive integer, got 0"),
    ({"num_key_value_heads": 3}, r"num_attention_heads = 4 must be a multiple of num_key_value_heads = 3"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
     r"rope_theta = nan: must be a finite number > 1 \(RoPE's base"),
    ({"rope_parameters": None, "rope_theta": float("inf")}, r"rope_theta = inf: must be a finite"),
    ({"rope_parameters": None, "rope_theta": 0.5}, r"rope_theta = 0.5: must be a finite number > 1"),
    ({"rms_norm_eps": -1}, r"rms_norm_eps = -1: must be a finite number > 0 and < 1"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps = nan: must be a finite number > 0 and < 1"),
    ({"rms_norm_eps": 10.0}, r"rms_norm_eps = 10.0: must be a finite number > 0 and < 1"),
    # a NaN the adapter does not read (rope_parameters' base wins over the top-level one) is refused too
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_theta": float("nan")},
     r"config.json: rope_theta = nan: must be a finite number \(JSON has no NaN or Infinity\)"),
    ({"initializer_range": float("inf")}, r"config.json: initializer_range = inf: must be a finite number"),
    ({"rope_parameters": {"rope_type": "linear", "factor": float("nan"), "rope_theta": 10000.0}},
     r"rope_scaling.factor = nan: must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0, "rope_theta": 10000.0}},
     r"rope_scaling.factor = 0: must be a finite number > 0"),
    # within every bound, but 2 M x 65,536 x 4 bytes of embedding is more memory than any machine here has
    ({"vocab_size": 2**21, "hidden_size": 65536, "num_attention_heads": 512, "num_key_value_heads": 512},
     r"needs at least \d+\.\d GiB for its weights and position table but the cpu has"),
])
def test_bad_configs_are_a_value_error_in_under_a_second(hf_dir, tmp_path, changes, match):
    _refused_fast(_with_config(hf_dir, tmp_path, **changes), match)


def test_deeply_nested_config_is_a_value_error(hf_dir, tmp_path):
    path = _with_config(hf_dir, tmp_path)
    (path / "config.json").unlink()
    cfg = json.loads((hf_dir / "config.json").read_text())
    text = json.dumps(cfg)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (path / "config.json").write_text(text)
    _refused_fast(path, r"config.json: nested too deeply")


def test_rope_table_is_sized_by_max_model_len(hf_dir, tmp_path):
    """max_position_embeddings 10^7 under max_model_len=256 built a 611 MB table; now 256 rows."""
    from minfer.model.loader import load_model

    path = _with_config(hf_dir, tmp_path, max_position_embeddings=10**7)
    with rss_growth() as rss:
        lm = load_model(str(path), dtype="float32", device="cpu", max_model_len=256)
    tables = [b for n, b in lm.model.named_buffers() if n.endswith("cos_sin")]
    assert tables and all(t.shape[1] == 256 for t in tables), [t.shape for t in tables]
    assert rss["mb"] < 100, f"memory +{rss['mb']:.0f} MB"


def test_model_config_checks_do_not_need_a_file():
    from minfer.config import ModelConfig

    base = dict(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    ModelConfig(**base)
    for name, bound in MODEL_SIZE_BOUNDS.items():
        with pytest.raises(ValueError, match=rf"{name} = {bound + 1}: must be an integer in \[1, {bound}\]"):
            ModelConfig(**{**base, name: bound + 1})
    for name, out_of_range in (("rms_norm_eps", 1.0), ("rope_theta", 1.0), ("rope_local_theta", 0.5),
                               ("query_pre_attn_scalar", 0.0)):
        for bad in (math.nan, math.inf, -math.inf, 0.0, -1.0, out_of_range):
            with pytest.raises(ValueError, match=rf"{name} = {bad!r}: must be a finite number >"):
                ModelConfig(**{**base, name: bad})
    for key, bad in (("factor", math.nan), ("partial_rotary_factor", 1.5), ("beta_fast", math.inf)):
        with pytest.raises(ValueError, match=rf"rope_scaling.{key} = {bad!r}: must be a finite number > 0"):
            ModelConfig(**{**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, key: bad}})
    ModelConfig(**{**base, "rms_norm_eps": 1e-12, "rope_theta": 1.5})  # in range, however unusual


# ----------------------------------------------------------------------------------------------------------
# The HTTP layer: header size (431), Transfer-Encoding with Content-Length (400, closed), private fields
# ----------------------------------------------------------------------------------------------------------
def _raw(url: str, data: bytes, wait: float = 5) -> tuple[bytes, bool]:
    """Send `data` in one write; (everything the server sent, whether it closed the connection)."""
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=wait)
    with sock:
        sock.sendall(data)
        got, deadline = b"", time.time() + wait
        while time.time() < deadline:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                return got, False
            if not chunk:
                return got, True
            got += chunk
        return got, False


@pytest.mark.parametrize("kib, status", [(8, 200), (17, 431), (60, 431)])
def test_header_section_limit_is_enforced_in_one_write(kib, status):
    limits = ServerLimits()
    with server_in_thread(_app(limits=limits), **uvicorn_options(limits)) as url:
        headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"x" * 1000) for i in range(kib))
        got, _ = _raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"Connection: close\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 %d " % status), got[:300]
        if status == 431:
            assert b"--h11-max-incomplete-event-size" in got
        assert httpx.get(url + "/health").status_code == 200


def test_transfer_encoding_with_content_length_is_refused_and_the_connection_closed():
    with server_in_thread(_app(), **uvicorn_options(ServerLimits())) as url:
        body = b'{"prompt": "alpha", "max_tokens": 1}'
        smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                   % (len(body), len(body), body))
        got, closed = _raw(url, request + smuggled)
        assert got.startswith(b"HTTP/1.1 400 ") and b"Transfer-Encoding and Content-Length" in got, got[:300]
        assert closed and got.count(b"HTTP/1.1 ") == 1, "the next request on the socket was processed"
        _ok(url)


def test_generate_refuses_private_fields():
    with server_in_thread(_app(), **uvicorn_options(ServerLimits())) as url:
        r = httpx.post(url + "/generate", json={"prompt": "alpha", "max_tokens": 2, "_eos_token_ids": [1, 2]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "_eos_token_ids", r.text
        assert httpx.post(url + "/generate", json={"prompt": "alpha", "max_tokens": 2}).status_code == 200


# ----------------------------------------------------------------------------------------------------------
# The worst case of one request at the default limits (chapter 9's table)
# ----------------------------------------------------------------------------------------------------------
def test_one_request_stays_under_its_stated_bound():
    """The costliest bodies per byte the limits let through, 16 MiB each: one-character strings CPython does
    not cache (the most Python memory per byte of JSON once objects and arrays are capped) and the most text
    prompts at the character bound. Each is answered and the process's growth stays under
    `request_memory_bound`'s peak. 16 MiB of empty objects (26 bytes a byte) is refused before parsing."""
    limits = ServerLimits().resolve(FakeTokenizer(), MAX_MODEL_LEN)
    bound_mb = request_memory_bound(limits, MAX_MODEL_LEN)["peak"] / 2**20
    chars = limits.max_prompt_chars
    with server_in_thread(_app(limits=limits), **uvicorn_options(limits)) as url:
        empty = b'{"prompt": "a", "stop": [' + b"{}," * ((limits.max_request_body_bytes - 200) // 3) + b"{}]}"
        with rss_growth() as rss:
            r = httpx.post(url + "/v1/completions", content=empty, timeout=120,
                           headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "JSON objects and arrays" in r.text, r.text[:300]
        assert rss["mb"] < 100, f"memory +{rss['mb']:.0f} MB"
        strings = b'{"prompt": "a", "max_tokens": 1, "stop": [' + '"\u0100",'.encode() * (
            (limits.max_request_body_bytes - 200) // 5) + b'"a"]}'
        # one-letter words: one token a character pair, prompts of exactly the character bound
        text = ("a " * (chars // 2))[:chars]
        prompts = json.dumps({"prompt": [text] * limits.max_seqs_per_request, "max_tokens": 1,
                              "truncate_prompt_tokens": 8}).encode()
        for body in (strings, prompts):
            assert len(body) <= limits.max_request_body_bytes
            with rss_growth() as rss:
                r = httpx.post(url + "/v1/completions", content=body, timeout=120,
                               headers={"Content-Type": "application/json"})
            assert r.status_code in (200, 400), r.text[:300]
            assert rss["mb"] < bound_mb, f"memory +{rss['mb']:.0f} MB over the stated {bound_mb:.0f} MB"
        _ok(url)


@pytest.mark.skipif(not (SHARED / "models" / "stories260K" / "stories260K.bin").is_file(),
                    reason="needs ../shared/models/stories260K")
def test_weights_pool_and_swap_are_checked_together_against_memory(tmp_path, monkeypatch):
    """Each fits alone, all three do not: the engine refuses before it allocates the pool, naming the parts."""
    import minfer.kv_cache_plan
    from minfer import LLM
    from minfer.model.llama2c import llama2c_to_hf

    stories = SHARED / "models" / "stories260K"
    path = llama2c_to_hf(stories / "stories260K.bin", tmp_path / "stories", stories / "tok512.model")
    pool = 1 << 20
    monkeypatch.setattr(minfer.kv_cache_plan, "physical_memory_bytes", lambda: pool + 1024)  # the weights do not fit too
    with pytest.raises(ValueError, match=r"the weights \(.*\), the KV pool \(.*\) and the swap space"):
        LLM(model=str(path), kv_cache_memory_bytes=pool, max_model_len=256, kernels="reference")
