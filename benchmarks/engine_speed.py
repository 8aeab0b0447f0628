"""Where minfer's engine spends its time on the peer_vllm_serve workload, and what the fused CPU ops change
(issue 18; chapter 9 §9.2.2). Every time is CPU time (`time.process_time`) of this process, variants
alternated and the best of several repeats kept, so a loaded machine (which inflates wall-clock times 5-10x)
still gives comparable ratios. Run it single-threaded for the cleanest numbers:

    OMP_NUM_THREADS=1 python benchmarks/engine_speed.py [--model-dir /tmp/smollm2-hf] [--parts ops,engine]
        [--vllm-python /tmp/vllm-venv/bin/python] [--json PATH]

Parts:
- `ops`: the element-wise ops of a decoder layer, torch vs `minfer.cpu.fused_ops`, at 16 / 192 / 2048 rows;
  prefill attention of 192-token prompts, one SDPA call per sequence (what `PagedTorchBackend` does) vs one
  batched call.
- `gemm`: SmolLM2's linear shapes through oneDNN as minfer calls it (`torch.ops.mkldnn._linear_pointwise`,
  packed weights) and as vLLM's CPU backend does (`torch.ops._C.onednn_mm`); needs `--vllm-python` (it runs
  itself again under vLLM's venv, where both exist).
- `engine`: two engines on the same 16 prompts of 192 token ids, 48 greedy tokens, one with torch's element-wise
  ops (the platform's fused-ops choice turned off for it: `CpuPlatform.fused_ops`) and one with the fused ones,
  stepped in turn; CPU seconds per step, and whether their tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def best_cpu_time(fn, reps: int = 10, inner: int = 1) -> float:
    """Best CPU seconds of one call of `fn` over `reps` timings of `inner` calls each."""
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.process_time() - t) / inner)
    return best


def alternate(variants: dict, rounds: int = 3, reps: int = 10, inner: int = 1) -> dict:
    """CPU ms per call of each variant, the variants timed in turn for `rounds` rounds (best kept)."""
    t = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            fn()
            t[name] = min(t[name], best_cpu_time(fn, reps, inner))
    return {name: round(s * 1e3, 4) for name, s in t.items()}


def bench_ops() -> dict:
    from minfer.cpu import fused_ops as fc
    from minfer.model.layers import RMSNorm, silu_and_mul
    from minfer.model.positions import rotate_half_

    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    rows = []
    for t in (16, 192, 2048):
        x, r, gu = torch.randn(t, 576), torch.randn(t, 576), torch.randn(t, 3072)
        qkv, cos, sin = torch.randn(t, 960), torch.randn(t, 32), torch.randn(t, 32)
        q, k = qkv[:, :576].view(t, 9, 64), qkv[:, 576:768].view(t, 3, 64)
        pairs = {
            "add_rms_norm": (lambda: norm(x, r), lambda: fc.fused_add_rms_norm(x, r, norm.weight, 1e-5)),
            "silu_and_mul": (lambda: silu_and_mul(gu), lambda: fc.silu_and_mul(gu)),
            "rotary": (lambda: (rotate_half_(q.float(), cos, sin), rotate_half_(k.float(), cos, sin)),
                       lambda: fc.apply_rotary_(q, k, cos, sin)),
        }
        for name, (torch_fn, fused_fn) in pairs.items():
            ms = alternate({"torch": torch_fn, "fused_cpu": fused_fn}, reps=20, inner=5)
            rows.append({"op": name, "rows": t, "cpu_ms": ms, "speedup": round(ms["torch"] / ms["fused_cpu"], 2)})
            print(json.dumps(rows[-1]), flush=True)
    attn = []
    for b in (1, 16):
        t = 192
        q, k, v = torch.randn(b * t, 9, 64), torch.randn(b * t, 3, 64), torch.randn(b * t, 3, 64)

        def per_seq():
            out = torch.empty_like(q)
            for i in range(b):
                s = slice(i * t, (i + 1) * t)
                out[s] = F.scaled_dot_product_attention(
                    q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None], v[s].transpose(0, 1)[None],
                    is_causal=True, scale=0.125, enable_gqa=True)[0].transpose(0, 1)
            return out

        def batched():
            qb, kb, vb = (z.view(b, t, -1, 64).transpose(1, 2) for z in (q, k, v))
            return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=0.125,
                                                  enable_gqa=True).transpose(1, 2).reshape(b * t, 9, 64)

        attn.append({"prompts": b, "tokens_each": t, "cpu_ms": alternate({"per_sequence_sdpa": per_seq,
                                                                         "one_batched_sdpa": batched})})
        print(json.dumps(attn[-1]), flush=True)
    return {"elementwise": rows, "prefill_attention_one_layer": attn}


def bench_gemm() -> dict:
    """Run under vLLM's venv: oneDNN through torch (minfer's call) and through vLLM's own binding."""
    import vllm._C  # noqa: F401  (registers torch.ops._C)

    rows = []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        wt = w.t()
        handle = torch.tensor(torch.ops._C.create_onednn_mm_handler(wt, 32), dtype=torch.int64)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        for m in (16, 192, 1024):
            if name == "lm_head" and m > 16:
                continue  # prefill computes logits of one row per prompt
            x = torch.randn(m, k)

            def vllm_mm():
                out = torch.empty(m, n)
                torch.ops._C.onednn_mm(out, x, None, handle)
                return out

            variants = {"vllm_onednn_mm": vllm_mm,
                        "minfer_mkldnn_linear": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
            ref = F.linear(x, w)
            for fn in variants.values():
                torch.testing.assert_close(fn(), ref, atol=1e-3, rtol=1e-3)
            ms = alternate(variants, rounds=4, reps=max(3, min(20, int(3e8 / (m * k * n)) + 2)))
            rows.append({"layer": name, "M": m, "K": k, "N": n, "cpu_ms": ms,
                         "gflops": {v: round(2 * m * k * n / t / 1e6, 1) for v, t in ms.items()}})
            print(json.dumps(rows[-1]), flush=True)
    return {"torch": torch.__version__, "rows": rows}


def bench_engine(model_dir: str) -> dict:
    from minfer import LLM, SamplingParams
    from minfer.platform import CpuPlatform

    def make(fused: bool):
        # Only the element-wise ops differ: the platform's choice of them is turned off while this one loads
        # (kernels="reference" would change the Linear layout, the attention and the sampler too).
        choice = CpuPlatform.fused_ops
        if not fused:
            CpuPlatform.fused_ops = lambda self, attention_backend="auto": None
        try:
            return LLM(model_dir, dtype="float32", max_model_len=1024, max_num_seqs=16,
                       kv_cache_memory_bytes=256 << 20)
        finally:
            CpuPlatform.fused_ops = choice

    llms = {"torch_ops": make(False), "fused_cpu_ops": make(True)}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(192)] for _ in range(16)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for llm in llms.values():  # warm-up: first oneDNN calls, kernel builds
        llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engines = {name: llm.llm_engine for name, llm in llms.items()}
    for name, e in engines.items():
        for i, p in enumerate(prompts):
            e.add_request(f"{name}-{i}", p, params)
    steps: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, dict] = {name: {} for name in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, e in engines.items():  # in turn, so drift of a shared machine hits both alike
            if e.has_unfinished_requests():
                t = time.process_time()
                outs = e.step()
                steps[name].append(time.process_time() - t)
                tokens[name].update({o.request_id.split("-")[1]: list(o.outputs[0].token_ids) for o in outs if o.finished})

    def summary(s: list[float]) -> dict:
        dec = sorted(s[3:])
        return {"steps": len(s), "first_steps_cpu_s": [round(x, 3) for x in s[:3]],
                "decode_step_median_cpu_ms": round(dec[len(dec) // 2] * 1e3, 1), "total_cpu_s": round(sum(s), 2)}

    res = {"workload": "16 prompts of 192 random token ids, 48 greedy tokens, ignore_eos, max_num_seqs 16",
           "greedy_tokens_identical": tokens["torch_ops"] == tokens["fused_cpu_ops"],
           "engines": {name: summary(s) for name, s in steps.items()}}
    res["total_cpu_ratio_torch_over_fused"] = round(res["engines"]["torch_ops"]["total_cpu_s"]
                                                    / res["engines"]["fused_cpu_ops"]["total_cpu_s"], 3)
    print(json.dumps(res), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/smollm2-hf", help="HF directory of the model (float32)")
    ap.add_argument("--parts", default="ops,engine", help="comma-separated: ops, gemm, engine")
    ap.add_argument("--vllm-python", default=None, help="vLLM venv's python, for the gemm part")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--gemm-only", action="store_true", help=argparse.SUPPRESS)  # the re-run under vLLM's venv
    args = ap.parse_args(argv)
    if args.gemm_only:
        print("GEMM_JSON " + json.dumps(bench_gemm()))
        return 0
    parts = set(args.parts.split(","))
    result = {"note": "CPU time (time.process_time), variants alternated, best of repeats; compare ratios",
              "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()}
    if "ops" in parts:
        result["ops"] = bench_ops()
    if "gemm" in parts:
        if not args.vllm_python:
            raise SystemExit("--parts gemm needs --vllm-python (vLLM's venv has the onednn_mm binding)")
        run = subprocess.run([args.vllm_python, __file__, "--gemm-only"], capture_output=True, text=True, check=True)
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith("GEMM_JSON "))
        result["gemm"] = json.loads(line[len("GEMM_JSON "):])
    if "engine" in parts:
        result["engine"] = bench_engine(args.model_dir)
    result["loadavg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
