"""FlashAttention's tiling: one program owns a tile of queries, walks over the key/value tiles, and keeps a
running max m, sum l and output o on chip (the online-softmax recurrence); tiles above the causal diagonal are
never loaded. Lesson 04 (`minfer/kernels/flash_attention.py`, `_flash_attn_varlen_kernel`, `_attend_tile`)."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas, save

NAME = "flash_tiling"


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    fig, ax = canvas((14, 6.2), (0, 14), (0, 6.2), full=True, facecolor="white")

    n, cell = 4, 0.95          # 4 x 4 tiles of the score matrix S = Q K^T
    x0, y0 = 2.2, 0.55        # bottom-left corner of the matrix
    row = 2                    # the query tile this picture follows
    colors = {"skip": "#eeeeee", "full": "#9ecae1", "mask": "#fdae6b"}
    for i in range(n):         # i: query tile (top row = 0)
        for j in range(n):     # j: key tile
            kind = "skip" if j > i else ("mask" if j == i else "full")
            y = y0 + (n - 1 - i) * cell
            ax.add_patch(Rectangle((x0 + j * cell, y), cell, cell, facecolor=colors[kind], edgecolor="gray", lw=1))
            if i == row and j <= i:
                ax.text(x0 + (j + 0.5) * cell, y + cell / 2, f"step {j + 1}", ha="center", va="center", fontsize=11)
    ax.plot([x0, x0 + n * cell], [y0 + n * cell, y0], "k--", lw=1)
    yr = y0 + (n - 1 - row) * cell
    ax.add_patch(Rectangle((x0, yr), n * cell, cell, fill=False, edgecolor="black", lw=2.5))
    ax.add_patch(FancyArrowPatch((x0 + 0.1, yr - 0.12), (x0 + 3 * cell - 0.1, yr - 0.12), arrowstyle="-|>",
                                 mutation_scale=16, lw=1.6, color="black"))
    ax.text(x0 + n * cell / 2, y0 + n * cell + 0.55, "scores S = Q K^T (never stored)", ha="center", fontsize=13,
            weight="bold")
    ax.text(x0 + n * cell / 2, y0 + n * cell + 0.18, "key tiles K_j, V_j (BLOCK_N keys each)  →", ha="center",
            fontsize=11)
    ax.text(x0 - 0.12, y0 + n * cell - 0.75, "query tiles Q_i\n(BLOCK_M queries\neach)  ↓", ha="right", va="center",
            fontsize=11)
    ax.text(x0 - 0.12, yr + cell / 2, "program\nfor Q_3 ▶", ha="right", va="center", fontsize=11, weight="bold")
    ax.text(x0 + n * cell / 2, y0 - 0.35, "the program walks left to right, one key tile per step", ha="center",
            fontsize=10.5)

    lx = x0 + n * cell + 0.3  # legend
    for k, (kind, label) in enumerate([("full", "loaded, no mask"), ("mask", "loaded, masked (diagonal)"),
                                       ("skip", "skipped (above the diagonal)")]):
        yy = y0 + n * cell - 0.35 - 0.45 * k
        ax.add_patch(Rectangle((lx, yy), 0.3, 0.3, facecolor=colors[kind], edgecolor="gray"))
        ax.text(lx + 0.42, yy + 0.15, label, va="center", fontsize=11)

    # HBM vs on-chip memory
    bx, by = lx, 0.45
    ax.add_patch(FancyBboxPatch((bx, by), 3.15, 1.95, boxstyle="round,pad=0.05", facecolor="#f7fbff",
                                edgecolor="#3182bd", lw=1.5))
    ax.text(bx + 1.575, by + 1.7, "on chip (registers / SRAM)", ha="center", fontsize=11.5, weight="bold",
            color="#08519c")
    ax.text(bx + 1.575, by + 1.05, "Q_i  (loaded once)\nm, l: one per query row\no: BLOCK_M × d accumulator",
            ha="center", va="center", fontsize=11)
    ax.text(bx + 1.575, by + 0.25, "HBM: Q, K, V, O only; no L×L matrix", ha="center", fontsize=10.5,
            color="#555555")

    # the recurrence
    rx, ry = 9.65, 0.45
    ax.add_patch(FancyBboxPatch((rx, ry), 4.2, 5.2, boxstyle="round,pad=0.05", facecolor="#fff8f0",
                                edgecolor="#e6550d", lw=1.5))
    ax.text(rx + 2.1, ry + 4.85, "online softmax, per key tile j", ha="center", fontsize=13, weight="bold",
            color="#a63603")
    lines = [
        ("start:", "m = −inf,  l = 0,  o = 0"),
        ("scores:", "s = Q_i K_jᵀ · scale"),
        ("new max:", "m' = max(m, rowmax s)"),
        ("rescale:", "α = exp(m − m')"),
        ("sum:", "l = α·l + Σ exp(s − m')"),
        ("output:", "o = α·o + exp(s − m') V_j"),
        ("", "m = m'"),
        ("end:", "O_i = o / l   (one division)"),
    ]
    for k, (head, body) in enumerate(lines):
        yy = ry + 4.3 - 0.52 * k
        ax.text(rx + 0.2, yy, head, fontsize=11.5, color="#555555", va="center")
        ax.text(rx + 1.25, yy, body, fontsize=12.5, family="monospace", va="center")
    ax.text(rx + 2.1, ry + 0.1, "α < 1 corrects what was summed\nagainst the old, smaller max", ha="center",
            fontsize=10.5, color="#555555")
    ax.add_patch(FancyArrowPatch((x0 + n * cell + 0.1, yr + cell / 2), (rx - 0.1, ry + 2.9), arrowstyle="-|>",
                                 mutation_scale=16, lw=1.4, color="#a63603", connectionstyle="arc3,rad=-0.15"))
    save(fig, path, dpi=100)
