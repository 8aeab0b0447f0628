"""benchmarks/gpu_check.py's dry run (issue 31): every part of the GPU check on tiny shapes, on the CPU under
Triton's interpreter, so the GPU minutes are not spent on a typo. It must finish with no part in error, the
kernels must agree with torch at these sizes, every end-to-end configuration must give the torch backend's
greedy tokens, and the figures must be written. Times are not checked (a dry run's mean nothing).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from minfer.kernels import interpreter_active
from tests.benchmark_scripts import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_gpu_check():
    return load_benchmark("gpu_check")


def test_targets_against_their_bounds():
    gc = load_gpu_check()
    report = {"prefill": [{"seq_len": 4096, "minfer_tflops": 300.0, "torch_flash_tflops": 400.0}],
              "decode": [{"batch": 32, "context": 4096, "minfer_frac_of_peak": 0.55}],
              "cuda_graphs": [{"batch": 1, "speedup": 1.7}, {"batch": 8, "speedup": 0.9}]}
    t = gc.targets_of(report)
    assert t["prefill_4k_ratio_vs_torch_flash"] == {"value": 0.75, "target": 0.8, "met": False}
    assert t["decode_32x4k_frac_of_peak_bw"]["met"] is False
    assert t["cuda_graph_decode_speedup_b1"] == {"value": 1.7, "target": 1.0, "met": True}
    assert gc.targets_of({"cuda_graphs": [{"batch": 1, "graph_skipped": "no CUDA"}]}) == {}


@pytest.mark.skipif(not interpreter_active(), reason="the dry run needs Triton's interpreter (a CPU machine)")
def test_dry_run_covers_every_part(tmp_path, monkeypatch):
    gc = load_gpu_check()
    monkeypatch.setenv("MINFER_DEVICE", "cpu")
    out = tmp_path / "gpu_check.json"
    assert gc.main(["--dry-run", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["tests"]["passed"] and r["tests"]["collect_only"]
    assert "error" not in json.dumps(r), [k for k, v in r.items() if "error" in json.dumps(v)]
    for part in ("prefill", "decode", "w4a16", "decode_kv_quant", "cuda_graphs"):
        assert r[part], part
    assert all(x["max_abs_err_vs_sdpa"] < 1e-4 for x in r["prefill"] + r["decode"])
    assert all(x["max_rel_err"] < 1e-2 for x in r["w4a16"])
    kvq = {x["kv_cache_dtype"]: x["max_abs_diff_vs_unquantized"] for x in r["decode_kv_quant"]}
    assert kvq["torch.float32"] == 0.0 and 0 < kvq["int8"] < 0.05 and 0 < kvq["fp8_e4m3"] < 0.2
    assert set(r["end_to_end"]) == set(gc.e2e_configs(True))
    assert all(row["same_greedy_tokens_as_torch"] == 1.0 and row["generated_tokens"] > 0
               for row in r["end_to_end"].values())
    assert all("not CUDA" in row["graph_skipped"] and row["eager_ms"] > 0 for row in r["cuda_graphs"])
    assert r["targets"] == {}
    from minfer.course.gpu import sections

    assert set(r["notebook_gpu_sections"]) == {m.__name__.rsplit(".", 1)[1] for m in sections()}
    names = {pathlib.Path(p).name for p in r["figures"]}
    assert names == {f"gpu_check_{n}.png" for n in ("prefill", "decode", "w4a16", "end_to_end", "cuda_graphs")}
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)
