"""Speculative decoding's verification round (lesson 07b): a draft proposes k tokens, the target scores all
k + 1 positions in one forward, the accepted prefix is kept, the first rejected draft is replaced by a token drawn
from the residual max(0, p - q), and when every draft is accepted the target adds a bonus token."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas

NAME = "spec_accept_reject"


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = canvas((11, 6.4), (0, 11), (0, 6.4), facecolor="white")

    def box(x, y, w, h, text, fc, ec="#333333", fs=11, weight="normal", ls="-"):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=fc, ec=ec,
                                    lw=1.4, ls=ls))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, weight=weight)

    def arrow(x0, y0, x1, y1, text=None, dx=0.1):
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#333333"))
        if text:
            ax.text((x0 + x1) / 2 + dx, (y0 + y1) / 2, text, fontsize=9.5, va="center", color="#333333")

    ctx, drf, ok, bad, new, gone = "#e8e8e8", "#cfe2ff", "#c8f0c8", "#ffd0d0", "#ffe9a8", "#f6f6f6"
    w, h, y_top = 0.9, 0.6, 5.3
    ax.text(0.2, 6.1, "1. The draft (cheap) proposes k = 4 tokens, one after another, with probabilities q",
            fontsize=11.5, weight="bold")
    for i, t in enumerate(["The", "cat", "sat"]):
        box(0.3 + i * 1.0, y_top, w, h, t, ctx)
    ax.text(1.8, y_top - 0.25, "context", ha="center", fontsize=9, color="#555555")
    drafts = ["on", "the", "sofa", "and"]
    for i, t in enumerate(drafts):
        box(3.6 + i * 1.0, y_top, w, h, f"d{i + 1}: {t}", drf)
    ax.text(5.1, y_top - 0.25, "drafts d1..d4 (q1..q4)", ha="center", fontsize=9, color="#555555")

    ax.text(0.2, 4.45, "2. The target scores all k + 1 positions in ONE forward", fontsize=11.5, weight="bold")
    box(0.3, 3.65, 7.2, 0.55, "target forward over  [sat, d1, d2, d3, d4]  ->  p1, p2, p3, p4, p5", "#e6dcf5",
        fs=10.5)
    arrow(7.05, y_top - 0.35, 7.05, 4.23)

    ax.text(0.2, 3.2, "3. Verify left to right: accept d_i with probability", fontsize=11.5, weight="bold")
    ax.text(0.45, 2.88, "min(1, p_i(d_i) / q_i(d_i)); stop at the first rejection", fontsize=11, weight="bold")
    y = 1.75
    for i, t in enumerate(["The", "cat", "sat"]):
        box(0.3 + i * 1.0, y, w, h, t, ctx)
    box(3.6, y, w, h, "on", ok)
    box(4.6, y, w, h, "the", ok)
    box(5.6, y, w, h, "sofa", bad)
    box(6.6, y, w, h, "and", gone, ec="#aaaaaa", ls="--")
    ax.text(4.1, y + 0.72, "accept", ha="center", fontsize=9.5, color="#1a7a1a")
    ax.text(5.1, y + 0.72, "accept", ha="center", fontsize=9.5, color="#1a7a1a")
    ax.text(6.05, y + 0.72, "reject", ha="center", fontsize=9.5, color="#b00000")
    ax.text(7.05, y + 0.72, "discarded", ha="center", fontsize=9, color="#777777")
    box(5.6, 0.65, w, h, "mat", new, weight="bold")
    arrow(6.05, y - 0.05, 6.05, 1.3)
    ax.text(0.3, 0.95, "the rejected draft is replaced by a token\ndrawn from  norm(max(0, p3 - q3))",
            fontsize=10.5, va="center")
    ax.text(0.3, 0.2, "emitted: on, the, mat = 2 accepted drafts + 1 target token", fontsize=10.5, weight="bold")

    # right column: all accepted -> bonus token
    ax.plot([7.85, 7.85], [0.1, 4.6], color="#bbbbbb", lw=1)
    ax.text(8.05, 4.45, "If all k drafts are accepted:", fontsize=11.5, weight="bold")
    for i, t in enumerate(["d1", "d2", "d3", "d4"]):
        box(8.1 + i * 0.7, 3.55, 0.6, 0.55, t, ok, fs=10)
    box(9.2, 2.45, 0.9, 0.55, "bonus", new, weight="bold")
    arrow(9.65, 3.5, 9.65, 3.03)
    ax.text(8.05, 2.2, "drawn from p5, which the same\nforward already computed:\nk + 1 tokens for one forward",
            fontsize=10, va="top")
    ax.text(8.05, 0.75, "Greedy decoding: accept d_i\nif and only if d_i = argmax p_i", fontsize=10, va="top",
            color="#444444")
    fig.savefig(path, dpi=90, facecolor="white", metadata={"Software": None})
    plt.close(fig)
