"""What every concept diagram starts and ends with: a blank white canvas in data coordinates, and the saved PNG
(no software tag, so a redraw is byte-identical)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def canvas(figsize: tuple[float, float], xlim: tuple[float, float], ylim: tuple[float, float], *,
           full: bool = False, **figure_kw: Any):
    """A figure of `figsize` inches and one axes without frame or ticks spanning `xlim` x `ylim`; `full=True` makes
    the axes fill the whole figure (no margins). Returns (fig, ax)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if full:
        fig = plt.figure(figsize=figsize, **figure_kw)
        ax = fig.add_axes([0, 0, 1, 1])
    else:
        fig, ax = plt.subplots(figsize=figsize, **figure_kw)
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")
    return fig, ax


def save(fig: Any, path: Path, dpi: int, *, tight: bool = False) -> None:
    """Write `fig` as a white PNG at `path` and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi, facecolor="white", metadata={"Software": None}, **({"bbox_inches": "tight"} if tight else {}))
    plt.close(fig)
