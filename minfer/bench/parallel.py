"""`python -m minfer.bench parallel`: tensor and pipeline parallelism measured (chapter 12).

- The pipeline bubble: for p stages and m micro-batches, the idle share of the stages' time measured from the
  timeline of real runs (`minfer.parallel.timeline`), against GPipe's (p - 1) / (m + p - 1), for a decode step
  (one token per sequence) and a prefill-sized one (128 tokens per sequence), on a random 12-layer Llama;
  per point, what the gap is made of (`explain_gap`: unequal stages, the time between forwards).
- Tensor parallelism: tokens/s at TP=1 and TP=N on the real model, the all-reduce time per token and its
  share of the forward (rank 0's wall clock inside `dist.all_reduce`, which includes waiting for the
  slowest rank; on CUDA read after a device synchronize on both sides, `device_clock`), and what the same
  all-reduces (their measured count and size) would take on a GPU link,
  computed for assumed NVLink and PCIe figures (stated as computed, not measured).

    python -m minfer.bench parallel [--stages 2,3,4] [--micro-batches 1,2,4,8] [--rows 8] [--json assets/benchmarks/parallel_cpu.json]
"""

from __future__ import annotations

import time
from pathlib import Path


def save_random_llama(path, *, layers: int = 4, hidden: int = 64, heads: int = 8, kv_heads: int = 2,
                      intermediate: int = 128, vocab: int = 256, tied: bool = False, seed: int = 0,
                      max_positions: int = 1024) -> str:
    """A random Llama with a word-level tokenizer over `vocab` words ("w0" ...), saved as a Hugging Face
    directory at `path` (the tests', notebook's and benchmark's stand-in: even head counts split over 2 and 4
    ranks). The head is scaled up so greedy paths do not sit on near-ties. Returns the path as a string."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1,
                                   tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        for name, p in model.named_parameters():  # random norms: a misplaced norm cannot hide behind ones
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    words = [f"w{i}" for i in range(vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[2]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=words[0], eos_token=words[1],
                                         unk_token=words[2]).save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------------------
# Assumed links for the computed GPU figures (not measured here): NVLink 4 as on an H100 SXM board, about
# 450 GB/s each way per GPU, and PCIe 4.0 x16, about 25 GB/s; a per-hop latency of a few microseconds.
LINKS = {"nvlink4": dict(bandwidth_GBps=450.0, latency_us=3.0), "pcie4_x16": dict(bandwidth_GBps=25.0, latency_us=10.0)}


def ring_all_reduce_s(nbytes: float, tp: int, bandwidth_GBps: float, latency_us: float) -> float:
    """Seconds of one ring all-reduce of `nbytes` per rank over `tp` ranks: 2(tp - 1) steps, each moving
    nbytes / tp over one link (reduce-scatter then all-gather; Patarasuk & Yuan, 2009)."""
    steps = 2 * (tp - 1)
    return steps * (latency_us * 1e-6 + nbytes / tp / (bandwidth_GBps * 1e9))


def _bubble_points(model: str, stages: list[int], micro: list[int], rows: int, prompt_len: int,
                   repeats: int, log) -> list[dict]:
    import statistics

    from minfer import LLM, SamplingParams
    from minfer.parallel.timeline import bubble_fraction, gpipe_bubble

    points = []
    prefill_prompts = [[3 + (7 * i + j) % 250 for j in range(prompt_len)] for i in range(rows)]
    decode_prompts = [[3 + i, 4 + i, 5 + i, 6 + i] for i in range(rows)]
    for p in stages:
        llm = LLM(model=model, pipeline_parallel_size=p, seed=0, attention_backend="torch", max_model_len=prompt_len + 16,
                  max_num_batched_tokens=rows * (prompt_len + 16), kv_cache_memory_bytes=64 << 20)
        ex = llm.llm_engine.executor
        try:
            for m in micro:
                ex.set_num_micro_batches(m)
                llm.generate(decode_prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up
                ex.collect_timeline()
                for workload in ("prefill", "decode"):
                    fracs, stage_ms = [], []
                    for _ in range(repeats):
                        if workload == "prefill":
                            llm.generate(prefill_prompts, SamplingParams(temperature=0, max_tokens=1))
                        else:
                            llm.generate(decode_prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
                        ev = ex.collect_timeline()
                        tokens = {}
                        for e in ev:
                            if e["stage"] == 0 and e["tp_rank"] == 0:
                                tokens[e["step"]] = tokens.get(e["step"], 0) + e["num_tokens"]
                        want = [s for s, n in tokens.items() if (n == rows) == (workload == "decode")]
                        fracs.append(bubble_fraction(ev, steps=want))
                        per_stage = {}
                        for e in ev:
                            if e["step"] in want and e["tp_rank"] == 0:
                                per_stage.setdefault(e["stage"], []).append((e["end"] - e["start"]) * 1e3)
                        stage_ms.append([statistics.fmean(per_stage[s]) for s in sorted(per_stage)])
                    pt = dict(stages=p, micro_batches=m, workload=workload, measured_bubble=statistics.median(fracs),
                              formula_bubble=gpipe_bubble(p, m),
                              stage_forward_ms=[round(statistics.fmean(c), 3) for c in zip(*stage_ms)],
                              runs=[round(f, 4) for f in fracs])
                    pt["gap"] = pt["measured_bubble"] - pt["formula_bubble"]
                    explain_gap(pt)
                    points.append(pt)
                    log(f"  p={p} m={m} {workload:7s}: idle {pt['measured_bubble']:.3f}  formula "
                        f"{pt['formula_bubble']:.3f}  gap {pt['gap']:+.3f}  stage forward ms {pt['stage_forward_ms']}")
        finally:
            ex.shutdown()
    return points


def explain_gap(pt: dict) -> dict:
    """Add to one bubble point what its gap from the formula is made of (times in ms, from its own numbers):
    `step_span_ms` = busy / (p x (1 - measured bubble)); `span_from_stage_times_ms` = the step with the
    measured, unequal stage forward times and instant hand-offs (their sum + (m - 1) x the longest);
    `bubble_from_stage_times`, that step's idle share; `between_forwards_ms`, the rest of the measured step:
    building each micro-batch's inputs and the send/recv between stages. Means and a median are mixed, so
    the split holds to about 2% of a step."""
    p, m, t = pt["stages"], pt["micro_batches"], pt["stage_forward_ms"]
    busy = m * sum(t)
    span = busy / (p * (1 - pt["measured_bubble"]))
    ideal = sum(t) + (m - 1) * max(t)
    pt.update(step_span_ms=round(span, 3), span_from_stage_times_ms=round(ideal, 3),
              bubble_from_stage_times=round(1 - busy / (p * ideal), 4), between_forwards_ms=round(span - ideal, 3))
    return pt


def _tp_points(model: str, sizes: list[int], decode_tokens: int, prompt_len: int, log) -> list[dict]:
    from minfer import LLM, SamplingParams

    prompt = [3 + (11 * j) % 250 for j in range(prompt_len)]
    out = []
    for tp in sizes:
        llm = LLM(model=model, tensor_parallel_size=tp, seed=0, max_model_len=max(prompt_len + 8, 64) * 2,
                  kv_cache_memory_bytes=64 << 20)
        eng = llm.llm_engine
        ex = eng.executor
        try:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
            for workload in ("decode", "prefill"):
                if tp > 1:
                    ex.comm_stats()
                f0 = eng.forward_time_s
                t0 = time.perf_counter()
                if workload == "decode":
                    o = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=decode_tokens,
                                                                     ignore_eos=True))
                    tokens = len(o[0].outputs[0].token_ids)
                else:
                    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
                    tokens = prompt_len
                wall = time.perf_counter() - t0
                fwd = eng.forward_time_s - f0
                pt = dict(tp=tp, workload=workload, tokens=tokens, wall_s=wall, forward_s=fwd,
                          tokens_per_s=tokens / wall)
                if tp > 1:
                    stats = ex.comm_stats()
                    r0 = stats[0]
                    calls, nbytes = r0["all_reduce_calls"], r0["all_reduce_bytes"]
                    pt.update(all_reduce_calls=calls, all_reduce_bytes=nbytes, all_reduce_s=r0["all_reduce_s"],
                              all_reduce_ms_per_token=r0["all_reduce_s"] / tokens * 1e3,
                              all_reduce_share_of_forward=r0["all_reduce_s"] / fwd,
                              all_gather_s=r0["all_gather_s"],
                              all_reduce_s_per_rank=[s["all_reduce_s"] for s in stats])
                    mean_bytes = nbytes / max(calls, 1)
                    pt["computed_on_links"] = {
                        name: dict(link, all_reduce_ms_per_token=calls * ring_all_reduce_s(mean_bytes, tp, **link)
                                   / tokens * 1e3)
                        for name, link in LINKS.items()}
                out.append(pt)
                log(f"  tp={tp} {workload:7s}: {pt['tokens_per_s']:.1f} tok/s"
                    + (f", all-reduce {pt['all_reduce_ms_per_token']:.3f} ms/token, "
                       f"{pt['all_reduce_share_of_forward']:.0%} of the forward" if tp > 1 else ""))
        finally:
            ex.shutdown()
    for pt in out:
        base = next(b for b in out if b["tp"] == 1 and b["workload"] == pt["workload"])
        pt["speedup_vs_tp1"] = pt["tokens_per_s"] / base["tokens_per_s"]
    add_computed_scaling(out)
    return out


def add_computed_scaling(points: list[dict]) -> None:
    """Computed, not measured: for each TP>1 point, the speed-up TP would give if the TP=1 forward time per
    token measured here were split perfectly over the ranks and the all-reduces cost what `computed_on_links`
    says, (t1) / (t1 / tp + all-reduce on the link), and the all-reduce's share of that step."""
    for pt in points:
        if pt["tp"] == 1 or "computed_on_links" not in pt:
            continue
        base = next(b for b in points if b["tp"] == 1 and b["workload"] == pt["workload"])
        t1 = base["forward_s"] / base["tokens"] * 1e3  # ms per token at TP=1
        for link in pt["computed_on_links"].values():
            comm = link["all_reduce_ms_per_token"]
            link["computed_speedup_vs_tp1"] = t1 / (t1 / pt["tp"] + comm)
            link["computed_all_reduce_share"] = comm / (t1 / pt["tp"] + comm)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os
    import platform
    import tempfile

    import torch

    ap = argparse.ArgumentParser(prog="python -m minfer.bench parallel", description=__doc__)
    ap.add_argument("--stages", default="2,3,4", help="pipeline sizes p (default 2,3,4)")
    ap.add_argument("--micro-batches", default="1,2,4,8", help="micro-batch counts m (default 1,2,4,8)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; the median is reported (default 3)")
    ap.add_argument("--tp-model", default="smollm2-135m-instruct",
                    help="model of the TP measurement (default: SmolLM2, whose 9 heads split over 3 ranks)")
    ap.add_argument("--tp-sizes", default="1,3", help="TP sizes (default 1,3; 1 is the baseline)")
    ap.add_argument("--rows", type=int, default=32, help="sequences per pipeline step (default 32; m of them "
                    "split into micro-batches, so m=8 with 32 rows is four sequences per micro-batch)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prefill tokens per sequence (default 128)")
    ap.add_argument("--skip-tp", action="store_true", help="only the pipeline bubble")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # rank 0 runs with the workers' one thread, so the stages are equal
    log = lambda s: print(s, flush=True)  # noqa: E731
    stages = [int(x) for x in a.stages.split(",")]
    micro = [int(x) for x in a.micro_batches.split(",")]
    result = dict(machine=dict(cpu_count=os.cpu_count(), platform=platform.platform(), torch=torch.__version__,
                               load_avg_at_start=os.getloadavg()),
                  note="measured on a shared 2-core CPU machine (other jobs running); gloo over loopback; "
                       "every rank one thread. The computed_on_links figures are computed from the measured "
                       "all-reduce counts and sizes with assumed link bandwidths/latencies (LINKS), not measured.")
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_llama(Path(tmp) / "bubble", layers=12, hidden=256, heads=8, kv_heads=2,
                                  intermediate=768, vocab=512)
        log(f"pipeline bubble: random Llama, 12 layers x 256 wide; {a.rows} sequences of {a.prompt_len} "
            f"tokens; p={stages}, m={micro}")
        result["bubble"] = dict(model="random Llama: 12 layers, hidden 256, 8 heads / 2 KV heads, vocab 512",
                                rows=a.rows, prefill_tokens_per_row=a.prompt_len,
                                points=_bubble_points(model, stages, micro, rows=a.rows, prompt_len=a.prompt_len,
                                                      repeats=a.repeats, log=log))
    if not a.skip_tp:
        sizes = [int(x) for x in a.tp_sizes.split(",")]
        log(f"tensor parallelism: {a.tp_model}, tp={sizes}")
        result["tp"] = dict(model=a.tp_model, links_assumed=LINKS,
                            points=_tp_points(a.tp_model, sizes, decode_tokens=16, prompt_len=256, log=log))
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {a.json}")
    return 0
