"""`python -m minfer.bench engine`: what continuous batching buys, measured on the real model (chapter 6).

    python -m minfer.bench engine [--quick] [--json PATH] [--only throughput,prefix,itl,sched]
    python -m minfer.bench engine --quantization int8,int4,gguf [--quick] [--num-requests N] [--json PATH]

Four parts, each compared with a baseline measured in the same run (ratios, never timed assertions):

1. throughput - N requests with random prompts and output lengths (greedy, ignore_eos) through
   (a) minfer's engine, all requests queued at once (continuous batching over the paged KV pool);
   (b) transformers' static batching: left-padded batches of B, `generate(max_new_tokens=max of the batch)`,
       only the requested tokens counted as useful;
   (c) minfer's one-at-a-time simple path (`LLM.generate_simple`), on a subset, rate extrapolated.
2. prefix - TTFT of a request whose prompt is a long shared prefix + a short suffix, prefix caching on
   (prefix cached by an earlier request) vs off.
3. itl - p99 inter-token latency of running decodes while a long prompt arrives, chunked prefill on vs off.
4. sched - the scheduler's own time (schedule() + building the flat batch, block tables, slot mapping) as a
   fraction of an engine step with many running decodes.

With `--quantization` the benchmark is instead part 1's engine run with weight-quantized models beside the
float32 one, the same workload in the same process (chapter 5): output tokens/s per method, its ratio to
float32, and how many tokens each engine step carried (`run_quant_throughput`). On a CPU where the integer
GEMM builds, every step takes it (`minfer.quantization.base`); the "kernel route" column counts the steps of
at most `KERNEL_MAX_ROWS` tokens, the split that only the fallback without that kernel still makes.

Every `run_*` function is importable (the chapter 6 notebook calls them with small settings) and returns a
plain dict; `main` prints a table and can write it all as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minfer.config import parse_quantization_config
from minfer.sampling_params import SamplingParams

DEFAULT_JSON = "assets/benchmarks/engine_cpu.json"
QUANT_JSON = "assets/benchmarks/engine_quant_cpu.json"
QUANT_METHODS = ("int8", "int4", "gguf")
QUANT_TARGET = 1.5  # output tokens/s, quantized engine / float32 engine (issue 11)
PARTS = ("throughput", "prefix", "itl", "sched")
MIB = 1 << 20

TARGETS = {
    "engine_vs_static": 3.0,  # output tokens/s, engine / transformers static batching
    "engine_vs_one_at_a_time": 4.0,  # output tokens/s, engine / simple path
    "prefix_ttft_speedup": 3.0,  # TTFT cache off / cache on
    "itl_p99_reduction": 2.0,  # p99 ITL without chunking / with chunking
    "sched_fraction_max": 0.10,  # (schedule + prepare_inputs) / step
}


@dataclass
class Settings:
    """Sizes of one run. `full()` is the default CLI run, `quick()` the CI / notebook one."""

    num_requests: int = 64
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 256)
    static_batch_size: int = 16
    simple_subset: int = 8
    prefix_len: int = 1000
    suffix_len: int = 16
    prefix_requests: int = 3
    itl_decodes: int = 8
    itl_prompt_len: int = 2000
    itl_chunk_budget: int = 256
    itl_tail_steps: int = 8
    sched_seqs: int = 64
    sched_steps: int = 16
    seed: int = 0

    @classmethod
    def full(cls) -> "Settings":
        return cls()

    @classmethod
    def quick(cls) -> "Settings":
        return cls(num_requests=16, prompt_len=(32, 128), output_len=(16, 64), static_batch_size=8, simple_subset=4,
                   prefix_len=256, prefix_requests=3, itl_decodes=4, itl_prompt_len=512, itl_chunk_budget=64,
                   itl_tail_steps=4, sched_seqs=32, sched_steps=8)


# -- helpers ---------------------------------------------------------------------------------------------
def make_llm(**kwargs):
    """minfer's `LLM` on the default model (float32 CPU), greedy-friendly defaults, any EngineArgs override."""
    from minfer import LLM

    return LLM(**{"model": "smollm2-135m-instruct", "seed": 0, **kwargs})


