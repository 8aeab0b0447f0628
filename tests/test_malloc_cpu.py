"""glibc malloc tuning of a CPU engine (minfer/cpu/malloc.py): set once, off on request, the user's settings win.
What it is for (less page faulting, faster prefill) is a measurement, `benchmarks/wave_profile.py`, not a test:
a small probe's fault counts moved too little and too unevenly to assert on."""

import os
import subprocess
import sys

import pytest

PROBE = r"""
from minfer.cpu.malloc import keep_freed_memory
print(keep_freed_memory(), keep_freed_memory())
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def _probe(**env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "MINFER_MALLOC"))}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_tuning_is_set_once_and_can_be_turned_off():
    import ctypes

    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("not glibc")
    assert _probe() == "True True"
    assert _probe(MINFER_MALLOC_TUNING="0") == "False False"
    assert _probe(MINFER_MALLOC_TUNING="off") == "False False"


def test_the_users_own_malloc_settings_win():
    assert _probe(MALLOC_TRIM_THRESHOLD_="1000000") == "False False"
    assert _probe(MALLOC_MMAP_THRESHOLD_="1000000") == "False False"
    assert _probe(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536") == "False False"
