"""A router in front of 4 replicas, each TP=2 across 2 GPUs (8 GPUs in all), routing by prompt prefix (chapter 12b)."""

from __future__ import annotations

from pathlib import Path

NAME = "replicas_router"

A, B, C = "#f4a259", "#5b8def", "#8cc084"  # three system prompts' colours


def _box(ax, x, y, w, h, text="", fc="white", ec="#333", fs=11, weight="normal", lw=1.4, va="center"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=fc, ec=ec, lw=lw))
    if text:
        ty = y + h / 2 if va == "center" else y + h - 0.22
        ax.text(x + w / 2, ty, text, ha="center", va="center", fontsize=fs, weight=weight)


def _request(ax, x, y, colour, label, user):
    _box(ax, x, y, 1.1, 0.5, label, fc=colour, fs=10)
    _box(ax, x + 1.15, y, 0.9, 0.5, user, fc="#eee", fs=10)


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5.8))
    ax.set_xlim(0, 12)
    ax.set_ylim(0.25, 6.45)
    ax.axis("off")
    fig.patch.set_facecolor("white")

    ax.text(6, 6.15, "Replicas behind a router: 8 GPUs, TP = 2  ->  8 / 2 = 4 replicas", ha="center",
            fontsize=15, weight="bold")

    # requests
    ax.text(1.05, 5.45, "requests (prompt = system prompt + user turn)", ha="center", fontsize=10)
    reqs = [(A, "system A", "user 1"), (B, "system B", "user 2"), (A, "system A", "user 3"),
            (C, "system C", "user 4"), (B, "system B", "user 5")]
    ys = [4.7, 3.95, 3.2, 2.45, 1.7]
    for (colour, s, u), y in zip(reqs, ys):
        _request(ax, 0.05, y, colour, s, u)
        ax.annotate("", xy=(2.95, 3.2), xytext=(2.15, y + 0.25),
                    arrowprops=dict(arrowstyle="->", color="#666", lw=1.2))

    # router
    _box(ax, 2.95, 1.45, 3.1, 3.7, "", fc="#f7f7f7", lw=1.8)
    ax.text(4.5, 4.85, "router (API process)", ha="center", fontsize=12, weight="bold")
    ax.text(4.5, 4.5, "DPEngineClient + prefix_aware", ha="center", fontsize=9.5, family="monospace")
    ax.text(4.5, 4.05, "key = hash(first 2 blocks\nof prompt token ids)", ha="center", va="center", fontsize=10)
    table = [("key", "replica"), ("hash(A...)", "0"), ("hash(B...)", "1"), ("hash(C...)", "2")]
    for k, (key, rep) in enumerate(table):
        y = 3.35 - 0.42 * k
        fc = ["#ddd", A, B, C][k]
        _box(ax, 3.3, y, 1.55, 0.36, key, fc=fc, fs=10, weight="bold" if k == 0 else "normal", lw=1)
        _box(ax, 4.95, y, 0.8, 0.36, rep, fc=fc, fs=10, weight="bold" if k == 0 else "normal", lw=1)
    ax.text(4.5, 1.75, "new key -> least-loaded replica\nknown key -> its replica", ha="center", va="center",
            fontsize=9.5, style="italic")

    # replicas
    colours = [[A], [B], [C], []]
    for r in range(4):
        y = 4.75 - 1.25 * r
        _box(ax, 7.0, y - 0.15, 4.85, 1.05, "", fc="#fbfbfb", lw=1.6)
        ax.text(7.15, y + 0.72, f"replica {r}", fontsize=11, weight="bold", va="center")
        for g in range(2):
            _box(ax, 8.2 + 1.15 * g, y + 0.42, 1.05, 0.4, f"GPU {2 * r + g}", fc="#e8e0f5", fs=10, lw=1)
        ax.text(11.05, y + 0.62, "TP = 2:\nlayers split", fontsize=9, va="center", ha="center")
        _box(ax, 7.15, y - 0.05, 4.55, 0.36, "", fc="white", lw=1)
        ax.text(7.25, y + 0.13, "prefix cache:", fontsize=9.5, va="center")
        for k, col in enumerate(colours[r]):
            _box(ax, 8.5 + 0.55 * k, y + 0.0, 0.5, 0.26, "", fc=col, lw=0.8)
        if not colours[r]:
            ax.text(8.5, y + 0.13, "(empty: next new prefix comes here)", fontsize=9, va="center", style="italic")
        if r < 3:
            colour = colours[r][0]
            ax.annotate("", xy=(7.0, y + 0.38), xytext=(6.05, 3.2 - 0.1 * r),
                        arrowprops=dict(arrowstyle="-|>", color=colour, lw=2.6))

    ax.text(6, 0.55, "Each replica is a whole copy of the model with its own weights, KV cache, prefix cache and "
            "scheduler.\nRequests sharing a system prompt go to the same replica, so its cached blocks are hit "
            "instead of recomputed.", ha="center", va="center", fontsize=11)
    fig.savefig(path, dpi=100, facecolor="white", metadata={"Software": None})
    plt.close(fig)
