"""The server benchmark's workload without the server: where an engine step's time goes, and what scheduling does.

    python benchmarks/wave_profile.py [--model /tmp/smollm2-hf] [--dtype float32] [--num-prompts 48]
        [--concurrency 16] [--input-len 192] [--output-len 48] [--chunked --max-num-batched-tokens N]
        [--profile] [--breakdown] [--json PATH]

`benchmarks/peer_vllm_serve.py` drives both servers with a closed loop: `--concurrency` clients, each sending
its next request (random token ids, `ignore_eos`) when the last one finishes. This script replays that loop
on `LLMEngine` directly, one step at a time: a new request is added as soon as one finishes, so the steps
are the ones the server's engine process would run, minus HTTP. It reports output tok/s, TTFT and TPOT as
`vllm bench serve` defines them (TPOT = (last token - first token) / (tokens - 1), per request, then the
mean), a histogram of the steps (prefill-carrying and decode-only, their rows and times), and with
`--profile` a torch.profiler table of the first `--profile-steps` steps by op (self CPU time); the profiler
slows the steps it records, so a profiled run's throughput and latencies are not the unprofiled ones.

`--breakdown` times the parts of every step with wall clocks around them (no profiler): each projection
(q|k|v, o, gate|up, down, LM head) in decode-only steps and in prefill-carrying ones, with its GFLOP/s, and the
same projection timed alone afterwards at the same rows with warm caches; attention split into prefill
(`attend_prefill`), decode (the paged kernel, with the K/V bytes it read per second), the K/V store and the
gather of earlier chunks; and the machine's streaming read speed (a sum over 1 GiB). It is how lab notes 9b
§9b.17 finds where a 64-stream step's time goes.

It is the quick way to compare scheduler settings (`--chunked`, `--max-num-batched-tokens`) and engine
changes before the servers are measured; its numbers are the engine's ceiling for the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def sched_decode_only(sched) -> bool:
    """True when the step about to run has no prompt tokens (every waiting request has to wait and every running
    sequence has its prompt in the cache): read from the scheduler before `engine.step()`."""
    return not sched.waiting and all(s.num_computed_tokens >= s.num_prompt_tokens for s in sched.running)


def gflops(flops: float, seconds: float) -> float | None:
    return round(flops / seconds / 1e9, 1) if seconds > 0 else None


def summarize_parts(seconds: dict, flops: dict, wall: float) -> dict:
    """`seconds` / `flops`: {(part, kind): value}, kind "decode" or "prefill" -> {part: {kind: {s, share, GFLOP/s}}}
    with each part's share of `wall` (seconds); GFLOP/s where the part has a FLOP count (the projections)."""
    out: dict = {}
    for (part, kind), s in sorted(seconds.items()):
        entry = {"s": round(s, 3), "share": round(s / wall, 4) if wall > 0 else None}
        if flops.get((part, kind)):
            entry["gflops"] = gflops(flops[(part, kind)], s)
        out.setdefault(part, {})[kind] = entry
    return out


