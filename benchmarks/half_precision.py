"""Article §5, bf16 vs fp16 (chapter 5 §5.0): the two formats' ranges, the largest activations of SmolLM2-135M on
real text against fp16's largest finite value, and perplexity in float32, bfloat16 and float16.

    python benchmarks/half_precision.py [--max-tokens 4096] [--window 512]
                                        [--json assets/benchmarks/half_precision.json]

For each dtype the engine scores the first --max-tokens tokens of the shipped eval text (`minfer.eval.perplexity`,
windows of --window tokens). During each run, forward hooks on every layer's modules record the largest |x| of
what each produces: the q|k|v projection, the attention output (o_proj's input), o_proj's output, gate|up,
SiLU(gate) * up (down_proj's input), down_proj's output and the residual stream (what the post-attention norm
returns as the new residual), and count non-finite values. Under float16 a value above 65504 becomes inf,
which the count shows; float32's maxima say which layers would need it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# module name inside a decoder layer -> what the hook records (its output, or its input)
SITES = {"self_attn.qkv_proj": ("out", "q|k|v"), "self_attn.o_proj": ("in", "attention output"),
         "self_attn.o_proj#out": ("out", "o_proj output"), "mlp.gate_up_proj": ("out", "gate|up"),
         "mlp.down_proj": ("in", "SiLU(gate)*up"), "mlp.down_proj#out": ("out", "down_proj output"),
         "post_attention_layernorm": ("residual", "residual stream")}


def format_ranges() -> dict:
    """torch.finfo of float32, bfloat16 and float16: largest finite, smallest normal, epsilon, mantissa bits."""
    import torch

    out = {}
    for name, dt, bits in (("float32", torch.float32, 23), ("bfloat16", torch.bfloat16, 7), ("float16", torch.float16, 10)):
        f = torch.finfo(dt)
        out[name] = {"max": f.max, "smallest_normal": f.tiny, "eps": f.eps, "mantissa_bits": bits,
                     "exponent_bits": {"float32": 8, "bfloat16": 8, "float16": 5}[name]}
    return out


def attach(model) -> tuple[dict, list]:
    """Forward hooks recording per (layer, site) the largest |x| and the number of non-finite values."""
    import torch

    stats = defaultdict(lambda: {"absmax": 0.0, "nonfinite": 0})
    handles = []

    def record(key, t):
        t = t.detach()
        finite = torch.isfinite(t)
        s = stats[key]
        s["nonfinite"] += int((~finite).sum())
        if finite.any():
            s["absmax"] = max(s["absmax"], float(t[finite].abs().max()))

    for i, layer in enumerate(model.model.layers):
        for site, (what, label) in SITES.items():
            mod = layer.get_submodule(site.split("#")[0])

            def hook(_m, args, out, key=(i, label), what=what):
                if what == "in":
                    record(key, args[0])
                elif what == "out":
                    record(key, out[0] if isinstance(out, tuple) else out)
                elif isinstance(out, tuple):  # the norm's (normed, new residual)
                    record(key, out[1])
            handles.append(mod.register_forward_hook(hook))
    return stats, handles


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "assets/benchmarks/half_precision.json"))
    args = ap.parse_args(argv)

    import torch

    from minfer import LLM
    from minfer.eval import perplexity

    torch.set_num_threads(args.threads)
    fp16_max = torch.finfo(torch.float16).max
    result = {"command": f"python benchmarks/half_precision.py --max-tokens {args.max_tokens} --window {args.window} "
                         f"--dtypes {args.dtypes}",
              "model": "smollm2-135m-instruct", "text": "minfer/data/eval_python_docs.txt", "window": args.window,
              "max_tokens": args.max_tokens, "machine": platform.machine(), "loadavg_start": os.getloadavg(),
              "formats": format_ranges(), "rows": [], "activations": {}}
    for dtype in args.dtypes.split(","):
        t = time.perf_counter()
        # the torch attention path: the same SDPA for every dtype (the C++ decode kernel is float32-only)
        llm = LLM(dtype=dtype, max_model_len=args.window + 1, seed=0, attention_backend="torch")
        stats, handles = attach(llm.llm_engine.worker.model)
        res = perplexity(llm, window=args.window, max_tokens=args.max_tokens, use_tqdm=False)
        for h in handles:
            h.remove()
        sites = sorted(stats.items())
        row = {"dtype": dtype, "ppl": res.ppl, "nll": res.nll, "num_tokens": res.num_tokens,
               "max_abs_activation": max(s["absmax"] for _, s in sites),
               "nonfinite_activations": sum(s["nonfinite"] for _, s in sites),
               "sites_above_fp16_max": [f"layer {i} {label}" for (i, label), s in sites if s["absmax"] > fp16_max],
               "seconds": time.perf_counter() - t, "loadavg": os.getloadavg()}
        result["rows"].append(row)
        result["activations"][dtype] = [{"layer": i, "site": label, **s} for (i, label), s in sites]
        print(f"{dtype:9s} ppl {res.ppl:9.3f}  max|x| {row['max_abs_activation']:10.1f}  non-finite "
              f"{row['nonfinite_activations']}  above fp16 max: {row['sites_above_fp16_max']}", flush=True)
        del llm
        gc.collect()
        _write(result, args.json)  # after each dtype: a slow one (float16 on a CPU) does not lose the others
    print("wrote", args.json)
    return 0


def _write(result: dict, path: str) -> None:
    base = result["rows"][0]["ppl"]
    for row in result["rows"]:
        row["ppl_vs_first"] = row["ppl"] / base - 1
    result["loadavg_end"] = os.getloadavg()
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
