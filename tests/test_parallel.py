"""Tensor and pipeline parallelism (minfer/parallel/, the MultiprocExecutor of minfer/executor.py, chapter 12).

- Single process, no process group (each rank's shard built with `set_parallel_state`): sharded weights
  re-assemble to the originals, and the ranks' partial results put together (concatenated for
  column-parallel, summed for row-parallel and the vocab-parallel embedding) equal the single-process layer.
- Two gloo ranks in spawned processes: the layers with their real all-reduce / all-gather against the
  single-process layers.
- Through the engine on a random Llama (8 query / 2 KV heads, 4 layers): greedy TP=2, TP=4 (KV heads
  replicated), PP=2, PP=3 and TP=2 x PP=2 equal TP=1 token for token, with chunked prefill, prefix caching
  and preemption by recompute; TP=3 on SmolLM2 (9 / 3 heads) equals TP=1.
- A worker that dies fails the next step with WorkerDiedError at once, never a hang; bad sizes are refused
  before loading with clear errors. Through the server (TP=2 and PP=2, the engine in its own process or in a
  thread, `--no-engine-process`): a worker SIGKILLed during a stream ends it with an error event, or while
  idle turns /health to 503 within seconds; every later request is a 503 with OpenAI's error body.

Every multi-process test is bounded (the executor's own waits, and pytest-timeout).

    PYTHONPATH=$PWD python -m pytest -q tests/test_parallel.py
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.bench.parallel import save_random_llama
from minfer.config import EngineArgs, ModelConfig, verify_parallel_config
from minfer.model.layers import Linear
from minfer.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minfer.parallel.parallel_state import ParallelState, set_parallel_state
from minfer.parallel.pipeline import split_micro_batches, stage_layers
from minfer.parallel.timeline import bubble_fraction, gpipe_bubble

from .conftest import needs_default_model

MIB = 1 << 20


class rank_of:
    """Build layers as rank `tp_rank` of `tp_size` (no process group: collectives are not called)."""

    def __init__(self, tp_size, tp_rank):
        self.state = ParallelState(tp_size=tp_size, tp_rank=tp_rank)

    def __enter__(self):
        self.prev = set_parallel_state(self.state)

    def __exit__(self, *exc):
        set_parallel_state(self.prev)


def _load(layer, params: dict[str, list[torch.Tensor]]):
    for name, parts in params.items():
        p = getattr(layer, name)
        for shard, t in enumerate(parts):
            p.weight_loader(p, t, shard)
    return layer


# -- single process: shards --------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_shards_reassemble_and_compute(tp):
    torch.manual_seed(0)
    gate, up = torch.randn(48, 16), torch.randn(48, 16)
    w_down, b_down = torch.randn(16, 48), torch.randn(16)
    x, h = torch.randn(5, 16), torch.randn(5, 48)
    full = _load(Linear(16, output_sizes=[48, 48], method="nn"), {"weight": [gate, up]})
    down = _load(Linear(48, 16, bias=True, method="nn"), {"weight": [w_down], "bias": [b_down]})
    cols, partial = [], torch.zeros(5, 16)
    for r in range(tp):
        with rank_of(tp, r):
            col = _load(ColumnParallelLinear(16, [48, 48], method="nn"), {"weight": [gate, up]})
            row = _load(RowParallelLinear(48, 16, bias=True, method="nn"), {"weight": [w_down], "bias": [b_down]})
        g, u = col.weight.split(48 // tp)
        assert torch.equal(g, gate[r * 48 // tp:(r + 1) * 48 // tp]) and torch.equal(u, up[r * 48 // tp:(r + 1) * 48 // tp])
        assert torch.equal(row.weight, w_down[:, r * 48 // tp:(r + 1) * 48 // tp])
        cols.append(col(x))
        partial += row(h[:, r * 48 // tp:(r + 1) * 48 // tp])  # tp = 1 state inside: no all-reduce, sum here
    gates = torch.cat([c[:, :48 // tp] for c in cols], 1)
    ups = torch.cat([c[:, 48 // tp:] for c in cols], 1)
    torch.testing.assert_close(torch.cat([gates, ups], 1), full(x))
    torch.testing.assert_close(partial, down(h))  # the bias counted once (rank 0 only)


@pytest.mark.parametrize("heads, kv_heads, tp", [(8, 2, 2), (8, 2, 4), (8, 8, 4), (9, 3, 3)])
def test_qkv_split_by_heads_with_kv_replication(heads, kv_heads, tp):
    d = 4
    q, k, v = torch.randn(heads * d, 8), torch.randn(kv_heads * d, 8), torch.randn(kv_heads * d, 8)
    x = torch.randn(3, 8)
    seen_kv = []
    for r in range(tp):
        with rank_of(tp, r):
            layer = _load(QKVParallelLinear(8, d, heads, kv_heads, method="nn"), {"weight": [q, k, v]})
        hq, hkv = layer.num_heads, layer.num_kv_heads
        assert hq == heads // tp and hkv == max(1, kv_heads // tp)
        y = layer(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        torch.testing.assert_close(y[0], x @ q[r * hq * d:(r + 1) * hq * d].T)
        kv0 = layer.kv_head_start
        torch.testing.assert_close(y[1], x @ k[kv0 * d:(kv0 + hkv) * d].T)
        torch.testing.assert_close(y[2], x @ v[kv0 * d:(kv0 + hkv) * d].T)
        # The KV head a rank holds is the one its query heads read (GQA group = query head // (heads / kv_heads)).
        assert {(r * hq + i) // (heads // kv_heads) for i in range(hq)} <= set(range(kv0, kv0 + hkv))
        seen_kv.extend(range(kv0, kv0 + hkv))
    assert set(seen_kv) == set(range(kv_heads))


@pytest.mark.parametrize("vocab, tp", [(12, 2), (10, 4), (10, 3)])
def test_vocab_parallel_head_and_embedding_with_padding(vocab, tp):
    table, x = torch.randn(vocab, 6), torch.randn(4, 6)
    ids = torch.arange(vocab)
    logits, emb, tied_emb = [], torch.zeros(vocab, 6), torch.zeros(vocab, 6)
    for r in range(tp):
        with rank_of(tp, r):
            head = _load(ParallelLMHead(vocab, 6, method="nn"), {"weight": [table]})
            own = _load(VocabParallelEmbedding(vocab, 6), {"weight": [table]})
            tied = VocabParallelEmbedding(vocab, 6, tied_head=head)
        logits.append(head.method.apply(head, x))  # this rank's columns, padding rows included
        for e, out in ((own, emb), (tied, tied_emb)):
            e.tp_size = 2  # take the masked path of a real rank (its all-reduce is the sum taken here)
            with rank_of(1, 0):
                out += e(ids)
    full = torch.cat(logits, 1)[:, :vocab]
    torch.testing.assert_close(full, x @ table.T)
    torch.testing.assert_close(emb, table)
    torch.testing.assert_close(tied_emb, table)


def test_stage_layers_and_micro_batches():
    assert [stage_layers(30, 4, r) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layers(4, 3, r) for r in range(3)] == [(0, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="larger than the model's 4 layers"):
        stage_layers(4, 5, 0)
    assert split_micro_batches(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_micro_batches(2, 4) == [(0, 1), (1, 2)]
    assert gpipe_bubble(4, 8) == pytest.approx(3 / 11)
    ev = [dict(step=1, stage=s, tp_rank=0, micro_batch=0, start=s, end=s + 1, num_tokens=1) for s in range(2)]
    assert bubble_fraction(ev) == pytest.approx(0.5)  # two stages, one micro-batch: each idle half the span


@pytest.mark.parametrize("p,m", [(2, 4), (3, 8), (4, 2)])
def test_explain_gap_splits_the_gap_into_stage_times_and_hand_offs(p, m):
    from minfer.bench.parallel import explain_gap

    # A GPipe timeline built by hand: stage s's micro-batch takes t[s] ms, each hand-off h ms.
    t, h = [3.0 + s for s in range(p)], 0.5
    end = {}
    for i in range(m):
        for s in range(p):
            start = max(end.get((i, s - 1), -h) + h, end.get((i - 1, s), 0.0))
            end[(i, s)] = start + t[s]
    span = end[(m - 1, p - 1)]
    measured = 1 - m * sum(t) / (p * span)
    pt = explain_gap(dict(stages=p, micro_batches=m, stage_forward_ms=t, measured_bubble=measured))
    assert pt["step_span_ms"] == pytest.approx(span, abs=1e-3)
    assert pt["span_from_stage_times_ms"] == pytest.approx(sum(t) + (m - 1) * max(t))
    assert pt["bubble_from_stage_times"] > gpipe_bubble(p, m)  # unequal stages idle more than the formula
    assert pt["between_forwards_ms"] == pytest.approx((p - 1) * h, abs=1e-3)  # the hops on the critical path
    equal = explain_gap(dict(stages=p, micro_batches=m, stage_forward_ms=[2.0] * p,
                             measured_bubble=gpipe_bubble(p, m)))
    assert equal["bubble_from_stage_times"] == pytest.approx(gpipe_bubble(p, m), abs=1e-4)
    assert equal["between_forwards_ms"] == pytest.approx(0, abs=1e-3)


# -- bad sizes -----------------------------------------------------------------------------------------------
def _cfg(**kw):
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("tp, pp, cfg, needle", [
    (2, 1, {}, "does not divide the model's 9 attention heads"),
    (4, 1, dict(num_attention_heads=8, num_key_value_heads=3), "KV heads|num_key_value_heads"),
    (3, 1, dict(intermediate_size=1000), "intermediate_size"),
    (1, 31, {}, "larger than the model's 30 layers"),
    (2, 1, dict(architecture="GPT2LMHeadModel"), "built for"),
])
def test_bad_sizes_refused(tp, pp, cfg, needle):
    with pytest.raises(ValueError, match=needle):
        verify_parallel_config(_cfg(**cfg), tp, pp)
    verify_parallel_config(_cfg(), 3, 30)  # SmolLM2's shape: TP=3 and 30 stages are fine


@pytest.mark.parametrize("kwargs, needle", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"), (dict(pipeline_parallel_size=-1), "pipeline_parallel_size"),
    (dict(tensor_parallel_size=2, quantization="gguf"), "gguf"),
    (dict(distributed_executor_backend="ray"), "distributed_executor_backend"),
    (dict(pipeline_micro_batches=0), "pipeline_micro_batches"),
])
def test_bad_engine_args(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineArgs(**kwargs)


@needs_default_model
def test_smollm2_tp2_refused_before_loading(monkeypatch):
    import minfer.executor
    import minfer.worker

    def never(*args, **kwargs):  # the refusal must come before any worker process starts or any weight loads
        raise AssertionError("a worker was started or a weight loaded for a refused configuration")

    monkeypatch.setattr(minfer.worker, "load_model", never)
    monkeypatch.setattr(minfer.executor.subprocess, "Popen", never)
    with pytest.raises(ValueError, match="9 attention heads"):
        LLM(tensor_parallel_size=2)


# -- gloo ranks: the layers with real collectives ----------------------------------------------------------
def _layers_rank(rank, world, init, out):
    from minfer.parallel.parallel_state import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(world, 1, rank, init, backend="gloo")
    torch.manual_seed(0)
    w_o, b_o, table, x, h = (torch.randn(16, 32), torch.randn(16), torch.randn(10, 16), torch.randn(3, 16),
                             torch.randn(3, 32))
    row = _load(RowParallelLinear(32, 16, bias=True, method="nn"), {"weight": [w_o], "bias": [b_o]})
    head = _load(ParallelLMHead(10, 16, method="nn"), {"weight": [table]})
    emb = VocabParallelEmbedding(10, 16, tied_head=head)
    per = 32 // world
    got = dict(row=row(h[:, rank * per:(rank + 1) * per]), head=head(x), emb=emb(torch.tensor([0, 9, 4, 5])))
    want = dict(row=h @ w_o.T + b_o, head=x @ table.T, emb=table[[0, 9, 4, 5]])
    out.put((rank, {k: float((got[k] - want[k]).abs().max()) for k in got}))
    destroy_parallel()


def test_layers_with_gloo_collectives_equal_single_process():
    import torch.multiprocessing as mp

    from minfer.executor import _free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_layers_rank, args=(r, 2, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, errs in results.items():
        assert max(errs.values()) < 1e-5, (rank, errs)


# -- through the engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rand_model(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("par") / "llama", layers=4, heads=8, kv_heads=2)


def _prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (20,), generator=g).tolist()  # a common prefix: prefix-cache hits
    return [shared + torch.randint(3, 256, (5 + 9 * i,), generator=g).tolist() for i in range(n)]


PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# A pool of 14 blocks of 8 tokens for 6 sequences of up to 82 tokens: preemption (recompute) happens.
ENGINE = dict(max_model_len=96, seed=0, attention_backend="torch", block_size=8, enable_chunked_prefill=True,
              max_num_batched_tokens=32, enable_prefix_caching=True)


def _generate(model, **kw):
    llm = LLM(model=model, **ENGINE, kv_cache_memory_bytes=_pool_bytes(), **kw)
    try:
        outs = llm.generate(_prompts(), PARAMS)
        stats = llm.stats()
        assert llm.llm_engine.all_blocks_free()
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.llm_engine.executor.shutdown()


def _pool_bytes():
    # 4 layers x 2 (K, V) x 8 tokens x 2 KV heads x 8 dims x 4 bytes = 4 KiB a block; 14 blocks.
    return 14 * 4 * 2 * 8 * 2 * 8 * 4


@pytest.fixture(scope="module")
def reference(rand_model):
    tokens, stats = _generate(rand_model)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0  # the paths under test are taken
    return tokens


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (1, 2), (1, 3), (2, 2)])
def test_parallel_greedy_equals_one_rank(rand_model, reference, tp, pp):
    tokens, stats = _generate(rand_model, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert stats.num_preemptions > 0
    assert tokens == reference


def _overlap(a, b) -> float:
    return max(0.0, min(a["end"], b["end"]) - max(a["start"], b["start"]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_timeline_has_micro_batches_in_flight(rand_model):
    llm = LLM(model=rand_model, max_model_len=128, seed=0, attention_backend="torch", pipeline_parallel_size=2,
              pipeline_micro_batches=4, kv_cache_memory_bytes=4 * MIB, max_num_batched_tokens=512)
    prompts = [[3 + (5 * i + j) % 250 for j in range(48)] for i in range(8)]
    try:
        ex = llm.llm_engine.executor
        ex.collect_timeline()
        overlaps = []
        for _ in range(6):  # one prefill step each
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
            ev = ex.collect_timeline()
            assert len({e["step"] for e in ev}) == 1
            s0 = sorted((e for e in ev if e["stage"] == 0), key=lambda e: e["micro_batch"])
            s1 = sorted((e for e in ev if e["stage"] == 1), key=lambda e: e["micro_batch"])
            assert [e["micro_batch"] for e in s0] == [e["micro_batch"] for e in s1] == [0, 1, 2, 3]
            assert [e["num_tokens"] for e in s0] == [96] * 4
            # Real timestamps: stage 1 never runs a micro-batch before stage 0 has finished it ...
            assert all(b["start"] >= a["end"] for a, b in zip(s0, s1))
            assert 0 < bubble_fraction(ev) < 1
            overlaps.append(sum(_overlap(a, b) for a in s0 for b in s1))
    finally:
        llm.llm_engine.executor.shutdown()
    # ... and the two stages ran at the same time: micro-batches in flight (a step run one micro-batch at a
    # time, stage after stage, would have no overlap at all). On a machine so loaded that the two processes
    # never get a core at the same moment there is nothing to see: that is skipped, not passed.
    if max(overlaps) == 0 and os.getloadavg()[0] > 2 * (os.cpu_count() or 1):
        pytest.skip(f"no two stages ran at once in 6 steps at load {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores")
    assert max(overlaps) > 0


@pytest.mark.timeout(180)
def test_dead_worker_fails_requests_without_hanging(rand_model):
    from minfer.executor import WorkerDiedError

    llm = LLM(model=rand_model, max_model_len=128, seed=0, attention_backend="torch", tensor_parallel_size=2,
              kv_cache_memory_bytes=4 * MIB)
    ex = llm.llm_engine.executor
    try:
        assert llm.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids
        ex._procs[1].kill()  # the worker process this executor started
        ex._procs[1].wait(timeout=10)
        t0 = time.perf_counter()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            llm.generate([[5, 6, 7]], PARAMS)
        assert time.perf_counter() - t0 < 60
        with pytest.raises(WorkerDiedError):  # and every later call at once
            ex.check_health()
        assert llm.llm_engine.all_blocks_free()  # the failed request was aborted: no KV block leaked
    finally:
        ex.shutdown()


@pytest.mark.timeout(180)
def test_second_llm_while_a_parallel_one_lives_is_a_clear_error(rand_model):
    """`llm = LLM(tp=2)` then `llm = LLM()`: the second is built while the first still holds this process's
    parallel state; it must refuse (found by a new user: it gave garbage), and work once the first is shut down."""
    tp2 = LLM(model=rand_model, max_model_len=64, attention_backend="torch", tensor_parallel_size=2,
              kv_cache_memory_bytes=4 * MIB)
    try:
        for kw in ({}, {"pipeline_parallel_size": 2}):
            with pytest.raises(ValueError, match="still rank 0 of a tensor/pipeline-parallel engine"):
                LLM(model=rand_model, max_model_len=64, attention_backend="torch", kv_cache_memory_bytes=4 * MIB,
                    **kw)
    finally:
        tp2.llm_engine.executor.shutdown()
    one = LLM(model=rand_model, max_model_len=64, attention_backend="torch", kv_cache_memory_bytes=4 * MIB)
    assert len(one.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids) == PARAMS.max_tokens


@needs_default_model
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_tp3_greedy_equals_one_rank():
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=12)
    out = {}
    for tp in (1, 3):
        llm = LLM(max_model_len=256, seed=0, tensor_parallel_size=tp, kv_cache_memory_bytes=64 * MIB,
                  enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True)
        try:
            out[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.llm_engine.executor.shutdown()
    assert out[3] == out[1]


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `pid`, read from /proc (Linux)."""
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            try:
                cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            out.append((c, cmd))
            todo.append(c)
    return out


