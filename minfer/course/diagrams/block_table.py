"""The paged KV cache (chapter 3): a pool of physical blocks, two sequences' block tables mapping their logical
blocks to physical ones, a prefix block both reference (ref count 2), and the partly filled last blocks."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas

NAME = "block_table"

BS = 16
SEQS = {  # name: (tokens, block table, colour)
    "A": (41, [3, 6, 1], "#4c78a8"),
    "B": (35, [3, 8, 5], "#f58518"),
}
SHARED, SHARED_COLOUR, NUM_BLOCKS = 3, "#8e6bbf", 10


def _block(ax, x, y, w, h, filled, colour, label, fontsize=12):
    """A block as a box whose left `filled` fraction is coloured (its used slots), the rest hatched (empty)."""
    from matplotlib.patches import Rectangle

    if filled > 0:
        ax.add_patch(Rectangle((x, y), w * filled, h, facecolor=colour, edgecolor="none", alpha=0.85))
    if filled < 1:
        ax.add_patch(Rectangle((x + w * filled, y), w * (1 - filled), h, facecolor="white", edgecolor="#999999",
                               hatch="///", lw=0))
    ax.add_patch(Rectangle((x, y), w, h, facecolor="none", edgecolor="black", lw=1.5))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize,
                color="white" if filled >= 0.6 else "black", weight="bold")


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    fig, ax = canvas((12, 7.6), (0, 12), (0, 7.6), dpi=100)
    fig.patch.set_facecolor("white")

    # the physical pool, in the middle
    pw, ph, px0, py = 0.95, 0.8, 1.3, 3.35
    owner = {}
    for name, (n, table, colour) in SEQS.items():
        for k, b in enumerate(table):
            fill = min(BS, n - k * BS) / BS
            owner.setdefault(b, []).append((name, fill, colour))
    ax.text(0.15, py + ph / 2, "physical\nKV pool", ha="left", va="center", fontsize=12, weight="bold")
    centres = {}
    for b in range(NUM_BLOCKS):
        x = px0 + b * (pw + 0.08)
        centres[b] = (x + pw / 2, py, py + ph)
        if b not in owner:
            from matplotlib.patches import Rectangle
            ax.add_patch(Rectangle((x, py), pw, ph, facecolor="#e8e8e8", edgecolor="#888888", lw=1.2))
            ax.text(x + pw / 2, py + ph / 2, f"{b}", ha="center", va="center", fontsize=12, color="#666666")
            ax.text(x + pw / 2, py - 0.22, "free", ha="center", va="top", fontsize=10, color="#666666")
            continue
        users = owner[b]
        colour = SHARED_COLOUR if b == SHARED else users[0][2]
        _block(ax, x, py, pw, ph, users[0][1], colour, f"{b}")
        ax.text(x + pw / 2, py - 0.22, f"ref {len(users)}", ha="center", va="top", fontsize=10,
                weight="bold" if len(users) > 1 else "normal")
    ax.text(px0 + NUM_BLOCKS * (pw + 0.08) + 0.05, py + ph / 2, f"{BS} slots\nper block", ha="left", va="center",
            fontsize=10)

    # each sequence: its logical blocks and its block table; A above the pool, B below
    lw_, lh = 1.35, 0.7
    for name, (n, table, colour), (y_log, y_tab, up) in zip(
            SEQS, SEQS.values(), ((6.55, 5.45, False), (0.35, 1.45, True))):
        ax.text(0.15, y_log + lh / 2, f"sequence {name}\n{n} tokens", ha="left", va="center", fontsize=12,
                weight="bold", color=colour)
        ax.text(0.15, y_tab + lh / 2, "block table", ha="left", va="center", fontsize=11)
        for k, b in enumerate(table):
            x = 2.0 + k * (lw_ + 0.25)
            fill = min(BS, n - k * BS) / BS
            c = SHARED_COLOUR if b == SHARED else colour
            lo, hi = k * BS, min(n, (k + 1) * BS) - 1
            _block(ax, x, y_log, lw_, lh, fill, c, f"logical {k}", fontsize=11)
            ax.text(x + lw_ / 2, y_log + (lh + 0.08 if not up else -0.08), f"tokens {lo}-{hi}", ha="center",
                    va="bottom" if not up else "top", fontsize=9.5)
            # table entry
            from matplotlib.patches import Rectangle
            ax.add_patch(Rectangle((x + 0.15, y_tab), lw_ - 0.3, lh, facecolor="#f2f2f2", edgecolor="black", lw=1.2))
            ax.text(x + lw_ / 2, y_tab + lh / 2, f"[{k}] = {b}", ha="center", va="center", fontsize=11)
            ax.add_patch(FancyArrowPatch((x + lw_ / 2, y_log if not up else y_log + lh),
                                         (x + lw_ / 2, y_tab + lh if not up else y_tab),
                                         arrowstyle="-|>", mutation_scale=12, color="#555555", lw=1))
            cx, ybot, ytop = centres[b]
            ax.add_patch(FancyArrowPatch((x + lw_ / 2, y_tab if not up else y_tab + lh),
                                         (cx, ytop if not up else ybot - 0.45),
                                         arrowstyle="-|>", mutation_scale=14, color=c, lw=1.8,
                                         connectionstyle="arc3,rad=0.0"))

    # notes on the right
    notes = [
        (6.8, 6.75, "A and B start with the same 16-token prompt:\nboth tables point at block 3 (ref count 2)"),
        (6.8, 5.85, "A's last block (1) holds 9 of 16 slots; the hatched\nslots are internal fragmentation (grey: free blocks)"),
        (6.8, 1.75, "token t lives in block_table[t // 16], offset t % 16\n"
                    "A's token 40: block_table[2] = 1, offset 8\n"
                    "slot_mapping = 1 × 16 + 8 = 24"),
        (6.8, 0.55, "a block frees when its ref count reaches 0;\nthe blocks need not be adjacent"),
    ]
    for x, y, t in notes:
        ax.text(x, y, t, ha="left", va="center", fontsize=11,
                bbox=dict(boxstyle="round,pad=0.35", facecolor="#fbfbf2", edgecolor="#bbbbbb"))
    ax.set_title("Paged KV cache: block tables map each sequence's logical blocks to physical blocks of one pool",
                 fontsize=13, pad=6)
    fig.savefig(path, dpi=100, bbox_inches="tight", facecolor="white", metadata={"Software": None})
    plt.close(fig)
