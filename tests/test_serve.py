"""The OpenAI-compatible server (`python -m minfer.serve`, minfer/serve/*), end to end.

Most tests start the real server as a subprocess with the real default model (smollm2-135m-instruct) on a free
loopback port and talk to it with the official `openai` client or raw httpx. A few run the app in-process
on tests/fake_engine.py (API key, a crashing engine step) or only parse flags (start-up refusals).

    pytest -q tests/test_serve.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]

from tests.fake_engine import FakeEngine  # noqa: E402
from tests.serving import running_server  # noqa: E402

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
MAX_SEQS_PER_REQUEST = 32  # low, so that a request at the cap runs in seconds on a CPU

pytestmark = pytest.mark.timeout(240)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def server():
    """The real server, real model: yields its base URL; stopped at the end (no traceback allowed in its log)."""
    with running_server(["--max-model-len", str(MAX_MODEL_LEN), "--max-seqs-per-request", str(MAX_SEQS_PER_REQUEST),
                         "--disable-log-requests", "--uvicorn-log-level", "warning"],
                        fake_engine_args=[MODEL, str(MAX_MODEL_LEN)]) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/stats", timeout=10).json()["stats"]


def _wait_all_blocks_free(url: str, timeout: float = 15.0) -> dict:
    deadline = time.time() + timeout
    while True:
        s = _stats(url)
        if s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        if time.time() > deadline:
            raise AssertionError(f"KV blocks not all free after {timeout} s: {s}")
        time.sleep(0.1)


def _metrics(url: str) -> dict[str, float]:
    """{sample name + sorted labels: value} of /metrics, parsed with prometheus-client."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# ----------------------------------------------------------------------------------------------------------