def kv_bytes_for(llm_or_cfg, num_tokens: int, block_size: int = 16, margin: float = 1.25) -> int:
    """Bytes of a KV pool that holds `num_tokens` tokens (with a margin), for the model of `llm_or_cfg`."""
    from minfer.kv_cache_plan import bytes_per_block

    engine = getattr(llm_or_cfg, "llm_engine", None)
    cfg = engine.model_config.config if engine is not None else llm_or_cfg
    blocks = int(num_tokens * margin) // block_size + 16
    return blocks * bytes_per_block(cfg, block_size, torch.float32)


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Random prompts (token ids, uniform lengths) and output lengths from a fixed seed."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        prompts.append([rng.randrange(100, vocab_size) for _ in range(n)])
        outs.append(rng.randint(*output_len))
    return prompts, outs


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation (numpy's default), without numpy."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _rates(prompt_tokens: int, output_tokens: int, seconds: float) -> dict:
    return dict(seconds=seconds, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                output_tok_s=output_tokens / seconds, total_tok_s=(prompt_tokens + output_tokens) / seconds)


def load_hf_model(llm=None, device: str | torch.device | None = None):
    """transformers' model on the same GGUF weights (float32), on the device of minfer's `llm` (or `device`;
    the CPU when neither is given), so that the static-batching baseline and the engine run on one device."""
    from transformers import AutoModelForCausalLM

    from minfer.model.sources import find_default_gguf

    if device is None:
        device = llm.llm_engine.device if llm is not None else "cpu"
    p = find_default_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    return model.to(device)


# -- 1. throughput ---------------------------------------------------------------------------------------
def run_engine_batch(llm, prompts: list[list[int]], max_tokens: list[int], progress: bool = True,
                     record_steps: bool = False) -> dict:
    """All requests queued at once in minfer's engine, stepped until done. Optionally records every step:
    which sequences ran with how many tokens (the timeline of chapter 6)."""
    engine = llm.llm_engine
    for p, m in zip(prompts, max_tokens):
        engine.add_request(None, p, greedy(m))
    steps = []
    bar = tqdm(total=len(prompts), desc="minfer engine", disable=not progress, leave=False)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if record_steps:
            steps.append(_timed_step(engine, t0))
            done = steps[-1]["finished"]
        else:
            done = sum(1 for o in engine.step() if o.finished)
        bar.update(done)
    dt = time.perf_counter() - t0
    bar.close()
    out = _rates(sum(map(len, prompts)), sum(max_tokens), dt)
    if record_steps:
        out["steps"] = steps
    return out


def _timed_step(engine, t0: float) -> dict:
    """One engine.step(), recording the batch the scheduler built (sequence -> tokens) and the step's time."""
    sched = engine.scheduler
    seen = {}
    orig = sched.schedule

    def schedule():
        b = orig()
        seen["batch"] = [(s.request_id, n, s.num_computed_tokens < s.num_prompt_tokens) for s, n in
                         zip(b.seqs, b.num_new_tokens)]
        return b

    sched.schedule = schedule
    start = time.perf_counter()
    try:
        outs = engine.step()
    finally:
        del sched.schedule  # back to the class method
    end = time.perf_counter()
    return dict(start=start - t0, end=end - t0, batch=seen.get("batch", []),
                finished=sum(1 for o in outs if o.finished))


def static_batch_slots(prompt_lens: list[int], output_lens: list[int], batch_size: int) -> dict:
    """The token slots static batching computes: each batch of `batch_size` requests (in order; the last may
    be smaller) pads every prompt to the batch's longest and runs every row until the batch's longest output.
    Returns prompt slots, output slots, the useful tokens (what was asked for) and the wasted share."""
    prompt_slots = output_slots = 0
    for i in range(0, len(prompt_lens), batch_size):
        ps, ms = prompt_lens[i:i + batch_size], output_lens[i:i + batch_size]
        prompt_slots += len(ps) * max(ps)
        output_slots += len(ms) * max(ms)
    useful = sum(prompt_lens) + sum(output_lens)
    total = prompt_slots + output_slots
    return dict(prompt_slots=prompt_slots, output_slots=output_slots, useful=useful,
                wasted_share=1 - useful / total if total else 0.0)


def run_static_hf(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int, pad_id: int = 0,
                  progress: bool = True) -> dict:
    """transformers' static batching: left-pad each batch of `batch_size`, generate the batch's longest output
    for every row. Only the requested tokens count (the rest is padding/waiting). The inputs go to the model's
    own device, and the clock is read after that device's queued work is done (a no-op on a CPU)."""
    from minfer.course import sync

    device = next(model.parameters()).device
    sync(device)
    t0 = time.perf_counter()
    batches = range(0, len(prompts), batch_size)
    padded_tokens = generated_tokens = 0
    for i in tqdm(batches, desc="transformers static", disable=not progress, leave=False):
        ps, ms = prompts[i:i + batch_size], max_tokens[i:i + batch_size]
        width, m = max(map(len, ps)), max(ms)
        ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for r, p in enumerate(ps):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=m,
                           min_new_tokens=m, do_sample=False, pad_token_id=pad_id)
        padded_tokens += width * len(ps)
        generated_tokens += m * len(ps)
    sync(device)
    dt = time.perf_counter() - t0
    out = _rates(sum(map(len, prompts)), sum(max_tokens), dt)
    out.update(batch_size=batch_size, computed_prompt_tokens=padded_tokens, computed_output_tokens=generated_tokens)
    return out


