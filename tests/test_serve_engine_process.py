"""The engine core in its own process (minfer/serve/engine_core.py, minfer/serve/engine_client.py).

- The wire format: step deltas rebuilt into the same cumulative snapshots the in-process loop makes
  (no process, no model).
- The real server (`python -m minfer.serve`, which runs the engine in a process of its own by default):
  it is two processes; 32 concurrent streams, half of them dropped mid-stream, leave every KV block free
  and the finished ones equal to the same request answered alone; a SIGKILLed engine process is seen within
  seconds (the stream in flight ends with an error event, /health 503) and the server exits with status 3; a
  SIGSTOPped engine fails /health and its requests within the heartbeat timeout; a killed API server takes its
  engine process with it, idle or busy.

    pytest -q tests/test_serve_engine_process.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minfer.serve.engine_core import encode_step
from tests.serving import free_port, running_server, server_process

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
ARGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--disable-log-requests", "--uvicorn-log-level", "warning"]

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------------------------------------
# Wire format, no process
# ----------------------------------------------------------------------------------------------------------
def _out(rid, texts, ids, finished=False, logprobs=None):
    m = RequestMetrics(arrival_time=0.0)
    return RequestOutput(rid, None, [1, 2, 3], [
        CompletionOutput(i, t, list(x), "length" if finished else None, None,
                         [dict(lp) for lp in logprobs[i]] if logprobs else None)
        for i, (t, x) in enumerate(zip(texts, ids))], finished=finished, metrics=m)


def _client_side():
    """An MPEngineClient's receive half without its sockets: routes + `_on_outputs`."""
    from minfer.serve.engine_client import MPEngineClient, _Route

    class _Loop:
        def call_soon_threadsafe(self, fn, *a):
            fn(*a)

    class _Q(list):
        put_nowait = list.append

    c = MPEngineClient.__new__(MPEngineClient)
    c.metrics, c.recent_ttfts = None, []
    c._routes, c._lock = {}, __import__("threading").Lock()
    q = _Q()
    c._routes["r"] = _Route(_Loop(), q, time.perf_counter())
    return c, q


def test_deltas_rebuild_the_cumulative_snapshots():
    """Each step sends only what is new; the client's snapshots equal the engine's full outputs, including a
    step whose text got shorter (an output processor that rewrites held-back text)."""
    steps = [
        _out("r", ["He", "A"], [[5], [9]], logprobs=[[{5: -0.1}], [{9: -0.2}]]),
        _out("r", ["Hello", "A b"], [[5, 6], [9, 10]], logprobs=[[{5: -0.1}, {6: -0.3}], [{9: -0.2}, {10: -1.0}]]),
        _out("r", ["Hel", "A b c"], [[5, 6, 7], [9, 10, 11]],  # text 0 shrank: sent whole again
             logprobs=[[{5: -0.1}, {6: -0.3}, {7: -2.0}], [{9: -0.2}, {10: -1.0}, {11: -0.5}]]),
        _out("r", ["Help!", "A b c."], [[5, 6, 7, 8], [9, 10, 11, 12]], finished=True,
             logprobs=[[{5: -0.1}, {6: -0.3}, {7: -2.0}, {8: -0.1}], [{9: -0.2}, {10: -1.0}, {11: -0.5}, {12: -0.4}]]),
    ]
    import msgpack

    sent: dict = {}
    client, q = _client_side()
    sizes = []
    for out in steps:
        wire = msgpack.packb(["step", encode_step([out], sent, 0.0), None], use_bin_type=True)
        sizes.append(len(wire))
        client._on_outputs(msgpack.unpackb(wire, raw=False, strict_map_key=False)[1])
        rid, kind, snap = q[-1]
        assert (rid, kind) == ("r", "output")
        assert snap.finished == out.finished and snap.num_prompt_tokens == 3
        for got, want in zip(snap.outputs, out.outputs, strict=True):
            assert (got.index, got.text, got.token_ids, got.finish_reason) == (
                want.index, want.text, want.token_ids, want.finish_reason)
            assert got.logprobs == want.logprobs
    assert sent == {} and "r" not in client._routes  # finished: forgotten on both sides
    assert len(q) == len(steps)
    assert q[-1][2].prompt_token_ids == [1, 2, 3]  # the final snapshot carries the prompt (echo reads it)


