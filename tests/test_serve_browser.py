"""The demo page in a real browser: Debian's chromium, headless, driven by Selenium.

Needs `apt-get install -y chromium chromium-driver` and `pip install selenium`; skipped (with the reason) when
either is missing. Nothing here downloads a browser or a driver: the system ones are named explicitly and
Selenium Manager is kept offline.

The server is `python -m minfer.serve` with the real default model; set MINFER_TEST_FAKE_ENGINE=1 to serve
tests/fake_engine.py instead (for working on the page without the engine).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time

import pytest

from tests.serving import running_server

CHROMIUM = os.environ.get("MINFER_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("MINFER_CHROMEDRIVER", "/usr/bin/chromedriver")

pytestmark = pytest.mark.timeout(300)


def _missing() -> str | None:
    if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"chromium not installed at {CHROMIUM} (apt-get install -y chromium chromium-driver)"
    if not (os.path.exists(CHROMEDRIVER) and os.access(CHROMEDRIVER, os.X_OK)):
        return f"chromedriver not installed at {CHROMEDRIVER} (apt-get install -y chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install selenium)"
    return None


@pytest.fixture(scope="module")
def server_url():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    with running_server(["--max-model-len", "512", "--disable-log-requests", "--uvicorn-log-level", "warning"],
                        check_log=False) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never try to download anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="minfer-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1200,900"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _wait(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def test_demo_page_streams_answer_and_updates_panels(server_url, browser):
    from selenium.webdriver.common.by import By

    browser.get(server_url + "/")
    assert "minfer" in browser.title

    def text(el_id: str) -> str:
        return browser.find_element(By.ID, el_id).text

    # panels come alive: the stats poll runs every ~500 ms
    _wait(lambda: int(text("stats-updates") or 0) >= 2, 10, "two /v1/stats polls")
    assert text("kv-usage").endswith("%")
    assert text("num-running").isdigit()
    ttft_before = text("ttft")
    updates_before = int(text("stats-updates"))

    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("48")
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("0")
    box = browser.find_element(By.ID, "prompt")
    box.send_keys("What is the capital of France?")
    browser.find_element(By.ID, "send").click()

    # the question shows, then an assistant bubble whose text grows while it streams
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.user"), 5, "the user's message")
    answer = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"), 5, "the answer bubble")[-1]
    lengths = []

    def grown():
        state = answer.get_attribute("data-state")
        lengths.append(len(browser.execute_script(
            "return arguments[0].firstChild ? arguments[0].firstChild.textContent : ''", answer)))
        return state != "streaming"

    _wait(grown, 120, "the answer to finish", interval=0.02)
    assert answer.get_attribute("data-state") == "done", answer.text
    final = answer.text
    assert "TTFT" in final and "finish:" in final, final
    nonzero = sorted(set(x for x in lengths if x > 0))
    assert nonzero, f"no streamed text appeared: {final!r}"
    chunks = int(re.search(r"(\d+) chunks", final).group(1))
    assert chunks >= 2, f"the answer came in {chunks} chunk(s), not streamed: {final!r}"
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")

    # the panels moved on: more polls, and a TTFT for the request we just made
    _wait(lambda: int(text("stats-updates")) >= updates_before + 2, 10, "more stats polls")
    _wait(lambda: text("ttft") not in ("", "–") and (text("ttft") != ttft_before or ttft_before != "–"), 10,
          "a TTFT in the panel")
    assert text("ttft").endswith("ms")
    assert int(text("gen-tokens")) > 0
    # after the answer, every KV block is free again
    _wait(lambda: text("kv-usage") == "0.0%", 10, "KV usage back to 0.0%")