def run_one_at_a_time(llm, prompts: list[list[int]], max_tokens: list[int], subset: int | None = None,
                      progress: bool = True) -> dict:
    """minfer's simple path (contiguous cache, batch 1), request after request, on the first `subset`."""
    k = len(prompts) if subset is None else min(subset, len(prompts))
    t0 = time.perf_counter()
    for p, m in tqdm(list(zip(prompts[:k], max_tokens[:k])), desc="one at a time", disable=not progress,
                     leave=False):
        llm.generate_simple(p, greedy(m))
    dt = time.perf_counter() - t0
    out = _rates(sum(map(len, prompts[:k])), sum(max_tokens[:k]), dt)
    out.update(measured_requests=k, of_requests=len(prompts), extrapolated=k < len(prompts),
               est_seconds_all=dt * (sum(max_tokens) + sum(map(len, prompts)))
               / (sum(max_tokens[:k]) + sum(map(len, prompts[:k]))))
    return out


def _warmup(llm, hf_model=None):
    llm.generate([[100 + i for i in range(16)]] * 2, greedy(2))
    llm.generate_simple([100 + i for i in range(16)], greedy(2))
    if hf_model is not None:
        with torch.inference_mode():
            hf_model.generate(input_ids=torch.arange(100, 116, device=next(hf_model.parameters()).device)[None],
                              max_new_tokens=2, do_sample=False, pad_token_id=0)


def run_throughput(llm=None, hf_model=None, settings: Settings | None = None, progress: bool = True,
                   baselines: tuple[str, ...] = ("static", "one_at_a_time")) -> dict:
    """Part 1. Builds the LLM (KV pool sized to hold every request at once) and the transformers model when
    not given."""
    s = settings or Settings.full()
    if llm is None:  # a pool that holds every request at its longest: no preemption in this part
        need = s.num_requests * (s.prompt_len[1] + s.output_len[1])
        llm = make_llm(max_model_len=s.prompt_len[1] + s.output_len[1] + 16,
                       kv_cache_memory_bytes=kv_bytes_for(_cfg(), need))
    vocab = llm.llm_engine.model_config.vocab_size
    prompts, outs = make_workload(s.num_requests, s.prompt_len, s.output_len, vocab, s.seed)
    if "static" in baselines and hf_model is None:
        hf_model = load_hf_model(llm)  # on the engine's device
    _warmup(llm, hf_model if "static" in baselines else None)
    before = llm.stats()
    res = dict(settings=dict(num_requests=s.num_requests, prompt_len=list(s.prompt_len), output_len=list(s.output_len),
                             static_batch_size=s.static_batch_size, simple_subset=s.simple_subset, seed=s.seed))
    res["engine"] = run_engine_batch(llm, prompts, outs, progress)
    after = llm.stats()
    res["engine"].update(steps=after.num_steps - before.num_steps, preemptions=after.num_preemptions - before.num_preemptions)
    if "static" in baselines:
        res["static"] = run_static_hf(hf_model, prompts, outs, s.static_batch_size, progress=progress)
        res["engine_vs_static"] = res["engine"]["output_tok_s"] / res["static"]["output_tok_s"]
    if "one_at_a_time" in baselines:
        res["one_at_a_time"] = run_one_at_a_time(llm, prompts, outs, s.simple_subset, progress)
        res["engine_vs_one_at_a_time"] = res["engine"]["output_tok_s"] / res["one_at_a_time"]["output_tok_s"]
    return res


# -- 2. prefix caching -----------------------------------------------------------------------------------
def _run_alone(engine, prompt: list[int], max_tokens: int = 1):
    rid = engine.add_request(None, prompt, greedy(max_tokens))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out


def measure_prefix_ttft(llm, prefix: list[int], suffixes: list[list[int]]) -> dict:
    """TTFT of prefix+suffix requests, one at a time, after a first request that puts the prefix in the pool
    (cached if and only if the engine has prefix caching on). The first (warming) request is not counted."""
    engine = llm.llm_engine
    warm = _run_alone(engine, prefix + suffixes[0])
    ttfts, cached = [], []
    for suf in suffixes[1:]:
        o = _run_alone(engine, prefix + suf)
        ttfts.append(o.metrics.ttft)
        cached.append(o.num_cached_tokens)
    return dict(ttft_s=ttfts, median_ttft_s=statistics.median(ttfts), cached_tokens=cached,
                warm_ttft_s=warm.metrics.ttft)


