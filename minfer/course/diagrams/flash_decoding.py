"""Flash-Decoding: one decode query, its KV cache split into chunks, one program per chunk producing a partial
(m_s, l_s, acc_s), and a second kernel merging the partials exactly with log-sum-exp weights. Lesson 04
(`minfer/kernels/paged_decode.py`: `_paged_decode_split_kernel`, `_combine_splits_kernel`)."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas, save

NAME = "flash_decoding"


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    fig, ax = canvas((13, 5.4), (0, 13), (0, 5.4), full=True, facecolor="white")

    ax.text(6.5, 5.0, "Flash-Decoding: split the keys of one query, then merge", ha="center", fontsize=14,
            weight="bold")
    # the query and the KV cache as one long row of tokens
    ax.add_patch(FancyBboxPatch((0.3, 3.75), 1.3, 0.6, boxstyle="round,pad=0.04", facecolor="#dadaeb",
                                edgecolor="#54278f"))
    ax.text(0.95, 4.05, "query q\n(1 token)", ha="center", va="center", fontsize=11)
    x0, w, ntok = 2.2, 9.6, 24
    split_colors = ["#9ecae1", "#a1d99b", "#fdae6b"]
    for t in range(ntok):
        s = t * 3 // ntok
        ax.add_patch(Rectangle((x0 + t * w / ntok, 3.75), w / ntok, 0.6, facecolor=split_colors[s],
                               edgecolor="white", lw=1))
    ax.text(x0 + w / 2, 4.52, "K/V cache of the sequence (context tokens)", ha="center", fontsize=11.5)
    centers = []
    for s in range(3):
        cx = x0 + (s + 0.5) * w / 3
        centers.append(cx)
        ax.add_patch(FancyArrowPatch((cx, 3.7), (cx, 3.05), arrowstyle="-|>", mutation_scale=15, lw=1.4))
        ax.add_patch(FancyBboxPatch((cx - 1.35, 2.0), 2.7, 1.0, boxstyle="round,pad=0.04",
                                    facecolor=split_colors[s], edgecolor="gray"))
        ax.text(cx, 2.68, f"program s = {s + 1}", ha="center", fontsize=11.5, weight="bold")
        ax.text(cx, 2.25, f"m_{s + 1} = max score\nl_{s + 1} = Σ exp(score − m_{s + 1}),  acc_{s + 1}", ha="center",
                va="center", fontsize=10)
        ax.add_patch(FancyArrowPatch((cx, 1.95), (6.95 + (s - 1) * 1.2, 1.32), arrowstyle="-|>", mutation_scale=15,
                                     lw=1.4))
    ax.add_patch(FancyBboxPatch((2.9, 0.15), 8.1, 1.1, boxstyle="round,pad=0.05", facecolor="#fff8f0",
                                edgecolor="#e6550d", lw=1.5))
    ax.text(6.95, 0.92, "merge (combine_splits):  M = max_s m_s,   L = Σ_s l_s · exp(m_s − M)", ha="center",
            fontsize=11.5, family="monospace")
    ax.text(6.95, 0.45, "O = Σ_s acc_s · exp(m_s − M) / L        (exact: M + log L = log-sum-exp)",
            ha="center", fontsize=11.5, family="monospace")
    ax.text(0.3, 2.5, "grid:\nbatch × heads\n× splits", fontsize=11, va="center", color="#555555")
    save(fig, path, dpi=100)
