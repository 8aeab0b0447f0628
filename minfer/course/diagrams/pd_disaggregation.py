"""Prefill/decode disaggregation: a prefill pool computes the prompt's KV cache and its first token, the KV
blocks are transferred to a decode pool, which generates the rest. Above it, why: on one colocated device a
long prefill step stalls every running decode. Chapter 6."""

from __future__ import annotations

from pathlib import Path

NAME = "pd_disaggregation"
PREFILL, DECODE, KV = "#f28e2b", "#4e79a7", "#59a14f"


def draw(path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    fig = plt.figure(figsize=(11, 7.2), facecolor="white")
    top = fig.add_axes((0.04, 0.68, 0.92, 0.27))
    bot = fig.add_axes((0.02, 0.02, 0.96, 0.62))

    # -- top: colocated, one device alternates ---------------------------------------------------------
    top.set_xlim(0, 22)
    top.set_ylim(0, 3)
    top.axis("off")
    top.text(0, 2.75, "Colocated: one device runs both phases, so a long prefill step stalls every running decode",
             fontsize=11, va="top")
    x = 0.0
    for kind, w in [("d", 1), ("d", 1), ("d", 1), ("P", 7), ("d", 1), ("d", 1), ("d", 1), ("P", 3), ("d", 1)]:
        color = PREFILL if kind == "P" else DECODE
        top.add_patch(Rectangle((x + 0.05, 0.9), w - 0.1, 1.0, facecolor=color, edgecolor="white"))
        top.text(x + w / 2, 1.4, "prefill: a new\n2,000-token prompt" if kind == "P" and w == 7 else
                 ("prefill" if kind == "P" else "d"), ha="center", va="center", color="white", fontsize=10)
        x += w
    top.add_patch(FancyArrowPatch((3.0, 0.55), (10.0, 0.55), arrowstyle="<->", mutation_scale=14, color="black"))
    top.text(6.5, 0.2, "one inter-token gap of every running stream", ha="center", va="center", fontsize=10)
    top.text(21.8, 1.4, "compute-bound prefill and\nmemory-bound decode\ninterfere", ha="right", va="center",
             fontsize=10, style="italic")

    # -- bottom: two pools -----------------------------------------------------------------------------
    bot.set_xlim(0, 22)
    bot.set_ylim(0, 10)
    bot.axis("off")
    bot.text(0.2, 9.7, "Disaggregated: separate pools, each sized and tuned for its phase", fontsize=11, va="top")

    def box(x, y, w, h, color, title, lines):
        bot.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.15", facecolor=color, alpha=0.15,
                                     edgecolor=color, linewidth=2))
        bot.text(x + w / 2, y + h - 0.35, title, ha="center", va="top", fontsize=12, weight="bold")
        bot.text(x + w / 2, y + h - 1.15, "\n".join(lines), ha="center", va="top", fontsize=10, linespacing=1.5)

    def arrow(a, b, text="", color="black", dy=0.3, lw=1.8):
        bot.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=18, color=color, linewidth=lw))
        if text:
            bot.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + dy, text, ha="center", va="bottom", fontsize=10)

    def gpus(x0, color):  # a pool's three GPUs, in a row from x0
        for i in range(3):
            bot.add_patch(Rectangle((x0 + i * 1.6, 2.5), 1.2, 0.9, facecolor=color, edgecolor="white"))
            bot.text(x0 + 0.6 + i * 1.6, 2.95, f"GPU {i}", ha="center", va="center", color="white", fontsize=9)

    bot.add_patch(FancyBboxPatch((0.3, 3.9), 2.4, 1.6, boxstyle="round,pad=0.15", facecolor="white",
                                 edgecolor="black"))
    bot.text(1.5, 4.7, "router\n(requests in)", ha="center", va="center", fontsize=10)
    box(4.2, 2.0, 6.0, 6.0, PREFILL, "prefill pool", [
        "whole prompts, big batches of tokens",
        "compute-bound: matrix x matrix",
        "tuned for TTFT",
        "writes the prompt's KV cache",
        "and samples the first token"])
    gpus(5.0, PREFILL)
    box(14.8, 2.0, 6.6, 6.0, DECODE, "decode pool", [
        "many sequences, one token each",
        "memory-bound: reads weights + KV",
        "tuned for ITL, large batches",
        "holds the KV of every stream"])
    gpus(15.7, DECODE)
    arrow((2.9, 4.7), (4.1, 4.7), "prompt", dy=0.25)
    arrow((10.4, 5.6), (14.6, 5.6), color=KV, lw=3.5)
    bot.text(12.5, 6.0, "KV cache transfer", ha="center", va="bottom", fontsize=11, weight="bold", color=KV)
    bot.text(12.5, 5.2, "bytes = layers x prompt tokens\nx kv_heads x head_dim x 2 x dtype\n"
             "over NVLink, RDMA or PCIe", ha="center", va="top", fontsize=9.5, linespacing=1.4)
    arrow((18.1, 1.8), (18.1, 0.6))
    bot.text(18.3, 1.0, "tokens stream to the user", ha="left", va="center", fontsize=10)
    bot.text(0.3, 0.9, "Works when the KV transfer is short next to the prefill that produced it\n"
             "(DistServe, Splitwise, Mooncake; vLLM's disaggregated prefill, SGLang's PD)",
             ha="left", va="center", fontsize=10, style="italic")
    fig.savefig(path, dpi=90, facecolor="white", metadata={"Software": None})
    plt.close(fig)
