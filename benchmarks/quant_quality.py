"""The quality table of chapter 5: perplexity and greedy agreement per weight-quantization method.

    python benchmarks/quant_quality.py [--model smollm2-135m-instruct] [--group-size 64]
                                       [--json assets/benchmarks/quant_quality_cpu.json]

For each configuration (float32, bfloat16, int8 (W8A8 on a CPU: the integer GEMM rounds activations too),
int8 W8A16 (weight-only: `{"kernel": "torch"}`), int4 RTN at g32 and g64, AWQ and GPTQ at --group-size,
gguf, and each `--kv-cache-dtypes` entry the build accepts): `minfer.eval.perplexity` on the first
--max-tokens tokens of the shipped eval text in windows of --window tokens, and the greedy agreement with
float32 over 64 tokens on 20 prompts (windows of the eval text after the scored part). AWQ and GPTQ are
first calibrated and saved by `minfer.quantize.quantize_model` (timed) and loaded from their directories,
the way a user runs them. Every number comes from this one run; timings are from a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--group-size", type=int, default=64, help="AWQ's and GPTQ's group size")
    p.add_argument("--max-tokens", type=int, default=20480)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--samples", type=int, default=32, help="calibration windows of 256 tokens")
    p.add_argument("--n-grid", type=int, default=20, help="AWQ's grid points (scale exponent; clipping: half)")
    p.add_argument("--max-rows", type=int, default=512, help="calibration rows AWQ's scale search reads")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--only", default=None, help="comma-separated subset of configuration names")
    p.add_argument("--kv-cache-dtypes", default="int8,fp8_e4m3,fp8_e5m2", help="KV dtypes to try (skipped if not built)")
    p.add_argument("--reference-greedy-only", action="store_true",
                   help="float32 gives only the greedy reference (no perplexity): for a second process that "
                   "measures other configurations against the same reference, merged afterwards")
    p.add_argument("--no-greedy", action="store_true", help="perplexity only")
    p.add_argument("--skip-float32", action="store_true", help="no float32 row (merged from another run)")
    p.add_argument("--reuse-calibration", action="store_true",
                   help="load an AWQ/GPTQ directory already in --workdir instead of calibrating again")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 is faster on a busy machine)")
    p.add_argument("--gptq-desc-act", action="store_true", help="GPTQ with act-order (desc_act)")
    p.add_argument("--workdir", default="/tmp/minfer-quant-quality")
    p.add_argument("--json", default="assets/benchmarks/quant_quality_cpu.json")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no measuring: merge these runs' JSON into --json (rows of the first run first; a later "
                   "run's rows that the first lacks are appended, its greedy agreement kept only if its "
                   "float32 reference tokens are the first run's)")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.group_size, args.json)

    import torch

    from minfer import LLM
    from minfer.config import EngineArgs
    from minfer.eval import greedy_agreement, greedy_tokens, perplexity
    from minfer.memory import weight_bytes
    from minfer.quantize import quantize_model

    torch.set_num_threads(min(args.threads, os.cpu_count() or 1))
    G = args.group_size
    work = Path(args.workdir)
    configs = [("float32", {}), (f"int4 g{G} RTN", {"quantization": "int4", "quantization_config": {"group_size": G}}),
               (f"GPTQ g{G}", {"saved": "gptq"}), (f"AWQ g{G}", {"saved": "awq"}), ("int8", {"quantization": "int8"}),
               # the row above runs the CPU's integer GEMM, which also rounds activations (W8A8); this one
               # keeps them in bfloat16 (weight-only, W8A16), the comparison the article's claim is about
               ("int8 W8A16", {"quantization": "int8", "quantization_config": {"kernel": "torch"}}),
               ("int4 g32 RTN", {"quantization": "int4", "quantization_config": {"group_size": 32}}),
               ("gguf (Q4_1 blocks)", {"quantization": "gguf"}), ("bfloat16", {"dtype": "bfloat16"})]
    for kv in filter(None, args.kv_cache_dtypes.split(",")):
        configs.append((f"KV {kv}", {"kv_cache_dtype": kv}))
    # the article's mixed recipe: 4-bit weights, bfloat16 activations (the whole model runs in bfloat16),
    # an INT8 KV cache
    configs.append((f"int4 g{G} + bf16 activations + KV int8",
                    {"quantization": "int4", "quantization_config": {"group_size": G}, "dtype": "bfloat16",
                     "kv_cache_dtype": "int8"}))
    if args.only:  # in the order given (float32 first: the reference)
        keep = args.only.split(",")
        unknown = [k for k in keep if k not in {c[0] for c in configs}]
        if unknown:
            raise SystemExit(f"--only: unknown configuration(s) {unknown}; choose from "
                             f"{', '.join(repr(c[0]) for c in configs)}")
        configs = sorted((c for c in configs if c[0] in keep or (c[0] == "float32" and not args.skip_float32)),
                         key=lambda c: -1 if c[0] == "float32" else keep.index(c[0]))

    result = {"model": args.model, "text": "minfer/data/eval_python_docs.txt", "window": args.window,
              "max_tokens": args.max_tokens, "group_size": G, "calibration_samples": args.samples,
              "calibration_seq_len": 256, "awq_n_grid": args.n_grid, "awq_max_rows": args.max_rows,
              "prompts": args.prompts, "new_tokens": args.new_tokens, "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "note": "shared 2-core CPU machine; times are indicative",
              "loadavg_start": os.getloadavg(), "rows": [], "calibration": {}}
    reference = prompts = None
    for name, kw in configs:
        kw = dict(kw)
        row = {"name": name, **{k: v for k, v in kw.items()}}
        if "saved" in kw:
            method = kw.pop("saved")
            out = work / f"{method}-g{G}"
            t = time.perf_counter()
            extra = {"n_grid": args.n_grid, "max_rows": args.max_rows} if method == "awq" else {}
            if method == "gptq":
                extra = {"desc_act": args.gptq_desc_act}
                row["desc_act"] = args.gptq_desc_act
            if args.reuse_calibration and (out / "config.json").is_file():
                summary = None
            else:
                summary = quantize_model(args.model, method, G, out, n_samples=args.samples, seq_len=256, **extra)
            if summary is not None:
                result["calibration"][method] = {"seconds": time.perf_counter() - t, "out": str(out),
                                                 "awq_losses": summary["awq_losses"]}
            kw = {"model": str(out)}
        else:
            kw["model"] = args.model
        if "kv_cache_dtype" in kw:
            try:
                EngineArgs(kv_cache_dtype=kw["kv_cache_dtype"])
            except ValueError as e:
                row["skipped"] = f"not in this build: {e}"
                result["rows"].append(row)
                print(name, row["skipped"], flush=True)
                continue
        t = time.perf_counter()
        llm = LLM(max_model_len=args.window + 1, seed=0, **kw)
        if prompts is None:
            ids = llm.get_tokenizer().encode(open(Path(__file__).resolve().parents[1] / "minfer/data" /
                                                  "eval_python_docs.txt").read(), add_special_tokens=False)
            rest = ids[args.max_tokens:]
            prompts = [{"prompt_token_ids": rest[i * 96:i * 96 + 32]} for i in range(args.prompts)]
            result["text_tokens"] = len(ids)
        if not (args.reference_greedy_only and reference is None):
            res = perplexity(llm, window=args.window, max_tokens=args.max_tokens)
            row.update(ppl=res.ppl, nll=res.nll, num_tokens=res.num_tokens, ppl_seconds=time.perf_counter() - t)
        if not args.no_greedy:
            toks = greedy_tokens(llm, prompts, args.new_tokens)
            if reference is None:
                reference = toks
                result["reference_tokens"] = toks
            row["greedy_agreement"] = greedy_agreement(toks, reference)
        row["weight_bytes"] = weight_bytes(llm.llm_engine.worker.model)
        row["loadavg"] = os.getloadavg()
        result["rows"].append(row)
        print(f"{name:40s} ppl {row.get('ppl', float('nan')):8.3f}  agree {row.get('greedy_agreement')}", flush=True)
        del llm
        gc.collect()
        _finish(result, G, args.json)
    _finish(result, G, args.json)
    print("wrote", args.json)
    return 0


def merge(paths: list[str], G: int, out: str) -> int:
    """`--merge`: one JSON from several runs of this script (each measured its rows against its own float32;
    the float32 greedy tokens are deterministic, and merging checks they are equal)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    result = dict(runs[0], merged_from=[str(p) for p in paths], runs=[])
    names = {r["name"] for r in result["rows"]}
    for path, run in zip(paths, runs):
        same_ref = run.get("reference_tokens") == result.get("reference_tokens")
        result["runs"].append({"json": str(path), "loadavg_start": run.get("loadavg_start"),
                               "loadavg_end": run.get("loadavg_end"), "same_float32_greedy_tokens": same_ref,
                               "calibration_samples": run.get("calibration_samples")})
        for row in run["rows"]:
            if row["name"] in names:
                continue
            row = dict(row, run=str(path))
            if not same_ref:
                row.pop("greedy_agreement", None)
            result["rows"].append(row)
            names.add(row["name"])
        for m, c in run.get("calibration", {}).items():
            result["calibration"].setdefault(m, c)
    _finish(result, G, out, keep_loadavg=True)
    print("wrote", out)
    return 0


def _finish(result: dict, G: int, path: str, keep_loadavg: bool = False) -> None:
    """Ratios against float32 and AWQ's/GPTQ's share of RTN's increase recovered; write the JSON."""
    base = result["rows"][0].get("ppl") if result["rows"] and result["rows"][0]["name"] == "float32" else None
    if base is None:  # a --reference-greedy-only run: ratios are computed after merging
        Path(path).write_text(json.dumps(result, indent=1))
        return
    for row in result["rows"]:
        if "ppl" in row:
            row["ppl_vs_float32"] = row["ppl"] / base - 1
    by = {r["name"]: r for r in result["rows"]}
    rtn = by.get(f"int4 g{G} RTN")
    for m in ("AWQ", "GPTQ"):
        r = by.get(f"{m} g{G}")
        if rtn and r and "ppl" in r and rtn["ppl"] > base:
            r["recovered_of_rtn_increase"] = (rtn["ppl"] - r["ppl"]) / (rtn["ppl"] - base)
    if not keep_loadavg:
        result["loadavg_end"] = os.getloadavg()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