def test_echo_scoring_through_the_engine_process(server):
    """`echo` + `logprobs` + `max_tokens: 0` (lm-evaluation-harness's request) needs the prompt's ids and
    logprobs, which cross the process boundary with the last row."""
    r = httpx.post(server + "/v1/completions", timeout=60, json={
        "model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 0,
        "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert r.json()["choices"][0]["text"] == "The capital of France is"
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(lp["token_logprobs"]) > 3
    assert all(x < 0 for x in lp["token_logprobs"][1:])


def test_a_step_message_carries_only_the_new_tokens():
    sent: dict = {}
    long = list(range(1000))
    encode_step([_out("r", ["x" * 1000], [long])], sent, 0.0)
    rows = encode_step([_out("r", ["x" * 1001], [long + [7]])], sent, 0.0)
    (rid, _, _, finished, ttft, fin, comps), = rows
    assert comps[0][1:5] == [1000, [7], 1000, "x"] and not finished and ttft is None and fin is None


# ----------------------------------------------------------------------------------------------------------
# The real server, two processes
# ----------------------------------------------------------------------------------------------------------
def _stats(url):
    return httpx.get(url + "/v1/stats", timeout=10).json()


def _wait_all_blocks_free(url, timeout=20.0):
    deadline = time.time() + timeout
    while True:
        s = _stats(url)["stats"]
        if s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        assert time.time() < deadline, f"KV blocks not all free after {timeout} s: {s}"
        time.sleep(0.1)


async def _stream(client, url, body, drop_after=None):
    """Text of a streamed completion, or None if it was dropped after `drop_after` chunks."""
    text, n = "", 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            n += 1
            if drop_after is not None and n >= drop_after:
                return None  # leaving the block closes the connection mid-stream
    return text


@pytest.fixture(scope="module")
def server():
    with running_server(ARGS) as url:
        yield url


def test_engine_runs_in_its_own_process(server):
    s = _stats(server)
    assert s["engine_pid"] != s["api_server_pid"] and s["engine_loop_alive"]
    assert httpx.get(server + "/health", timeout=5).status_code == 200


def test_engine_process_openmp_workers_spin_through_a_step(server):
    """The engine process gets GOMP_SPINCOUNT at exec (libgomp reads it when torch loads): 300000 from a server
    at normal priority, 100 from a niced one, never the API process's PASSIVE; unless the user chose a policy
    (chapter 9, section 9.2.3)."""
    from minfer.envs import ENGINE_CORE_SPINCOUNT, ENGINE_CORE_SPINCOUNT_NICED

    user_set = any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
    if user_set and not os.environ.get("MINFER_OMP_DEFAULT"):
        pytest.skip("the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT: it is passed on unchanged")
    pid = _stats(server)["engine_pid"]
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    niced = os.getpriority(os.PRIO_PROCESS, pid) > 0  # the server inherits this test's priority
    want = ENGINE_CORE_SPINCOUNT_NICED if niced else ENGINE_CORE_SPINCOUNT
    assert f"GOMP_SPINCOUNT={want}".encode() in env
    assert not any(e.startswith(b"OMP_WAIT_POLICY=") for e in env)


def test_32_streams_with_disconnects_leave_every_block_free(server):
    prompts = [f"Story number {i}: once upon a time" for i in range(32)]
    base = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[
                _stream(c, server, {**base, "prompt": p}, drop_after=2 + i % 5 if i % 2 else None)
                for i, p in enumerate(prompts)])

    before = _wait_all_blocks_free(server)
    texts = asyncio.run(run())
    after = _wait_all_blocks_free(server)
    assert [t is None for t in texts] == [bool(i % 2) for i in range(32)]
    assert after["num_total_blocks"] == before["num_total_blocks"]
    # the dropped half did not run to the end: fewer tokens than 32 full requests
    assert after["num_generation_tokens_total"] - before["num_generation_tokens_total"] < 32 * 24
    # a finished stream under load is token for token the same request answered alone (greedy)
    for i in (0, 10):
        alone = httpx.post(server + "/v1/completions", json={**base, "prompt": prompts[i], "stream": False},
                           timeout=60).json()["choices"][0]["text"]
        assert texts[i] == alone


def _stream_then(url: str, action, max_tokens: int = 400, **extra):
    """Start a greedy stream, wait for its first token, call `action()`, read the rest of the stream.
    Returns (the rest's lines, seconds from the action to the stream's end)."""
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, **extra}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            t0 = time.perf_counter()
            action()
            rest = list(lines)  # must end, not hang (the client's timeout would fail the test)
            return rest, time.perf_counter() - t0


def _errors(rest):
    return [json.loads(x[6:]) for x in rest if x.startswith("data: {") and '"error"' in x]


