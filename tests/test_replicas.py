"""Replicas as real processes (chapter 12b), on a tiny random model so that each process loads in seconds.

- `python -m minfer.serve --data-parallel-size 2`: two engine processes behind the server's router; 16
  concurrent streams end with 0 errors, each greedy text equal to the same request answered alone, both
  replicas used and labelled in /metrics; a SIGKILLed replica fails its stream in flight with an error (not
  a hang), /health answers 503 naming it, and new requests go to the live replica. With
  `--tensor-parallel-size 2` too, each replica is a TP=2 job of its own, with the same greedy answers.
- An external router: vllm-router (PyPI, its own venv; set MINFER_VLLM_ROUTER to its executable or put it
  on PATH) in front of two `python -m minfer.serve` processes, 16 concurrent requests with 0 errors and
  both servers used. Skipped when vllm-router is not installed.
- `minfer.bench.replicas` on in-process replicas: prefix_aware's hit rate >= 1.5x round_robin's; every
  output token counted with 1 and 2 replicas.

    pytest -q tests/test_replicas.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from tests.serving import free_port, running_server, stream_completion

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", "16M", "--max-num-seqs", "16", "--disable-log-requests",
        "--uvicorn-log-level", "warning"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minfer.bench.replicas import tiny_random_model

    return tiny_random_model(tmp_path_factory.mktemp("replicas") / "tiny")


def _prompt(i: int) -> str:
    return " ".join(f"w{3 + (i * 7 + k) % 250}" for k in range(8 + i % 5))




def _streams(url, model, n=16, max_tokens=16):
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[stream_completion(c, url, {**body, "prompt": _prompt(i)}) for i in range(n)])

    return asyncio.run(asyncio.wait_for(run(), 180)), body


def test_two_replicas_serve_16_streams_and_a_dead_one_is_reported(tiny):
    with running_server(["--model", tiny, "--data-parallel-size", "2", "--router-policy", "least_outstanding", *ARGS],
                        check_log=False) as url:
        results, body = _streams(url, tiny)
        assert all(errors == [] for _, errors in results), [e for _, e in results if e][:2]
        for i in (0, 7):
            alone = httpx.post(url + "/v1/completions", json={**body, "prompt": _prompt(i), "stream": False},
                               timeout=60).json()["choices"][0]["text"]
            assert results[i][0] == alone
        metrics = httpx.get(url + "/metrics", timeout=10).text
        for r in ("0", "1"):
            line = next(x for x in metrics.splitlines()
                        if x.startswith("minfer:router_requests_routed_total") and f'replica="{r}"' in x)
            assert float(line.split()[-1]) >= 4, line  # least_outstanding spreads 16 concurrent streams
            assert f'minfer:generation_tokens_total{{model_name="{tiny}",replica="{r}"}}' in metrics
        stats = httpx.get(url + "/v1/stats", timeout=10).json()
        pids = [rep["engine_pid"] for rep in stats["stats"]["replicas"]]
        assert len(set(pids)) == 2 and stats["api_server_pid"] not in pids

        # kill replica 0 while a long stream runs on it (least_outstanding sends the first of two to replica 0)
        long = {"model": tiny, "prompt": _prompt(1), "max_tokens": 230, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=long) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            t_kill = time.perf_counter()
            os.kill(pids[0], signal.SIGKILL)
            rest = list(lines)  # must end, not hang
            t_end = time.perf_counter()
        errors = [json.loads(x[6:]) for x in rest if x.startswith("data: {") and '"error"' in x]
        assert errors and "engine process died" in errors[0]["error"]["message"], rest[-3:]
        assert t_end - t_kill < 10
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "replica 0" in health.text, health.text
        r = httpx.post(url + "/v1/completions", json={**body, "prompt": _prompt(3), "stream": False}, timeout=60)
        assert r.status_code == 200, r.text  # the live replica serves
        assert r.json()["choices"][0]["text"] == results[3][0]
        assert 'minfer:replica_up{model_name="%s",replica="0"} 0.0' % tiny in httpx.get(url + "/metrics").text


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to find the worker processes")
def test_each_replica_may_be_tensor_parallel(tiny):
    # -dp 2 -tp 2: two engine processes, each the driver of a TP=2 job with its own spawned worker; greedy
    # answers equal one process's.
    from minfer import LLM, SamplingParams
    from tests.test_parallel import _descendants

    with running_server(["--model", tiny, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                         "--router-policy", "round_robin", "--attention-backend", "torch", *ARGS],
                        check_log=False) as url:
        workers = [pid for pid, cmd in _descendants(os.getpid()) if "worker_main(1)" in cmd]
        assert len(workers) == 2, workers  # one TP worker per replica
        results, _ = _streams(url, tiny, n=4, max_tokens=8)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    assert all(errors == [] for _, errors in results), results
    for r in ("0", "1"):  # round_robin: both replicas answered
        line = next(x for x in metrics.splitlines()
                    if x.startswith("minfer:router_requests_routed_total") and f'replica="{r}"' in x)
        assert float(line.split()[-1]) == 2, line
    llm = LLM(model=tiny, max_model_len=256, kv_cache_memory_bytes=16 << 20, attention_backend="torch")
    outs = llm.generate([_prompt(i) for i in range(4)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [t for t, _ in results] == [o.outputs[0].text for o in outs]


# ----------------------------------------------------------------------------------------------------------
# vllm-router in front of two minfer servers
# ----------------------------------------------------------------------------------------------------------
def _vllm_router() -> str | None:
    exe = os.environ.get("MINFER_VLLM_ROUTER") or shutil.which("vllm-router")
    return exe if exe and os.access(exe, os.X_OK) else None


@contextlib.contextmanager
def _process(cmd, log_path):
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(_vllm_router() is None, reason="vllm-router is not installed (pip install vllm-router in a "
                                                    "venv; set MINFER_VLLM_ROUTER to its executable)")
def test_vllm_router_in_front_of_two_servers(tiny, tmp_path):
    with running_server(["--model", tiny, *ARGS]) as a, running_server(["--model", tiny, *ARGS]) as b:
        port = free_port()
        cmd = [_vllm_router(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", a, b,
               "--policy", "round_robin", "--log-level", "warning", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port())]
        with _process(cmd, tmp_path / "router.log") as proc:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + 60
            while True:
                assert proc.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.time() < deadline, "vllm-router not healthy after 60 s"
                time.sleep(0.25)
            results, body = _streams(url, tiny)
            assert all(errors == [] for _, errors in results), [e for _, e in results if e][:2]
            alone = httpx.post(a + "/v1/completions", json={**body, "prompt": _prompt(5), "stream": False},
                               timeout=60).json()["choices"][0]["text"]
            assert results[5][0] == alone
        counts = [httpx.get(u + "/v1/stats", timeout=10).json()["num_requests_total"] for u in (a, b)]
        assert sum(counts) == 16 + 1 and min(counts) >= 4, counts


def test_bench_prefix_aware_beats_round_robin(tiny):
    from minfer.bench.replicas import Settings, run_hit_rate
    from minfer.config import EngineArgs

    r = run_hit_rate(EngineArgs(model=tiny, max_model_len=512), Settings.quick(), in_process=True,
                     progress=lambda *_: None)
    rows = r["policies"]
    assert all(row["errors"] == 0 for row in rows.values())
    assert rows["prefix_aware"]["hit_rate"] >= 1.5 * rows["round_robin"]["hit_rate"], rows
    assert rows["prefix_aware"]["hit_rate"] <= r["ideal_hit_rate"] + 1e-9


def test_bench_throughput_counts_every_token(tiny):
    from minfer.bench.replicas import Settings, run_throughput
    from minfer.config import EngineArgs

    s = Settings.quick()
    r = run_throughput(EngineArgs(model=tiny, max_model_len=256), s, in_process=True, progress=lambda *_: None)
    assert [row["replicas"] for row in r["runs"]] == [1, 2]
    for row in r["runs"]:
        assert row["errors"] == 0 and row["output_tokens"] == s.tp_num_requests * s.tp_output_len
    assert r["runs"][1]["requests_per_replica"] == [9, 9]  # 16 + 2 warm-up, spread by least_outstanding
