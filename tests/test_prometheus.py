"""A real Prometheus scrapes the server with `deploy/prometheus.yml` and answers `minfer:` (and `vllm:`)
series back through its own HTTP query API (chapter 15). Skipped, saying why, without the `prometheus`
binary (Debian's package: `apt-get install -y prometheus`; scripts/setup.sh --test installs it).

    pytest -q tests/test_prometheus.py
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from minfer.serve.connection import uvicorn_options
from minfer.serve.limits import ServerLimits
from minfer.serve.routes import build_app
from tests.fake_engine import FakeEngine
from tests.serving import free_port, server_in_thread

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install -y prometheus)")]


def _query(base: str, expr: str) -> list:
    r = httpx.get(base + "/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_and_answers_minfer_series(tmp_path):
    app = build_app(FakeEngine(step_delay=0.01), served_model_names=["fake"], log_requests=False)
    with server_in_thread(app, **uvicorn_options(ServerLimits())) as url:
        for i in range(4):
            r = httpx.post(url + "/v1/completions", json={"prompt": f"alpha {i}", "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200
        config = (ROOT / "deploy" / "prometheus.yml").read_text()
        assert '"localhost:8000"' in config
        config = config.replace("localhost:8000", url.removeprefix("http://")).replace("scrape_interval: 5s",
                                                                                      "scrape_interval: 1s")
        (tmp_path / "prometheus.yml").write_text(config)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = open(tmp_path / "prometheus.log", "w")
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 60
            found = None
            while time.time() < deadline:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                try:
                    result = _query(base, 'minfer:generation_tokens_total{job="minfer"}')
                except httpx.HTTPError:
                    result = []
                if result:
                    found = result
                    break
                time.sleep(0.5)
            assert found, "Prometheus never scraped minfer: series\n" + (tmp_path / "prometheus.log").read_text()[-3000:]
            assert float(found[0]["value"][1]) == 20 and found[0]["metric"]["model_name"] == "fake"
            ttft = _query(base, "minfer:time_to_first_token_seconds_count")
            assert float(ttft[0]["value"][1]) == 4
            assert _query(base, "vllm:kv_cache_usage_perc") and _query(base, "vllm:request_queue_time_seconds_count")
            targets = httpx.get(base + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            assert [t["health"] for t in targets] == ["up"]
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
