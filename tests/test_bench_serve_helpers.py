"""minfer.bench.serve's server helpers that the peer benchmarks share (free_port, wait_until_healthy): a /health
that turns 200 after a few 503s, a server process that dies first, one that never answers."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from minfer.bench.serve import free_port, wait_until_healthy


def test_waits_through_503s_until_health_is_200():
    calls = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            calls.append(self.path)
            self.send_response(200 if len(calls) >= 3 else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        waited = wait_until_healthy(f"http://127.0.0.1:{port}", timeout_s=30, interval_s=0.01)
    finally:
        server.shutdown()
    assert calls == ["/health"] * 3 and waited >= 0


def test_a_server_that_exits_first_is_an_error():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match="exited with status 3"):
        wait_until_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=30, interval_s=0.01)


def test_no_answer_times_out():
    with pytest.raises(RuntimeError, match="not healthy after"):
        wait_until_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=0.2, interval_s=0.05)


def test_stop_server_terminates_then_kills():
    from minfer.bench.serve import stop_server

    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop_server(polite, grace_s=30)
    assert polite.returncode is not None
    stubborn = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"  # SIGTERM is ignored from here on
    stop_server(stubborn, grace_s=0.2)
    assert stubborn.returncode == -9
