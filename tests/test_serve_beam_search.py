"""Beam search through the server (`use_beam_search` on /v1/completions, `minfer/serve/beam_search.py`).

A tiny random Llama with a word-level tokenizer (as in tests/test_spec_decode.py), in-process (`TestClient`):

- the beams through the server equal `LLM.beam_search`'s on a second engine of the same model (text, finish
  reason, order, usage), for `n`, `best_of` > n, several prompts, length_penalty and ignore_eos;
- a beam search sent while a sampled request runs waits for it (the engine loop runs it when idle), both
  answer, and no KV block leaks; on a stub engine, `EngineLoop.run_when_idle` runs a job only when idle,
  holds requests added meanwhile until it ran, drops a cancelled job and survives a failing one;
- streamed (`stream: true`), the same beams come one chunk each, then [DONE]; chat's `use_beam_search`
  answers the beams of the rendered conversation as assistant messages, streamed or not;
- bad values, sampling-only fields and beams too big for the KV pool are 400s with OpenAI's error body
  naming the field;
- through the real server with its engine in its own process (`python -m minfer.serve`, the default): the
  beams equal `LLM.beam_search`'s, a beam search sent while streams run waits for them and all answer, a
  failing search (beams too big for the pool) is a 400 and the server goes on, and no block leaks.

    PYTHONPATH=$PWD python -m pytest -q tests/test_serve_beam_search.py
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from minfer import LLM, BeamSearchParams
from minfer.serve.routes import build_app

from .test_spec_decode import _save_tiny

KV_BYTES = 64 * 1024  # 256 token slots (2 layers x K,V x 2 heads x 8 dims x 4 bytes = 256 bytes a token)
ENGINE = dict(max_model_len=128, seed=0, attention_backend="torch", kv_cache_memory_bytes=KV_BYTES)
PROMPTS = ["w5 w9 w12 w7 w30", "w17 w3 w44 w44 w21 w9"]
ID_PROMPTS = [[0, 17, 3, 44, 44, 21, 9], [0, 8]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(_save_tiny(tmp_path_factory.mktemp("beam") / "m", 0))


@pytest.fixture(scope="module")
def reference_llm(model):
    return LLM(model=model, **ENGINE)


@pytest.fixture(scope="module")
def served(model):
    llm = LLM(model=model, **ENGINE)
    with TestClient(build_app(llm.llm_engine, served_model_names=["tiny"], log_requests=False)) as c:
        yield c, llm.llm_engine


def _post(client, **body):
    return client.post("/v1/completions", json={"model": "tiny", "use_beam_search": True, **body})


@pytest.mark.parametrize("fields, width, n", [
    (dict(n=3, max_tokens=8), 3, 3),
    (dict(n=2, best_of=4, max_tokens=10, length_penalty=0.5), 4, 2),
    (dict(n=2, max_tokens=6, ignore_eos=True, temperature=0.7), 2, 2),
    (dict(n=3), 3, 3),  # max_tokens omitted: completions' default 16
    (dict(n=1, best_of=3, max_tokens=7, prompt=ID_PROMPTS), 3, 1),  # token-id prompts
])
def test_beams_equal_llm_beam_search(served, reference_llm, fields, width, n):
    fields = dict(fields)
    client, engine = served
    prompts = fields.pop("prompt", PROMPTS)
    r = _post(client, prompt=prompts, **fields)
    assert r.status_code == 200, r.text
    got = r.json()
    want = reference_llm.beam_search(prompts, BeamSearchParams(
        beam_width=width, max_tokens=fields.get("max_tokens", 16), ignore_eos=fields.get("ignore_eos", False),
        temperature=fields.get("temperature", 0.0), length_penalty=fields.get("length_penalty", 1.0)))
    expected = [(i * n + j, s.text, s.finish_reason) for i, out in enumerate(want) for j, s in
                enumerate(out.sequences[:n])]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in got["choices"]] == expected
    assert len(expected) == len(prompts) * n
    assert got["object"] == "text_completion" and got["model"] == "tiny"
    prompt_lens = [len(reference_llm.llm_engine.tokenize_prompt(p)[1]) for p in prompts]
    assert got["usage"]["prompt_tokens"] == sum(prompt_lens)
    assert got["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for out in want
                                                    for s in out.sequences[:n])
    assert engine.all_blocks_free()


def test_beam_search_waits_for_running_requests(served, reference_llm):
    client, engine = served
    results = {}

    def sampled():
        results["sampled"] = client.post("/v1/completions", json={
            "model": "tiny", "prompt": "w3 w4", "max_tokens": 100, "ignore_eos": True, "temperature": 1.0})
        results["sampled_done"] = time.perf_counter()

    t = threading.Thread(target=sampled)
    t.start()
    deadline = time.time() + 10
    while not engine.has_unfinished_requests() and time.time() < deadline and t.is_alive():
        time.sleep(0.001)
    assert engine.has_unfinished_requests(), "the sampled request should still be running"
    r = _post(client, prompt=PROMPTS[0], n=2, max_tokens=8)
    beam_done = time.perf_counter()
    t.join(60)
    assert results["sampled_done"] <= beam_done, "the beam search ran before the engine was idle"
    assert results["sampled"].status_code == 200
    assert len(results["sampled"].json()["choices"][0]["text"].split()) > 0
    assert r.status_code == 200, r.text
    want = reference_llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=8))[0]
    assert [c["text"] for c in r.json()["choices"]] == [s.text for s in want.sequences]
    # and the server keeps serving sampled requests afterwards
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": "w3", "max_tokens": 3}).status_code == 200
    assert engine.all_blocks_free()


@pytest.mark.parametrize("fields, param", [
    (dict(stream="yes"), "stream"),
    (dict(n=3, best_of=2), "best_of"),
    (dict(n=0), "n"),
    (dict(n=1000), "n"),
    (dict(length_penalty="long"), "length_penalty"),
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=500), "prompt"),  # prompt + max_tokens > max_model_len (128)
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(top_p=0.5), "top_p"),
    (dict(stop=["w3"]), "stop"),
    (dict(logprobs=1), "logprobs"),
    (dict(echo=True), "echo"),
    (dict(use_beam_search="yes"), "use_beam_search"),
    (dict(n=8, max_tokens=100), "max_tokens"),  # 8 beams x 100 tokens cannot fit in 16 blocks
    # the sampling path's fallbacks: validated as there; a time limit is refused (the search cannot stop midway)
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=1.5), "truncate_prompt_tokens"),
    (dict(request_timeout=0.05), "request_timeout"),
    (dict(request_timeout="abc"), "request_timeout"),
    (dict(include_stop_str_in_output="no"), "include_stop_str_in_output"),
])
def test_bad_values_are_400_with_openai_error_body(served, fields, param):
    client, engine = served
    r = _post(client, prompt=PROMPTS[0], **{"max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    assert engine.all_blocks_free() and not engine.has_unfinished_requests()


def test_truncate_prompt_tokens_and_kv_pressure_cap_apply_to_beams(model):
    """truncate_prompt_tokens keeps the prompt's tail as without beams; under KV pressure the beams' max_tokens
    is capped and the answer says so (`fallback`, X-Max-Tokens-Capped)."""
    from minfer.serve.fallbacks import FallbackConfig

    llm = LLM(model=model, **ENGINE)
    app = build_app(llm.llm_engine, served_model_names=["tiny"], log_requests=False,
                    fallbacks=FallbackConfig(kv_pressure_threshold=0.0, kv_pressure_max_tokens=2))
    with TestClient(app) as client:
        whole = _post(client, prompt=ID_PROMPTS[0], n=2, max_tokens=2, ignore_eos=True).json()
        r = _post(client, prompt=ID_PROMPTS[0], n=2, max_tokens=2, ignore_eos=True, truncate_prompt_tokens=3)
        assert r.status_code == 200, r.text
        assert whole["usage"]["prompt_tokens"] == 7 and r.json()["usage"]["prompt_tokens"] == 3
        tail = _post(client, prompt=ID_PROMPTS[0][-3:], n=2, max_tokens=2, ignore_eos=True).json()
        assert [c["text"] for c in r.json()["choices"]] == [c["text"] for c in tail["choices"]]
        r = _post(client, prompt=PROMPTS[0], n=2, max_tokens=6, ignore_eos=True)
        assert r.status_code == 200, r.text
        capped = r.json()["fallback"]["max_tokens_capped"]
        assert (capped["requested"], capped["granted"], capped["threshold"]) == ([6], 2, 0.0)
        assert r.headers["X-Max-Tokens-Capped"] == "2" and r.json()["usage"]["completion_tokens"] == 2 * 2
        assert llm.llm_engine.all_blocks_free()


def test_streamed_beams_equal_the_answer(served):
    client, _ = served
    fields = dict(prompt=PROMPTS, n=2, best_of=3, max_tokens=8)
    whole = _post(client, **fields).json()["choices"]
    r = _post(client, stream=True, **fields)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    got = [(c["index"], c["text"], c["finish_reason"]) for e in events for c in e["choices"]]
    assert got == [(c["index"], c["text"], c["finish_reason"]) for c in whole]
    assert r.text.rstrip().endswith("data: [DONE]")


def test_chat_beam_search(chat_served, model):
    client, engine = chat_served
    msgs = [{"role": "user", "content": "w3 w9 w12"}]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "use_beam_search": True, "n": 2,
                                                  "max_completion_tokens": 6, "messages": msgs})
    assert r.status_code == 200, r.text
    got = r.json()
    ids = engine.tokenizer.encode_chat(msgs)
    want = LLM(model=model, **ENGINE).beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=6))[0]
    assert got["object"] == "chat.completion"
    assert [(c["message"]["role"], c["message"]["content"]) for c in got["choices"]] == [
        ("assistant", s.text) for s in want.sequences[:2]]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "use_beam_search": True, "n": 2, "stream": True,
                                                  "max_tokens": 6, "messages": msgs})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["delta"]["content"] for e in events[1:] for c in e["choices"]] == [s.text for s in want.sequences[:2]]
    # chat's beam path takes the fallbacks' fields as completions' does
    body = {"model": "tiny", "use_beam_search": True, "n": 2, "max_tokens": 2, "messages": msgs}
    r = client.post("/v1/chat/completions", json={**body, "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3 < len(ids), r.text
    for bad, param in ((dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                       (dict(request_timeout=0.05), "request_timeout"),
                       (dict(request_timeout="abc"), "request_timeout")):
        r = client.post("/v1/chat/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert engine.all_blocks_free()


@pytest.fixture(scope="module")
def chat_served(tmp_path_factory):
    from transformers import AutoTokenizer

    path = _save_tiny(tmp_path_factory.mktemp("beamchat") / "m", 0)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"
    tok.save_pretrained(str(path))
    llm = LLM(model=str(path), **ENGINE)
    with TestClient(build_app(llm.llm_engine, served_model_names=["tiny"], log_requests=False)) as c:
        yield c, llm.llm_engine


class _BusyEngine:
    """Just enough of `LLMEngine` for `EngineLoop`: busy until `idle` is set; records what it was asked."""

    def __init__(self):
        self.idle = threading.Event()
        self.added: list[str] = []

    def has_unfinished_requests(self):
        return not self.idle.is_set()

    def step(self):
        time.sleep(0.005)
        return []

    def add_request(self, rid, prompt, params, arrival_time=None):
        self.added.append(rid)
        self.idle.clear()

    def abort_request(self, rids):
        pass

    def stats(self):
        return None

    def kv_pool_info(self):
        return {}


def test_engine_loop_runs_a_job_only_when_idle_holds_new_requests_and_drops_cancelled_jobs():
    import asyncio

    from minfer.sampling_params import SamplingParams
    from minfer.serve.engine_loop import EngineLoop

    engine = _BusyEngine()
    loop = EngineLoop(engine)
    ran = []

    async def scenario():
        jobs, adds = asyncio.Queue(), asyncio.Queue()
        loop.run_when_idle("j1", lambda e: ran.append("j1") or "result", jobs)
        loop.run_when_idle("j2", lambda e: ran.append("j2"), jobs)
        loop.cancel_job("j2")  # its client left before it started
        loop.add("r1", [1, 2], SamplingParams(max_tokens=2), adds, time.perf_counter())
        await asyncio.sleep(0.3)
        assert ran == [] and engine.added == [], "a job ran on a busy engine, or a request jumped the queue"
        engine.idle.set()
        assert await asyncio.wait_for(jobs.get(), 10) == ("j1", "done", "result")
        assert await asyncio.wait_for(adds.get(), 10) == ("r1", "added", None)  # released after the job
        loop.run_when_idle("j3", lambda e: 1 / 0, jobs)
        engine.idle.set()
        rid, kind, exc = await asyncio.wait_for(jobs.get(), 10)
        assert (rid, kind, type(exc)) == ("j3", "error", ZeroDivisionError)
        assert loop.alive  # a failed job answers its own request; the loop goes on

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()
    assert ran == ["j1"] and engine.added == ["r1"]


# -- the engine in its own process (the server's default) ------------------------------------------------------
@pytest.fixture(scope="module")
def process_server(model):
    from .serving import running_server

    with running_server(["--model", model, "--served-model-name", "tiny", "--max-model-len", "128", "--seed", "0",
                         "--attention-backend", "torch", "--kv-cache-memory-bytes", str(KV_BYTES),
                         "--disable-log-requests", "--uvicorn-log-level", "warning"]) as url:
        yield url


@pytest.mark.slow
def test_engine_process_beams_equal_llm_beam_search(process_server, reference_llm):
    import httpx

    url = process_server
    fields = dict(n=2, best_of=3, max_tokens=8, length_penalty=0.5)
    results = {}

    def sampled(i):
        results[i] = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "w3 w4", "max_tokens": 40, "ignore_eos": True, "temperature": 1.0, "seed": i})

    threads = [threading.Thread(target=sampled, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": PROMPTS, "use_beam_search": True, **fields})
    for t in threads:
        t.join()
    assert r.status_code == 200, r.text
    want = reference_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5))
    expected = [(i * 2 + j, s.text, s.finish_reason) for i, out in enumerate(want) for j, s in
                enumerate(out.sequences[:2])]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in r.json()["choices"]] == expected
    assert all(results[i].status_code == 200 for i in range(3))
    too_big = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPTS[0], "use_beam_search": True, "n": 64, "max_tokens": 100})
    assert too_big.status_code == 400, too_big.text
    assert httpx.post(url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "w3",
                                                                 "max_tokens": 3}).status_code == 200
    deadline = time.time() + 20
    while time.time() < deadline:
        s = httpx.get(url + "/v1/stats", timeout=10).json()["stats"]
        if s["num_free_blocks"] == s["num_total_blocks"]:
            break
        time.sleep(0.2)
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0


# A tensor-parallel worker killed while a beam search runs: the search answers 503 with OpenAI's error body
# (type server_error), as the sampling path does, and later requests and /health are 503 too; the engine in
# its own process (the default) or in a thread of the server (--no-engine-process).
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "thread"])
def test_beam_search_with_a_dead_worker_is_a_503(tmp_path, engine_process):
    import httpx

    from minfer.bench.parallel import save_random_llama

    from .serving import running_server
    from .test_parallel import _kill_worker_1

    model = save_random_llama(tmp_path / "llama", layers=4, heads=8, kv_heads=2)
    args = [model, "--tensor-parallel-size", "2", "--attention-backend", "torch", "--max-model-len", "512",
            "--kv-cache-memory-bytes", "4M", *([] if engine_process else ["--no-engine-process"])]
    if engine_process:
        # The engine process dies with its worker and the server exits with status 3 for its supervisor (chapter
        # 15 §15.3b); the beam search in flight is answered with a 503 if the answer gets out before the exit.
        from .serving import assert_exits_engine_died, server_process

        with server_process(args) as (proc, url, log):
            body = dict(model=model, prompt="w3 w4 w5", max_tokens=4, use_beam_search=True, n=2)
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
            answer: list = []

            def search():
                try:
                    answer.append(httpx.post(url + "/v1/completions", timeout=120,
                                             json=dict(body, max_tokens=480, ignore_eos=True)))
                except httpx.HTTPError as e:  # the server exited before it answered
                    answer.append(e)

            t = threading.Thread(target=search, daemon=True)
            t.start()
            time.sleep(1.5)
            assert t.is_alive(), "the beam search ended before the worker was killed"
            _kill_worker_1()
            t.join(90)
            assert not t.is_alive(), "the beam search still runs 90 s after the worker died"
            if isinstance(answer[0], httpx.Response):
                assert answer[0].status_code == 503, (answer[0].status_code, answer[0].text)
            assert_exits_engine_died(proc, log)
        return
    with running_server(args, check_log=False) as url:
        body = dict(model=model, prompt="w3 w4 w5", max_tokens=4, use_beam_search=True, n=2)
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        answer: list = []
        long_body = dict(body, max_tokens=480, ignore_eos=True)  # long enough to be running when the worker dies
        t = threading.Thread(target=lambda: answer.append(
            httpx.post(url + "/v1/completions", json=long_body, timeout=120)), daemon=True)
        t.start()
        time.sleep(1.5)
        assert t.is_alive(), "the beam search ended before the worker was killed"
        _kill_worker_1()
        t.join(60)
        assert not t.is_alive(), "the beam search still runs 60 s after the worker died"
        r = answer[0]
        assert r.status_code == 503, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "server_error" and "rank 1" in err["message"], err
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)  # later beam searches: 503 at once
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
        h = httpx.get(url + "/health", timeout=5)
        assert h.status_code == 503 and "rank 1" in h.json()["error"]["message"], h.text
