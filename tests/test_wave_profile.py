"""`benchmarks/wave_profile.py --breakdown`: its summary arithmetic on synthetic numbers, its step classification,
and its timers on a tiny engine (they record every part and put the engine's methods back)."""

from types import SimpleNamespace

import pytest

from tests.benchmark_scripts import load_benchmark

wp = load_benchmark("wave_profile")


def test_summarize_parts_gives_shares_and_gflops():
    seconds = {("gate_up_proj", "prefill"): 2.0, ("gate_up_proj", "decode"): 0.5, ("attn_decode", "decode"): 1.0}
    flops = {("gate_up_proj", "prefill"): 600e9, ("gate_up_proj", "decode"): 50e9}
    out = wp.summarize_parts(seconds, flops, wall=10.0)
    assert out["gate_up_proj"]["prefill"] == {"s": 2.0, "share": 0.2, "gflops": 300.0}
    assert out["gate_up_proj"]["decode"]["gflops"] == 100.0
    assert out["attn_decode"]["decode"] == {"s": 1.0, "share": 0.1}  # no FLOP count: no GFLOP/s


def test_a_step_is_decode_only_when_no_prompt_token_is_left():
    def seq(computed, prompt):
        return SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt)

    assert wp.sched_decode_only(SimpleNamespace(waiting=[], running=[seq(12, 10), seq(5, 5)]))
    assert not wp.sched_decode_only(SimpleNamespace(waiting=[], running=[seq(12, 10), seq(4, 5)]))  # a chunk left
    assert not wp.sched_decode_only(SimpleNamespace(waiting=[seq(0, 3)], running=[seq(12, 10)]))


@pytest.mark.slow
def test_breakdown_times_each_part_and_restores_the_engine(llm):
    from minfer import SamplingParams

    engine = llm.llm_engine
    backend = engine.worker.backend
    before = {name: getattr(backend, name) for name in ("_decode", "_store", "attend_prefill")}
    parts = wp.Breakdown(engine, concurrency=4)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), [1 + i, 2, 3, 4, 5, 6], params)
    while engine.has_unfinished_requests():
        parts.decode_only = wp.sched_decode_only(engine.scheduler)
        engine.step()
    parts.restore()
    out = parts.summary(wall=1.0)
    for part in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "attn_prefill", "kv_store"):
        assert out[part]["prefill"]["s"] > 0, part
    assert out["lm_head"]["prefill"]["gflops"] > 0
    assert sum(v.get("decode", {}).get("s", 0) for v in out.values() if isinstance(v, dict)) > 0  # decode steps seen
    assert {name: getattr(backend, name) for name in before} == before  # the engine's own methods again
    warm = parts.warm_linears(rows=(2,), repeats=2)
    assert set(warm) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert all(v["2"] > 0 for v in warm.values())
