"""This machine's arithmetic peaks, measured: float32 FMA (GFLOP/s) and the integer multiply-add idiom (GOP/s) of
the widest instruction set it has, on every core. Beside `peak_gemm.py` (what torch's float32 GEMM reaches), these
are the ceilings the served verdicts are divided by (`peer_serve.py`), so a result from a Zen 1, a Zen 3 or an
AVX-512 machine reads the same.

    flock /tmp/minfer-bench.lock python3 benchmarks/peak_idiom.py [--threads N] [--seconds 0.3] [--all-isas] [--json PATH]

The kernels (`peak_idiom_cpu.cpp`, built through `minfer.cpu.build`) keep independent accumulators in registers:
float32 FMA on 12 chains (ymm with AVX2 + FMA, zmm with AVX-512F); the integer idiom of the integer GEMMs
(`minfer/cpu/qgemm.py`): vpmaddubsw + vpmaddwd + vpaddd on AVX2 and AVX-512BW, vpdpbusd with AVX-VNNI or
AVX-512 VNNI. The idiom picked is the widest this CPU runs (AVX-512 VNNI > AVX-VNNI > AVX-512BW > AVX2 > scalar).
The idiom alone is not all the integer GEMM does: each block of 32 of K also turns its integer sums into floats
(cvt, the scales' mul, fma), on the same vector ports. So the JSON also records "qgemm_ceiling": the rate of
qgemm's real inner work on one block held in L1 (the register tile, the weight and broadcast loads, the dot
products and the epilogue of each weight format: int8's per-row scale, Q4_0's per-block one, Q4_1's with its
offset), per SIMD path qgemm has (AVX-512 VNNI, AVX2), beside that path's idiom peak: the kernel's measured
ceiling, and what the per-block float scales cost against the bare idiom.

Operations are counted as a GEMM counts them: 2 per FMA lane, 2 per u8 x s8 product. Every OpenMP thread runs the
loop (`--threads`, default: every CPU this process may use); each peak is the best of `--repeats` timed calls of
about `--seconds` each.

Theoretical peaks need the clock and the number of vector units, which differ by microarchitecture: the FMA one is
given when the maximum clock is readable (/sys cpufreq), under the assumption written beside it (2 FMA pipes of the
full vector width per core: Intel since Haswell, AMD since Zen 2 for 256-bit); the idiom's is None (its ports vary
more: one or two 512-bit multipliers, maddubs and maddwd sharing them).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from minfer.cpu.build import I32, I64, PTR, CppLibrary  # noqa: E402

SOURCE = Path(__file__).with_name("peak_idiom_cpu.cpp")
FMA_ISAS = {"scalar": 0, "avx2_fma": 1, "avx512f": 2}
IDIOM_ISAS = {"scalar": 0, "avx2": 1, "avx512bw": 2, "avx_vnni": 3, "avx512_vnni": 4}
# qgemm's block loop (kind 2 + epilogue): the weight formats whose epilogue each one is
BLOCK_EPILOGUES = {"int8": 0, "q4_0": 1, "q4_1": 2}  # per-row scale; per-block scale (also Q8_0); + offset (int4)
BLOCK_ISAS = ("avx512_vnni", "avx2")  # qgemm's SIMD paths
FMA_LANES = {"scalar": 1, "avx2_fma": 8, "avx512f": 16}

# -O3 without -march=native: every ISA's function carries its own target attribute (the .cpp's last comment).
LIBRARY = CppLibrary("minfer_peak_idiom", str(SOURCE), ["-O3", "-fopenmp"], {
    "peak_best_fma_isa": ([], I32), "peak_best_idiom_isa": ([], I32),
    "peak_ops_per_iter": ([I32, I32], I64),
    "peak_run": ([I32, I32, I64, I32, PTR], ctypes.c_double)})


def cpu_flags(text: str | None = None) -> set[str]:
    """The instruction-set flags of /proc/cpuinfo's first "flags" line (`text`: that file's content, for tests)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def idiom_isa_from_flags(flags: set[str]) -> str:
    """The integer idiom ISA a CPU with these /proc/cpuinfo flags runs (the same order as the C++ picks)."""
    if "avx512_vnni" in flags and "avx512f" in flags:
        return "avx512_vnni"
    if "avx_vnni" in flags:
        return "avx_vnni"
    if "avx512bw" in flags and "avx512f" in flags:
        return "avx512bw"
    return "avx2" if "avx2" in flags else "scalar"


def fma_isa_from_flags(flags: set[str]) -> str:
    if "avx512f" in flags:
        return "avx512f"
    return "avx2_fma" if {"avx2", "fma"} <= flags else "scalar"


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def physical_cores(text: str | None = None, cpus: set[int] | None = None) -> int | None:
    """Distinct (physical id, core id) pairs among `cpus` (default: the CPUs this process may use) in /proc/cpuinfo
    (`text`, for tests): two SMT siblings share one core's vector units. None where cpuinfo does not say."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    if cpus is None:
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores, cpu, package = set(), None, "0"
    for line in text.splitlines() + [""]:
        key, _, value = (x.strip() for x in line.partition(":"))
        if key == "processor":
            cpu, package = int(value), "0"
        elif key == "physical id":
            package = value
        elif key == "core id" and cpu is not None and (cpus is None or cpu in cpus):
            cores.add((package, value))
    return len(cores) or None


def max_clock_ghz() -> float | None:
    """The highest clock cpufreq reports for CPU 0 (GHz), or None (no cpufreq here, as in most VMs)."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6
    except (OSError, ValueError):
        return None


