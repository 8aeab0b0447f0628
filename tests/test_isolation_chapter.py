"""Chapter 12c (article §6-5) and its lab notes quote their numbers from `assets/benchmarks/cpu_tenants.json` and
`minfer.parallel.mig`: every table row the lesson or the lab notes print is recomputed here from those sources."""

import json
import re
import statistics
from pathlib import Path

import pytest

from minfer.parallel.mig import mig_table

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "chapters" / "12c-isolation.md"
LAB = ROOT / "chapters" / "lab" / "12c-isolation.md"
DATA = json.loads((ROOT / "assets" / "benchmarks" / "cpu_tenants.json").read_text())
LESSON = CHAPTER.read_text()
TEXT = LESSON + "\n" + LAB.read_text()  # the lesson keeps part c and the H100's MIG rows; the lab notes the rest


def row(key: str) -> list[str]:
    """The cells of the first table row, in the lesson or its lab notes, whose first cell is `key` (in backticks)."""
    for line in TEXT.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == f"`{key}`":
            return cells
    raise AssertionError(f"chapter 12c has no table row for `{key}`")


def numbers(cells: list[str]) -> list[str]:
    return [c.replace("**", "") for c in cells[1:] if re.fullmatch(r"\**[0-9][0-9.,]*\**|–", c)]


def test_chapter_has_the_sections_and_the_figure():
    for heading in ("MIG", "NUMA", "pinning", "tenants"):
        assert re.search(rf"^## .*{heading}", LESSON, re.M | re.I), heading
    assert "![" in LESSON and "../assets/figures/cpu_tenants.png" in LESSON
    assert (ROOT / "assets/figures/cpu_tenants.png").is_file()
    assert "computed, not measured" in LESSON
    assert "numactl --cpunodebind" in LESSON and "--membind" in LESSON


def test_machine_layout_recorded():
    m = DATA["machine"]
    assert m["sched_getaffinity"] and m["numa_nodes"] and m["lscpu"]
    for part in "abc":
        rec = DATA["parts"][part]
        assert rec["command"].startswith("flock /tmp/minfer-bench.lock")
        assert len(rec["load_average_before"]) == 3 and len(rec["load_average_after"]) == 3


@pytest.mark.parametrize("name", sorted(DATA["parts"]["a"]["results"]))
def test_part_a_rows(name):
    r = DATA["parts"]["a"]["results"][name]
    tpot = statistics.median(run["tpot_ms"]["p50"] for run in r["runs"])
    assert numbers(row(name)) == [f"{r['decode_tok_s']:.1f}", f"{r['ttft_p50_ms']:.0f}", f"{tpot:.1f}"]


@pytest.mark.parametrize("name", sorted(DATA["parts"]["b"]["results"]))
def test_part_b_rows(name):
    r = DATA["parts"]["b"]["results"][name]
    e, t = r["per_engine_decode_tok_s"], r["per_engine_ttft_p50_ms"]
    assert numbers(row(name)) == [f"{r['total_decode_tok_s']:.1f}", f"{e[0]:.1f}", f"{e[1]:.1f}", f"{t[0]:.0f}",
                                  f"{t[1]:.0f}"]


@pytest.mark.parametrize("name", sorted(DATA["parts"]["c"]["results"]))
def test_part_c_rows(name):
    r = DATA["parts"]["c"]["results"][name]
    lt = r["latency_tenant"]
    batch = r.get("batch_tenant", {}).get("output_tok_s")
    assert numbers(row(name)) == [f"{lt['ttft_ms']['p50']:.0f}", f"{lt['ttft_ms']['p99']:.0f}",
                                  f"{lt['tpot_ms']['p50']:.1f}", "–" if batch is None else f"{batch:.1f}"]
    assert lt["failed"] == 0


def test_mig_rows():
    for r in mig_table():
        cells = row(f"{r['gpu']} {r['profile']}")
        counts = [str(r[k]) for k in r if k.endswith(("bfloat16", "int4"))]
        assert cells[1:] == [r["memory_fraction"], r["sm_fraction"], str(r["max_instances"]),
                             f"{r['slice_gb']:.1f}"] + counts