def _wait_exit(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server was still running {timeout:g} s after its engine died")


def test_killed_engine_process_is_detected_and_the_server_exits_nonzero():
    """Issue 33: a dead engine is not served around. The stream in flight ends with a 503 error event within
    seconds, /health says why while the server shuts down, and the server exits with status 3 (its
    supervisor restarts it: chapter 15, "When the engine dies")."""
    from minfer.serve.__main__ import ENGINE_DIED_EXIT_STATUS

    with server_process(ARGS) as (proc, url, log):
        pid = _stats(url)["engine_pid"]
        rest, took = _stream_then(url, lambda: os.kill(pid, signal.SIGKILL))
        errors = _errors(rest)
        assert errors and "engine process died" in errors[0]["error"]["message"], rest[-3:]
        assert "data: [DONE]" in rest
        assert took < 5, f"the stream ended {took:.1f} s after the kill"
        try:
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 503 and "engine process died" in health.text
        except httpx.TransportError:
            pass  # the server already closed its socket on its way out
        assert _wait_exit(proc, 30) == ENGINE_DIED_EXIT_STATUS
        assert "exiting with status 3" in Path(log).read_text()


def test_stopped_engine_process_fails_health_and_requests_within_the_heartbeat_bound():
    """A SIGSTOPped engine (alive but silent, no CPU used): /health turns 503 within the heartbeat timeout (3 s
    here) and keeps answering in well under a second until then (the server may already have closed its socket
    on its way out when the probe comes), the stream in flight ends with a 503 error event within the timeout
    plus a poll, and the stopped process is killed (the server then exits with status 3)."""
    from minfer.serve.__main__ import ENGINE_DIED_EXIT_STATUS

    timeout = 3.0
    with server_process([*ARGS, "--engine-heartbeat-timeout", str(timeout)]) as (proc, url, log):
        pid = _stats(url)["engine_pid"]
        probes = []

        def stop():
            os.kill(pid, signal.SIGSTOP)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < timeout + 2:  # /health stays fast while the engine is stopped
                t = time.perf_counter()
                try:
                    code = httpx.get(url + "/health", timeout=5).status_code
                except httpx.TransportError:  # the stall was declared and the server already closed its socket
                    code = None
                probes.append((t - t0, time.perf_counter() - t, code))
                if code in (503, None):
                    break
                time.sleep(0.2)

        try:
            rest, took = _stream_then(url, stop)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert max(p[1] for p in probes) < 1.0, probes
        assert probes[-1][2] in (503, None) and probes[-1][0] < timeout + 1.5, probes
        assert all(code == 200 for _, _, code in probes[:-1]), probes
        errors = _errors(rest)
        assert errors and "stopped answering" in errors[0]["error"]["message"], rest[-3:]
        assert took < timeout + 3, f"the stream ended {took:.1f} s after SIGSTOP"
        assert _wait_exit(proc, 30) == ENGINE_DIED_EXIT_STATUS
        deadline = time.time() + 10
        while _alive(pid):
            assert time.time() < deadline, "the stalled engine process was not killed"
            time.sleep(0.1)


def test_killed_api_server_takes_its_busy_engine_process_with_it():
    """The engine process ends when its parent dies, also in the middle of generating (the heartbeat thread
    checks the parent every 0.5 s; the step loop never waits for work)."""
    with server_process(ARGS) as (proc, url, log):
        pid = _stats(url)["engine_pid"]

        def kill_api():
            proc.kill()  # SIGKILL: no shutdown code runs in the API process
            proc.wait(10)

        with contextlib.suppress(httpx.HTTPError):
            # 16 sequences of 480 tokens: minutes of work, so an engine that only looked for its parent when
            # idle would outlive the server by far more than the 5 s allowed here
            _stream_then(url, kill_api, max_tokens=480, n=16, temperature=1.0)
        deadline = time.time() + 5
        while _alive(pid):
            assert time.time() < deadline, "the busy engine process outlived its API server by 5 s"
            time.sleep(0.1)


def test_killed_api_server_takes_its_engine_process_with_it():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "minfer.serve", "--port", str(port), *ARGS], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None and time.time() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        pid = _stats(url)["engine_pid"]
        proc.kill()  # SIGKILL: no shutdown code runs in the API process
        proc.wait(10)
        deadline = time.time() + 10
        while _alive(pid):
            assert time.time() < deadline, "the engine process outlived its API server by 10 s"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_no_engine_process_flag_serves_in_process():
    with running_server([*ARGS, "--no-engine-process"]) as url:
        s = _stats(url)
        assert s["engine_pid"] == s["api_server_pid"]
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