def run_prefix(llm_on=None, llm_off=None, settings: Settings | None = None, progress: bool = True) -> dict:
    """Part 2. TTFT with prefix caching on (hit) vs off, median over `prefix_requests` requests."""
    s = settings or Settings.full()
    max_len = s.prefix_len + s.suffix_len + 16
    kv = kv_bytes_for(_cfg(), 4 * max_len)
    llm_on = llm_on or make_llm(max_model_len=max_len, kv_cache_memory_bytes=kv, enable_prefix_caching=True)
    llm_off = llm_off or make_llm(max_model_len=max_len, kv_cache_memory_bytes=kv, enable_prefix_caching=False)
    vocab = llm_on.llm_engine.model_config.vocab_size
    rng = random.Random(s.seed + 1)
    prefix = [rng.randrange(100, vocab) for _ in range(s.prefix_len)]
    suffixes = [[rng.randrange(100, vocab) for _ in range(s.suffix_len)] for _ in range(s.prefix_requests + 1)]
    _warmup(llm_on)
    _warmup(llm_off)
    res = dict(settings=dict(prefix_len=s.prefix_len, suffix_len=s.suffix_len, requests=s.prefix_requests))
    for name, llm in tqdm([("cache_on", llm_on), ("cache_off", llm_off)], desc="prefix", disable=not progress,
                          leave=False):
        res[name] = measure_prefix_ttft(llm, prefix, suffixes)
    res["prefix_ttft_speedup"] = res["cache_off"]["median_ttft_s"] / res["cache_on"]["median_ttft_s"]
    return res


# -- 3. chunked prefill and ITL --------------------------------------------------------------------------
def measure_itl(llm, num_decodes: int, long_prompt: list[int], tail_steps: int, decode_prompt_len: int = 32,
                seed: int = 0, record_steps: bool = False) -> dict:
    """Start `num_decodes` sequences and let them decode; then a long prompt arrives. Returns the inter-token
    latencies of the running decodes from its arrival until `tail_steps` steps after its first token, and
    the long prompt's TTFT. With `record_steps`, also the timeline of steps (sequence -> tokens)."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed + 2)
    budget = engine.max_model_len - decode_prompt_len  # as long as they may: they are aborted at the end
    dec = [engine.add_request(f"dec{i}", [rng.randrange(100, vocab) for _ in range(decode_prompt_len)],
                              greedy(budget)) for i in range(num_decodes)]
    t0 = time.perf_counter()
    steps = []
    def step():
        if record_steps:
            st = _timed_step(engine, t0)
            steps.append(st)
        else:
            engine.step()
    while min(len(engine.requests[r].metrics.token_times) for r in dec) < 4:  # steady decoding first
        step()
    t_arrive = time.perf_counter()
    long_id = engine.add_request("long", long_prompt, greedy(tail_steps + 2), arrival_time=t_arrive)
    n_arrive = len(steps)
    long_req = engine.requests[long_id]
    m_long = long_req.metrics
    while m_long.first_token_time is None:
        step()
    ttft = m_long.ttft
    for _ in range(tail_steps):
        if not engine.has_unfinished_requests():
            break
        step()
    itls = []
    for r in dec:
        t = engine.requests[r].metrics.token_times
        itls += [b - a for a, b in zip(t, t[1:]) if b > t_arrive]
    engine.abort_request(dec + ["long"])
    res = dict(itl_s=itls, p99_itl_s=percentile(itls, 99), p50_itl_s=percentile(itls, 50), max_itl_s=max(itls),
               long_ttft_s=ttft, num_itls=len(itls))
    if record_steps:
        res["steps"] = steps
        res["arrival_step"] = n_arrive
        res["arrival_time"] = t_arrive - t0
    return res


def run_itl(llm_chunked=None, llm_whole=None, settings: Settings | None = None, progress: bool = True) -> dict:
    """Part 3. p99 ITL of running decodes while a long prompt arrives, chunked prefill on vs off."""
    s = settings or Settings.full()
    max_len = max(s.itl_prompt_len + s.itl_tail_steps + 16, 32 + s.itl_prompt_len + s.itl_tail_steps + 80)
    kv = kv_bytes_for(_cfg(), max_len * (s.itl_decodes + 2))
    llm_chunked = llm_chunked or make_llm(max_model_len=max_len, kv_cache_memory_bytes=kv, enable_chunked_prefill=True,
                                          max_num_batched_tokens=s.itl_chunk_budget)
    llm_whole = llm_whole or make_llm(max_model_len=max_len, kv_cache_memory_bytes=kv, enable_chunked_prefill=False)
    vocab = llm_chunked.llm_engine.model_config.vocab_size
    rng = random.Random(s.seed + 3)
    long_prompt = [rng.randrange(100, vocab) for _ in range(s.itl_prompt_len)]
    _warmup(llm_chunked)
    _warmup(llm_whole)
    res = dict(settings=dict(decodes=s.itl_decodes, prompt_len=s.itl_prompt_len, chunk_budget=s.itl_chunk_budget,
                             whole_budget=llm_whole.llm_engine.max_num_batched_tokens, tail_steps=s.itl_tail_steps))
    for name, llm in tqdm([("chunked", llm_chunked), ("whole", llm_whole)], desc="itl", disable=not progress,
                          leave=False):
        res[name] = measure_itl(llm, s.itl_decodes, long_prompt, s.itl_tail_steps, seed=s.seed)
    res["itl_p99_reduction"] = res["whole"]["p99_itl_s"] / res["chunked"]["p99_itl_s"]
    return res


def _cfg():
    """The default model's ModelConfig, read from the GGUF metadata (no weights loaded)."""
    from minfer.model.gguf import gguf_config, open_gguf
    from minfer.model.sources import find_default_gguf

    p = find_default_gguf()
    return gguf_config(open_gguf(p), p)[0]