class Breakdown:
    """Wall clocks around each projection's forward and the attention backend's parts (see the module docstring).
    `decode_only` is set before each step; `restore()` puts the original methods back."""

    def __init__(self, engine, concurrency: int):
        import collections

        self.engine, self.concurrency, self.decode_only = engine, concurrency, False
        self.seconds, self.flops = collections.defaultdict(float), collections.defaultdict(float)
        self.kv_bytes = 0.0
        self._undo = []
        self.shapes = {}
        for name, mod in engine.worker.model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in PROJECTIONS and hasattr(mod, "in_features"):
                self.shapes.setdefault(leaf, mod)
                self._wrap(mod, "forward", leaf, flops=True)
        backend = engine.worker.backend
        for attr, part in (("attend_prefill", "attn_prefill"), ("_decode", "attn_decode"), ("_store", "kv_store"),
                           ("_gather_kv", "kv_gather")):
            if hasattr(backend, attr):
                self._wrap(backend, attr, part)

    def _wrap(self, obj, attr, part, flops=False):
        orig = getattr(obj, attr)
        had = attr in vars(obj)

        def timed(*a, **k):
            t = time.perf_counter()
            r = orig(*a, **k)
            dt = time.perf_counter() - t
            kind = "decode" if self.decode_only else "prefill"
            self.seconds[(part, kind)] += dt
            if flops:
                x = a[0]
                self.flops[(part, kind)] += 2 * x.shape[0] * x.shape[-1] * r.shape[-1]
            if part == "attn_decode":
                ctx = a[3]
                meta = ctx.attn_metadata.decode
                lens = getattr(meta, "context_lens", None)
                if lens is not None:
                    kv = a[1]
                    self.kv_bytes += 2 * int(lens.sum()) * kv.shape[-1] * kv.shape[-2] * kv.element_size()
            return r

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, orig if had else None))

    def reset(self):
        self.seconds.clear()
        self.flops.clear()
        self.kv_bytes = 0.0

    def restore(self):
        for obj, attr, orig in reversed(self._undo):
            if orig is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, orig)
        self._undo.clear()

    def summary(self, wall: float) -> dict:
        out = summarize_parts(self.seconds, self.flops, wall)
        dec = self.seconds.get(("attn_decode", "decode"), 0.0) + self.seconds.get(("attn_decode", "prefill"), 0.0)
        out["attn_decode_kv_gb_s"] = round(self.kv_bytes / dec / 1e9, 2) if dec else None
        out["wall_s"] = round(wall, 3)
        return out

    def warm_linears(self, rows=(64, 512), repeats: int = 20) -> dict:
        """Each projection alone, through its own layout's forward, `repeats` times at each row count: GFLOP/s
        with the weights (and everything else) warm in the caches, as in a GEMM benchmark."""
        import torch

        out = {}
        for leaf, mod in self.shapes.items():
            k = mod.in_features
            for m in rows:
                x = torch.randn(m, k, dtype=torch.float32)
                with torch.inference_mode():
                    mod(x)
                    t = time.perf_counter()
                    for _ in range(repeats):
                        y = mod(x)
                    dt = (time.perf_counter() - t) / repeats
                out.setdefault(leaf, {})[str(m)] = gflops(2 * m * k * y.shape[-1], dt)
        return out


