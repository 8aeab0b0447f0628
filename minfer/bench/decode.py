"""`python -m minfer.bench decode`: batch-1 decode speed, minfer vs transformers, and the bandwidth ceiling.

At batch 1 every decode step reads every weight once, so tokens/s can be at most
(memory read bandwidth) / (weight bytes). Both engines run the same model, dtype and thread count in the
same process, alternating runs so that a noisy machine hurts both alike; the script prints their ratio and
the fraction of the ceiling each reaches. Decode time is measured as time(N tokens) - time(1 token), which
removes the prefill from both sides the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm.auto import tqdm

from minfer.bench import best_time


def measure_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (a sum over a tensor much larger than the caches), best of `repeats`."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_time(x.sum, repeats)


def run(model: str = "smollm2-135m-instruct", new_tokens: int = 64, repeats: int = 3, threads: int | None = None,
        prompt: str = "Once upon a time, in a small village by the sea,", quantization: list[str] | None = None,
        quantization_config: dict | None = None) -> dict:
    """Measure; `quantization` adds one minfer engine per method (int8, int4, gguf; `quantization_config`
    applies to int4), timed in the same alternating loop, each with its resident weight bytes."""
    from transformers import AutoModelForCausalLM

    from minfer import LLM, SamplingParams
    from minfer.memory import weight_bytes
    from minfer.model.sources import find_default_gguf

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model=model, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    ids = llm.tokenizer.encode(prompt)
    quant = {q: LLM(model=model, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                    quantization=q, quantization_config=quantization_config if q == "int4" else None)
             for q in (quantization or [])}
    path = find_default_gguf() if model == "smollm2-135m-instruct" else None
    if path is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.eval()
    input_ids = torch.tensor([ids])

    def minfer_run(n, engine=None):
        t = time.perf_counter()
        (engine or llm).generate_simple(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    def hf_run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=llm.tokenizer.eos_token_ids[0])
        return time.perf_counter() - t

    minfer_run(4), hf_run(4)  # warm-up
    for q in quant.values():
        minfer_run(4, q)
    ours, theirs, qtimes = [], [], {q: [] for q in quant}
    for _ in tqdm(range(repeats), desc="decode benchmark"):
        ours.append((minfer_run(new_tokens) - minfer_run(1)) / (new_tokens - 1))
        theirs.append((hf_run(new_tokens) - hf_run(1)) / (new_tokens - 1))
        for q, engine in quant.items():
            qtimes[q].append((minfer_run(new_tokens, engine) - minfer_run(1, engine)) / (new_tokens - 1))
    wbytes = weight_bytes(llm.llm_engine.worker.model)
    bw = measure_read_bandwidth()
    res = {
        "model": model, "dtype": "float32", "threads": torch.get_num_threads(), "new_tokens": new_tokens,
        "minfer_tok_s": 1 / statistics.median(ours), "transformers_tok_s": 1 / statistics.median(theirs),
        "weight_bytes": wbytes, "read_bandwidth_GBps": bw / 1e9, "ceiling_tok_s": bw / wbytes,
    }
    res["ratio"] = res["minfer_tok_s"] / res["transformers_tok_s"]
    res["minfer_fraction_of_ceiling"] = res["minfer_tok_s"] / res["ceiling_tok_s"]
    res["transformers_fraction_of_ceiling"] = res["transformers_tok_s"] / res["ceiling_tok_s"]
    res["quantized"] = {q: {"tok_s": 1 / statistics.median(t), "vs_float32": statistics.median(ours) / statistics.median(t),
                            "weight_bytes": weight_bytes(quant[q].llm_engine.worker.model),
                            "quantization_config": quant[q].engine_args.quantization_config}
                        for q, t in qtimes.items()}
    if quant:
        res["note"] = "measured on a shared 2-core machine (other jobs running): compare ratios from the same run"
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.bench decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model (default: the embedded SmolLM2)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--quantization", default=None, metavar="M[,M]",
                    help="also time minfer with these weight quantizations: int8, int4, gguf (comma-separated)")
    ap.add_argument("--quantization-config", default=None, metavar="JSON",
                    help='settings for int4, e.g. \'{"group_size": 64}\'')
    args = ap.parse_args(argv)
    qcfg = json.loads(args.quantization_config) if args.quantization_config else None
    r = run(args.model, args.new_tokens, args.repeats, args.threads,
            quantization=args.quantization.split(",") if args.quantization else None, quantization_config=qcfg)
    print(f"model {r['model']} float32, {r['threads']} threads, batch 1, {r['new_tokens']} new tokens")
    print(f"  minfer        {r['minfer_tok_s']:7.1f} tok/s  ({r['minfer_fraction_of_ceiling']:.0%} of ceiling)")
    print(f"  transformers  {r['transformers_tok_s']:7.1f} tok/s  ({r['transformers_fraction_of_ceiling']:.0%} of ceiling)")
    print(f"  ratio minfer / transformers = {r['ratio']:.2f}x   (target >= 1.5x)")
    print(f"  ceiling: {r['weight_bytes'] / 1e6:.0f} MB of weights per token at {r['read_bandwidth_GBps']:.1f} GB/s "
          f"read bandwidth = {r['ceiling_tok_s']:.1f} tok/s")
    for q, v in r.get("quantized", {}).items():
        print(f"  minfer {q:6s} {v['tok_s']:7.1f} tok/s  ({v['vs_float32']:.2f}x float32; "
              f"{v['weight_bytes'] / 1e6:.0f} MB resident weights)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