# -- 4. scheduler overhead -------------------------------------------------------------------------------
def run_sched(llm=None, settings: Settings | None = None, progress: bool = True) -> dict:
    """Part 4. With `sched_seqs` sequences decoding, time each step's parts: `scheduler.schedule()`,
    `worker.prepare_inputs()` (flat ids, positions, block tables, slot mapping), the rest of the forward, and
    the engine's bookkeeping after it (from EngineStats)."""
    s = settings or Settings.full()
    prompt_len = 32
    total = s.sched_steps + 8
    if llm is None:
        llm = make_llm(max_model_len=prompt_len + total + 16,
                       kv_cache_memory_bytes=kv_bytes_for(_cfg(), s.sched_seqs * (prompt_len + total + 16)))
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(s.seed + 4)
    ids = [engine.add_request(None, [rng.randrange(100, vocab) for _ in range(prompt_len)], greedy(total))
           for _ in range(s.sched_seqs)]
    while any(len(engine.requests[r].metrics.token_times) < 2 for r in ids):  # all prefilled, decoding
        engine.step()
    sched, worker = engine.scheduler, engine.worker
    t = dict(schedule=0.0, build=0.0)

    def wrap(obj, name, key):
        orig = getattr(obj, name)

        def f(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                t[key] += time.perf_counter() - t0
        setattr(obj, name, f)

    wrap(sched, "schedule", "schedule")
    wrap(worker, "prepare_inputs", "build")
    before = engine.stats()
    running = []
    t0 = time.perf_counter()
    try:
        for _ in tqdm(range(s.sched_steps), desc="sched", disable=not progress, leave=False):
            running.append(len(sched.running))
            engine.step()
    finally:
        del sched.schedule, worker.prepare_inputs
    wall = time.perf_counter() - t0
    after = engine.stats()
    engine.abort_request(ids)
    sched_s = after.scheduler_time_s - before.scheduler_time_s
    fwd_s = after.forward_time_s - before.forward_time_s
    res = dict(settings=dict(seqs=s.sched_seqs, steps=s.sched_steps), running_per_step=running, wall_s=wall,
               schedule_s=t["schedule"], prepare_inputs_s=t["build"], forward_s=fwd_s - t["build"],
               bookkeeping_s=sched_s - t["schedule"], step_s=wall / s.sched_steps)
    res["sched_fraction"] = (t["schedule"] + t["build"]) / wall
    res["engine_overhead_fraction"] = (sched_s + t["build"]) / wall  # everything that is not the model
    return res


# -- quantized weights: the engine's throughput per method (chapter 5) ------------------------------------
def step_rows(steps: list[dict], kernel_max_rows: int) -> dict:
    """Summary of the tokens per engine step (= the rows of every Linear's matmul in that step): the
    quantized methods take their packed kernel at <= `kernel_max_rows` rows, dequantize + sgemm above."""
    rows = [sum(n for _, n, _ in st["batch"]) for st in steps if st["batch"]]
    if not rows:
        return dict(steps=0)
    dec = [sum(n for _, n, _ in st["batch"]) for st in steps if st["batch"] and not any(p for *_, p in st["batch"])]
    small = sum(1 for r in rows if r <= kernel_max_rows)
    return dict(steps=len(rows), mean_rows=sum(rows) / len(rows), median_rows=statistics.median(rows),
                max_rows=max(rows), decode_only_steps=len(dec),
                median_decode_rows=statistics.median(dec) if dec else 0,
                kernel_route_steps=small, kernel_route_fraction=small / len(rows), kernel_max_rows=kernel_max_rows)


def run_quant_throughput(methods: tuple[str, ...] = QUANT_METHODS, settings: Settings | None = None,
                         progress: bool = True, quantization_config: dict | None = None, llms: dict | None = None) -> dict:
    """Part 1's engine run (all requests queued at once, greedy, ignore_eos) for float32 and each weight
    quantization in `methods`, one model after the other in this process, on the same workload. Returns
    per method the `run_engine_batch` rates, `step_rows` and `vs_float32` (output tok/s ratio).

    `llms` maps a name ("float32" or a method) to a ready `LLM` (the test passes small ones); the others are
    built on the default model with a pool that holds every request (no preemption)."""
    from minfer.quantization.base import KERNEL_MAX_ROWS

    s = settings or Settings.full()
    need = s.num_requests * (s.prompt_len[1] + s.output_len[1])
    res = dict(settings=dict(num_requests=s.num_requests, prompt_len=list(s.prompt_len), output_len=list(s.output_len),
                             seed=s.seed, methods=list(methods), quantization_config=quantization_config or {}),
               target_vs_float32=QUANT_TARGET, runs={})
    prompts = outs = None
    for name in ("float32", *methods):
        llm = (llms or {}).get(name)
        if llm is None:
            kw = {} if name == "float32" else dict(quantization=name)
            if name == "int4" and quantization_config:  # the only method with settings (group_size)
                kw["quantization_config"] = quantization_config
            llm = make_llm(max_model_len=s.prompt_len[1] + s.output_len[1] + 16,
                           kv_cache_memory_bytes=kv_bytes_for(_cfg(), need), **kw)
        if prompts is None:
            prompts, outs = make_workload(s.num_requests, s.prompt_len, s.output_len,
                                          llm.llm_engine.model_config.vocab_size, s.seed)
        _warmup(llm)
        before = llm.stats()
        r = run_engine_batch(llm, prompts, outs, progress, record_steps=True)
        after = llm.stats()
        r["step_rows"] = step_rows(r.pop("steps"), KERNEL_MAX_ROWS)
        r.update(engine_steps=after.num_steps - before.num_steps,
                 preemptions=after.num_preemptions - before.num_preemptions)
        res["runs"][name] = r
        del llm
    base = res["runs"]["float32"]["output_tok_s"]
    for name in methods:
        res["runs"][name]["vs_float32"] = res["runs"][name]["output_tok_s"] / base
    return res


def format_quant_report(res: dict) -> str:
    env, r = res.get("env", {}), res["quant_throughput"]
    st = r["settings"]
    lines = [f"minfer engine throughput with quantized weights - {env.get('model')} on {env.get('device')}, "
             f"torch {env.get('torch')}, {env.get('threads')} threads, {env.get('cpus')} CPUs (absolute figures depend "
             "on the machine and its load; the ratios are measured in the same run)",
             f"{st['num_requests']} requests, prompts {st['prompt_len'][0]}-{st['prompt_len'][1]} tokens, outputs "
             f"{st['output_len'][0]}-{st['output_len'][1]} (random ids, greedy, ignore_eos), all queued at once",
             f"    {'weights':9s} {'seconds':>8s} {'out tok/s':>10s} {'vs float32':>11s} {'rows/step (median)':>19s} "
             f"{'steps on the kernel route':>26s}"]
    for name, d in r["runs"].items():
        sr = d["step_rows"]
        ratio = f"{d['vs_float32']:10.2f}x" if "vs_float32" in d else f"{'1.00x':>11s}"
        lines.append(f"    {name:9s} {d['seconds']:8.1f} {d['output_tok_s']:10.1f} {ratio} {sr.get('median_rows', 0):19.0f} "
                     f"{sr.get('kernel_route_steps', 0):>10d} of {sr.get('steps', 0):<5d} (<= {sr.get('kernel_max_rows')} rows)")
    for name, d in r["runs"].items():
        if "vs_float32" in d:
            lines.append(f"    {name} / float32 = {d['vs_float32']:.2f}x output tok/s   (target >= {r['target_vs_float32']}x: "
                         f"{_ok(d['vs_float32'], r['target_vs_float32'])})")
    return "\n".join(lines)


# -- the CLI ---------------------------------------------------------------------------------------------
def _ok(v: float, target: float, lower_is_better: bool = False) -> str:
    good = v < target if lower_is_better else v >= target
    return "met" if good else "MISSED"


def format_report(res: dict) -> str:
    lines = []
    env = res.get("env", {})
    if env:
        lines.append(f"minfer engine benchmark - {env.get('model')} float32 on {env.get('device')}, "
                     f"torch {env.get('torch')}, {env.get('threads')} threads, {env.get('cpus')} CPUs "
                     f"(absolute figures depend on the machine and its load, the ratios are measured in the same run)")
    if "throughput" in res:
        r = res["throughput"]
        st = r["settings"]
        lines.append("")
        lines.append(f"[1] throughput: {st['num_requests']} requests, prompts {st['prompt_len'][0]}-{st['prompt_len'][1]} "
                     f"tokens, outputs {st['output_len'][0]}-{st['output_len'][1]} (random ids, greedy, ignore_eos)")
        lines.append(f"    {'system':44s} {'seconds':>9s} {'out tok/s':>10s} {'total tok/s':>12s}")
        rows = [("minfer engine (continuous batching)", r["engine"])]
        if "static" in r:
            rows.append((f"transformers static batching, B={st['static_batch_size']}", r["static"]))
        if "one_at_a_time" in r:
            o = r["one_at_a_time"]
            rows.append(("minfer simple path, one at a time (*)", o))
        for name, d in rows:
            lines.append(f"    {name:44s} {d['seconds']:9.1f} {d['output_tok_s']:10.1f} {d['total_tok_s']:12.1f}")
        if "one_at_a_time" in r and r["one_at_a_time"]["extrapolated"]:
            o = r["one_at_a_time"]
            lines.append(f"    (*) measured on the first {o['measured_requests']} of {o['of_requests']} requests; "
                         f"rates from that subset (all {o['of_requests']} would take ~{o['est_seconds_all']:.0f} s)")
        if "static" in r:
            lines.append(f"    engine / static       = {r['engine_vs_static']:5.2f}x output tok/s   "
                         f"(target >= {TARGETS['engine_vs_static']:.0f}x: {_ok(r['engine_vs_static'], TARGETS['engine_vs_static'])})")
        if "one_at_a_time" in r:
            lines.append(f"    engine / one-at-a-time = {r['engine_vs_one_at_a_time']:5.2f}x output tok/s   "
                         f"(target >= {TARGETS['engine_vs_one_at_a_time']:.0f}x: "
                         f"{_ok(r['engine_vs_one_at_a_time'], TARGETS['engine_vs_one_at_a_time'])})")
        lines.append(f"    engine: {r['engine']['steps']} steps, {r['engine']['preemptions']} preemptions")
    if "prefix" in res:
        r = res["prefix"]
        st = r["settings"]
        lines.append("")
        lines.append(f"[2] prefix caching: {st['prefix_len']}-token shared prefix + {st['suffix_len']}-token suffix, "
                     f"median TTFT of {st['requests']} requests (prefix put in the pool by an earlier request)")
        for name in ("cache_on", "cache_off"):
            d = r[name]
            lines.append(f"    {name:10s} median TTFT {1e3 * d['median_ttft_s']:9.1f} ms   "
                         f"cached tokens {d['cached_tokens']}")
        lines.append(f"    TTFT off / on = {r['prefix_ttft_speedup']:5.1f}x   (target >= {TARGETS['prefix_ttft_speedup']:.0f}x: "
                     f"{_ok(r['prefix_ttft_speedup'], TARGETS['prefix_ttft_speedup'])})")
    if "itl" in res:
        r = res["itl"]
        st = r["settings"]
        lines.append("")
        lines.append(f"[3] chunked prefill: {st['decodes']} running decodes, a {st['prompt_len']}-token prompt arrives; "
                     f"token budget {st['chunk_budget']} (chunked) vs {st['whole_budget']} (whole prompt in one step)")
        for name in ("chunked", "whole"):
            d = r[name]
            lines.append(f"    {name:8s} ITL p50 {1e3 * d['p50_itl_s']:8.1f} ms  p99 {1e3 * d['p99_itl_s']:8.1f} ms  "
                         f"max {1e3 * d['max_itl_s']:8.1f} ms  ({d['num_itls']} gaps)   long prompt TTFT "
                         f"{d['long_ttft_s']:6.2f} s")
        lines.append(f"    p99 ITL whole / chunked = {r['itl_p99_reduction']:5.1f}x   (target >= "
                     f"{TARGETS['itl_p99_reduction']:.0f}x: {_ok(r['itl_p99_reduction'], TARGETS['itl_p99_reduction'])})")
    if "sched" in res:
        r = res["sched"]
        lines.append("")
        lines.append(f"[4] scheduler overhead: {r['settings']['seqs']} running decodes, {r['settings']['steps']} steps "
                     f"(running per step: {min(r['running_per_step'])}-{max(r['running_per_step'])})")
        n = r["settings"]["steps"]
        for k in ("schedule_s", "prepare_inputs_s", "forward_s", "bookkeeping_s"):
            lines.append(f"    {k[:-2]:14s} {1e3 * r[k] / n:9.2f} ms/step  {100 * r[k] / r['wall_s']:5.1f}%")
        lines.append(f"    step           {1e3 * r['step_s']:9.2f} ms")
        lines.append(f"    schedule + prepare_inputs = {100 * r['sched_fraction']:.1f}% of the step   (target < "
                     f"{100 * TARGETS['sched_fraction_max']:.0f}%: "
                     f"{_ok(r['sched_fraction'], TARGETS['sched_fraction_max'], lower_is_better=True)}); "
                     f"all engine overhead (+ bookkeeping) = {100 * r['engine_overhead_fraction']:.1f}%")
    return "\n".join(lines)


def environment() -> dict:
    return dict(model="SmolLM2-135M-Instruct", device="cpu" if not torch.cuda.is_available() else "cuda",
                torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(),
                machine=platform.machine(), python=platform.python_version(),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))


