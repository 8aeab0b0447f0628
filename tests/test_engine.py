"""The serving engine (minfer/engine.py, scheduler.py, block_manager.py, kv_cache.py) against the simple path.

Under greedy decoding every engine configuration — batched, paged, chunked, prefix-cached, preempted by
recompute or swap, any block size — must give token for token what chapter 1's one-sequence path gives,
and leave every KV block free afterwards.
"""

import pytest

from minfer import LLM, SamplingParams
from tests.conftest import needs_default_model

pytestmark = needs_default_model

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say when you do not know. "
          "Question: ")
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
    "Who wrote Hamlet?", "Why is the sky blue?", "What is a prime number?",
    "Translate 'good morning' into Spanish.", "What does a CPU do?", "List the planets of the solar system.",
    "How many legs does a spider have?", "What is photosynthesis?", "Explain gravity to a child.",
    "What is the boiling point of water at sea level in Celsius?", "Write a haiku about rain.",
    "What is the largest ocean on Earth?", "Give an example of a mammal that can fly.",
    "Why do we have seasons? Explain in detail, mentioning the tilt of the axis, the orbit, and how sunlight "
    "reaches each hemisphere differently during the year.",
    "What is the square root of 81?", "Who painted the Mona Lisa?", "What language is spoken in Brazil?",
    "Summarize the plot of Romeo and Juliet in two sentences, naming the families, the city, and how it ends.",
    "hi",
]
PROMPTS = [SYSTEM + q for q in QUESTIONS]
MAX_TOKENS = [8 + (i * 7) % 25 for i in range(len(PROMPTS))]  # 8..32 new tokens, varied
MIB = 1 << 20


def greedy(i):
    # ignore_eos: every sequence runs its full length, so the comparison covers many decode steps
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm):
    """Token ids of the simple path (contiguous cache, one sequence at a time) for every prompt."""
    return [llm.generate_simple(p, greedy(i))[0].outputs[0].token_ids for i, p in enumerate(PROMPTS)]


def run_engine(**kwargs):
    engine_llm = LLM(**{"max_model_len": 1024, "seed": 0, **kwargs})
    outs = engine_llm.generate(PROMPTS, [greedy(i) for i in range(len(PROMPTS))])
    assert engine_llm.llm_engine.all_blocks_free(), "blocks leaked"
    assert not engine_llm.llm_engine.has_unfinished_requests()
    return engine_llm, [o.outputs[0].token_ids for o in outs]


