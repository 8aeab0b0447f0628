"""The fast tier (`pytest -m "not slow"`): tests/conftest.py's SLOW_MODULES name real files, and notebooks are
never in it."""

from pathlib import Path

from tests.conftest import SLOW_MODULES, is_slow_module

ROOT = Path(__file__).resolve().parents[1]


def test_slow_modules_are_files():
    missing = [m for m in SLOW_MODULES if not (ROOT / m).is_file()]
    assert not missing, f"SLOW_MODULES names files that do not exist: {missing}"


def test_notebooks_and_slow_modules_are_slow_and_the_rest_is_not():
    notebook = sorted((ROOT / "notebooks").glob("*.ipynb"))[0].relative_to(ROOT)
    assert is_slow_module(f"{notebook}::Cell 0")
    assert is_slow_module(f"{SLOW_MODULES[0]}::test_x")
    assert not is_slow_module("tests/test_fast_tier.py::test_slow_modules_are_files")
