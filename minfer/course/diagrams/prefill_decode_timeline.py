"""Prefill and decode on one timeline (chapter 1): one wide prefill step over the T prompt tokens, then one decode
step per output token, with the KV cache drawn under each step, growing block by block; TTFT and TPOT marked."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas

NAME = "prefill_decode_timeline"

PROMPT = 8          # prompt tokens in the picture
DECODES = 5         # decode steps drawn
BLOCK = 4           # tokens per KV block


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    prompt_c, out_c, empty_c = "#f4a261", "#5b8fd9", "white"
    fig, ax = canvas((10, 6.4), (-2, 101), (-17.8, 13.2), dpi=100)
    fig.patch.set_facecolor("white")


    # --- the steps on a time axis ---------------------------------------------------------------------------
    y0, h = 4.0, 3.2
    steps = [(0.0, 40.0, f"prefill: one forward, all T = {PROMPT} rows")]
    x = 42.0
    for i in range(DECODES):
        steps.append((x, 10.0, f"decode {i + 1}"))
        x += 11.8 if i < DECODES - 1 else 0
    for k, (x, w, label) in enumerate(steps):
        ax.add_patch(FancyBboxPatch((x, y0), w, h, boxstyle="round,pad=0.02,rounding_size=0.6",
                                    fc="#fde8d7" if k == 0 else "#dde8f8", ec="black", lw=1.2))
        ax.text(x + w / 2, y0 + h - 0.85, label, ha="center", va="center", fontsize=11 if k == 0 else 10)
        if k == 0:  # the prompt's rows inside the prefill box, processed together
            for j in range(PROMPT):
                ax.add_patch(Rectangle((x + 1.6 + j * 4.6, y0 + 0.4), 4.0, 1.2, fc=prompt_c, ec="black", lw=0.6))
                ax.text(x + 1.6 + j * 4.6 + 2.0, y0 + 1.0, f"p{j + 1}", ha="center", va="center", fontsize=10)
        else:
            ax.add_patch(Rectangle((x + w / 2 - 2.0, y0 + 0.4), 4.0, 1.2, fc=out_c, ec="black", lw=0.6))
            ax.text(x + w / 2, y0 + 1.0, f"o{k}", ha="center", va="center", fontsize=10, color="white")
        # the token this step produces, above its end
        cx = x + w - 2.2
        ax.annotate("", xy=(cx, y0 + h + 1.4), xytext=(cx, y0 + h), arrowprops=dict(arrowstyle="->", lw=1.1))
        ax.add_patch(Rectangle((cx - 2.0, y0 + h + 1.4), 4.0, 1.2, fc=out_c, ec="black", lw=0.6))
        ax.text(cx, y0 + h + 2.0, f"o{k + 1}", ha="center", va="center", fontsize=10, color="white")
    ax.text(34.5, y0 + h + 2.0, "first output token", fontsize=10, va="center", ha="right", color="#333333")

    # time axis
    ax.annotate("", xy=(101, 2.8), xytext=(0, 2.8), arrowprops=dict(arrowstyle="->", lw=1.3))
    ax.text(101, 2.2, "time", ha="right", va="top", fontsize=10)
    ax.plot([0, 0], [2.3, 3.3], color="black", lw=1.3)
    ax.text(0, 2.2, "request arrives", ha="left", va="top", fontsize=10)

    # TTFT and TPOT brackets
    def bracket(x0, x1, y, text, color):
        ax.plot([x0, x0], [y - 0.5, y + 0.5], color=color, lw=1.2)
        ax.plot([x1, x1], [y - 0.5, y + 0.5], color=color, lw=1.2)
        ax.annotate("", xy=(x1, y), xytext=(x0, y), arrowprops=dict(arrowstyle="<->", lw=1.5, color=color))
        ax.text((x0 + x1) / 2, y + 0.5, text, ha="center", va="bottom", fontsize=11, color=color, fontweight="bold")

    bracket(0, 40, 10.6, "TTFT (time to first token) = the prefill", "#b5541c")
    bracket(steps[2][0], steps[3][0], 10.6, "TPOT = one decode step", "#1f4e99")

    # --- the KV cache after each step, in blocks of BLOCK tokens ---------------------------------------------
    ax.text(0, 0.6, f"KV cache after each step, one cell per token, drawn in groups of {BLOCK} (every layer holds one like it)",
            fontsize=11, va="center")
    slot_w, slot_h, gap = 2.0, 1.3, 0.4
    for k, (x, w, _) in enumerate(steps):
        tokens = PROMPT + k          # the prefill writes T rows; each decode step appends one
        blocks = -(-tokens // BLOCK)
        bx = x + w / 2 - BLOCK * slot_w / 2
        for b in range(blocks):
            by = -1.0 - b * (slot_h + gap) - slot_h
            for s in range(BLOCK):
                t = b * BLOCK + s
                fc = prompt_c if t < PROMPT else out_c if t < tokens else empty_c
                ax.add_patch(Rectangle((bx + s * slot_w, by), slot_w, slot_h, fc=fc, ec="black", lw=0.6,
                                       ls="-" if t < tokens else ":"))
            ax.add_patch(Rectangle((bx, by), BLOCK * slot_w, slot_h, fill=False, ec="black", lw=1.4))
        ax.text(x + w / 2, -1.0 - 4 * (slot_h + gap) - 0.4, f"{tokens} tokens\n{blocks} blocks",
                ha="center", va="top", fontsize=10)

    ax.text(50, -13.2, "each decode step reads the whole cache and appends one row;\n"
            "a new block is taken only when the last one is full", ha="center", va="center", fontsize=10.5,
            style="italic")
    # legend
    for i, (fc, label) in enumerate(((prompt_c, "prompt token's K/V (prefill)"),
                                     (out_c, "output token's K/V (decode)"),
                                     (empty_c, "free slot"))):
        lx = 2 + i * 36
        ax.add_patch(Rectangle((lx, -16.6), 2.4, 1.2, fc=fc, ec="black", lw=0.6, ls=":" if fc == empty_c else "-"))
        ax.text(lx + 3.2, -16.0, label, va="center", fontsize=10.5)
    ax.set_title("One request: prefill over the prompt, then one decode step per output token", fontsize=13)
    fig.savefig(path, dpi=115, bbox_inches="tight", facecolor="white", metadata={"Software": None})
    plt.close(fig)
