"""`ruff check .` is clean with the configuration committed in pyproject.toml (CI runs it through this test)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str] | None:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    try:
        import ruff  # noqa: F401 - only whether it is installed
    except ImportError:
        return None
    return [sys.executable, "-m", "ruff"]


def test_ruff_check_is_clean():
    cmd = _ruff()
    if cmd is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    r = subprocess.run([*cmd, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_the_check_can_fail(tmp_path):
    cmd = _ruff()
    if cmd is None:
        pytest.skip("ruff is not installed")
    (tmp_path / "bad.py").write_text("import os\n")  # F401: imported, never used
    r = subprocess.run([*cmd, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), "bad.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "F401" in r.stdout, r.stdout + r.stderr