CONFIGS = {
    # Chunked prefill is on by default (256 tokens a step on a CPU); "whole-prompt" keeps the other path tested.
    "default": dict(kv_cache_memory_bytes=256 * MIB),
    "whole-prompt": dict(kv_cache_memory_bytes=256 * MIB, enable_chunked_prefill=False),
    "chunked-16": dict(kv_cache_memory_bytes=256 * MIB, enable_chunked_prefill=True, max_num_batched_tokens=16),
    # 4 at a time: later requests are admitted after the shared system prompt's blocks are cached.
    "prefix-cache": dict(kv_cache_memory_bytes=256 * MIB, enable_prefix_caching=True, max_num_seqs=4),
    "block-1": dict(kv_cache_memory_bytes=256 * MIB, block_size=1),
    "block-32": dict(kv_cache_memory_bytes=256 * MIB, block_size=32),
    # Every other configuration runs the default "auto" backend: the C++ decode kernel where it builds.
    "torch-reference": dict(kv_cache_memory_bytes=256 * MIB, attention_backend="torch"),
    # The textbook path (minfer/platform.py): plain torch everywhere, every step through the model's layers;
    # and the CPU kernels without the one-call step runner. The same greedy tokens as the simple path's.
    "kernels-reference": dict(kv_cache_memory_bytes=256 * MIB, kernels="reference"),
    "enforce-eager": dict(kv_cache_memory_bytes=256 * MIB, enforce_eager=True),
    # 272 token slots (max_model_len 256) for ~1,200 tokens of work: sequences are preempted and resumed.
    "preempt-recompute": dict(max_model_len=256, kv_cache_memory_bytes=12 * MIB),
    "preempt-swap": dict(max_model_len=256, kv_cache_memory_bytes=12 * MIB, swap_space=0.05),
    "chunked-prefix-preempt": dict(max_model_len=256, kv_cache_memory_bytes=12 * MIB, enable_chunked_prefill=True,
                                   max_num_batched_tokens=64, enable_prefix_caching=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_equals_simple_path(reference, name):
    engine_llm, outs = run_engine(**CONFIGS[name])
    for i, (got, want) in enumerate(zip(outs, reference)):
        assert got == want, f"{name}: prompt {i} differs"
    from minfer.cpu.attention import CpuPagedBackend, cpu_kernel_available

    backend = type(engine_llm.llm_engine.worker.backend)
    assert (backend is CpuPagedBackend) == (name not in ("torch-reference", "kernels-reference")
                                            and cpu_kernel_available())
    if name in ("kernels-reference", "enforce-eager"):
        assert engine_llm.llm_engine.worker.step_runner is None
    stats = engine_llm.stats()
    if "preempt" in name:
        assert stats.num_preemptions > 0
        if name == "preempt-swap":
            from minfer.swap import SwapPreemption

            assert isinstance(engine_llm.llm_engine.scheduler.preemption, SwapPreemption)
    if "prefix" in name:
        assert stats.prefix_cache_hits > 0 and 0 < stats.prefix_cache_hit_rate < 1


def test_prefix_cache_after_stops_and_aborts(reference):
    """Requests that ended on a stop string or were aborted mid-way leave only correct blocks behind."""
    llm = LLM(max_model_len=1024, seed=0, kv_cache_memory_bytes=256 * MIB, enable_prefix_caching=True)
    engine = llm.llm_engine
    stopper = llm.generate(PROMPTS[:6], SamplingParams(temperature=0, max_tokens=32, stop=[" ", "e"]))
    assert all(o.outputs[0].finish_reason == "stop" for o in stopper)
    for i in range(6, 12):
        engine.add_request(f"abort-{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=64))
    for _ in range(3):
        engine.step()
    engine.abort_request([f"abort-{i}" for i in range(6, 12)])
    assert engine.all_blocks_free()
    outs = llm.generate(PROMPTS, [greedy(i) for i in range(len(PROMPTS))])
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert engine.all_blocks_free() and llm.stats().prefix_cache_hits > 0


def test_seeded_request_independent_of_batch():
    llm = LLM(max_model_len=1024, seed=0, kv_cache_memory_bytes=128 * MIB)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS[:8], [params] + [SamplingParams(temperature=1.0, max_tokens=12)] * 7)
    assert mixed[0].outputs[0].token_ids == alone


def test_step_streams_and_abort_frees_blocks():
    llm = LLM(max_model_len=1024, seed=0, kv_cache_memory_bytes=64 * MIB)
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    seen = {"a": [], "b": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(len(out.outputs[0].token_ids))
            if out.request_id == "b" and len(out.outputs[0].token_ids) == 10:
                engine.abort_request("b")
    assert seen["a"] == list(range(1, 7))  # one new token per step, reported as it comes
    assert seen["b"][-1] == 10
    assert engine.all_blocks_free()


def test_pool_too_small_for_max_model_len_fails_at_start():
    """A pool that cannot hold one max_model_len sequence is refused at start-up (so no request can be
    admitted that could never finish): the error states the numbers and the option to change."""
    with pytest.raises(ValueError, match=r"max_model_len=2048 tokens needs 128 blocks.*Raise kv_cache_memory_bytes"):
        LLM(max_model_len=2048, kv_cache_memory_bytes=48 * MIB)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(max_model_len=1024, max_num_batched_tokens=512, kv_cache_memory_bytes=64 * MIB,
            enable_chunked_prefill=False)


def test_stats_fields(llm):
    s = llm.stats()
    for f in ("num_running", "num_waiting", "num_swapped", "num_free_blocks", "num_total_blocks", "kv_cache_usage",
              "fragmentation", "prefix_cache_hit_rate", "num_preemptions", "num_evicted_blocks"):
        assert hasattr(s, f)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5))[0]
    m = out.metrics
    assert m.ttft is not None and m.ttft > 0 and len(m.token_times) == len(out.outputs[0].token_ids)
    assert m.tpot is not None and len(m.itl) == len(m.token_times) - 1


def test_swapped_out_mid_chunked_prefill_resumes_in_chunks(llm):
    """A prompt swapped out half-prefilled comes back and finishes its prefill in budget-sized chunks.

    Pool: 13 blocks of 16 = 208 tokens. A (40 + 24 tokens) decodes while B's 190-token prompt is prefilled in
    chunks of 32; the pool runs out, B (the newest) is swapped out with part of its prompt computed, and its
    remaining prompt is longer than one step's budget.
    """
    import random

    rng = random.Random(1)
    a = [rng.randrange(100, 20000) for _ in range(40)]
    b = [rng.randrange(100, 20000) for _ in range(190)]
    pa = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    pb = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [llm.generate_simple(p, sp)[0].outputs[0].token_ids for p, sp in ((a, pa), (b, pb))]
    small = LLM(max_model_len=208, seed=0, kv_cache_memory_bytes=13 * 16 * 46080, swap_space=0.02,
                enable_chunked_prefill=True, max_num_batched_tokens=32)
    engine = small.llm_engine
    ra = engine.add_request(None, a, pa)
    while engine.requests[ra].seqs[0].num_computed_tokens < len(a):
        engine.step()
    rb = engine.add_request(None, b, pb)
    outs, swapped_mid_prefill, steps = {}, False, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 400, "no progress"
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        seq_b = engine.requests[rb].seqs[0] if rb in engine.requests else None
        if seq_b is not None and engine.stats().num_swapped and seq_b.num_computed_tokens < len(b) - 32:
            swapped_mid_prefill = True
    assert swapped_mid_prefill, "the scenario did not swap B out in the middle of its prefill"
    assert [outs[ra], outs[rb]] == want
    assert engine.all_blocks_free()


def test_the_engine_runs_each_step_through_its_one_executor(llm, monkeypatch):
    """`LLMEngine` holds no model: each step goes to `minfer/executor.py`'s `UniProcExecutor`, whose driver
    worker owns the model, pool, backend and sampler, and retired sequences are released there."""
    from minfer.executor import UniProcExecutor

    engine = llm.llm_engine
    assert isinstance(engine.executor, UniProcExecutor) and engine.worker is engine.executor.driver_worker
    steps, released = [], []
    execute, release = engine.worker.execute_model, engine.worker.release
    monkeypatch.setattr(engine.worker, "execute_model", lambda batch: steps.append(len(batch.seqs)) or execute(batch))
    monkeypatch.setattr(engine.worker, "release", lambda ids: released.extend(ids) or release(ids))
    out = llm.generate(["1, 2, 3,", "a b c"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert steps == [2, 2, 2] and [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert len(released) == 2 and engine.all_blocks_free()
