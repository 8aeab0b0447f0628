"""Chapter 9: the API server process and the engine-core process, joined by two sockets, and the engine's step loop."""

from __future__ import annotations

from pathlib import Path

from minfer.course.diagrams._canvas import canvas

NAME = "serving_processes"


def draw(path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = canvas((14.5, 6.6), (0, 28.5), (0, 11.4), facecolor="white")

    def box(x, y, w, h, text, fc, ec="#333", size=12.5, weight="normal"):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.08,rounding_size=0.25", fc=fc, ec=ec, lw=1.4))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)

    def arrow(x0, y0, x1, y1, color="#333", rad=0.0):
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=18, lw=1.8,
                                     color=color, connectionstyle=f"arc3,rad={rad}"))

    # the two processes
    ax.add_patch(FancyBboxPatch((0.3, 0.4), 10.2, 9.8, boxstyle="round,pad=0.1,rounding_size=0.3", fc="#eef4fb",
                                ec="#4a78b0", lw=2))
    ax.text(5.4, 10.6, "API server process (asyncio)", ha="center", fontsize=16, weight="bold", color="#24507f")
    ax.add_patch(FancyBboxPatch((17.3, 0.4), 10.2, 9.8, boxstyle="round,pad=0.1,rounding_size=0.3", fc="#eef8ee",
                                ec="#3d8b3d", lw=2))
    ax.text(22.4, 10.6, "engine-core process", ha="center", fontsize=16, weight="bold", color="#276227")

    # the API side, top to bottom
    box(0.9, 7.9, 9.0, 1.7, "HTTP handlers for many clients (OpenAI API):\nparse, check limits, template, tokenize",
        "#ffffff")
    box(0.9, 4.9, 9.0, 1.9, "MPEngineClient: sends add / abort;\nreceiver thread: appends each\n"
        "step's deltas to the request's output", "#ffffff")
    box(0.9, 1.0, 9.0, 2.8, "one asyncio queue per request\n-> SSE stream: a 'data:' event per step\n"
        "-> errors in OpenAI's shape\n/metrics, /health", "#ffffff", size=12)
    arrow(5.4, 7.9, 5.4, 6.8)
    arrow(5.4, 4.9, 5.4, 3.8)
    ax.text(5.6, 4.35, "call_soon_threadsafe", fontsize=11.5, color="#555")

    # the engine side: the step loop
    box(18.0, 7.9, 8.4, 1.5, "1. drain commands:\nadd_request, abort_request", "#ffffff")
    box(18.0, 5.5, 8.4, 1.5, "2. engine.step():\nschedule, forward, sample", "#fff3d0", weight="bold")
    box(18.0, 3.1, 8.4, 1.5, "3. encode_step:\nnew tokens and text of each request", "#ffffff")
    box(18.0, 0.9, 8.4, 1.5, "owns the LLMEngine: scheduler,\nblock manager, KV pool, weights", "#e3f0e3", size=12)
    arrow(22.2, 7.9, 22.2, 7.0)
    arrow(22.2, 5.5, 22.2, 4.6)
    arrow(26.4, 3.85, 26.4, 8.65, color="#276227", rad=0.55)
    ax.text(28.25, 6.25, "repeat", rotation=90, ha="center", va="center", fontsize=12.5, color="#276227")

    # the sockets between the processes
    arrow(9.9, 6.3, 18.0, 8.5, color="#24507f")
    ax.text(13.9, 8.05, "commands (ZMQ PUSH)\nadd, abort", ha="center", fontsize=12.5, color="#24507f", rotation=0)
    arrow(18.0, 3.85, 9.9, 5.4, color="#276227")
    ax.text(13.9, 3.45, "one message per step\n(ZMQ PULL): deltas only", ha="center", fontsize=12.5, color="#276227")
    fig.savefig(path, dpi=90, facecolor="white", metadata={"Software": None})
    plt.close(fig)
