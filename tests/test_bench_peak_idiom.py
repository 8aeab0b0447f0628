"""`benchmarks/peak_idiom.py`: the ISA it picks follows /proc/cpuinfo's flags, and its peaks are positive. No speed
is asserted: on a shared CPU only a quiet machine's numbers mean anything."""

import pytest

from tests.benchmark_scripts import load_benchmark

peak = load_benchmark("peak_idiom")

ZEN1 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2 sha_ni"  # Zen 1 and Zen 3 alike: AVX2, no VNNI
ICELAKE = "avx avx2 fma avx512f avx512bw avx512vl avx512_vnni"
ALDERLAKE = "avx avx2 fma avx_vnni"
SKYLAKE_X = "avx avx2 fma avx512f avx512bw avx512vl"


@pytest.mark.parametrize("flags, idiom, fma", [(ZEN1, "avx2", "avx2_fma"), (ICELAKE, "avx512_vnni", "avx512f"),
                                               (ALDERLAKE, "avx_vnni", "avx2_fma"),
                                               (SKYLAKE_X, "avx512bw", "avx512f"), ("sse sse2", "scalar", "scalar")])
def test_isa_from_flags(flags, idiom, fma):
    f = peak.cpu_flags(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert peak.idiom_isa_from_flags(f) == idiom and peak.fma_isa_from_flags(f) == fma


def test_physical_cores_count_smt_siblings_once():
    # 2 cores x 2 SMT threads: CPUs 0 and 2 are core 0's siblings, 1 and 3 core 1's
    text = "".join(f"processor\t: {cpu}\nphysical id\t: 0\ncore id\t\t: {cpu % 2}\n\n" for cpu in range(4))
    assert peak.physical_cores(text, {0, 1, 2, 3}) == 2
    assert peak.physical_cores(text, {0, 2}) == 1
    assert peak.physical_cores("processor\t: 0\n", {0}) is None  # no core ids (some VMs, other ISAs)


@pytest.fixture(scope="module")
def lib():
    if not peak.LIBRARY.available():
        pytest.skip("no C++ compiler with OpenMP here")
    return peak.LIBRARY.load()


def test_measured_peaks_are_positive_and_the_isa_is_the_cpus(lib):
    r = peak.measure(threads=2, seconds=0.02, repeats=1)
    flags = peak.cpu_flags()
    assert r["isa"] == peak.idiom_isa_from_flags(flags) and r["fma_isa"] == peak.fma_isa_from_flags(flags)
    assert r["fma_gflops"] > 0 and r["int8_idiom_gops"] > 0 and r["threads"] == 2
    assert {"theoretical_fma_gflops", "theoretical_int8_idiom_gops", "clock_ghz"} <= set(r)
    if r["clock_ghz"] is None:
        assert r["theoretical_fma_gflops"] is None
    else:
        assert r["theoretical_fma_gflops"] > 0


def test_every_isa_the_cpu_has_runs_and_the_others_are_refused(lib):
    flags = peak.cpu_flags()
    has = {"scalar": True, "avx2": "avx2" in flags, "avx512bw": {"avx512f", "avx512bw"} <= flags,
           "avx_vnni": "avx_vnni" in flags, "avx512_vnni": {"avx512f", "avx512_vnni"} <= flags}
    for isa, present in has.items():
        if present:
            r = peak.measure(threads=1, seconds=0.01, repeats=1, idiom_isa=isa, fma_isa="scalar")
            assert r["isa"] == isa and r["int8_idiom_gops"] > 0
        else:
            with pytest.raises(ValueError, match="lacks"):
                peak.measure(threads=1, seconds=0.01, repeats=1, idiom_isa=isa)
    with pytest.raises(ValueError, match="unknown ISA"):
        peak.measure(idiom_isa="neon")


def test_ops_per_iteration_count_two_per_product(lib):
    # 12 zmm FMA chains x 16 lanes x 2; 12 vpdpbusd zmm x 64 products x 2; 6 AVX2 maddubs idioms x 32 x 2
    assert lib.peak_ops_per_iter(0, peak.FMA_ISAS["avx512f"]) == 12 * 16 * 2
    assert lib.peak_ops_per_iter(1, peak.IDIOM_ISAS["avx512_vnni"]) == 12 * 64 * 2
    assert lib.peak_ops_per_iter(1, peak.IDIOM_ISAS["avx2"]) == 6 * 32 * 2


def test_the_qgemm_block_ceiling_is_measured_for_each_simd_path_the_cpu_has(lib):
    r = peak.measure(threads=1, seconds=0.01, repeats=1)
    flags = peak.cpu_flags()
    has = {"avx2": "avx2" in flags, "avx512_vnni": {"avx512f", "avx512_vnni"} <= flags}
    assert set(r["qgemm_ceiling"]) == {isa for isa, present in has.items() if present}
    for row in r["qgemm_ceiling"].values():
        assert row["idiom_gops"] > 0
        for fmt in peak.BLOCK_EPILOGUES:
            assert row[f"{fmt}_gops"] > 0 and row[f"{fmt}_of_idiom"] == round(row[f"{fmt}_gops"] / row["idiom_gops"], 3)
    # a tile of 6 rows x 32 columns x one block of 32 (VNNI), 4 x 16 x 32 (AVX2), 2 operations per product
    assert lib.peak_ops_per_iter(2, peak.IDIOM_ISAS["avx512_vnni"]) == 6 * 32 * 32 * 2
    assert lib.peak_ops_per_iter(4, peak.IDIOM_ISAS["avx2"]) == 4 * 16 * 32 * 2
    assert lib.peak_run(2, peak.IDIOM_ISAS["avx512bw"], 1, 1, None) == -1.0  # not one of qgemm's paths
