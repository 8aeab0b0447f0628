"""Group-wise weight quantization and AWQ's per-channel scaling (lesson 05).

Top: one weight row cut into groups of G inputs; each group stores 4-bit codes plus its own scale s and zero z,
so a group's few large weights only coarsen their own group's grid. Bottom: AWQ multiplies weight column j by
s_j and divides input channel j by s_j: the product is unchanged, and the salient channel's weights (large
activations) get a finer share of the grid.
"""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas

NAME = "quant_groups"


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, ax = canvas((10, 6.2), (0, 20), (0, 12.4), dpi=100)
    fig.patch.set_facecolor("white")


    colors = ["#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc"]
    # --- top: one row, 4 groups of G = 4 weights (a real row has G = 32..128) ---
    ax.text(0.2, 11.8, "1. Group-wise INT4: one weight row W[n, :] cut into groups of G inputs",
            fontsize=13, weight="bold", va="center")
    w = [0.12, -0.30, 0.05, 0.21, 0.02, 0.01, -0.03, 0.04, 1.90, -0.20, 0.10, 0.33, -0.08, 0.15, -0.11, 0.06]
    x0, y0, cw, ch = 1.4, 9.4, 1.08, 1.0
    for i, v in enumerate(w):
        g = i // 4
        ax.add_patch(Rectangle((x0 + i * cw, y0), cw, ch, facecolor=colors[g], edgecolor="black", lw=1))
        ax.text(x0 + (i + 0.5) * cw, y0 + ch / 2, f"{v:g}", ha="center", va="center", fontsize=9)
    ax.text(0.2, y0 + ch / 2, "w", fontsize=12, va="center", style="italic")
    for g in range(4):
        cx = x0 + (g * 4 + 2) * cw
        ax.add_patch(FancyArrowPatch((cx, y0 - 0.05), (cx, y0 - 0.75), arrowstyle="-|>", mutation_scale=14, lw=1.2))
        ax.add_patch(Rectangle((cx - 2.0, y0 - 1.95), 4.0, 1.15, facecolor=colors[g], edgecolor="black", lw=1))
        ax.text(cx, y0 - 1.2, f"group {g}: 4 codes (4-bit)", ha="center", va="center", fontsize=8.5)
        ax.text(cx, y0 - 1.65, "+ scale s + zero z", ha="center", va="center", fontsize=8.5)
    ax.text(x0 + 8.5 * cw, y0 + ch + 0.3, "the outlier 1.9 widens only group 2's step s = (max - min) / 15",
            ha="center", fontsize=10, color="#990000")
    ax.text(0.2, 6.85, "w_hat = (q - 8) s + z    bytes/weight = 0.5 + (2 + 2) / G  (G = 64: 0.5625; float32: 4)",
            fontsize=11, family="monospace")

    # --- bottom: AWQ ---
    ax.text(0.2, 5.9, "2. AWQ: scale the salient input channel before rounding; the product is unchanged",
            fontsize=13, weight="bold", va="center")
    xs = [0.3, 0.2, 6.0, 0.25]     # mean |x| per input channel; channel 2 is salient
    bx, by = 1.2, 1.0
    ax.text(bx - 0.6, 5.15, "inputs x: mean |x| per channel", fontsize=10)
    for j, v in enumerate(xs):
        h = 0.5 * v if j != 2 else 2.6
        ax.add_patch(Rectangle((bx + j * 1.1, by + 0.6), 0.8, h, facecolor="#f4cccc" if j == 2 else "#cfe2f3",
                               edgecolor="black"))
        ax.text(bx + j * 1.1 + 0.4, by + 0.25, f"ch {j}", ha="center", fontsize=9)
    ax.text(bx + 2 * 1.1 + 1.0, by + 0.6 + 2.2, "salient", ha="left", fontsize=9, color="#990000")

    ax.add_patch(FancyArrowPatch((6.0, 2.9), (8.0, 2.9), arrowstyle="-|>", mutation_scale=18, lw=1.5))
    ax.text(7.0, 3.2, "x_j / s_j", ha="center", fontsize=11)
    ax.text(7.0, 2.35, "(folded into the\nnorm before)", ha="center", fontsize=8.5, va="top")

    ax.add_patch(Rectangle((8.4, 1.2), 4.6, 3.6, facecolor="white", edgecolor="black"))
    for j in range(4):
        ax.add_patch(Rectangle((8.6 + j * 1.1, 1.4), 0.9, 3.2, facecolor="#f4cccc" if j == 2 else "#eeeeee",
                               edgecolor="grey"))
        ax.text(9.05 + j * 1.1, 3.0, f"col {j}\n x s_{j}" if j == 2 else f"col {j}", ha="center", va="center", fontsize=9)
    ax.text(10.7, 5.15, "W: column j x s_j, then quantize", ha="center", fontsize=10)

    ax.add_patch(FancyArrowPatch((13.3, 2.9), (14.6, 2.9), arrowstyle="-|>", mutation_scale=18, lw=1.5))
    ax.text(14.8, 3.55, "y = (x / s) (W s)^T = x W^T", fontsize=11, family="monospace")
    ax.text(14.8, 2.75, "s_j = mean|x_j|^alpha,", fontsize=10)
    ax.text(14.8, 2.25, "alpha searched on a grid", fontsize=10)
    ax.text(14.8, 1.5, "s_j > 1: channel j's weights\nuse more of the 4-bit grid", fontsize=10, color="#990000", va="center")

    fig.savefig(path, dpi=100, facecolor="white", metadata={"Software": None})
    plt.close(fig)
