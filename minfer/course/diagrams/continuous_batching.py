"""Static batching (padding, idle slots, a batch drained before the next starts) against continuous batching
(a finished row is refilled at the next step, and a long prompt is cut into chunks that share each step's token
budget with the running decodes). Chapter 6."""

from __future__ import annotations

from pathlib import Path

NAME = "continuous_batching"

# (name, prompt tokens, output tokens): eight requests, arriving together
REQUESTS = [("A", 8, 2), ("B", 6, 8), ("C", 5, 3), ("D", 4, 2), ("E", 14, 3), ("F", 6, 7), ("G", 9, 2), ("H", 5, 3)]
BUDGET, SLOTS, STATIC_B = 12, 4, 4
PREFILL, DECODE, PAD, IDLE = "#f28e2b", "#4e79a7", "#bab0ac", "#eeeeee"


def continuous_schedule():
    """The steps of a chunked-prefill scheduler (running first, then waiting, under BUDGET tokens and SLOTS
    sequences): a list of steps, each {slot: (name, tokens, is_prefill)}."""
    waiting = [dict(name=n, prompt=p, out=o, done=0, made=0) for n, p, o in REQUESTS]
    slots: list[dict | None] = [None] * SLOTS
    steps = []
    while waiting or any(slots):
        budget, step = BUDGET, {}
        for k, r in enumerate(slots):  # running: a decode or the next chunk of a prompt
            if r is None or budget == 0:
                continue
            want = r["prompt"] - r["done"] if r["done"] < r["prompt"] else 1
            n = min(want, budget)
            step[k] = (r["name"], n, r["done"] < r["prompt"])
            budget -= n
        for k in range(SLOTS):  # waiting: fill free slots while the budget lasts
            if slots[k] is None and waiting and budget > 0:
                slots[k] = waiting.pop(0)
                n = min(slots[k]["prompt"], budget)
                step[k] = (slots[k]["name"], n, True)
                budget -= n
        for k, (name, n, pre) in step.items():
            r = slots[k]
            if pre:
                r["done"] += n
                if r["done"] == r["prompt"]:
                    r["made"] += 1  # the prompt's last chunk samples the first token
            else:
                r["made"] += 1
            if r["made"] >= r["out"]:
                slots[k] = None
        steps.append(step)
    return steps


def draw(path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    steps = continuous_schedule()
    static_len = sum(1 + max(o for _, _, o in REQUESTS[i:i + STATIC_B]) - 1 for i in range(0, len(REQUESTS), STATIC_B))
    width = max(static_len, len(steps)) + 1
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(11, 7.6), gridspec_kw=dict(height_ratios=[4, 4, 2.2]),
                                     facecolor="white")

    def cell(ax, x, y, color, text="", hatch=None, frac=1.0, pad_color=None):
        if pad_color is not None and frac < 1.0:
            ax.add_patch(Rectangle((x + 0.04, y + 0.08), 0.92 * (1 - frac), 0.84, facecolor=pad_color,
                                   hatch="///", edgecolor="white"))
            ax.add_patch(Rectangle((x + 0.04 + 0.92 * (1 - frac), y + 0.08), 0.92 * frac, 0.84, facecolor=color,
                                   edgecolor="white"))
        else:
            ax.add_patch(Rectangle((x + 0.04, y + 0.08), 0.92, 0.84, facecolor=color, hatch=hatch,
                                   edgecolor="#999999" if hatch else "white"))
        if text:
            cx = x + 0.04 + 0.92 * (1 - frac / 2) if pad_color is not None else x + 0.5
            ax.text(cx, y + 0.5, text, ha="center", va="center", fontsize=10,
                    color="white" if color in (PREFILL, DECODE) else "black")

    # static batching: one prefill step padded to the batch's longest prompt, then every row decodes until the
    # batch's longest output; the next batch waits for the whole batch
    x0 = 0
    for b in range(0, len(REQUESTS), STATIC_B):
        batch = REQUESTS[b:b + STATIC_B]
        longest_p, longest_o = max(p for _, p, _ in batch), max(o for _, _, o in batch)
        for row, (name, p, o) in enumerate(batch):
            cell(a1, x0, row, PREFILL, name, frac=p / longest_p, pad_color=PAD)
            for t in range(1, longest_o):
                if t < o:
                    cell(a1, x0 + t, row, DECODE, name)
                else:
                    cell(a1, x0 + t, row, IDLE, hatch="xx")
        x0 += longest_o
        a1.axvline(x0, color="black", lw=1.2, ls="--")
    a1.set_title(f"Static batching, batches of {STATIC_B}: prompts padded to the longest, rows idle until the "
                 f"longest output ends ({static_len} steps)", fontsize=11, loc="left")

    # continuous batching with chunked prefill
    for t, step in enumerate(steps):
        for k, (name, n, pre) in step.items():
            cell(a2, t, k, PREFILL if pre else DECODE, f"{name}{n}" if pre else name)
    a2.set_title(f"Continuous batching with chunked prefill: a finished row is refilled at the next step "
                 f"({len(steps)} steps)", fontsize=11, loc="left")

    for ax in (a1, a2):
        ax.set_xlim(0, width)
        ax.set_ylim(SLOTS, 0)
        ax.set_yticks([k + 0.5 for k in range(SLOTS)], [f"row {k}" for k in range(SLOTS)], fontsize=10)
        ax.set_xticks([])
        for s in ax.spines.values():
            s.set_visible(False)

    pre = [sum(n for _, n, p in st.values() if p) for st in steps]
    dec = [sum(n for _, n, p in st.values() if not p) for st in steps]
    xs = [t + 0.5 for t in range(len(steps))]
    a3.bar(xs, dec, 0.9, color=DECODE, label="decode tokens (scheduled first)")
    a3.bar(xs, pre, 0.9, bottom=dec, color=PREFILL, label="prefill chunk tokens (fill what is left)")
    a3.axhline(BUDGET, color="black", ls=":", lw=1.5)
    a3.text(width - 0.2, BUDGET + 0.4, f"token budget per step = {BUDGET}", ha="right", va="bottom", fontsize=10)
    a3.set_xlim(0, width)
    a3.set_ylim(0, BUDGET * 1.45)
    a3.set_xticks(xs, [str(t) for t in range(len(steps))], fontsize=9)
    a3.set_xlabel("engine step", fontsize=10)
    a3.set_ylabel("tokens\nin step", fontsize=10)
    a3.legend(fontsize=9, loc="upper center", ncol=2, frameon=False)
    for s in ("top", "right"):
        a3.spines[s].set_visible(False)

    fig.legend(handles=[Patch(facecolor=PREFILL, label="prefill (C5 = a 5-token chunk of C)"),
                        Patch(facecolor=DECODE, label="decode: one token"),
                        Patch(facecolor=PAD, hatch="///", edgecolor="white", label="padding"),
                        Patch(facecolor=IDLE, hatch="xx", edgecolor="#999999", label="idle slot (waiting)")],
               loc="lower center", ncol=4, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=90, facecolor="white", metadata={"Software": None})
    plt.close(fig)
