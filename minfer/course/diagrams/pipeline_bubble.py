"""A GPipe-style pipeline schedule: p stages, m micro-batches; stage s runs micro-batch i in time slot s + i, so a
step lasts m + p - 1 slots and each stage idles p - 1 of them: the bubble, (p - 1) / (m + p - 1). Chapter 12."""

from __future__ import annotations

from pathlib import Path

NAME = "pipeline_bubble"


def draw(path: Path, p: int = 4, m: int = 6) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    colors = plt.get_cmap("tab10")
    slots = m + p - 1
    fig, ax = plt.subplots(figsize=(11, 4.6), facecolor="white")
    for s in range(p):
        for t in range(slots):
            i = t - s
            if 0 <= i < m:
                ax.add_patch(Rectangle((t + 0.04, s + 0.08), 0.92, 0.84, facecolor=colors(i), edgecolor="white"))
                ax.text(t + 0.5, s + 0.5, f"mb {i}", ha="center", va="center", fontsize=11, color="white",
                        weight="bold")
            else:
                ax.add_patch(Rectangle((t + 0.04, s + 0.08), 0.92, 0.84, facecolor="#eeeeee", hatch="//",
                                       edgecolor="#aaaaaa"))
    ax.set_xlim(0, slots)
    ax.set_ylim(p, 0)
    ax.set_yticks([s + 0.5 for s in range(p)], [f"stage {s}\n(layers {s * 8}..{s * 8 + 7})" for s in range(p)],
                  fontsize=10)
    ax.set_xticks([t + 0.5 for t in range(slots)], [str(t) for t in range(slots)], fontsize=10)
    ax.set_xlabel("time slot (one micro-batch forward through one stage)", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    idle = p * slots - p * m
    ax.set_title(f"One pipeline step: p = {p} stages, m = {m} micro-batches, m + p - 1 = {slots} time slots\n"
                 f"idle (hatched): {idle} of {p * slots} stage-slots = (p - 1) / (m + p - 1) = {(p - 1) / slots:.0%}",
                 fontsize=11, loc="left")
    ax.legend(handles=[Patch(facecolor=colors(0), label="micro-batch forward (mb i: rows of the step)"),
                       Patch(facecolor="#eeeeee", hatch="//", edgecolor="#aaaaaa",
                             label="bubble: the stage waits (fill at the start, drain at the end)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=10, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90, facecolor="white", metadata={"Software": None})
    plt.close(fig)
