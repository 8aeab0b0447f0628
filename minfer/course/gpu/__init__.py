"""The notebooks' guarded GPU sections, one module per lesson (`ch04.py`, ...): each defines
`run(device: str = "cuda", small: bool = False) -> dict`, which measures on the device what the lesson claims
(synchronized timings, peak memory) and returns the numbers. A notebook calls it only when
`torch.cuda.is_available()`; `small=True` runs the same code path on tiny shapes on any device, which is what
`python benchmarks/gpu_check.py --dry-run` does in CI, so a GPU section cannot rot unseen."""

from __future__ import annotations

import importlib
import pkgutil


def sections() -> list:
    """Every lesson's GPU-section module, sorted by name."""
    return [importlib.import_module(f"{__name__}.{m.name}") for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)]
