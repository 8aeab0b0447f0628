"""Smoke test of `benchmarks/prefix_cache_cost.py` on a tiny random model: both engines run the same unique prompts
in alternation, the cache-on engine looks every prompt up and finds nothing, and the JSON holds the ratios, the load
average and the CPU time. No timing is asserted: on a shared CPU only the full benchmark's ratios mean anything."""

import json

import pytest

from tests.benchmark_scripts import load_benchmark

cost = load_benchmark("prefix_cache_cost")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minfer.bench.replicas import tiny_random_model

    return tiny_random_model(tmp_path_factory.mktemp("prefix-cost") / "tiny")


def test_prompts_are_unique_and_repeatable():
    a = cost.unique_prompts(8, 40, 256, seed=3)
    assert a == cost.unique_prompts(8, 40, 256, seed=3) and a != cost.unique_prompts(8, 40, 256, seed=4)
    assert len({tuple(p[:16]) for p in a}) == 8 and all(3 <= t < 256 for p in a for t in p)
    with pytest.raises(ValueError, match="share their first 16 tokens"):
        cost.unique_prompts(2, 16, 4, seed=0)  # one id to draw from: every prompt is the same


def test_summary_ratios_are_on_over_off():
    def run(tok_s, ttft, tpot, cpu, hits=0):
        return {"output_throughput": tok_s, "mean_ttft_ms": ttft, "mean_tpot_ms": tpot, "cpu_s": cpu,
                "prefix_cache": {"queries": 100, "hits": hits}}

    s = cost.summarize({"on": [run(90, 110, 22, 10), run(80, 130, 20, 12), run(100, 120, 21, 11)],
                        "off": [run(100, 100, 20, 10), run(100, 100, 20, 10)]})
    assert s["medians"]["on"]["output_throughput"] == 90 and s["medians"]["off"]["mean_ttft_ms"] == 100
    assert s["ratios_on_over_off"] == {"output_throughput": 0.9, "mean_ttft_ms": 1.2, "mean_tpot_ms": 1.05,
                                       "cpu_s": 1.1}
    assert s["hits_with_cache_on"] == 0 and s["queries_with_cache_on"] == 300


@pytest.mark.timeout(600)
def test_runs_end_to_end_on_a_tiny_model(tiny, tmp_path, capsys):
    out = tmp_path / "sub" / "cost.json"
    rc = cost.main(["--model", tiny, "--num-requests", "4", "--input-len", "40", "--output-len", "3",
                    "--rounds", "2", "--max-model-len", "64", "--kv-cache-memory-bytes", str(4 << 20), "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    r = json.loads(out.read_text())
    on, off = r["runs"]["on"], r["runs"]["off"]
    assert len(on) == len(off) == 2
    assert [x["position_in_round"] for x in on] == [0, 1] and [x["position_in_round"] for x in off] == [1, 0]
    for x in on + off:
        assert x["requests"] == 4 and x["output_tokens"] == 12 and x["prompt_tokens"] == 160
        assert x["output_throughput"] > 0 and x["mean_ttft_ms"] > 0 and x["mean_tpot_ms"] > 0
        assert x["cpu_s"] >= 0 and len(x["load_average_before_after"]) == 2 and x["all_blocks_free"]
    # the cache-on engine looked every prompt token up and found none; the cache-off one looked nothing up
    assert all(x["prefix_cache"] == {"queries": 160, "hits": 0} for x in on)
    assert all(x["prefix_cache"] == {"queries": 0, "hits": 0} for x in off)
    s = r["summary"]
    assert s["hits_with_cache_on"] == 0 and set(s["ratios_on_over_off"]) == set(cost.METRICS)
    assert all(v > 0 for v in s["ratios_on_over_off"].values())
    assert r["environment"]["cpus"] >= 1 and r["config"]["num_requests"] == 4