def stream_read_gb_s(gib: float = 1.0) -> float:
    """GB/s of a sum over `gib` GiB of float32 on torch's threads (best of 3): the machine's streaming read speed."""
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return round(x.numel() * 4 / best / 1e9, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/tmp/smollm2-hf",
                    help="a model minfer loads (default: peer_vllm_serve.py's HF export of the default GGUF, "
                         "written there first when missing, so that both scripts run the same weights)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--chunked", action="store_true", help="enable_chunked_prefill")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=4, help="requests run before the measured loop")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over the first --profile-steps steps")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--breakdown", action="store_true", help="wall-clock each projection and attention part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", choices=["auto", "reference"], default="auto", help="EngineArgs.kernels")
    ap.add_argument("--enforce-eager", action="store_true", help="EngineArgs.enforce_eager (no step runner)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.model == "/tmp/smollm2-hf" and not os.path.isdir(args.model):
        from pathlib import Path

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from peer_vllm_serve import export_hf_dir

        print(f"exporting the default GGUF to {args.model} (float32 HF directory) ...", file=sys.stderr)
        export_hf_dir(Path(args.model))

    import torch

    from minfer import SamplingParams
    from minfer.config import EngineArgs
    from minfer.engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.concurrency,
        kv_cache_memory_bytes=1 << 30, enable_chunked_prefill=args.chunked,
        max_num_batched_tokens=args.max_num_batched_tokens, kernels=args.kernels, enforce_eager=args.enforce_eager))
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def prompt():
        return [rng.randrange(vocab) for _ in range(args.input_len)]

    parts = Breakdown(engine, args.concurrency) if args.breakdown else None
    for i in range(args.warmup):
        engine.add_request(f"warm{i}", prompt()[:16], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()

    if parts is not None:
        parts.reset()
    prompts = [prompt() for _ in range(args.num_prompts)]
    sent, done, results, steps = 0, 0, [], []
    profiler_teardown_s = 0.0

    def send():
        nonlocal sent
        engine.add_request(str(sent), prompts[sent], params, arrival_time=time.perf_counter())
        sent += 1

    prof = None
    if args.profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    t_start = time.perf_counter()
    for _ in range(min(args.concurrency, args.num_prompts)):
        send()
    while done < args.num_prompts:
        sched = engine.scheduler
        t0 = time.perf_counter()
        if parts is not None:
            parts.decode_only = sched_decode_only(sched)
        outs = engine.step()
        dt = time.perf_counter() - t0
        n_tok = engine.last_step_num_tokens
        # rows of this step that were prefill (a step's decodes are one token per running decoding sequence)
        steps.append({"s": round(dt, 4), "tokens": n_tok, "seqs": len(sched.running)})
        for o in outs:
            if o.finished:
                done += 1
                m = o.metrics
                n = len(o.outputs[0].token_ids)
                results.append({"ttft": m.first_token_time - m.arrival_time,
                                "tpot": (m.last_token_time - m.first_token_time) / max(n - 1, 1), "n": n})
                if sent < args.num_prompts:
                    send()
        if prof is not None and len(steps) == args.profile_steps:
            t_exit = time.perf_counter()
            prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            prof = None
            profiler_teardown_s = time.perf_counter() - t_exit
    # The profiler's teardown (seconds, inside the loop) is taken out of the wall time; the requests in flight
    # across it still see it in their TTFT/TPOT, so read a profiled run's step times, not its latencies.
    wall = time.perf_counter() - t_start - profiler_teardown_s
    if prof is not None:
        prof.__exit__(None, None, None)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)

    out_tokens = sum(r["n"] for r in results)
    decode_only = [s["s"] for s in steps if s["tokens"] <= args.concurrency]
    prefill = [s for s in steps if s["tokens"] > args.concurrency]
    summary = {
        "output_tok_s": out_tokens / wall, "wall_s": wall,
        "mean_ttft_ms": 1000 * statistics.mean(r["ttft"] for r in results),
        "mean_tpot_ms": 1000 * statistics.mean(r["tpot"] for r in results),
        "profiler_teardown_s": profiler_teardown_s, "steps": len(steps), "decode_only_steps": len(decode_only),
        "decode_only_median_ms": 1000 * statistics.median(decode_only) if decode_only else None,
        "decode_only_total_s": sum(decode_only),
        "prefill_steps": len(prefill), "prefill_total_s": sum(s["s"] for s in prefill),
        "prefill_tokens_per_step_mean": statistics.mean(s["tokens"] for s in prefill) if prefill else None,
        # turning batches into tensors (`ModelRunner.prepare_inputs`), whole run incl. warm-up, per step
        "prepare_ms_per_step": 1000 * engine.worker.build_time_s / max(engine.num_steps, 1),
    }
    breakdown = None
    if parts is not None:
        parts.restore()
        breakdown = parts.summary(wall)
        breakdown["warm_linear_gflops"] = parts.warm_linears(rows=(args.concurrency, 512))
        breakdown["stream_read_gb_s"] = stream_read_gb_s()
    cfg = {k: v for k, v in vars(args).items() if k != "json"}
    cfg["threads"] = torch.get_num_threads()
    print(json.dumps(cfg))
    for k, v in summary.items():
        print(f"  {k:28s} {v:.3f}" if isinstance(v, float) else f"  {k:28s} {v}")
    if args.profile:
        print(table)
    if breakdown is not None:
        print(json.dumps(breakdown, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"note": "one process, closed loop as the server benchmark's client; shared 2-core machine",
                       "load_average": os.getloadavg(), "config": cfg, "summary": summary, "steps": steps,
                       "profile": table if args.profile else None, "breakdown": breakdown}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
