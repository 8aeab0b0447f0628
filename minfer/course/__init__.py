"""The course's helpers for lessons and notebooks: machine notes, synchronized timing, figure saving, exercise checks.

What the notebooks import from here is small on purpose: the lesson code lives in `minfer/` itself, and this package
only keeps the notebooks honest (say which machine and how busy it was, synchronize before reading a clock on a GPU,
never rewrite a tracked file unless asked).

    python -m minfer.course exercises --out my-notebooks/   # copies of the notebooks with the solutions blanked
    python -m minfer.course diagrams                        # redraw assets/diagrams/*.png
    python -m minfer.course words chapters/*.md             # prose words and machine paragraphs per lesson
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "assets" / "figures"
DIAGRAMS = ROOT / "assets" / "diagrams"

__all__ = ["machine", "is_busy", "sync", "timed", "save_figure", "passed", "expect_close", "expect_equal"]


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def other_cpu_use(window_s: float = 0.3) -> float | None:
    """How many cores other processes keep busy right now (0.0 to the number of cores), measured over `window_s`
    seconds from /proc/stat minus this process's own use; None where /proc is missing (not Linux).

    The 1-minute load average cannot tell: it also counts this notebook's own work of the last minute, so on an
    idle 2-core machine it reads about 2 right after a timed cell."""
    def sample() -> tuple[int, int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return sum(fields[:8]), idle, int(own[11]) + int(own[12])

    try:
        t0, i0, o0 = sample()
        time.sleep(window_s)
        t1, i1, o1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    if t1 <= t0:
        return 0.0
    busy = (t1 - t0 - (i1 - i0) - (o1 - o0)) / (t1 - t0) * cores
    return max(0.0, round(busy, 2))


def is_busy(threshold: float = 0.5) -> bool:
    """True when other processes keep more than `threshold` cores busy (or, without /proc, when the 1-minute load
    average exceeds the number of cores): they then share the cores, and wall-clock timings mean little."""
    others = other_cpu_use()
    if others is None:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    return others > threshold


def machine(device: str | None = None) -> dict[str, Any]:
    """Print (and return) the machine a timing comes from: CPU model, cores, the 1-minute load average, and the
    GPU when `device` is CUDA. When the machine is busy it says plainly that the timings below may not mean
    anything, so a learner on a shared machine is not misled by a flipped conclusion."""
    load = round(os.getloadavg()[0], 2)
    cores = os.cpu_count() or 1
    others = other_cpu_use()
    busy = others > 0.5 if others is not None else load > cores
    info: dict[str, Any] = {"cpu": cpu_name(), "cores": cores, "load_average_1min": load,
                            "other_processes_cores_busy": others, "busy": busy}
    line = f"machine: {info['cpu']}, {cores} cores, load average {load}"
    if others is not None:
        line += f", other processes busy on {others:.1f} cores now"
    if device is not None and str(device).startswith("cuda"):
        import torch

        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        line += f"; GPU: {info['gpu']}"
    print(line)
    if info["busy"]:
        print(f"WARNING: other work shares this machine (load average {load} on {cores} cores), so the timings "
              "below may be off by 2x or more and their conclusions may flip. "
              "Rerun this cell on a quiet machine before you trust them.")
    return info


def sync(device: Any = None) -> None:
    """Wait for queued GPU work on `device` (a no-op on a CPU): a CUDA kernel launch returns before the kernel
    ends, so a clock read without this measures the launch, not the work."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


def timed(fn: Callable[[], Any], device: Any = None, repeat: int = 3, warmup: int = 1) -> float:
    """The best of `repeat` wall-clock runs of `fn()` in seconds, synchronized on `device` before and after
    each run, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def save_figure(fig: Any, name: str, dpi: int = 110) -> Path | None:
    """Save a notebook's figure as `assets/figures/NAME` only when `envs.MINFER_SAVE_FIGURES` is on (the
    environment variable set to 1), so that running a notebook changes no tracked file; a refresh of the committed
    figures sets it.
    Returns the path written, or None."""
    from minfer import envs

    if not envs.MINFER_SAVE_FIGURES:
        return None
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / name
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    return path


# --- exercise checks ---------------------------------------------------------------------------------------------


def passed(exercise: str) -> None:
    """Print the line a check cell ends with when the learner's answer is right."""
    print(f"{exercise}: correct")


def expect_close(exercise: str, got: Any, expected: Any, *, atol: float = 1e-5, rtol: float = 1e-4,
                 what: str = "your result") -> None:
    """Raise AssertionError naming the exercise when `got` is not `expected` within tolerance (tensors, arrays or
    numbers). The message shows both, so the learner sees how far off they are."""
    import torch

    g = torch.as_tensor(got, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    if g.shape != e.shape:
        raise AssertionError(f"{exercise}: {what} has shape {tuple(g.shape)}, expected {tuple(e.shape)}")
    if not torch.allclose(g, e, atol=atol, rtol=rtol, equal_nan=True):
        diff = (g - e).abs().nan_to_num(nan=float("inf"))
        at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
        where = f" at index {list(at)}" if at else ""
        raise AssertionError(f"{exercise}: {what} differs from minfer's by up to {diff.max().item():.3g}{where}: "
                             f"got {g[at].item():.6g}, expected {e[at].item():.6g} there")


def expect_equal(exercise: str, got: Any, expected: Any, what: str = "your result") -> None:
    """Raise AssertionError naming the exercise when `got != expected` (exact: ints, lists, strings, bool tensors)."""
    import torch

    if isinstance(got, torch.Tensor) or isinstance(expected, torch.Tensor):
        g, e = torch.as_tensor(got), torch.as_tensor(expected)
        if g.shape != e.shape:
            raise AssertionError(f"{exercise}: {what} has shape {tuple(g.shape)}, expected {tuple(e.shape)}")
        if not torch.equal(g, e):
            at = tuple(int(i) for i in (g != e).nonzero()[0])
            raise AssertionError(f"{exercise}: {what} differs first at index {list(at)}: got {g[at].item()!r}, "
                                 f"expected {e[at].item()!r} ({int((g != e).sum())} of {e.numel()} entries differ)")
        return
    if got != expected:
        raise AssertionError(f"{exercise}: {what} is {_short(got)}, expected {_short(expected)}")


def _short(x: Any, n: int = 80) -> str:
    s = repr(x.tolist() if hasattr(x, "tolist") else x)
    return s if len(s) <= n else s[: n - 3] + "..."
