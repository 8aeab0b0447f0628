"""Tensor parallelism on one MLP over 2 ranks: W1 split by output rows (column-parallel, no communication),
the activation applied to each rank's slice, W2 split by input columns (row-parallel, a partial sum per rank),
one all-reduce adds the partial sums. Chapter 12."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas

NAME = "tensor_parallel"
RANK = ("#4e79a7", "#f28e2b")


def draw(path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle, FancyArrowPatch, Rectangle

    fig, ax = canvas((11, 7.0), (0, 22), (0, 13.6), facecolor="white")

    def mat(x, y, w, h, color, label, sub="", alpha=0.85, text_color="white"):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", alpha=alpha, linewidth=1))
        ax.text(x + w / 2, y + h / 2 + (0.25 if sub else 0), label, ha="center", va="center", fontsize=11,
                color=text_color, weight="bold")
        if sub:
            ax.text(x + w / 2, y + h / 2 - 0.35, sub, ha="center", va="center", fontsize=9, color=text_color)

    def arrow(a, b, color="black"):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=14, color=color, linewidth=1.4))

    ax.text(0.2, 13.4, "y = act(x W1ᵀ) W2ᵀ on tp = 2 ranks: column-parallel W1, row-parallel W2, one all-reduce",
            fontsize=12, va="top")
    ax.text(6.1, 12.3, "column-parallel W1\n(split by output rows)", ha="center", va="top", fontsize=10)
    ax.text(10.4, 12.3, "each rank's slice\nof the activation", ha="center", va="top", fontsize=10)
    ax.text(14.2, 12.3, "row-parallel W2\n(split by input columns)", ha="center", va="top", fontsize=10)
    ax.text(17.9, 12.3, "partial sums\n[T, H] each", ha="center", va="top", fontsize=10)

    mat(0.4, 4.4, 2.2, 2.0, "#888888", "x", "[T, H]\nevery rank")
    for r, yc in ((0, 7.6), (1, 1.6)):
        c = RANK[r]
        ax.add_patch(Rectangle((4.3, yc - 0.3), 15.2, 3.4, facecolor=c, alpha=0.07, edgecolor=c, linewidth=1.5,
                               linestyle="--"))
        ax.text(4.45, yc + 2.85, f"rank {r}", fontsize=11, color=c, weight="bold", va="center")
        mat(5.0, yc, 2.2, 2.4, c, f"W1[{r}]", f"[I/2, H]\nrows {'0..I/2' if r == 0 else 'I/2..I'}")
        mat(9.6, yc + 0.2, 1.6, 2.0, c, f"h{r}", "[T, I/2]")
        mat(13.0, yc + 0.2, 2.4, 2.0, c, f"W2[{r}]", f"[H, I/2]\ncols {'0..I/2' if r == 0 else 'I/2..I'}")
        mat(17.2, yc + 0.2, 1.4, 2.0, c, f"y{r}", "[T, H]")
        arrow((2.7, 5.4), (4.9, yc + 1.2))
        arrow((7.3, yc + 1.2), (9.5, yc + 1.2))
        ax.text(8.3, yc + 1.45, "x W1[r]ᵀ, act", ha="center", va="bottom", fontsize=9)
        arrow((11.3, yc + 1.2), (12.9, yc + 1.2))
        arrow((15.5, yc + 1.2), (17.1, yc + 1.2))
        arrow((18.7, yc + 1.2), (20.0, 5.6 if r == 0 else 5.0))
    ax.add_patch(Circle((20.6, 5.3), 0.75, facecolor="#e15759", edgecolor="black"))
    ax.text(20.6, 5.3, "all-\nreduce\n(sum)", ha="center", va="center", fontsize=8.5, color="white", weight="bold")
    ax.text(20.6, 3.9, "y = y0 + y1\non every rank", ha="center", va="top", fontsize=10)
    ax.text(0.2, 0.5, "No communication until the all-reduce: act works element by element on each slice.\n"
            "A Llama layer has two such pairs (q|k|v → o_proj by heads, gate|up → down), so two all-reduces "
            "per layer.", fontsize=9.5, va="center")
    fig.savefig(path, dpi=105, facecolor="white", bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
