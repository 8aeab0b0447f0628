"""The operations of chapter 15 as server features, on the fake engine (fast, no model):

- the chat stream's first chunk comes with the first token, not at admission;
- the extra routes (`minfer/serve/ops_routes.py`): GET /v1/models/{id}, POST /tokenize and /detokenize,
  GET /version, /ping;
- the fallbacks (`minfer/serve/fallbacks.py`): --max-waiting-requests (503 + Retry-After, nothing lost),
  the time limit (finish_reason "timeout"), truncate_prompt_tokens, the KV-pressure max_tokens cap;
- the metrics: the article's monitoring list, the `vllm:` names, the per-phase histograms;
- vLLM's legacy POST /generate (`minfer/serve/legacy_api.py`), with bad input (400, nothing lost).

    pytest -q tests/test_serve_operations.py
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minfer.serve.connection import uvicorn_options
from minfer.serve.fallbacks import FallbackConfig
from minfer.serve.limits import ServerLimits
from minfer.serve.routes import build_app
from tests.fake_engine import FakeEngine
from tests.serving import server_in_thread

pytestmark = pytest.mark.timeout(120)


def _serve(engine=None, **kw):
    app = build_app(engine or FakeEngine(max_num_seqs=8), served_model_names=["fake"], log_requests=False, **kw)
    return server_in_thread(app, **uvicorn_options(ServerLimits()))


def _stats(url):
    return httpx.get(url + "/v1/stats", timeout=10).json()["stats"]


def _all_free(url, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        s = _stats(url)
        if s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0 and s["num_waiting"] == 0:
            return True
        if time.time() > deadline:
            raise AssertionError(f"blocks not freed: {s}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------------------
# (1) The role chunk comes with the first token
# ----------------------------------------------------------------------------------------------------------
class SlowPrefill(FakeEngine):
    """A fake whose first step of each request (its prefill) takes `prefill_s`."""

    prefill_s = 1.0

    def step(self):
        if self.waiting:
            time.sleep(self.prefill_s)
        return super().step()


def test_chat_stream_first_chunk_arrives_with_the_first_token():
    with _serve(SlowPrefill()) as url:
        body = {"messages": [{"role": "user", "content": "alpha beta"}], "max_tokens": 4, "stream": True,
                "ignore_eos": True}
        t0 = time.perf_counter()
        arrivals = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append((time.perf_counter() - t0, json.loads(line[6:])))
        first_t, first = arrivals[0]
        assert first["choices"][0]["delta"].get("role") == "assistant"  # still the role chunk, OpenAI's shape
        content = [(t, c) for t, c in arrivals if c["choices"] and c["choices"][0]["delta"].get("content")]
        # The role chunk waited for the prefill (the old server sent it at ~0 s) and came with the first token.
        assert first_t >= 0.9 * SlowPrefill.prefill_s, arrivals
        assert content[0][0] - first_t < 0.5, arrivals


# ----------------------------------------------------------------------------------------------------------
# (2) Routes
# ----------------------------------------------------------------------------------------------------------
def test_model_retrieve_tokenize_detokenize_version_ping():
    with _serve(api_key=None) as url:
        oc = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        m = oc.models.retrieve("fake")
        assert m.id == "fake" and m.object == "model"
        r = httpx.get(url + "/v1/models/nope")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            oc.models.retrieve("nope")

        r = httpx.post(url + "/tokenize", json={"prompt": "alpha beta gamma", "return_token_strs": True})
        assert r.status_code == 200, r.text
        t = r.json()
        assert t["tokens"] == [1, 2, 3] and t["count"] == 3 and t["max_model_len"] == 256
        assert t["token_strs"] == [" alpha", " beta", " gamma"]
        r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "alpha"}]})
        assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) >= 2
        r = httpx.post(url + "/detokenize", json={"tokens": [1, 2, 3]})
        assert r.status_code == 200 and r.json() == {"prompt": " alpha beta gamma"}
        for path, bad in [("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/tokenize", {"prompt": "a", "messages": []}),
                          ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}),
                          ("/tokenize", {"prompt": "a", "model": "nope"}),
                          ("/detokenize", {"tokens": "abc"}), ("/detokenize", {"tokens": [-1]}),
                          ("/detokenize", {"tokens": [True]}), ("/detokenize", {"tokens": [10**12]})]:
            r = httpx.post(url + path, json=bad)
            assert r.status_code in (400, 404), (path, bad, r.text)
            assert "error" in r.json()

        assert httpx.get(url + "/version").json()["version"]
        assert httpx.get(url + "/ping").status_code == 200
        assert httpx.post(url + "/ping").status_code == 200


def test_ping_is_open_behind_the_api_key():
    with _serve(api_key="k") as url:
        assert httpx.get(url + "/ping").status_code == 200
        assert httpx.post(url + "/tokenize", json={"prompt": "alpha"}).status_code == 401
        assert httpx.get(url + "/v1/models/fake").status_code == 401
        r = httpx.get(url + "/v1/models/fake", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["id"] == "fake"


# ----------------------------------------------------------------------------------------------------------
# (3) Fallbacks
# ----------------------------------------------------------------------------------------------------------
def test_max_waiting_requests_sheds_with_503_and_loses_nothing_admitted():
    engine = FakeEngine(max_num_seqs=1, step_delay=0.02)
    with _serve(engine, fallbacks=FallbackConfig(max_waiting_requests=2)) as url:
        results = {}

        def run(name):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": f"alpha {name}", "max_tokens": 60, "ignore_eos": True})
            results[name] = r

        first = threading.Thread(target=run, args=("a",))
        first.start()
        deadline = time.time() + 10
        while _stats(url)["num_running"] < 1 and time.time() < deadline:  # "a" runs (max_num_seqs=1)
            time.sleep(0.01)
        time.sleep(0.1)  # "a" has its first token: it no longer waits
        queued = [threading.Thread(target=run, args=(n,)) for n in ("b", "c")]
        for t in queued:
            t.start()
        while _stats(url)["num_waiting"] < 2 and time.time() < deadline:
            time.sleep(0.01)
        shed = httpx.post(url + "/v1/completions", json={"prompt": "alpha d", "max_tokens": 2}, timeout=30)
        assert shed.status_code == 503, shed.text
        assert int(shed.headers["Retry-After"]) >= 1 and shed.json()["error"]["code"] == "server_overloaded"
        for t in [first, *queued]:
            t.join(60)
        for name in "abc":  # every admitted request ran to the end
            assert results[name].status_code == 200, results[name].text
            assert results[name].json()["usage"]["completion_tokens"] == 60
        _all_free(url)
        ok = httpx.post(url + "/v1/completions", json={"prompt": "alpha d", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200  # the places were given back
        text = httpx.get(url + "/metrics").text
        assert 'minfer:request_fallbacks_total{kind="shed",model_name="fake"} 1.0' in text


def test_request_timeout_ends_with_what_it_has():
    engine = FakeEngine(step_delay=0.05)
    with _serve(engine, fallbacks=FallbackConfig(request_timeout=30)) as url:
        body = {"prompt": "alpha", "max_tokens": 200, "ignore_eos": True, "request_timeout": 0.5}
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        elapsed = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "timeout" and choice["text"]
        assert 1 <= r.json()["usage"]["completion_tokens"] < 200 and elapsed < 3
        _all_free(url)
        # streamed: the last chunk ends the choice with "timeout"
        chunks = []
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "alpha"}], "max_tokens": 200,
                                "ignore_eos": True, "stream": True, "request_timeout": 0.5}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == "timeout" and reasons.count("timeout") == 1
        _all_free(url)
        for bad in (0, -1, "5", True, float("inf")):
            r = httpx.post(url + "/v1/completions", content=json.dumps({"prompt": "alpha", "request_timeout": bad}),
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "request_timeout", (bad, r.text)
    # the server's flag alone
    with _serve(FakeEngine(step_delay=0.05), fallbacks=FallbackConfig(request_timeout=0.4)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "alpha", "max_tokens": 200, "ignore_eos": True},
                       timeout=30)
        assert r.json()["choices"][0]["finish_reason"] == "timeout"
        assert 'minfer:request_fallbacks_total{kind="timeout",model_name="fake"} 1.0' in httpx.get(url + "/metrics").text


def test_truncate_prompt_tokens_keeps_the_tail_and_refuses_bad_values():
    with _serve() as url:
        words = "alpha beta gamma delta epsilon zeta eta theta"
        tail = "eta theta"
        a = httpx.post(url + "/v1/completions", json={"prompt": words, "max_tokens": 5, "truncate_prompt_tokens": 2})
        b = httpx.post(url + "/v1/completions", json={"prompt": tail, "max_tokens": 5})
        assert a.status_code == 200, a.text
        assert a.json()["usage"]["prompt_tokens"] == 2
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
        # a prompt longer than max_model_len is refused without it (never truncated silently) and runs with it
        long = " ".join(["alpha"] * 300)
        assert httpx.post(url + "/v1/completions", json={"prompt": long, "max_tokens": 2}).status_code == 400
        r = httpx.post(url + "/v1/completions", json={"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 100})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": words}],
                                                           "max_tokens": 2, "truncate_prompt_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
        for bad in (0, -2, 1.5, True, "3", 257):
            r = httpx.post(url + "/v1/completions", json={"prompt": words, "truncate_prompt_tokens": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (bad, r.text)
        _all_free(url)


def test_kv_pressure_caps_max_tokens_and_says_so():
    with _serve(fallbacks=FallbackConfig(kv_pressure_threshold=0.0, kv_pressure_max_tokens=3)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "alpha", "max_tokens": 10, "ignore_eos": True})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["fallback"]["max_tokens_capped"]["granted"] == 3
        assert r.json()["fallback"]["max_tokens_capped"]["requested"] == [10]
        assert r.headers["X-Max-Tokens-Capped"] == "3"
        small = httpx.post(url + "/v1/completions", json={"prompt": "alpha", "max_tokens": 2, "ignore_eos": True})
        assert "fallback" not in small.json()  # under the cap: untouched
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "alpha", "max_tokens": 10,
                                                                 "ignore_eos": True, "stream": True}) as s:
            assert s.headers["X-Max-Tokens-Capped"] == "3"
            s.read()
    with _serve(fallbacks=FallbackConfig(kv_pressure_threshold=1.0, kv_pressure_max_tokens=3)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "alpha", "max_tokens": 10, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 10 and "fallback" not in r.json()


def test_a_request_that_can_never_fit_the_waiting_limit_is_400_not_503():
    """More prompts in one request than --max-waiting-requests could ever admit: a 400 saying so (a 503 would
    be retried forever). n counts once (one engine request per prompt): n=3 is served."""
    with _serve(fallbacks=FallbackConfig(max_waiting_requests=2)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": ["alpha", "beta", "gamma"], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "--max-waiting-requests 2" in r.json()["error"]["message"] and "Retry-After" not in r.headers
        r = httpx.post(url + "/v1/completions", json={"prompt": ["alpha", "beta"], "n": 3, "max_tokens": 2})
        assert r.status_code == 200, r.text
        _all_free(url)
        # refused, not shed (the series is exported from 0)
        assert 'minfer:request_fallbacks_total{kind="shed",model_name="fake"} 0.0' in httpx.get(url + "/metrics").text


@pytest.mark.parametrize("kw", [dict(max_waiting_requests=-1), dict(max_waiting_requests=0), dict(request_timeout=0),
                                dict(kv_pressure_threshold=0.5), dict(kv_pressure_threshold=2, kv_pressure_max_tokens=4),
                                dict(kv_pressure_threshold=0.5, kv_pressure_max_tokens=0)])
def test_bad_fallback_settings_refused(kw):
    with pytest.raises(ValueError):
        FallbackConfig(**kw)


# ----------------------------------------------------------------------------------------------------------
# (4) Metrics: the article's list, vLLM's names
# ----------------------------------------------------------------------------------------------------------
ARTICLE_LIST = {  # the article's monitoring list -> the series that answers it
    "KV page usage": "minfer:kv_cache_usage_perc",
    "fragmentation": "minfer:kv_cache_fragmentation_perc",
    "eviction events": "minfer:num_evicted_blocks_total",
    "OOM / preemption events": "minfer:num_preemptions_total",
    "tokens/s": "minfer:avg_generation_throughput_toks_per_s",
    "TTFT": "minfer:time_to_first_token_seconds_count",
}
VLLM_SERIES = ["time_per_output_token_seconds_count", "request_queue_time_seconds_count",
               "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
               "request_prompt_tokens_count", "request_generation_tokens_count", "iteration_tokens_total_count",
               "cache_config_info", "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
               "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc",
               "prompt_tokens_total", "generation_tokens_total", "request_success_total",
               "cpu_cache_usage_perc", "request_max_num_generation_tokens_count", "request_params_n_count",
               "request_params_max_tokens_count"]


def parse_metrics(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_metrics_cover_the_article_list_and_vllm_names():
    with _serve(FakeEngine(step_delay=0.01)) as url:
        for i in range(3):
            r = httpx.post(url + "/v1/completions", json={"prompt": f"alpha beta {i}", "max_tokens": 6,
                                                          "ignore_eos": True})
            assert r.status_code == 200
        time.sleep(0.2)
        m = parse_metrics(httpx.get(url + "/metrics").text)
        for item, name in ARTICLE_LIST.items():
            assert name in m, (item, name)
        assert m["minfer:time_to_first_token_seconds_count"][0][1] == 3
        assert m["minfer:avg_generation_throughput_toks_per_s"][0][1] > 0
        for name in VLLM_SERIES:
            assert "vllm:" + name in m, name
        for phase in ("queue", "prefill", "decode"):
            assert m[f"vllm:request_{phase}_time_seconds_count"][0][1] == 3
        assert m["vllm:request_generation_tokens_sum"][0][1] == 18
        assert m["vllm:request_prompt_tokens_sum"][0][1] == 9
        assert m["vllm:iteration_tokens_total_sum"][0][1] == 18 + 9  # every token of every step
        labels = m["vllm:cache_config_info"][0][0]
        assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "64"
        # the two prefixes carry the same samples, vLLM's with its `engine` label
        assert m["vllm:generation_tokens_total"] == [({**labels, "engine": "0"}, v)
                                                     for labels, v in m["minfer:generation_tokens_total"]]


# ----------------------------------------------------------------------------------------------------------
# (6) vLLM's legacy /generate
# ----------------------------------------------------------------------------------------------------------
def test_legacy_generate_route_and_its_stream():
    with _serve(FakeEngine(step_delay=0.01)) as url:
        r = httpx.post(url + "/generate", json={"prompt": "alpha beta", "max_tokens": 5, "temperature": 0,
                                                "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = r.json()["text"]
        assert len(text) == 1 and text[0].startswith("alpha beta") and len(text[0]) > len("alpha beta")
        c = httpx.post(url + "/v1/completions", json={"prompt": "alpha beta", "max_tokens": 5, "temperature": 0,
                                                      "ignore_eos": True})
        assert text[0] == "alpha beta" + c.json()["choices"][0]["text"]  # the same engine output
        r = httpx.post(url + "/generate", json={"prompt": "alpha", "n": 2, "max_tokens": 3, "seed": 1})
        assert len(r.json()["text"]) == 2
        with httpx.stream("POST", url + "/generate", json={"prompt": "alpha beta", "max_tokens": 5,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "stream": True}) as s:
            raw = s.read()
        parts = [json.loads(p) for p in raw.split(b"\0") if p]
        assert len(parts) == 5 and parts[-1]["text"] == text  # cumulative, the last one the whole answer
        assert all(parts[i]["text"][0] in parts[i + 1]["text"][0] for i in range(4))


def test_legacy_generate_bad_input_is_400_and_loses_nothing():
    with _serve(FakeEngine(step_delay=0.02)) as url:
        result = {}

        def long_running():
            result["r"] = httpx.post(url + "/generate", json={"prompt": "alpha", "max_tokens": 30,
                                                              "ignore_eos": True}, timeout=60)

        t = threading.Thread(target=long_running)
        t.start()
        bad_bodies = [{}, {"prompt": ""}, {"prompt": 5}, {"prompt": "a", "stream": "yes"},
                      {"prompt": "a", "bogus_field": 1}, {"prompt": "a", "temperature": -1},
                      {"prompt": "a", "max_tokens": 0}, {"prompt": "a", "n": 10**6},
                      {"prompt": " ".join(["alpha"] * 300)}, {"prompt": "a", "truncate_prompt_tokens": 0}]
        # each names its field: booleans must be booleans ("no" is truthy), a guided regex that does not
        # compile is the guided field's error, a string timeout shows as a string
        named = [({"skip_special_tokens": "no"}, "skip_special_tokens"), ({"ignore_eos": "no"}, "ignore_eos"),
                 ({"include_stop_str_in_output": 0}, "include_stop_str_in_output"),
                 ({"guided_decoding": {"regex": "("}}, "guided_decoding"),
                 ({"guided_decoding": {"json": "{bad"}}, "guided_decoding"),
                 ({"request_timeout": "5"}, "request_timeout")]
        for bad in bad_bodies + [{"prompt": "Hi", "max_tokens": 3, **fields} for fields, _ in named]:
            r = httpx.post(url + "/generate", json=bad)
            assert r.status_code == 400, (bad, r.status_code, r.text)
            assert "message" in r.json()["error"]
        for fields, param in named:
            for stream in (False, True):
                r = httpx.post(url + "/generate", json={"prompt": "Hi", "max_tokens": 3, "stream": stream, **fields})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
        assert "'5'" in r.json()["error"]["message"]  # request_timeout "5": not "got 5"
        r = httpx.post(url + "/generate", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        t.join(60)
        assert result["r"].status_code == 200  # the request running meanwhile was not disturbed
        assert len(result["r"].json()["text"][0].split()) == 31
        _all_free(url)