def run_all(settings: Settings, parts=PARTS, progress: bool = True) -> dict:
    res = dict(env=environment(), targets=TARGETS, quick=settings.num_requests < Settings.full().num_requests)
    t0 = time.perf_counter()
    if "throughput" in parts:
        res["throughput"] = run_throughput(settings=settings, progress=progress)
    if "prefix" in parts:
        res["prefix"] = run_prefix(settings=settings, progress=progress)
    if "itl" in parts:
        res["itl"] = run_itl(settings=settings, progress=progress)
    if "sched" in parts:
        res["sched"] = run_sched(settings=settings, progress=progress)
    res["elapsed_s"] = time.perf_counter() - t0
    return res


def _strip_series(res: dict) -> dict:
    """The JSON keeps summaries and the per-request/per-gap lists, not step timelines."""
    out = json.loads(json.dumps(res, default=str))
    for d in (out.get("itl", {}).get("chunked", {}), out.get("itl", {}).get("whole", {}),
              out.get("throughput", {}).get("engine", {})):
        if isinstance(d.get("steps"), list):  # a recorded timeline (engine.steps is otherwise a count)
            del d["steps"]
    return out


def _quant_args(ap: argparse.ArgumentParser, args) -> tuple[tuple[str, ...], dict | None]:
    """--quantization's methods and --quantization-config's dict (int4's settings), or `ap.error`: unknown
    methods, a config that is not a JSON object or that int4 refuses (`parse_quantization_config`, as `LLM`
    does), or a config with no int4 run to apply to (it would be silently ignored)."""
    if not args.quantization:
        if args.quantization_config:
            ap.error("--quantization-config needs --quantization int4")
        return (), None
    methods = tuple(m.strip() for m in args.quantization.split(",") if m.strip())
    bad = [m for m in methods if m not in QUANT_METHODS]
    if bad or not methods:
        ap.error(f"--quantization: unknown method(s) {bad}; choose from {','.join(QUANT_METHODS)}")
    if not args.quantization_config:
        return methods, None
    if "int4" not in methods:
        ap.error(f"--quantization-config applies to int4 only, and --quantization {args.quantization} has no int4")
    try:
        qcfg = parse_quantization_config("int4", args.quantization_config)
    except ValueError as e:
        ap.error(f"--quantization-config: {e}")
    return methods, qcfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.bench engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small settings (CI / notebook): ~1-3 minutes on a CPU")
    ap.add_argument("--json", nargs="?", const=DEFAULT_JSON, default=None, metavar="PATH",
                    help=f"write the results as JSON (default path {DEFAULT_JSON})")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {','.join(PARTS)}")
    ap.add_argument("--num-requests", type=int, default=None, help="throughput: number of requests (default 64)")
    ap.add_argument("--batch-size", type=int, default=None, help="throughput: static batch size B (default 16)")
    ap.add_argument("--simple-subset", type=int, default=None, help="throughput: requests run one at a time (default 8)")
    ap.add_argument("--quantization", default=None, metavar="M[,M...]",
                    help=f"instead of the four parts: the engine run with quantized weights ({','.join(QUANT_METHODS)}) "
                         f"beside float32; --json defaults to {QUANT_JSON}")
    ap.add_argument("--quantization-config", default=None, help="JSON object for int4, e.g. '{\"group_size\": 64}'")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {','.join(PARTS)}")
    if args.num_requests is not None and args.num_requests < 1:  # 0 would silently run the default 64
        ap.error(f"--num-requests must be at least 1, got {args.num_requests}")
    methods, qcfg = _quant_args(ap, args)  # checked before any run, not after the float32 one
    s = Settings.quick() if args.quick else Settings.full()
    if args.num_requests:
        s.num_requests = args.num_requests
    if args.batch_size:
        s.static_batch_size = args.batch_size
    if args.simple_subset:
        s.simple_subset = args.simple_subset
    from minfer.model.sources import ModelNotFoundError, find_default_gguf

    try:
        find_default_gguf()
    except ModelNotFoundError as e:
        print(f"the default model is missing: {e}")
        return 1
    load_before = round(os.getloadavg()[0], 2)
    if args.quantization:
        t0 = time.perf_counter()
        res = dict(env=environment(), quick=bool(args.quick),
                   quant_throughput=run_quant_throughput(methods, s, progress=not args.no_progress,
                                                         quantization_config=qcfg))
        res["elapsed_s"] = time.perf_counter() - t0
        print(format_quant_report(res))
        if args.json == DEFAULT_JSON:
            args.json = QUANT_JSON
    else:
        res = run_all(s, parts, progress=not args.no_progress)
        print(format_report(res))
    res["load_average_1min_before_after"] = [load_before, round(os.getloadavg()[0], 2)]
    print(f"\n(total {res['elapsed_s']:.0f} s, load average {load_before} -> {res['load_average_1min_before_after'][1]})")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_strip_series(res), indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
