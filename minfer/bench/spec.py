"""`python -m minfer.bench spec`: speculative decoding's speed-up against its acceptance rate (chapter 7b).

For each method (none, n-gram prompt lookup with k = 2, 4, 6, a draft model) and each workload — an
input-grounded one (copy a given passage: the output repeats the input) and free generation (a story) —
greedy decoding of one request (batch 1) and of a batch of 4, on the real SmolLM2-135M-Instruct. Reports
tokens/s, the speed-up over no speculation in the same run, the acceptance rate α, the mean tokens per
verification round, and the speed-up predicted by Leviathan et al.'s formula

    speed-up = (1 - α^(k+1)) / ((1 - α)(k·c + 1))

with c the cost of one proposal step relative to one target decode step (0 for n-gram lookup; 1 for the
only draft pair available here, the model itself: no smaller model shares SmolLM2's tokenizer in this
environment). Also checks that every speculative output equals the output without speculation.

    python -m minfer.bench spec [--quick] [--only-interleaved] [--json assets/benchmarks/spec_decode_cpu.json]

The sweep runs each method after the other; on a shared machine the load drifts between them, so the
batch-1 speed-ups are measured again interleaved (all methods loaded, timed in turn each round).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PASSAGE = (
    "The old harbour town wakes slowly. At six the bakery on the corner lifts its shutters, and the smell of "
    "bread drifts down to the quay, where the fishing boats knock gently against the stone. By seven the "
    "ferry to the islands has left, carrying a few tired workers and a dog that belongs to nobody. The market "
    "opens at eight: tomatoes, lemons, bright green beans, and a man who sells only keys. Nobody knows where "
    "he finds them, and nobody asks.")
WORKLOADS = {
    "grounded": "Repeat the following passage exactly, word for word, with no comment:\n\n" + PASSAGE,
    "free": "Write a short story about a lighthouse keeper who finds a strange machine on the beach.",
}


def methods(quick: bool) -> dict:
    m = {"none": None,
         "ngram-k2": dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4, prompt_lookup_min=1),
         "ngram-k4": dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1),
         "ngram-k6": dict(method="ngram", num_speculative_tokens=6, prompt_lookup_max=4, prompt_lookup_min=1),
         "draft-self-k3": dict(method="draft_model", model="smollm2-135m-instruct", num_speculative_tokens=3)}
    if quick:
        m = {k: m[k] for k in ("none", "ngram-k4", "draft-self-k3")}
    return m


QUANTIZED_DRAFT_METHODS = ("none", "draft-self-k3", "draft-int8-k3", "draft-int4-k3")


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. (2023), eq. for the expected improvement in walltime: (1 - α^(k+1)) / ((1 - α)(kc + 1))."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


def alpha_from_round_length(mean_tokens: float, k: int) -> float:
    """The α whose expected tokens per round (1 - α^(k+1)) / (1 - α) is `mean_tokens` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if predicted_speedup(mid, k, 0.0) < mean_tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def run(quick: bool = False, progress: bool = True) -> dict:
    from minfer import LLM, SamplingParams
    from minfer.bench.engine import environment

    max_tokens = 32 if quick else 64
    batch = 4
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    res = dict(env={**environment(), "note": "measured on a shared CPU (other jobs running): compare the ratios "
                                              "within this run, not the absolute tokens/s"},
               max_tokens=max_tokens, batch=batch, results={})
    baseline: dict = {}
    toks_of: dict = {}
    # No speculation is measured first and again last: on a shared CPU the load drifts during the run, and
    # each speed-up is taken against the mean of the two baselines.
    plan = list(methods(quick).items()) + [("none_again", None)]
    for name, spec in plan:
        llm = LLM(max_model_len=1024, seed=0, kv_cache_memory_bytes=64 << 20, speculative_config=spec)
        prompts = {w: llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for w, p in WORKLOADS.items()}
        llm.generate(prompts["free"], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        for w, ids in prompts.items():
            for bs in (1, batch):
                before = llm.stats()
                t0 = time.perf_counter()
                outs = llm.generate([ids] * bs, params)
                dt = time.perf_counter() - t0
                st = llm.stats()
                toks = [o.outputs[0].token_ids for o in outs]
                n_out = sum(len(t) for t in toks)
                drafts = st.spec_decode_num_drafts - before.spec_decode_num_drafts
                proposed = st.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                accepted = st.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
                steps = st.num_steps - before.num_steps
                fwd = st.forward_time_s - before.forward_time_s
                per_pos = [a - b for a, b in zip(st.spec_decode_num_accepted_tokens_per_pos,
                                                 list(before.spec_decode_num_accepted_tokens_per_pos)
                                                 + [0] * len(st.spec_decode_num_accepted_tokens_per_pos))]
                row = dict(seconds=dt, output_tokens=n_out, tok_s=n_out / dt, steps=steps,
                           forward_s_per_step=fwd / max(steps, 1), num_drafts=drafts, num_draft_tokens=proposed,
                           num_accepted_tokens=accepted, num_accepted_tokens_per_pos=per_pos)
                key = f"{w}/bs{bs}"
                if spec is None:
                    baseline.setdefault(key, []).append(row)
                toks_of[name, key] = toks
                res["results"].setdefault(name, {})[key] = row
                if progress:
                    print(f"{name:14s} {key:12s} {row['tok_s']:7.1f} tok/s", file=sys.stderr, flush=True)
        del llm
    for name, spec in plan:
        if spec is None:
            continue
        for key, row in res["results"][name].items():
            base_tok_s = sum(b["tok_s"] for b in baseline[key]) / len(baseline[key])
            base_step_s = sum(b["forward_s_per_step"] for b in baseline[key]) / len(baseline[key])
            b0 = baseline[key][0]
            k = spec["num_speculative_tokens"]
            c = 0.0 if spec["method"] == "ngram" else 1.0
            drafts, accepted, proposed = row["num_drafts"], row["num_accepted_tokens"], row["num_draft_tokens"]
            mean_round = 1 + accepted / drafts if drafts else 1.0
            alpha = alpha_from_round_length(mean_round, k) if drafts else 0.0
            row.update(same_output_as_none=toks_of[name, key] == toks_of["none", key],
                       speedup=row["tok_s"] / base_tok_s,
                       speedup_range=[row["tok_s"] / max(b["tok_s"] for b in baseline[key]),
                                      row["tok_s"] / min(b["tok_s"] for b in baseline[key])],
                       acceptance_rate=accepted / proposed if proposed else 0.0,
                       mean_tokens_per_round=mean_round, alpha=alpha, k=k, c=c,
                       predicted_speedup=predicted_speedup(alpha, k, c),
                       step_cost_ratio=row["forward_s_per_step"] / base_step_s,
                       tokens_per_step_ratio=(row["output_tokens"] / row["steps"]) / (b0["output_tokens"] / b0["steps"]))
            if progress:
                print(f"{name:14s} {key:12s} x{row['speedup']:.2f} (formula x{row['predicted_speedup']:.2f}, "
                      f"alpha {alpha:.2f}, same={row['same_output_as_none']})", file=sys.stderr, flush=True)
    return res


def run_interleaved(rounds: int = 3, max_tokens: int = 32, progress: bool = True,
                    names: tuple[str, ...] = ("none", "ngram-k4", "draft-self-k3")) -> dict:
    """Batch 1 only, all methods loaded at once and timed in turn, round after round: each speed-up is taken
    against the run without speculation of the same round, so a shared machine's load drift (which moves
    a whole run by 2-4x here) cancels. `names`: the methods of `_all_methods` to compare ("none" first).
    Returns per method and workload the per-round speed-ups and median, the acceptance rate (accepted /
    proposed draft tokens, all rounds) and whether every output equalled the one without speculation."""
    import statistics

    from minfer import LLM, SamplingParams

    every = _all_methods()
    chosen = {k: every[k] for k in names}
    llms = {name: LLM(max_model_len=1024, seed=0, kv_cache_memory_bytes=64 << 20, speculative_config=spec)
            for name, spec in chosen.items()}
    tok = llms["none"].tokenizer
    prompts = {w: tok.encode_chat([{"role": "user", "content": p}]) for w, p in WORKLOADS.items()}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts["free"], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    out: dict = {name: {w: [] for w in WORKLOADS} for name in chosen if name != "none"}
    same: dict = {name: True for name in out}
    counts: dict = {name: [0, 0] for name in out}  # accepted, proposed draft tokens
    for r in range(rounds):
        for w, ids in prompts.items():
            times = {}
            order = list(chosen)
            order = order[r % len(order):] + order[:r % len(order)]  # rotate who goes first
            toks = {}
            for name in order:
                before = llms[name].stats()
                t0 = time.perf_counter()
                toks[name] = llms[name].generate(ids, params)[0].outputs[0].token_ids
                times[name] = time.perf_counter() - t0
                st = llms[name].stats()
                if name in counts:
                    counts[name][0] += st.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
                    counts[name][1] += st.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            for name in out:
                same[name] = same[name] and toks[name] == toks["none"]
            for name in out:
                out[name][w].append(times["none"] / times[name])
            if progress:
                print(f"round {r} {w}: " + ", ".join(f"{n} {max_tokens / t:.1f} tok/s" for n, t in times.items()),
                      file=sys.stderr, flush=True)
    return dict(rounds=rounds, max_tokens=max_tokens, batch=1,
                speedup={n: {w: dict(per_round=v, median=statistics.median(v)) for w, v in d.items()}
                         for n, d in out.items()},
                acceptance_rate={n: a / p if p else 0.0 for n, (a, p) in counts.items()},
                same_output_as_none=same)


def _all_methods() -> dict:
    """Every method, and the target's own weights quantized as the draft (`--quantized-draft`: c below 1)."""
    m = methods(False)
    spec = dict(method="draft_model", model="smollm2-135m-instruct", num_speculative_tokens=3)
    m.update({"draft-int8-k3": dict(spec, quantization="int8"), "draft-int4-k3": dict(spec, quantization="int4")})
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="three methods, 32 tokens instead of 64")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    ap.add_argument("--only-interleaved", action="store_true",
                    help="only the interleaved batch-1 comparison; added to the --json file if it exists")
    ap.add_argument("--quantized-draft", action="store_true",
                    help="only the interleaved batch-1 comparison of the target as its own draft in float32, "
                         "int8 and int4 (speculative_config quantization)")
    args = ap.parse_args(argv)
    if args.quantized_draft:
        res = {"machine": "2 CPU cores shared with four other jobs: compare ratios within this run only",
               "interleaved": run_interleaved(rounds=2, max_tokens=32, names=QUANTIZED_DRAFT_METHODS)}
    elif args.only_interleaved:
        import os

        res = json.load(open(args.json)) if args.json and os.path.exists(args.json) else {}
        res["interleaved"] = run_interleaved()
    else:
        res = run(quick=args.quick)
        res["interleaved"] = run_interleaved(rounds=2 if args.quick else 3, max_tokens=16 if args.quick else 32)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
