"""`minfer.bench.profile`: one request's phases add up, and profiling leaves the engine as it was.

    pytest tests/test_bench_profile.py
"""

from __future__ import annotations

import pytest

from minfer import SamplingParams
from minfer.bench.profile import profile_request


@pytest.fixture(scope="module")
def llm():
    from minfer import LLM

    return LLM(max_model_len=512)


def test_phases_add_up_and_the_engine_is_restored(llm):
    engine = llm.llm_engine
    msgs = [{"role": "user", "content": "Say hello."}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prof = profile_request(llm, msgs, params)
    assert prof.output_tokens == 5 and prof.steps == 5
    assert prof.prompt_tokens == len(llm.tokenizer.encode_chat(msgs))
    assert sum(prof.phases.values()) == pytest.approx(prof.total_s, rel=1e-6)
    assert sum(prof.forward_ops.values()) == pytest.approx(prof.phases["forward"], rel=1e-6)
    assert prof.forward_ops["linear: MLP"] > 0 and prof.forward_ops["attention (KV store + read)"] > 0
    assert "linear: LM head" not in prof.forward_ops  # counted as its own phase
    # no timer is left behind: the instance attributes are gone and no module keeps a hook
    assert "schedule" not in vars(engine.scheduler) and "add_request" not in vars(engine)
    assert "forward" not in vars(engine.worker.model)
    assert type(engine.worker.sampler).__name__ != "_TimedCallable"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in engine.worker.model.modules())
    # and the engine still answers the same, unprofiled
    again = llm.chat(msgs, params)[0].outputs[0].token_ids
    assert len(again) == 5


def test_a_bad_request_raises_and_leaves_no_timer(llm):
    with pytest.raises(ValueError):
        profile_request(llm, [{"role": "user", "content": "x"}], SamplingParams(max_tokens=10_000))
    assert "schedule" not in vars(llm.llm_engine.scheduler)
