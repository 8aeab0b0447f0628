"""When each pipeline stage really ran: the per-stage start and end of every micro-batch forward, from
`time.perf_counter()` in each rank's own process (CLOCK_MONOTONIC on Linux: one clock for every process of a
machine, so the ranks' intervals line up; across machines they would not). Not a simulation: the bubble
drawn and measured here is the time a stage had no forward to run. On CUDA a forward returns once its kernels
are queued, so the clock is read only after `torch.cuda.synchronize` (`device_clock`): the intervals are the
kernels' execution, not their launch.

    device_clock(device)           the clock both read: perf_counter, after the device's queued work is done
    TimelineRecorder.record(...)   called by `Worker.execute_parallel` around each forward
    bubble_fraction(events)        idle share of the stages' time, per step, from the intervals
    gpipe_bubble(p, m)             the formula (p - 1) / (m + p - 1) (GPipe, arXiv:1811.06965)
    plot_gantt(events, ax)         the Gantt chart: one row per stage, a bar per forward, idle time shaded
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


def device_clock(device: torch.device | str | None = None) -> float:
    """`time.perf_counter()` (seconds) once every kernel queued on `device` has finished: on CUDA it first
    waits with `torch.cuda.synchronize(device)`, so an interval between two readings is execution time, not
    launch time. On a CPU (or None) the clock alone. Inside a CUDA-graph capture (where a synchronize is an
    error) the clock alone too: nothing executes while a graph is captured."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class StageEvent:
    """One micro-batch forward on one rank. `start`/`end`: seconds of `device_clock` (`time.perf_counter()`)."""

    step: int
    stage: int
    tp_rank: int
    micro_batch: int
    start: float
    end: float
    num_tokens: int


class TimelineRecorder:
    """The events of one rank, kept until `drain()` hands them over (the executor collects every rank's)."""

    def __init__(self):
        self.events: list[StageEvent] = []
        self._step = 0

    def next_step(self) -> int:
        self._step += 1
        return self._step

    def record(self, step: int, stage: int, tp_rank: int, micro_batch: int, start: float, end: float,
               num_tokens: int) -> None:
        self.events.append(StageEvent(step, stage, tp_rank, micro_batch, start, end, num_tokens))

    def drain(self) -> list[dict]:
        out, self.events = [asdict(e) for e in self.events], []
        return out


def gpipe_bubble(p: int, m: int) -> float:
    """Idle fraction of p equal stages running m equal micro-batches: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def _as_dicts(events) -> list[dict]:
    return [e if isinstance(e, dict) else asdict(e) for e in events]


def bubble_fraction(events, steps: list[int] | None = None) -> float:
    """Measured idle share: for each step, span = first start to last end over all stages; each stage's
    idle time = span - its busy time; summed over the steps, idle / (stages x span). TP rank 0's events
    stand for their stage. Returns 0.0 for no events."""
    ev = [e for e in _as_dicts(events) if e["tp_rank"] == 0 and (steps is None or e["step"] in steps)]
    idle = total = 0.0
    for step in sorted({e["step"] for e in ev}):
        se = [e for e in ev if e["step"] == step]
        stages = sorted({e["stage"] for e in se})
        span = max(e["end"] for e in se) - min(e["start"] for e in se)
        busy = sum(e["end"] - e["start"] for e in se)
        idle += len(stages) * span - busy
        total += len(stages) * span
    return idle / total if total else 0.0


def plot_gantt(events, ax=None, step: int | None = None, title: str | None = None):
    """Draw one step's timeline (default: the last step) as a Gantt chart on `ax` (a new figure if None):
    a row per stage, a bar per micro-batch forward labelled with its index, the idle time between the
    step's first start and last end shaded. Times in milliseconds from the step's start. Returns the axes."""
    import matplotlib.pyplot as plt

    ev = [e for e in _as_dicts(events) if e["tp_rank"] == 0]
    step = max(e["step"] for e in ev) if step is None else step
    ev = [e for e in ev if e["step"] == step]
    t0, t1 = min(e["start"] for e in ev), max(e["end"] for e in ev)
    stages = sorted({e["stage"] for e in ev})
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.6 * len(stages) + 1.2))
    colors = plt.get_cmap("tab10")
    for s in stages:
        ax.barh(s, (t1 - t0) * 1e3, left=0, height=0.8, color="0.9", hatch="//", edgecolor="0.7")  # idle
        for e in (e for e in ev if e["stage"] == s):
            ax.barh(s, (e["end"] - e["start"]) * 1e3, left=(e["start"] - t0) * 1e3, height=0.8,
                    color=colors(e["micro_batch"] % 10), edgecolor="black")
            ax.text((e["start"] + e["end"] - 2 * t0) * 500, s, str(e["micro_batch"]), ha="center", va="center")
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first forward")
    frac = bubble_fraction(ev)
    ax.set_title(title or f"pipeline step {step}: {len(stages)} stages, "
                 f"{len({e['micro_batch'] for e in ev})} micro-batches, idle (hatched) {frac:.0%}")
    return ax
