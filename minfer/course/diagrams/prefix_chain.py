"""Chapter 11: two prompts, their chained block names, and the KV blocks they share in the pool."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas

NAME = "prefix_chain"


def draw(path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, ax = canvas((14, 6.6), (0, 28), (0, 13.2), facecolor="white")

    shared, own_a, own_b, part = "#cfe3f7", "#fde2c4", "#d9efd2", "#eeeeee"

    def block(x, y, text, fc, w=4.2, h=1.3, size=12.5):
        ax.add_patch(Rectangle((x, y), w, h, fc=fc, ec="#333", lw=1.4))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)

    def arrow(x0, y0, x1, y1, color="#333", rad=0.0, lw=1.6, style="-|>"):
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=16, lw=lw, color=color,
                                     connectionstyle=f"arc3,rad={rad}"))

    xs = [3.2, 8.0, 12.8, 17.6]
    # prompt A
    ax.text(0.2, 11.25, "prompt A", fontsize=14, weight="bold", va="center")
    for x, t, fc in zip(xs, ["system prompt\n(tokens 0-15)", "system prompt\n(tokens 16-31)", "question A\n(tokens 32-47)",
                             "3 tokens"], [shared, shared, own_a, part]):
        block(x, 10.6, t, fc)
    # prompt B
    ax.text(0.2, 6.25, "prompt B", fontsize=14, weight="bold", va="center")
    for x, t, fc in zip(xs, ["system prompt\n(tokens 0-15)", "system prompt\n(tokens 16-31)", "question B\n(tokens 32-47)",
                             "5 tokens"], [shared, shared, own_b, part]):
        block(x, 5.6, t, fc)

    # the names: h_i = hash(h_{i-1}, tokens of block i)
    for row_y, names in ((9.3, ["h0", "h1", "h2 (A)", "no name"]), (7.5, ["h0", "h1", "h2 (B)", "no name"])):
        for x, n in zip(xs, names):
            ax.text(x + 2.1, row_y + 0.1, n, ha="center", va="center", fontsize=12.5,
                    color="#888" if n == "no name" else "#1d3f6e", style="italic" if n == "no name" else "normal")
    for x0, x1 in zip(xs[:2], xs[1:3]):
        for row_y in (9.4, 7.6):
            arrow(x0 + 2.9, row_y, x1 + 1.3, row_y, color="#1d3f6e", lw=1.3)
    ax.text(22.3, 8.45, "name of block i =\nhash(name of block i-1,\n        tokens of block i)\n\npartial blocks: no name",
            fontsize=12.5, va="center", color="#1d3f6e")

    # the pool
    ax.text(0.2, 2.05, "KV pool", fontsize=14, weight="bold", va="center")
    pool_x = [3.2 + 2.5 * i for i in range(6)]
    labels = ["h0", "h1", "h2 (A)", "A's\npartial", "h2 (B)", "B's\npartial"]
    fills = [shared, shared, own_a, part, own_b, part]
    for i, (x, lab, fc) in enumerate(zip(pool_x, labels, fills)):
        block(x, 1.3, f"block {i}\n{lab}", fc, w=2.3, h=1.5, size=11)
    # both prompts' first two blocks point at the same pool blocks
    for src_x, dst in ((xs[0], 0), (xs[1], 1)):
        arrow(src_x + 1.2, 5.6, pool_x[dst] + 0.8, 2.8, color="#2a62a8", lw=2.0)
    arrow(xs[2] + 1.2, 5.6, pool_x[4] + 1.1, 2.8, color="#3d8b3d")
    arrow(xs[3] + 0.8, 5.6, pool_x[5] + 1.1, 2.8, color="#777")
    ax.text(19.2, 2.7, "A ran first: its K/V fill\nblocks 0-3. B finds h0 and h1\nin the cache: its block table\n"
            "points at blocks 0 and 1\n(ref count 2), and B computes\nonly its own 21 tokens.",
            fontsize=12, color="#2a62a8", ha="left", va="center")
    ax.text(14.0, 12.7, "Block size 16: only full blocks are named, and each name covers every token before it",
            ha="center", fontsize=14, weight="bold")
    fig.savefig(path, dpi=90, facecolor="white", metadata={"Software": None})
    plt.close(fig)