def _kill_worker_1() -> None:
    import signal

    procs = [(pid, cmd) for pid, cmd in _descendants(os.getpid()) if "worker_main(1)" in cmd]
    assert len(procs) == 1, procs
    os.kill(procs[0][0], signal.SIGKILL)  # the worker this test's server started


def _stream_in_thread(url: str, body: dict, first_chunk) -> tuple:
    """Stream `body` from a thread; `first_chunk` is set once the first token arrived. Returns (thread, lines)."""
    import threading

    import httpx

    lines: list[str] = []

    def run():
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=120) as r:
            lines.append(str(r.status_code))
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if line.startswith("data: {"):
                    first_chunk.set()
        first_chunk.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, lines


# The engine in its own process (the default), or in a thread of the server (--no-engine-process); a
# worker killed while a stream is in flight, or while the server is idle (only /health can notice then).
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to find the worker process")
@pytest.mark.parametrize("parallel,engine_process,when", [
    (["--tensor-parallel-size", "2"], True, "in_flight"),
    (["--tensor-parallel-size", "2"], False, "in_flight"),
    (["--pipeline-parallel-size", "2"], False, "idle"),
    (["--pipeline-parallel-size", "2"], True, "idle"),
], ids=["tp2-engine-process", "tp2-thread-in-flight", "pp2-thread-idle", "pp2-engine-process-idle"])
def test_server_with_a_dead_worker_fails_requests_and_reports_unhealthy(rand_model, parallel, engine_process, when):
    import json
    import threading

    import httpx

    from .serving import running_server

    args = [rand_model, *parallel, "--attention-backend", "torch", "--max-model-len", "512",
            "--kv-cache-memory-bytes", "4M", *([] if engine_process else ["--no-engine-process"])]
    if engine_process:
        # The engine process dies with its worker, and a server whose engine process died exits with status 3 for
        # its supervisor to restart (chapter 15 §15.3b); the stream in flight still ends with an error event.
        from .serving import assert_exits_engine_died, server_process

        with server_process(args) as (proc, url, log):
            body = dict(model=rand_model, prompt="w3 w4 w5", max_tokens=4, temperature=0)
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
            stream = None
            if when == "in_flight":
                first = threading.Event()
                stream = _stream_in_thread(url, dict(body, max_tokens=480, ignore_eos=True), first)
                assert first.wait(60), "the stream sent nothing"
            _kill_worker_1()
            if stream is not None:
                stream[0].join(60)
                assert not stream[0].is_alive(), "the in-flight stream still runs after 60 s"
                lines = stream[1]
                assert lines[0] == "200" and lines[-1] == "data: [DONE]", lines[-3:]
                assert any('"error"' in x for x in lines), lines[-3:]
            assert_exits_engine_died(proc, log)
        return
    with running_server(args, check_log=False) as url:
        body = dict(model=rand_model, prompt="w3 w4 w5", max_tokens=4, temperature=0)
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        stream = None
        if when == "in_flight":  # a long answer, so that the worker dies while it streams
            first = threading.Event()
            stream = _stream_in_thread(url, dict(body, max_tokens=480, ignore_eos=True), first)
            assert first.wait(60), "the stream sent nothing"
        _kill_worker_1()
        t0 = time.perf_counter()
        if stream is not None:  # the in-flight stream ends with an OpenAI error event, then [DONE]
            stream[0].join(60)
            assert not stream[0].is_alive(), "the in-flight stream still runs after 60 s"
            lines = stream[1]
            errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {") and '"error"' in x]
            assert lines[0] == "200" and lines[-1] == "data: [DONE]", lines[-3:]
            assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error", errors
            assert "rank 1" in errors[0]["error"]["message"], errors
        else:  # nothing runs: the engine notices on its own, and /health says so
            while httpx.get(url + "/health", timeout=5).status_code != 503:
                assert time.perf_counter() - t0 < 30, "the server still reports healthy 30 s after the death"
                time.sleep(0.5)
        for stream_it in (False, True):  # every later request: a 503 with OpenAI's error body, at once
            t1 = time.perf_counter()
            r = httpx.post(url + "/v1/completions", json=dict(body, stream=stream_it), timeout=60)
            assert time.perf_counter() - t1 < 10
            assert r.status_code == 503, (r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "server_error" and "rank 1" in err["message"], err
        h = httpx.get(url + "/health", timeout=5)
        assert h.status_code == 503 and "rank 1" in h.json()["error"]["message"], h.text
        assert time.perf_counter() - t0 < 60


def _free_port_pair() -> int:
    """A port P with P + 1 free too: torchrun's rendezvous takes P, minfer's control listener P + 1."""
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _write_torchrun_script(path, model: str):
    """The script both torchrun tests launch: TP=2 through the torchrun backend, greedy tokens printed."""
    path.write_text(
        "import json, sys\n"
        "from minfer import LLM, SamplingParams\n"
        f"llm = LLM(model={model!r}, tensor_parallel_size=2, distributed_executor_backend='torchrun',\n"
        "          attention_backend='torch', max_model_len=96, kv_cache_memory_bytes=1 << 22, seed=0)\n"
        f"outs = llm.generate({_prompts(3)!r}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))\n"
        "print('RESULT', json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)\n"
        "llm.llm_engine.executor.shutdown()\n")
    return path


def _result_tokens(stdout: str) -> list[list[int]]:
    import json

    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT"))[7:])


def _one_rank_tokens(model: str) -> list[list[int]]:
    llm = LLM(model=model, attention_backend="torch", max_model_len=96, kv_cache_memory_bytes=1 << 22, seed=0)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(3), SamplingParams(temperature=0, max_tokens=8,
                                                                                     ignore_eos=True))]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_backend_equals_one_rank(rand_model, tmp_path):
    """`torchrun --nproc-per-node 2` runs the same script on two ranks; rank 1 becomes the worker inside LLM()."""
    import subprocess
    import sys

    script = _write_torchrun_script(tmp_path / "run.py", rand_model)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(_free_port_pair()), str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _result_tokens(r.stdout) == _one_rank_tokens(rand_model)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_nodes_equals_one_rank(rand_model, tmp_path):
    """`torchrun --nnodes 2`, as across two machines: two launchers (node ranks 0 and 1, one process each) meet at
    a static rendezvous on MASTER_ADDR, so LOCAL_WORLD_SIZE (1) < WORLD_SIZE (2) and every cross-node rule
    applies (the control connections need MINFER_DIST_AUTHKEY; without it node 0 refuses). Both launchers run
    on this one machine over loopback: the multi-node code path, not a real network."""
    import subprocess
    import sys

    script = _write_torchrun_script(tmp_path / "run.py", rand_model)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def launch(node_rank: int, port: int, key: str | None) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("MINFER_DIST_AUTHKEY", None)
        if key is not None:
            env["MINFER_DIST_AUTHKEY"] = key
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                 "1", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port",
                                 str(port), str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def run_pair(key: str | None) -> tuple[subprocess.Popen, str, str]:
        port = _free_port_pair()
        nodes = [launch(0, port, key), launch(1, port, key)]
        try:
            out0, err0 = nodes[0].communicate(timeout=240)
        finally:
            for n in nodes:
                if n.poll() is None:
                    n.kill()
                n.wait(timeout=30)
        return nodes[0], out0, err0

    node0, out, err = run_pair(None)  # across machines the control channel needs a shared secret
    assert node0.returncode != 0 and "MINFER_DIST_AUTHKEY" in err, err[-3000:]
    node0, out, err = run_pair("a-shared-secret-for-this-test")
    assert node0.returncode == 0, err[-3000:]
    assert _result_tokens(out) == _one_rank_tokens(rand_model)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("quantization, config", [("int8", None), ("int4", {"group_size": 32})])