# Start-up: flags whose feature is not built stop the server with exit status 2 (no model is loaded)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, needle", [
    (["--tensor-parallel-size", "0"], "tensor_parallel_size"),
    (["--pipeline-parallel-size", "0"], "pipeline_parallel_size"),
    (["--quantization", "bitsandbytes"], "quantization"),
    (["--kv-cache-dtype", "fp4"], "kv_cache_dtype"),
    (["--block-size", "3"], "block_size"),
])
def test_unbuilt_or_bad_flag_stops_startup(flags, needle):
    r = subprocess.run([sys.executable, "-m", "minfer.serve", *flags], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "error" in r.stderr


def test_help_lists_vllm_flags():
    r = subprocess.run([sys.executable, "-m", "minfer.serve", "--help"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--model", "--served-model-name", "--host", "--port", "--tensor-parallel-size",
                 "--pipeline-parallel-size", "--max-model-len", "--gpu-memory-utilization", "--dtype",
                 "--quantization", "--kv-cache-dtype", "--enable-prefix-caching", "--max-num-batched-tokens",
                 "--max-num-seqs", "--swap-space", "--enforce-eager", "--enable-chunked-prefill",
                 "--disable-log-requests", "--seed", "--block-size", "--kv-cache-memory-bytes", "--api-key",
                 "--enable-flash-attn", "--attention-backend"):
        assert flag in r.stdout, flag


def test_flags_map_onto_engine_args():
    from minfer.serve.__main__ import build_parser, engine_args_from

    args = build_parser().parse_args(["--max-model-len", "256", "--enable-prefix-caching", "--max-num-seqs", "4",
                                      "--block-size", "8", "--kv-cache-memory-bytes", "16M", "--swap-space", "1",
                                      "--enable-chunked-prefill", "--max-num-batched-tokens", "64",
                                      "--seed", "7", "--enable-flash-attn", "--dtype", "float32"])
    ea = engine_args_from(args)
    assert (ea.max_model_len, ea.enable_prefix_caching, ea.max_num_seqs, ea.block_size) == (256, True, 4, 8)
    assert ea.kv_cache_memory_bytes == 16 * 2**20 and ea.swap_space == 1.0 and ea.enable_chunked_prefill
    assert (ea.max_num_batched_tokens, ea.seed, ea.attention_backend, ea.dtype) == (64, 7, "triton", "float32")
    assert ea.model == MODEL
    assert engine_args_from(build_parser().parse_args([])).attention_backend == "auto"
    # prefix caching: on unless turned off, as vLLM V1's server
    assert engine_args_from(build_parser().parse_args([])).enable_prefix_caching is True
    assert engine_args_from(build_parser().parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert engine_args_from(build_parser().parse_args(["--attention-backend", "torch"])).attention_backend == "torch"
    with pytest.raises(ValueError, match="--enable-flash-attn"):
        engine_args_from(build_parser().parse_args(["--attention-backend", "cpu", "--enable-flash-attn"]))
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(["--attention-backend", "fast"])


# ----------------------------------------------------------------------------------------------------------
# In-process, fake engine: API key, an engine step that crashes
# ----------------------------------------------------------------------------------------------------------
def test_api_key_required_in_process():
    from fastapi.testclient import TestClient

    from minfer.serve.routes import build_app

    app = build_app(FakeEngine(), served_model_names=["fake"], api_key="sekret", log_requests=False)
    with TestClient(app) as c:
        body = {"model": "fake", "prompt": "alpha beta", "max_tokens": 3}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200  # health and metrics stay open, as in vLLM
        assert c.get("/metrics").status_code == 200
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # and the official client with the key
        oc = openai.OpenAI(base_url="http://testserver/v1", api_key="sekret", http_client=c, max_retries=0)
        assert oc.models.list().data[0].id == "fake"
        bad = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=c, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_engine_step_crash_fails_only_running_requests():
    from fastapi.testclient import TestClient

    from minfer.serve.routes import build_app

    class Crashy(FakeEngine):
        crash = True

        def step(self):
            if self.crash and self.running:
                self.crash = False
                raise RuntimeError("boom")
            return super().step()

    app = build_app(Crashy(), log_requests=False)
    with TestClient(app) as c:
        c.post("/v1/completions", json={"prompt": "alpha", "max_tokens": 2})  # admits, then crashes
        r = c.post("/v1/completions", json={"prompt": "alpha beta", "max_tokens": 4})
        assert r.status_code == 200, r.text  # the loop survived
        stats = c.get("/v1/stats").json()
        assert stats["engine_loop_alive"] and stats["num_step_errors"] == 1
        assert stats["stats"]["num_free_blocks"] == stats["stats"]["num_total_blocks"]


# ----------------------------------------------------------------------------------------------------------
# Real server, real model
# ----------------------------------------------------------------------------------------------------------
def test_health_models_and_page(server, client):
    assert httpx.get(server + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    page = httpx.get(server + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/v1/chat/completions" in page.text and "/v1/stats" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN


def test_completion_and_stream_agree(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    r = client.completions.create(**kw)
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.text and choice.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True))
    assert len(chunks) >= 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_chat_and_stream_agree(client):
    msgs = [{"role": "user", "content": "Name one primary colour."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [r.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_n2_and_prompt_lists(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1,
                                  seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1] and all(c.text for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 12
    # a list of prompts, a token-id prompt and a list of token-id prompts
    r = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    r = client.completions.create(model=MODEL, prompt=[[1, 2, 3, 4], [5, 6, 7]], max_tokens=3, n=2,
                                  temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 7
    r = client.completions.create(model=MODEL, prompt=[101, 102, 103], max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == 3


def test_stop_string(client):
    kw = dict(model=MODEL, prompt="Count: 1, 2, 3, 4, 5, 6,", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 4
    stop = full[2:5]  # a piece of the greedy text (not at its very start)
    cut = full[: full.find(stop)]
    r = client.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    # streamed: the stop string never leaks out, even partially
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True)
                       if c.choices)
    assert streamed == cut


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b and a
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=10,
                temperature=1.0, seed=99)
    assert client.chat.completions.create(**chat).choices[0].message.content == \
        client.chat.completions.create(**chat).choices[0].message.content


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-4) for c in content)  # greedy


def test_32_concurrent_streams_then_all_blocks_free(server):
    aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=180)

    async def one(i: int):
        stream = await aclient.completions.create(model=MODEL, prompt=f"Request {i}: the number {i} is",
                                                  max_tokens=8, temperature=0.8, seed=i, stream=True)
        text, finish = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    assert all(finish in ("length", "stop") for _, finish in results), results
    assert sum(bool(text) for text, _ in results) >= 30
    s = _wait_all_blocks_free(server)
    assert s["kv_cache_usage"] == 0


def _good_request_in_background(server: str, out: dict) -> threading.Thread:
    def run():
        try:
            c = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
            chunks = list(c.completions.create(model=MODEL, prompt="Tell me a story about a dragon.",
                                               max_tokens=24, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
            out["text"] = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            out["finish"] = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        except Exception as exc:  # noqa: BLE001
            out["error"] = repr(exc)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_bad_requests_get_errors_and_do_not_disturb_others(server, client):
    out: dict = {}
    t = _good_request_in_background(server, out)
    time.sleep(0.2)
    too_long = "hello " * (MAX_MODEL_LEN + 50)
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": too_long, "max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 2}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [[]]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True, "stream": True}, 400, "echo"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"²": 1}}, 400, "logit_bias"),
        # min_tokens above the max_tokens the server fills in (completions' default 16)
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "min_tokens": 20}, 400, "min_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 1e-39}, 400,
         "repetition_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": [-1], "max_tokens": 0, "echo": True, "logprobs": 1}, 400,
         "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [2 ** 32], "max_tokens": 0, "echo": True, "logprobs": 1},
         400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 5}, 400, "prompt_logprobs"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": too_long}]}, 400,
         "prompt"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
         404, "model"),
    ]
    for path, body, status, param in cases:
        r = httpx.post(server + path, json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["message"] and err["param"] == param, (body, err)
    for stream in (False, True):  # streaming requests are refused before the stream starts
        r = httpx.post(server + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": too_long, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(server + "/v1/completions", content=b'{"model": "x", "prompt": ', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # valid JSON, too deep to parse (10,000 levels: under the server's cap on objects and arrays, 65,536)
    deep = b'{"model": "x", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    r = httpx.post(server + "/v1/completions", content=deep, timeout=30, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    # the official client maps them onto its exceptions
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    t.join(120)
    assert "error" not in out, out
    assert out["finish"] == "length" and out["text"], out
    _wait_all_blocks_free(server)


def test_client_disconnect_mid_stream_frees_blocks(server):
    _wait_all_blocks_free(server)
    before = _stats(server)
    body = {"model": MODEL, "prompt": "Write a very long essay about the sea.", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept open: closing this iterator would close the connection
            got = 0
            while got < 3:
                got += next(lines).startswith("data: {")
            deadline = time.time() + 5  # /v1/stats is refreshed by the engine loop every ~50 ms
            while (during := _stats(server))["num_running"] != 1 and time.time() < deadline:
                time.sleep(0.02)
            assert during["num_running"] == 1 and during["num_free_blocks"] < before["num_total_blocks"], during
            assert during["num_generation_tokens_total"] > before["num_generation_tokens_total"]
        # leaving the block closes the connection mid-stream
    s = _wait_all_blocks_free(server, timeout=15)
    assert s["num_generation_tokens_total"] - before["num_generation_tokens_total"] < 390
    # the same for a non-streaming request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    _wait_all_blocks_free(server, timeout=15)


def test_metrics_parse_and_move(server, client):
    m0 = _metrics(server)
    for name in ("minfer:num_requests_running", "minfer:num_requests_waiting", "minfer:num_requests_swapped",
                 "minfer:kv_cache_usage_perc", "minfer:prefix_cache_queries_total", "minfer:prefix_cache_hits_total",
                 "minfer:num_preemptions_total", "minfer:prompt_tokens_total", "minfer:generation_tokens_total",
                 "minfer:time_to_first_token_seconds_count", "minfer:inter_token_latency_seconds_count",
                 "minfer:e2e_request_latency_seconds_count"):
        assert name in m0, name
    client.completions.create(model=MODEL, prompt="Metrics are", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    assert httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 0}).status_code == 400
    deadline = time.time() + 10
    while True:
        m1 = _metrics(server)
        if m1["minfer:e2e_request_latency_seconds_count"] > m0["minfer:e2e_request_latency_seconds_count"]:
            break
        assert time.time() < deadline, "e2e histogram did not move"
        time.sleep(0.1)
    assert m1["minfer:generation_tokens_total"] >= m0["minfer:generation_tokens_total"] + 5
    assert m1["minfer:prompt_tokens_total"] > m0["minfer:prompt_tokens_total"]
    assert m1["minfer:time_to_first_token_seconds_count"] == m0["minfer:time_to_first_token_seconds_count"] + 1
    assert m1["minfer:inter_token_latency_seconds_count"] >= m0["minfer:inter_token_latency_seconds_count"] + 4
    assert m1["minfer:request_success_total{finished_reason=length}"] >= 1
    assert m1["minfer:request_errors_total{status=400}"] >= m0.get("minfer:request_errors_total{status=400}", 0) + 1
    assert 0 <= m1["minfer:kv_cache_usage_perc"] <= 1
    stats = httpx.get(server + "/v1/stats").json()
    assert stats["recent_ttfts"] and stats["kv_pool"]["num_blocks"] == stats["stats"]["num_total_blocks"]


@pytest.mark.skipif(bool(os.environ.get("MINFER_TEST_FAKE_ENGINE")), reason="the fake engine has no prefix cache")
def test_prefix_caching_is_on_by_default_and_a_repeated_prompt_hits(server):
    """The `server` fixture passes no prefix-caching flag: the default is on (as vLLM V1's server), so the second
    of two identical prompts finds its full blocks in the cache. Both counters are prompt tokens."""
    assert 'enable_prefix_caching="True"' in httpx.get(server + "/metrics", timeout=10).text
    prompt = " ".join(f"item {i}" for i in range(40))  # > 64 tokens: several full 16-token blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def counters() -> tuple[float, float]:
        m = _metrics(server)
        return m["minfer:prefix_cache_queries_total"], m["minfer:prefix_cache_hits_total"]

    assert httpx.post(server + "/v1/completions", json=body, timeout=120).status_code == 200
    _wait_all_blocks_free(server)
    q0, h0 = counters()
    r = httpx.post(server + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert n_prompt >= 64
    deadline = time.time() + 10  # the counters follow the engine's stats, refreshed every ~50 ms
    while (now := counters())[0] < q0 + n_prompt and time.time() < deadline:
        time.sleep(0.1)
    queries, hits = now[0] - q0, now[1] - h0
    assert queries == n_prompt, (queries, n_prompt)
    # every full block but the one holding the last token (which must be computed again for its logits)
    assert hits >= 16 * ((n_prompt - 1) // 16) and hits < n_prompt, (hits, n_prompt)
    _wait_all_blocks_free(server)


def test_benchmark_client_against_server(server, tmp_path):
    from minfer.bench.serve import format_result, main, run_benchmark

    r = run_benchmark(server, num_prompts=6, request_rate="inf", max_concurrency=3, input_len=16, output_len=4,
                      vocab_size=32000, disable_tqdm=True)
    assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
    assert r["total_output_tokens"] == 24 and r["total_input_tokens"] == 96
    assert r["mean_ttft_ms"] > 0 and r["p99_e2el_ms"] >= r["median_e2el_ms"] > 0
    assert "Serving Benchmark Result" in format_result(r)
    out = tmp_path / "r.json"
    rc = main(["--base-url", server, "--num-prompts", "4", "--request-rate", "20", "--dataset", "shared-prefix",
               "--prefix-len", "16", "--input-len", "4", "--output-len", "3", "--disable-tqdm",
               "--result-json", str(out)])
    assert rc == 0
    saved = json.loads(out.read_text())
    assert saved["completed"] == 4 and saved["total_input_tokens"] == 80
    _wait_all_blocks_free(server)


def test_bad_stream_options_rejected_before_admission(server):
    """A malformed stream_options is a 400, and no request is left running for nobody (found by fuzzing)."""
    base = server
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 50, "ignore_eos": True,
                                                     "stream": True, "stream_options": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "response_format": "json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    _wait_all_blocks_free(base, timeout=2.0)


def test_limits_derived_at_startup_refuse_before_tokenizing(server):
    """SmolLM2's longest token is 81 characters: no prompt of more than 512 x 81 characters fits 512 tokens."""
    limits = httpx.get(server + "/v1/stats", timeout=10).json()["limits"]
    assert limits["max_prompt_chars"] == MAX_MODEL_LEN * 81
    assert limits["max_seqs_per_request"] == MAX_SEQS_PER_REQUEST
    t0 = time.perf_counter()
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "a" * (MAX_MODEL_LEN * 81 + 1)},
                   timeout=60)
    assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"], r.text
    assert time.perf_counter() - t0 < 5
    r = httpx.post(server + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": ["hi"] * 8, "n": 5, "max_tokens": 1})
    assert r.status_code == 400 and "--max-seqs-per-request" in r.json()["error"]["message"], r.text


def test_omitted_max_tokens_fits_a_near_full_prompt(client):
    """max_tokens omitted (completions' default is 16): capped to the 3 tokens the prompt leaves, as vLLM does."""
    ids = [1000 + i % 500 for i in range(MAX_MODEL_LEN - 3)]
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == MAX_MODEL_LEN - 3 and r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_small_request_finishes_while_a_request_at_the_fan_out_cap_runs(server, client):
    """8 prompts x n=4 = 32 sequences (the cap here) of 64 tokens each, and a 4-token request sent once they run.

    The bound: the big request's 32 sequences and the small one fit in one batch (--max-num-seqs 256), so with
    continuous batching the small one queues behind no one; its prefill and 3 more steps are about 4 of the
    64 steps the big one decodes for. It must finish within a quarter of the big one's time: 4x slack over
    that, and far less than the whole, which is what queueing behind the big request would cost.
    """
    before = _wait_all_blocks_free(server)["num_generation_tokens_total"]
    big = {"model": MODEL, "prompt": [f"Story {i}: once upon a time" for i in range(8)], "n": 4, "max_tokens": 64,
           "ignore_eos": True, "temperature": 1.0, "seed": 0}
    done: dict = {}

    def run_big():
        t0 = time.perf_counter()
        done["response"] = httpx.post(server + "/v1/completions", json=big, timeout=300)
        done["span"] = (t0, time.perf_counter())

    thread = threading.Thread(target=run_big)
    thread.start()
    deadline = time.time() + 60
    while _stats(server)["num_generation_tokens_total"] == before:  # decoding: its prefill is done
        assert time.time() < deadline and thread.is_alive(), "the big request never started"
        time.sleep(0.05)
    t_small = time.perf_counter()
    small = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    small_s = time.perf_counter() - t_small
    thread.join(300)
    r = done["response"]
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 32 and r.json()["usage"]["completion_tokens"] == 32 * 64
    assert small.usage.completion_tokens == 4
    big_start, big_end = done["span"]
    assert t_small + small_s < big_end, "the small request finished after the big one"
    assert small_s < (big_end - big_start) / 4, f"small: {small_s:.2f} s, big: {big_end - big_start:.2f} s"
    _wait_all_blocks_free(server)


def test_engine_loop_routes_each_request_to_its_own_queue():
    """`minfer/serve/engine_loop.py` without HTTP: a rejected request gets its error on its own queue, the
    engine thread goes on, and an accepted one gets "added" and then outputs until it is finished."""
    from minfer.sampling_params import SamplingParams
    from minfer.serve.engine_loop import EngineLoop

    loop = EngineLoop(FakeEngine())

    async def run():
        good, bad = asyncio.Queue(), asyncio.Queue()
        loop.add("bad", [10 ** 9], SamplingParams(max_tokens=2), bad, time.perf_counter())
        loop.add("good", [1, 2, 3], SamplingParams(max_tokens=3), good, time.perf_counter())
        rid, kind, exc = await asyncio.wait_for(bad.get(), 10)
        assert (rid, kind) == ("bad", "error") and isinstance(exc, ValueError)
        events = [await asyncio.wait_for(good.get(), 10)]
        while not (events[-1][1] == "output" and events[-1][2].finished):
            events.append(await asyncio.wait_for(good.get(), 10))
        return events

    try:
        events = asyncio.run(run())
        assert events[0][:2] == ("good", "added") and all(e[1] == "output" for e in events[1:])
        assert len(events[-1][2].outputs[0].token_ids) == 3 and loop.alive
    finally:
        loop.stop()
    assert not loop.alive
