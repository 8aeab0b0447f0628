"""Start a real server on a free loopback port, for tests: `python -m minfer.serve` (or the fake engine) as a
subprocess (`running_server`), or an app under uvicorn in a thread of the test's own process
(`server_in_thread`: the test can then measure the server's memory, or give it its own limits)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_healthy(cmd: list[str], port: int, timeout: float):
    """Start `cmd` (a server on `port`, this checkout first on PYTHONPATH, output to a log file) and wait until
    /health answers 200. Returns (proc, url, log path); fails the test (killing the server) if it exits or is
    not healthy within `timeout` seconds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = tempfile.NamedTemporaryFile(prefix="minfer-serve-test-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{Path(log.name).read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy after {timeout} s:\n{Path(log.name).read_text()[-4000:]}")
        time.sleep(0.25)


@contextlib.contextmanager
def running_server(args: list[str], fake_engine_args: list[str] | None = None, timeout: float = 180,
                   check_log: bool = True):
    """Yield the base URL of a healthy server started with `args`; stop it afterwards.

    With MINFER_TEST_FAKE_ENGINE set, `tests/fake_engine.py` runs instead (server development without a
    model). `check_log` fails the test if the server logged a traceback.
    """
    port = free_port()
    if os.environ.get("MINFER_TEST_FAKE_ENGINE"):
        cmd = [sys.executable, str(ROOT / "tests" / "fake_engine.py"), str(port), *(fake_engine_args or [])]
    else:
        cmd = [sys.executable, "-m", "minfer.serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc, url, log = _start_healthy(cmd, port, timeout)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = Path(log).read_text()
    os.unlink(log)
    if check_log:
        assert "Traceback" not in text, text[-4000:]


@contextlib.contextmanager
def server_process(args: list[str], timeout: float = 300):
    """Yield `(proc, url, log_path)` of `python -m minfer.serve ARGS` once /health answers 200, for tests that
    kill or stop its processes and read its exit status; the server is killed afterwards if still running."""
    port = free_port()
    proc, url, log = _start_healthy([sys.executable, "-m", "minfer.serve", "--host", "127.0.0.1", "--port", str(port),
                                     *args], port, timeout)
    try:
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(log)


@contextlib.contextmanager
def server_in_thread(app, timeout: float = 30, **uvicorn_options):
    """Yield the base URL of `app` served by uvicorn on a free loopback port in a thread; stop it afterwards.

    `uvicorn_options` go to `uvicorn.Config` (e.g. `minfer.serve.connection.uvicorn_options(limits)`).
    """
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-in-test", daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        if not thread.is_alive():
            pytest.fail("uvicorn stopped before it started serving")
        if time.time() > deadline:
            server.should_exit = True
            pytest.fail(f"uvicorn not serving after {timeout} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str | None, list]:
    """(text, error chunks) of one streamed /v1/completions; (None, [the body]) when it is not a 200."""
    text, errors = "", []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return None, [(await resp.aread()).decode()]
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk)
                else:
                    text += chunk["choices"][0]["text"]
    return text, errors


def assert_exits_engine_died(proc: subprocess.Popen, log: str, timeout: float = 90) -> None:
    """The server `proc` exits within `timeout` s with the status of a dead engine (3: its supervisor restarts
    it, chapter 15 §15.3b); the test fails with the end of its log otherwise."""
    from minfer.serve.__main__ import ENGINE_DIED_EXIT_STATUS

    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server was still running {timeout:g} s after its engine died")
    assert code == ENGINE_DIED_EXIT_STATUS, (code, Path(log).read_text()[-2000:])