def _rate(kind: int, isa: int, threads: int, seconds: float, repeats: int) -> float:
    """Best rate (operations / s) of `repeats` calls sized to about `seconds` each. Raises ValueError for an ISA
    this CPU lacks."""
    lib = LIBRARY.load()
    sink = ctypes.c_double()
    iters = 1 << 12
    while True:  # grow the call until it takes a tenth of the target, then size it to the target
        dt = lib.peak_run(kind, isa, iters, threads, ctypes.byref(sink))
        if dt < 0:
            raise ValueError(f"this CPU lacks ISA {isa} for kind {kind}")
        if dt >= seconds / 10 or iters >= 1 << 40:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / max(dt, 1e-9)))
    best = min(lib.peak_run(kind, isa, iters, threads, ctypes.byref(sink)) for _ in range(repeats))
    return lib.peak_ops_per_iter(kind, isa) * iters * threads / best


def measure(threads: int | None = None, seconds: float = 0.3, repeats: int = 3, fma_isa: str | None = None,
            idiom_isa: str | None = None, all_isas: bool = False) -> dict:
    """Measure the peaks. Returns {"isa": the idiom ISA, "fma_isa", "threads", "fma_gflops" (GFLOP/s),
    "int8_idiom_gops" (GOP/s, 2 per u8 x s8 product), "clock_ghz", "physical_cores_used", "theoretical_fma_gflops",
    "theoretical_int8_idiom_gops", "theoretical_assumes", "load_average_before_after", "qgemm_ceiling": {path:
    {"idiom_gops", "<fmt>_gops", "<fmt>_of_idiom"} for qgemm's SIMD paths this CPU runs, fmt in BLOCK_EPILOGUES}}
    and, with `all_isas`, "int8_idiom_gops_by_isa" for every idiom ISA this CPU runs.

    `fma_isa` / `idiom_isa` force one (names of FMA_ISAS / IDIOM_ISAS; default: the widest this CPU runs).
    Raises `minfer.cpu.build.KernelUnavailable` when the kernel does not build, ValueError for an unknown ISA or
    one this CPU lacks."""
    lib = LIBRARY.load()
    threads = threads or default_threads()
    fma_names = {v: k for k, v in FMA_ISAS.items()}
    idiom_names = {v: k for k, v in IDIOM_ISAS.items()}
    fma = fma_isa or fma_names[lib.peak_best_fma_isa()]
    idiom = idiom_isa or idiom_names[lib.peak_best_idiom_isa()]
    if fma not in FMA_ISAS or idiom not in IDIOM_ISAS:
        raise ValueError(f"unknown ISA: fma {fma!r} (of {list(FMA_ISAS)}), idiom {idiom!r} (of {list(IDIOM_ISAS)})")
    load_before = os.getloadavg()[0]
    res = {"isa": idiom, "fma_isa": fma, "threads": threads,
           "fma_gflops": _rate(0, FMA_ISAS[fma], threads, seconds, repeats) / 1e9,
           "int8_idiom_gops": _rate(1, IDIOM_ISAS[idiom], threads, seconds, repeats) / 1e9}
    if all_isas:
        res["int8_idiom_gops_by_isa"] = {}
        for name, code in IDIOM_ISAS.items():
            try:
                res["int8_idiom_gops_by_isa"][name] = _rate(1, code, threads, seconds, repeats) / 1e9
            except ValueError:
                continue  # not on this CPU
    res["qgemm_ceiling"] = {}
    for name in BLOCK_ISAS:
        try:  # the path's idiom peak: the one measured above where it is the same ISA
            peak = res["int8_idiom_gops"] if name == idiom else _rate(1, IDIOM_ISAS[name], threads, seconds, repeats) / 1e9
        except ValueError:
            continue  # not on this CPU
        row = res["qgemm_ceiling"][name] = {"idiom_gops": peak}
        for fmt, e in BLOCK_EPILOGUES.items():
            row[f"{fmt}_gops"] = _rate(2 + e, IDIOM_ISAS[name], threads, seconds, repeats) / 1e9
            row[f"{fmt}_of_idiom"] = round(row[f"{fmt}_gops"] / peak, 3)
    ghz = max_clock_ghz()
    cores = min(threads, physical_cores() or threads)  # SMT siblings share one core's vector units
    res.update(clock_ghz=ghz, physical_cores_used=cores,
               theoretical_fma_gflops=None if ghz is None else cores * ghz * 2 * FMA_LANES[fma] * 2,
               theoretical_int8_idiom_gops=None,
               theoretical_assumes="2 FMA pipes of the full vector width per physical core used, at the max clock; "
                                   "None where the clock is not readable",
               load_average_before_after=[round(load_before, 2), round(os.getloadavg()[0], 2)])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="OpenMP threads (0: every CPU this process may use)")
    ap.add_argument("--seconds", type=float, default=0.3, help="length of one timed call (s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per peak (the best is kept)")
    ap.add_argument("--all-isas", action="store_true", help="also measure every idiom ISA this CPU runs")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    res = measure(threads=args.threads or None, seconds=args.seconds, repeats=args.repeats, all_isas=args.all_isas)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
