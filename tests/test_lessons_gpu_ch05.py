"""Lesson 05's GPU section (`minfer.course.gpu.ch05`) runs on tiny shapes on any device: on a CPU the W4A16
kernel runs under Triton's interpreter, so the section a GPU would run cannot rot unseen."""

from __future__ import annotations


def test_gpu_section_ch05_runs_small_on_cpu():
    from minfer.course.gpu import ch05

    result = ch05.run("cpu", small=True)
    assert result["rows"], result
    for r in result["rows"]:
        assert set(r["ms"]) == {"w4a16", "dequant+matmul", "fp16"}
        assert all(t > 0 for t in r["ms"].values())
        # the kernel reads the packed codes and scales: (0.5 + 4/G) bytes per weight, under float16's 2
        assert r["weight_bytes"]["w4a16"] == r["N"] * r["K"] * (0.5 + 4 / r["group_size"])
        assert r["weight_bytes"]["w4a16"] < r["weight_bytes"]["fp16"] < r["weight_bytes"]["dequant+matmul"]
        assert r["max_rel_diff_vs_reference"] < 1e-2
    assert "M" in ch05.table(result)
