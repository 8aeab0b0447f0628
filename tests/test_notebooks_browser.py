"""A course notebook run as a learner runs it: JupyterLab in a real browser, "Run All Cells", no errors.

`jupyter lab` starts on a free port over a scratch copy of one notebook (inside `notebooks/`, so the
notebook finds this checkout's `minfer` as it does when opened in place); Debian's chromium, headless and
driven by Selenium, opens it, picks Run > Run All Cells from the menu, and waits until every code cell has
an execution count. Then the notebook is saved from the browser and read back: no cell may have an error
output, and at least one figure must have been drawn. Skipped, with the reason, without chromium,
chromedriver or selenium (the same requirements as `tests/test_serve_browser.py`).

    pytest tests/test_notebooks_browser.py
    MINFER_BROWSER_NOTEBOOK=06_continuous_batching.ipynb pytest tests/test_notebooks_browser.py
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.serving import free_port
from tests.test_serve_browser import _missing, _wait, browser  # noqa: F401  (the shared headless-chromium fixture)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = os.environ.get("MINFER_BROWSER_NOTEBOOK", "11_prefix_caching.ipynb")

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]



@pytest.fixture(scope="module")
def lab():
    """(base URL, token, scratch dir name, process) of a JupyterLab serving a scratch copy of NOTEBOOK."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("jupyterlab")
    scratch = Path(tempfile.mkdtemp(prefix=".browser-run-", dir=ROOT / "notebooks"))
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, scratch / NOTEBOOK)
    port, token = free_port(), secrets.token_hex(16)
    log = open(scratch / "lab.log", "w")
    env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip", "127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT / 'notebooks'}", "--allow-root",
         "--ContentsManager.allow_hidden=True",
         f"--LabApp.workspaces_dir={scratch}", f"--LabApp.user_settings_dir={scratch}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail("jupyter lab exited:\n" + (scratch / "lab.log").read_text()[-3000:])
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("jupyter lab did not start within 120 s")
                time.sleep(0.5)
        yield url, token, scratch, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)



def test_run_all_cells_in_jupyterlab(lab, browser):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, token, scratch, _ = lab
    path = scratch / NOTEBOOK
    n_code = sum(c["cell_type"] == "code" for c in json.loads(path.read_text())["cells"])
    browser.set_page_load_timeout(120)
    browser.get(f"{url}/lab/tree/{scratch.name}/{NOTEBOOK}?token={token}")

    def kernel_idle():
        return browser.execute_script(
            "const s = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');"
            "return s && s.getAttribute('data-status') === 'idle';")

    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"), 120, "the notebook to open")
    _wait(kernel_idle, 180, "the kernel to start")

    def menu(label: str):
        items = [e for e in browser.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-itemLabel") if e.text == label]
        return items[0] if items else None

    _wait(lambda: menu("Run"), 30, "the Run menu").click()
    entry = _wait(lambda: [e for e in browser.find_elements(By.CSS_SELECTOR, ".lm-Menu-itemLabel")
                           if e.text == "Run All Cells"], 30, "Run All Cells")
    entry[0].click()

    def prompts():
        return [e.text.strip() for e in browser.find_elements(
            By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea .jp-InputPrompt")]

    def finished():
        # Run All queues every cell at once ("[*]:"); it is over when none is queued and the kernel is idle,
        # either because all ran or because one failed (JupyterLab then leaves the rest unexecuted).
        p = prompts()
        return p and "[*]:" not in p and any(t not in ("[ ]:", "") for t in p) and kernel_idle()

    _wait(finished, 480, "the notebook to run", interval=2)
    ran = [t for t in prompts() if t not in ("[ ]:", "")]
    figures = browser.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-RenderedImage img")
    mtime = path.stat().st_mtime
    browser.find_element(By.CSS_SELECTOR, ".jp-Notebook").send_keys(Keys.CONTROL, "s")
    _wait(lambda: path.stat().st_mtime > mtime, 30, "the browser's save")
    cells = json.loads(path.read_text())["cells"]
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(cells) if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"cells with an error output: {errors}"
    assert len(ran) == n_code, f"only {len(ran)} of {n_code} code cells ran"
    saved_figures = sum("image/png" in o.get("data", {}) for c in cells for o in c.get("outputs", []))
    assert figures and saved_figures >= 1, "the notebook drew no figure in the browser"
