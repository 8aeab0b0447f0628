"""Load a script of `benchmarks/` as a module, for the tests of its pure functions (`benchmarks/` is a folder of
scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py`, executed as module `name` and registered in `sys.modules` (dataclasses look their
    module up by name). The folder is appended to `sys.path`, so a script can import a sibling
    (`peer_vllm_serve_accounting` imports `peer_vllm_serve`)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
