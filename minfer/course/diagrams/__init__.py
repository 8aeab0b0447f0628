"""Concept diagrams drawn with matplotlib, one module per diagram: each defines `NAME` (the file stem under
assets/diagrams/) and `draw(path)`, which writes the PNG. `python -m minfer.course diagrams` redraws them all.
A lesson embeds one as `![...](../assets/diagrams/NAME.png)`."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path


def modules() -> list:
    """Every diagram module of this package, sorted by name."""
    return [importlib.import_module(f"{__name__}.{m.name}") for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
            if not m.name.startswith("_")]


def draw_all(out: Path) -> list[Path]:
    """Draw every diagram into folder `out`; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for mod in modules():
        path = out / f"{mod.NAME}.png"
        mod.draw(path)
        paths.append(path)
    return paths
