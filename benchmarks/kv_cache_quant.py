"""The quantized KV cache measured on the default model (chapter 5 §KV cache; minfer/attention/kv_quant.py).

    python benchmarks/kv_cache_quant.py                # about 3 minutes on 2 cores
    python benchmarks/kv_cache_quant.py --quick        # fewer prompts and tokens

For each `kv_cache_dtype` (auto = float32, bfloat16, int8, fp8_e4m3, fp8_e5m2), with the float32 model:
  1. capacity: the blocks and tokens a 256 MiB pool holds (`minfer.kv_cache_plan.determine_num_blocks`, and the
     bytes the allocated pool really has), and KV bytes per token;
  2. logits: one prefill of the 20 prompts joined into one text, every position's logits against the
     auto path's: max |diff| / std of the reference logits, mean KL(auto || quantized) in nats, and how
     often the argmax agrees;
  3. greedy agreement with the auto path over 64 new tokens on 20 prompts (ignore_eos): prompts whose 64
     tokens are all equal, and the mean length of the common prefix;
  4. decode speed: the same 20 requests batched through the engine, generated tokens / s (one run; the
     machine is shared, so only the ratio to auto measured in the same run means anything).

Writes assets/benchmarks/kv_cache_quant_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DTYPES = ["auto", "int8", "fp8_e4m3", "fp8_e5m2", "bfloat16"]
BUDGET = 256 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "assets" / "benchmarks" / "kv_cache_quant_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from minfer import LLM, SamplingParams
    from minfer.generate import SimpleGenerator
    from minfer.kv_cache_plan import bytes_per_block, determine_num_blocks
    from tests.test_engine import PROMPTS

    n_prompts, n_tokens = (6, 24) if args.quick else (20, 64)
    prompts = PROMPTS[:n_prompts]
    greedy = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    results, ref_logits, ref_tokens = {}, None, None
    text_ids = None
    for name in DTYPES:
        llm = LLM(max_model_len=1024, seed=0, kv_cache_memory_bytes=BUDGET, kv_cache_dtype=name, device="cpu")
        eng = llm.llm_engine
        cfg, dtype = eng.worker.config, eng.worker.dtype
        per_block = bytes_per_block(cfg, eng.block_manager.block_size, dtype, name)
        blocks = determine_num_blocks(cfg, eng.block_manager.block_size, dtype, torch.device("cpu"), BUDGET, 0.9,
                                      1024, name)
        row = {"blocks": blocks, "tokens": blocks * eng.block_manager.block_size, "pool_bytes": eng.worker.pool.nbytes,
               "kv_bytes_per_token": per_block // eng.block_manager.block_size,
               "storage_dtype": str(eng.worker.pool.spec.dtype), "backend": type(eng.worker.backend).__name__}
        # 2. logits of one long prefill through the simple path (its cache quantizes as the pool does)
        if text_ids is None:
            text_ids = eng.tokenizer.encode(" ".join(prompts))
        gen = SimpleGenerator(eng.worker.model, kv_cache_dtype=name)
        with torch.inference_mode():
            logits = gen.prefill_logits(text_ids, gen.new_cache(len(text_ids))).float()
        if ref_logits is None:
            ref_logits = logits
        diff = (logits - ref_logits).abs()
        logp_ref, logp = ref_logits.log_softmax(-1), logits.log_softmax(-1)
        row["prefill_tokens"] = len(text_ids)
        row["logits_max_abs_diff_over_std"] = float(diff.max() / ref_logits.std())
        row["logits_mean_abs_diff_over_std"] = float(diff.mean() / ref_logits.std())
        row["mean_kl_nats"] = float((logp_ref.exp() * (logp_ref - logp)).sum(-1).mean())
        row["argmax_agreement"] = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        # 3 + 4. greedy tokens through the engine, timed
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        secs = time.perf_counter() - t0
        tokens = [o.outputs[0].token_ids for o in outs]
        if ref_tokens is None:
            ref_tokens = tokens
        prefix = []
        for a, b in zip(tokens, ref_tokens):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            prefix.append(n)
        row["greedy_prompts_all_equal"] = sum(p == n_tokens for p in prefix)
        row["greedy_mean_common_prefix"] = sum(prefix) / len(prefix)
        row["greedy_token_agreement"] = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(tokens, ref_tokens)) / (
            n_tokens * len(tokens))
        row["engine_tokens_per_s"] = n_tokens * len(prompts) / secs
        results[name] = row
        print(name, json.dumps(row), flush=True)
        del llm, eng, gen
        write(args, results, n_prompts, n_tokens)  # after each dtype: a cut-short run still leaves its rows


def write(args, results: dict, n_prompts: int, n_tokens: int) -> None:
    auto = results["auto"]
    for row in results.values():
        row["tokens_vs_auto"] = row["tokens"] / auto["tokens"]
        row["speed_vs_auto"] = row["engine_tokens_per_s"] / auto["engine_tokens_per_s"]
    out = {
        "what": "kv_cache_dtype on the default model (float32 weights): capacity of a 256 MiB pool, logits and "
                "greedy tokens against kv_cache_dtype='auto', engine decode speed",
        "command": "python benchmarks/kv_cache_quant.py" + (" --quick" if args.quick else ""),
        "model": "smollm2-135m-instruct (Q4_1 GGUF, run in float32)",
        "prompts": n_prompts, "new_tokens": n_tokens, "threads": args.threads, "kv_cache_memory_bytes": BUDGET,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, shared with other jobs: "
                   "speeds are one run each, compare only the ratios",
        "scales": "float32, one per token and K/V head (4 bytes per 64-element head vector)",
        "results": results,
    }
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print("wrote", args.out, flush=True)


if __name__ == "__main__":
    main()
