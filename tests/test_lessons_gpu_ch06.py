"""Chapter 6's GPU section (`minfer/course/gpu/ch06.py`) on a CPU with a tiny model: the same code path the GPU
run takes (both systems on one device, synchronized clocks), so it cannot rot unseen. No timing is asserted."""

from __future__ import annotations


def test_static_vs_continuous_runs_small_on_cpu():
    from minfer.course.gpu import ch06

    r = ch06.run("cpu", small=True)
    assert r["device"] == "cpu" and r["num_requests"] == 8
    for key in ("continuous_output_tok_s", "static_output_tok_s", "continuous_ttft_median_s", "static_ttft_median_s"):
        assert r[key] > 0, key
    slots = r["static_slots"]
    assert slots["prompt_slots"] + slots["output_slots"] >= slots["useful"] > 0
