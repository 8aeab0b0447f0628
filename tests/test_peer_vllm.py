"""The pure helpers of `benchmarks/peer_vllm.py` (the benchmark itself runs vLLM and is never a test)."""

from types import SimpleNamespace

import pytest
import torch

from minfer.kv_cache_plan import bytes_per_block
from tests.benchmark_scripts import load_benchmark

peer_vllm = load_benchmark("peer_vllm")


@pytest.mark.parametrize("head_dim", [64, None])
def test_kv_bytes_per_token_matches_the_paged_pool(head_dim):
    config = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    if head_dim:
        config["head_dim"] = head_dim
    cfg = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=576 // 9)
    assert peer_vllm.kv_bytes_per_token(config) * 16 == bytes_per_block(cfg, 16, torch.float32)


def test_kv_pool_gib_rounds_up_with_margin():
    gib = 1 << 30
    assert peer_vllm.kv_pool_gib(1, 1) == 1
    assert peer_vllm.kv_pool_gib(gib // 1000, 1000, margin=1.0) == 1
    assert peer_vllm.kv_pool_gib(gib // 1000 + 1, 1000, margin=1.0) == 2
    assert peer_vllm.kv_pool_gib(gib, 1, margin=1.25) == 2


def _run(out_tok_s, b1, decode, load):
    return {"throughput": {"output_tok_s": out_tok_s}, "batch1": {"tok_s": b1, "decode_tok_s": decode}, "load_s": load}


def test_summarize_medians_and_ratios():
    runs = {"vllm": [_run(10, 20, 21, 30), _run(30, 40, 41, 10), _run(20, 30, 31, 20)],
            "minfer": [_run(40, 15, None, 5), _run(20, 25, 26, 7), _run(30, 35, 36, 6)]}
    s = peer_vllm.summarize(runs)
    assert s["medians"]["vllm"] == {"throughput_output_tok_s": 20, "batch1_tok_s": 30, "batch1_decode_tok_s": 31,
                                    "load_s": 20}
    assert "batch1_decode_tok_s" not in s["medians"]["minfer"]  # a missing value drops the metric, not the run
    assert s["minfer_over_vllm"] == pytest.approx({"throughput_output_tok_s": 1.5, "batch1_tok_s": 25 / 30,
                                                   "load_s": 0.3})


def test_compare_outputs():
    r = peer_vllm.compare_outputs([[1, 2, 3, 4], [5, 6], [7]], [[1, 2, 9, 9], [5, 6], [8]])
    assert r == {"identical": 1, "of": 3, "mean_common_prefix_fraction": pytest.approx((0.5 + 1 + 0) / 3)}
    with pytest.raises(ValueError):
        peer_vllm.compare_outputs([[1]], [])


def _accounting():
    return load_benchmark("peer_vllm_serve_accounting")


def test_step_timeline_clusters_the_streams_into_steps():
    acct = _accounting()
    # two requests start together; a 1 s prefill step gives both their first token, then three 0.1 s decode
    # steps; a third request joins at 1.15 s and gets its first token with the second decode step (a prefill)
    r = {"start_times": [0.0, 0.0, 1.15], "ttfts": [1.0, 1.001, 0.05],
         "itls": [[0.1, 0.1, 0.1], [0.1, 0.1, 0.1], [0.1]]}
    t = acct.step_timeline(r, cluster_s=0.005)
    assert t["clusters"] == 4
    assert t["first_tokens_per_prefill_cluster"] == [2, 1]
    assert t["prefill_cluster_gaps_s"] == [0.099]
    assert t["decode_gap_median_ms"] == 99.0


def test_diff_snapshots_per_thread_and_iteration_histogram(monkeypatch):
    acct = _accounting()
    before = {(1, 10): dict(proc="p", thread="python", cpu_s=1.0, vcsw=5, ivcsw=1)}
    after = {(1, 10): dict(proc="p", thread="python", cpu_s=3.0, vcsw=15, ivcsw=2),
             (1, 11): dict(proc="p", thread="python", cpu_s=0.5, vcsw=7, ivcsw=0)}
    rows = acct.diff_snapshots(before, after, wall_s=4.0)
    assert [(r["thread"], r["cpu_s"], r["cores"], r["voluntary_switches"]) for r in rows] == [
        ("python#0", 2.0, 0.5, 10), ("python#1", 0.5, 0.125, 7)]
    text = ('minfer:iteration_tokens_total_bucket{le="16.0",model_name="m"} 3.0\n'
            'minfer:iteration_tokens_total_count{model_name="m"} 4.0\n'
            'minfer:iteration_tokens_total_sum{model_name="m"} 2000.0\n'
            'vllm:iteration_tokens_total_count{model_name="m"} 4.0\n'
            'vllm:iteration_tokens_total_sum{model_name="m"} 2000.0\n')
    monkeypatch.setattr(acct.httpx, "get", lambda *a, **k: SimpleNamespace(text=text))
    h = acct.iteration_histogram("http://x")  # minfer's own series, not its vllm: copy as well
    assert h["count"] == 4.0 and h["sum"] == 2000.0 and h["buckets"] == {"16.0": 3.0}
