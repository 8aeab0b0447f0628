"""The one builder and loader of the CPU wing's C++ libraries (`minfer/cpu/csrc/`).

Each kernel is a C++ file of plain `extern "C"` functions. `CppLibrary` builds it with torch's extension
builder (`torch.utils.cpp_extension.load`: ninja, a build cache, a lock between processes), loads it with
`ctypes`, and declares its functions' signatures, so the C++ needs no torch headers and builds in about a
second. A build is cached per checkout, source version (the file and the `*.h` headers beside it) and kind of
CPU (`-march=native` code is built where it runs), under ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR).

Nothing here is imported on the `kernels="reference"` path (`minfer.platform`): that path loads no C++. This
module imports nothing else of minfer: every library of the wing raises a subclass of its `KernelUnavailable`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")

# ctypes spellings the signature tables use.
I32, I64, F32, PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class KernelUnavailable(RuntimeError):
    """A C++ kernel could not be built or loaded here (the message says why: no compiler, no ninja, a compiler
    without OpenMP...). Each library of the CPU wing raises its own subclass."""


def cpu_identity() -> str:
    """The CPU model and its instruction-set flags: code built with -march=native for one CPU may not run on
    another, so a home directory shared between machines gets one build per kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"


def declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list, object]]) -> None:
    """Set `argtypes` and `restype` of each function `name -> (argtypes, restype)` of `lib`."""
    for name, (argtypes, restype) in signatures.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, restype


def announce_first_build(build_name: str, source: Path) -> None:
    """Say on stderr that a kernel is being compiled when no cached build exists: the first start of the server
    compiles several, which takes up to a few minutes on a small machine, and silence would look like a hang."""
    import sys

    from torch.utils import cpp_extension

    try:  # torch's own rule for the folder (root/pyXY_cpu/name); private, so a change in torch only costs the line
        folder = Path(cpp_extension._get_build_directory(build_name, False))
    except Exception:
        return
    if not (folder / f"{build_name}.so").exists():
        print(f"minfer: compiling the CPU kernel {source.name} for this CPU (first use only; cached in {folder.parent})",
              file=sys.stderr, flush=True)


def load_library(name: str, source: Path, cflags: list[str],
                 unavailable: type[Exception] = KernelUnavailable) -> ctypes.CDLL:
    """Build `source` with `cflags` (once per checkout, source version and kind of CPU) and load it.

    Raises:
        `unavailable`: the build or the load failed (the message says why).
    """
    try:
        from torch.utils.cpp_extension import load

        # One build directory per checkout and source version, so that two checkouts (or an old and a new
        # version) used in turn do not keep rebuilding each other's library.
        text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        key = hashlib.sha1(f"{source}\n{cflags}\n{cpu_identity()}\n".encode() + text).hexdigest()[:12]
        announce_first_build(f"{name}_{key}", source)
        path = load(name=f"{name}_{key}", sources=[str(source)], extra_cflags=cflags,
                    extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        return ctypes.CDLL(path)
    except Exception as e:  # a missing compiler/ninja shows up as many different exception types
        raise unavailable(f"building {source.name} failed: {type(e).__name__}: {e}") from e


class CppLibrary:
    """One C++ library of `csrc/`: `load()` builds and loads it once per process (then returns the same
    `CDLL`), `available()` says whether it can be.

    Args:
        name: the build's name (`minfer_<kernel>`).
        source: the file name in `csrc/`.
        cflags: compiler flags (the source's comment says why each).
        signatures: `function -> (argtypes, restype)` of the functions Python calls.
        unavailable: the error `load` raises (a `KernelUnavailable` subclass).
    """

    def __init__(self, name: str, source: str, cflags: list[str], signatures: dict[str, tuple[list, object]],
                 unavailable: type[Exception] = KernelUnavailable):
        self.name, self.source, self.cflags = name, CSRC / source, list(cflags)
        self.signatures, self.unavailable = signatures, unavailable
        # functools.cache on the bound function: `load.cache_clear()` forgets the library (tests use it).
        self.load = functools.cache(self._load)

    def _load(self) -> ctypes.CDLL:
        lib = load_library(self.name, self.source, self.cflags, self.unavailable)
        declare(lib, self.signatures)
        return lib

    def available(self) -> bool:
        """True when the library is built and loadable here (builds it on the first call)."""
        try:
            self.load()
            return True
        except self.unavailable:
            return False