def test_quantized_shards_equal_quantized_one_rank(rand_model, quantization, config):
    """The parallel layers compose with the quantization methods: each rank quantizes its shard after loading.
    (Per-row int8 scales are the same whether a row is whole or split by rows; the row-parallel layers' scales
    cover half a row, which on this model still gives TP=1's greedy tokens.)"""
    out = {}
    for tp in (1, 2):
        llm = LLM(model=rand_model, tensor_parallel_size=tp, quantization=quantization, quantization_config=config,
                  attention_backend="torch", max_model_len=96, kv_cache_memory_bytes=1 << 22, seed=0)
        try:
            out[tp] = [o.outputs[0].token_ids for o in llm.generate(_prompts(4), PARAMS)]
        finally:
            llm.llm_engine.executor.shutdown()
    assert out[2] == out[1]


@pytest.mark.timeout(120)
def test_int4_group_that_does_not_divide_a_shard_is_a_clear_error(rand_model):
    # intermediate 128 / tp 2 = 64-wide down_proj shards, hidden 64 / 2 = 32-wide o_proj shards: group 64 fails.
    with pytest.raises(Exception, match="group_size=64 does not divide"):
        LLM(model=rand_model, tensor_parallel_size=2, quantization="int4", quantization_config={"group_size": 64},
            attention_backend="torch", max_model_len=96, kv_cache_memory_bytes=1 << 22)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_with_ngram_speculation_and_beam_search(rand_model):
    """The worker's other paths run sharded too: n-gram speculation (verification on the output rank) and beam
    search (which calls the executor's compute_logits) give TP=1's results."""
    from minfer.sampling_params import BeamSearchParams

    prompts = _prompts(4)
    spec = dict(method="ngram", num_speculative_tokens=3)
    out = {}
    for tp in (1, 2):
        llm = LLM(model=rand_model, tensor_parallel_size=tp, attention_backend="torch", max_model_len=96,
                  kv_cache_memory_bytes=1 << 22, seed=0, speculative_config=spec)
        try:
            out[tp] = ([o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)],
                       [[b.tokens for b in o.sequences] for o in llm.beam_search(
                           [{"prompt_token_ids": p} for p in prompts[:2]], BeamSearchParams(beam_width=3, max_tokens=6))])
        finally:
            llm.llm_engine.executor.shutdown()
    assert out[2] == out[1]
