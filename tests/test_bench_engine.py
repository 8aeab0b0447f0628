"""Smoke test of `python -m minfer.bench engine` (minfer/bench/engine.py) on tiny settings.

Checks that every part runs on the real model and returns the keys the CLI, the JSON and the chapter 6
notebook read. No timing is asserted: on a shared CPU only the full benchmark's ratios mean anything.
"""

import json

import pytest

from minfer.bench import engine as B
from tests.conftest import needs_default_model

pytestmark = needs_default_model

TINY = B.Settings(num_requests=3, prompt_len=(8, 16), output_len=(2, 4), static_batch_size=2, simple_subset=1,
                  prefix_len=48, suffix_len=4, prefix_requests=2, itl_decodes=2, itl_prompt_len=40,
                  itl_chunk_budget=16, itl_tail_steps=2, sched_seqs=4, sched_steps=2)


def test_workload_is_deterministic():
    a = B.make_workload(5, (4, 9), (2, 3), 1000, seed=7)
    assert a == B.make_workload(5, (4, 9), (2, 3), 1000, seed=7)
    prompts, outs = a
    assert all(4 <= len(p) <= 9 and all(100 <= t < 1000 for t in p) for p in prompts)
    assert all(2 <= m <= 3 for m in outs)
    assert B.percentile([1, 2, 3, 4, 5], 50) == 3 and B.percentile([1.0, 2.0], 100) == 2.0


@pytest.fixture(scope="module")
def tiny_hf():
    """A random 1-layer transformers Llama with the real vocabulary: exercises the static-batching path
    without the ~20 s GGUF load of the real weights (the benchmark itself uses those)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def test_parts_return_their_keys(llm, tiny_hf):
    res = dict(env=B.environment(), targets=B.TARGETS)
    res["throughput"] = t = B.run_throughput(llm, tiny_hf, settings=TINY, progress=False)
    for k in ("engine", "static", "one_at_a_time"):
        assert {"seconds", "output_tok_s", "total_tok_s", "output_tokens", "prompt_tokens"} <= set(t[k])
    assert t["engine"]["output_tokens"] == t["static"]["output_tokens"]  # only requested tokens are counted
    assert t["one_at_a_time"]["measured_requests"] == 1 and t["one_at_a_time"]["extrapolated"]
    assert t["engine_vs_static"] > 0 and t["engine_vs_one_at_a_time"] > 0

    res["sched"] = s = B.run_sched(llm, settings=TINY, progress=False)
    assert s["running_per_step"] == [4, 4]
    assert 0 < s["sched_fraction"] < 1 and s["sched_fraction"] <= s["engine_overhead_fraction"]

    prefix_on = B.make_llm(max_model_len=128, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=True)
    res["prefix"] = p = B.run_prefix(prefix_on, llm, settings=TINY, progress=False)
    assert p["cache_on"]["cached_tokens"] == [48] * TINY.prefix_requests
    assert p["cache_off"]["cached_tokens"] == [0] * TINY.prefix_requests
    assert p["prefix_ttft_speedup"] > 0

    chunked = B.make_llm(max_model_len=128, kv_cache_memory_bytes=16 << 20, enable_chunked_prefill=True,
                         max_num_batched_tokens=TINY.itl_chunk_budget)
    res["itl"] = i = B.run_itl(chunked, llm, settings=TINY, progress=False)
    for k in ("chunked", "whole"):
        assert {"p99_itl_s", "p50_itl_s", "max_itl_s", "long_ttft_s", "itl_s"} <= set(i[k])
        assert i[k]["num_itls"] >= TINY.itl_decodes
    assert i["itl_p99_reduction"] > 0
    for e in (llm, prefix_on, chunked):
        assert e.llm_engine.all_blocks_free() and not e.llm_engine.has_unfinished_requests()

    report = B.format_report(res)
    for heading in ("[1] throughput", "[2] prefix", "[3] chunked prefill", "[4] scheduler"):
        assert heading in report
    stripped = B._strip_series(res)
    assert isinstance(stripped["throughput"]["engine"]["steps"], int)  # a count, kept in the JSON
    json.dumps(stripped)


def test_timeline_records_chunks(llm):
    chunked = B.make_llm(max_model_len=128, kv_cache_memory_bytes=16 << 20, enable_chunked_prefill=True,
                         max_num_batched_tokens=16)
    r = B.measure_itl(chunked, 2, list(range(100, 140)), tail_steps=1, record_steps=True)
    after = r["steps"][r["arrival_step"]:]
    # the 40-token prompt runs in chunks that share steps with the two decodes: 14 + 14 + 12 tokens
    chunks = [n for st in after for rid, n, prefill in st["batch"] if rid == "long" and prefill]
    assert chunks == [14, 14, 12]
    assert all(st["end"] >= st["start"] for st in r["steps"])


def test_cli_rejects_unknown_part(capsys):
    with pytest.raises(SystemExit):
        B.main(["--only", "nope"])


def test_step_rows_says_which_route_ran():
    steps = [dict(batch=[("a", 40, True), ("b", 1, False)]), dict(batch=[("a", 1, False), ("b", 1, False)]),
             dict(batch=[])]
    r = B.step_rows(steps, kernel_max_rows=4)
    assert r["steps"] == 2 and r["kernel_route_steps"] == 1 and r["decode_only_steps"] == 1
    assert r["max_rows"] == 41 and r["median_decode_rows"] == 2 and r["kernel_route_fraction"] == 0.5


@pytest.mark.slow
def test_quant_throughput_runs_beside_float32(llm):
    res = B.run_quant_throughput(("int8",), settings=TINY, progress=False, llms={"float32": llm})
    runs = res["runs"]
    assert set(runs) == {"float32", "int8"} and "vs_float32" not in runs["float32"]
    assert runs["int8"]["output_tokens"] == runs["float32"]["output_tokens"] > 0
    assert runs["int8"]["vs_float32"] == runs["int8"]["output_tok_s"] / runs["float32"]["output_tok_s"]
    assert runs["int8"]["step_rows"]["steps"] > 0
    text = B.format_quant_report(dict(env=B.environment(), quant_throughput=res))
    assert "int8 / float32" in text
