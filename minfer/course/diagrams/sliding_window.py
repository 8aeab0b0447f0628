"""A sliding window over a paged sequence (chapter 3b): the next query sees the newest W keys, the blocks wholly
behind the window are released to the pool, the block straddling the window's start stays."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas

NAME = "sliding_window"

BS, W, Q, NBLK = 4, 10, 28, 8  # block size, window, next query position (= tokens computed), blocks drawn


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    first_visible = max(Q - W + 1, 0)
    dead = first_visible // BS
    fig, ax = canvas((12, 5.4), (-1.6, 32.5), (-3.6, 5.0), dpi=100)
    fig.patch.set_facecolor("white")

    cw, y = 1.0, 1.0
    for t in range(NBLK * BS):
        if t < Q:
            colour = "#4c78a8" if t >= first_visible else "#c9c9c9"
        elif t == Q:
            colour = "#e45756"
        else:
            colour = "white"
        ax.add_patch(Rectangle((t * cw, y), cw, 1.0, facecolor=colour, edgecolor="#777777", lw=0.6,
                               hatch="///" if t > Q else None))
        if t % 4 == 0 or t in (first_visible, Q):
            ax.text(t * cw + 0.5, y - 0.12, str(t), ha="center", va="top", fontsize=10)
    for b in range(NBLK):
        x = b * BS * cw
        freed = b < dead
        ax.add_patch(Rectangle((x, y), BS * cw, 1.0, facecolor="none", edgecolor="black", lw=2.2))
        ax.text(x + BS * cw / 2, y + 1.25, f"block {b}", ha="center", va="bottom", fontsize=11,
                color="#888888" if freed else "black", weight="normal" if freed else "bold")
        # the block table entry below
        ax.add_patch(Rectangle((x + 0.4, -1.6), BS * cw - 0.8, 0.8, facecolor="#eeeeee" if freed else "#dce8f5",
                               edgecolor="black", lw=1))
        label = "freed" if freed else ("live" if b * BS < Q else "new")
        ax.text(x + BS * cw / 2, -1.2, f"[{b}] {label}", ha="center", va="center", fontsize=10.5,
                color="#777777" if freed else "black")
    ax.text(-1.5, y + 0.5, "keys", ha="left", va="center", fontsize=11, weight="bold")
    ax.text(-1.5, -1.2, "table", ha="left", va="center", fontsize=11, weight="bold")
    # the window bracket
    x0, x1 = first_visible * cw, (Q + 1) * cw
    ax.annotate("", xy=(x0, 3.0), xytext=(x1, 3.0), arrowprops=dict(arrowstyle="<->", lw=1.8, color="#4c78a8"))
    ax.text((x0 + x1) / 2, 3.15, f"window: the query at q = {Q} sees keys {first_visible}..{Q} (W = {W})",
            ha="center", va="bottom", fontsize=11.5, color="#1f4e79")
    ax.add_patch(FancyArrowPatch((Q * cw + 0.5, -0.55), (Q * cw + 0.5, y - 0.45), arrowstyle="-|>", mutation_scale=14,
                                 color="#e45756", lw=1.6))
    ax.text(Q * cw - 0.2, -0.2, "next query", ha="right", va="center", fontsize=10.5, color="#b22222")
    # the dead blocks
    ax.annotate("", xy=(0, 3.0), xytext=(dead * BS * cw, 3.0), arrowprops=dict(arrowstyle="<->", lw=1.4,
                                                                              color="#888888"))
    ax.text(dead * BS * cw / 2, 3.15, "no later query reads these", ha="center", va="bottom", fontsize=11,
            color="#555555")
    ax.text(0, -2.6, f"dead blocks = (q − W + 1) // block_size = ({Q} − {W} + 1) // {BS} = {dead}: "
            f"blocks 0–{dead - 1} go back to the free pool (their table entries stay as placeholders).\n"
            f"Block {dead} straddles the window's start (key {first_visible} is still visible), so it stays; "
            f"a sequence holds at most ceil(W / block_size) + 1 blocks.",
            ha="left", va="top", fontsize=11)
    ax.set_title(f"Sliding window over a paged KV cache: {Q} tokens computed, block size {BS}, window {W}",
                 fontsize=13)
    fig.savefig(path, dpi=100, bbox_inches="tight", facecolor="white", metadata={"Software": None})
    plt.close(fig)
