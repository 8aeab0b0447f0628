"""glibc malloc settings for a CPU engine: keep the large buffers a forward frees, for the next forward.

A prefill step on the CPU allocates and frees tens of tensors of 1-25 MB per layer (a 1,500-token step's
gate|up output is 18 MB of float32). glibc serves blocks above its mmap threshold (128 KB at start, raised
dynamically up to 32 MB as large blocks are freed) with a fresh `mmap`, and returns freed memory at the top of
the heap to the kernel past its trim threshold; the next step's tensors then fault their pages in again,
each page zeroed by the kernel. Fixing the mmap threshold at its maximum (32 MB) and the trim threshold high
keeps that memory in the process: less prefill time, less system CPU time and a lower TTFT on the serving
workload of `benchmarks/wave_profile.py` (lab notes 9b (chapters/lab/09b-cpu-performance.md) §9b.4 has the measurements).

The cost: the process keeps its peak heap (what the largest step needed) instead of giving it back between
steps; an engine that holds a KV pool of gigabytes anyway does not miss it. This is what vLLM's CPU backend
gets by preloading tcmalloc (its installation guide's advice); minfer asks glibc instead of adding a library.

`keep_freed_memory()` is called by the platform (`CpuPlatform.configure_allocator`) of a CPU engine's worker
(offline `LLM` and the server's engine process). It changes nothing where the user set glibc's own variables (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, or a `glibc.malloc.*` tunable in `GLIBC_TUNABLES`: theirs win), where
`envs.MINFER_MALLOC_TUNING` is 0 (or false / no / off), or off glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys

import minfer.envs as envs

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # an int: effectively "never trim"

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring), once per process. Returns True when they are
    set (now or by an earlier call), False where it leaves malloc as it is (another libc, the user's own
    settings, `envs.MINFER_MALLOC_TUNING` off)."""
    global _done
    if _done:
        return True
    if not envs.MINFER_MALLOC_TUNING:
        return False
    if not sys.platform.startswith("linux"):
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):  # the user tuned malloc: theirs win
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl's mallopt does nothing)
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _done
