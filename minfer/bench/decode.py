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
        prompt: str = "Once upon a time, in a small village by the sea,") -> dict:
    from transformers import AutoModelForCausalLM

    from minfer import LLM, SamplingParams
    from minfer.memory import weight_bytes
    from minfer.model.sources import find_default_gguf

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model=model, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    ids = llm.tokenizer.encode(prompt)
    path = find_default_gguf() if model == "smollm2-135m-instruct" else None
    if path is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.eval()
    input_ids = torch.tensor([ids])

    def minfer_run(n):
        t = time.perf_counter()
        llm.generate_simple(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    def hf_run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=llm.tokenizer.eos_token_ids[0])
        return time.perf_counter() - t

    minfer_run(4), hf_run(4)  # warm-up
    ours, theirs = [], []
    for _ in tqdm(range(repeats), desc="decode benchmark"):
        ours.append((minfer_run(new_tokens) - minfer_run(1)) / (new_tokens - 1))
        theirs.append((hf_run(new_tokens) - hf_run(1)) / (new_tokens - 1))
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
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.bench decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model (default: the embedded SmolLM2)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    r = run(args.model, args.new_tokens, args.repeats, args.threads)
    print(f"model {r['model']} float32, {r['threads']} threads, batch 1, {r['new_tokens']} new tokens")
    print(f"  minfer        {r['minfer_tok_s']:7.1f} tok/s  ({r['minfer_fraction_of_ceiling']:.0%} of ceiling)")
    print(f"  transformers  {r['transformers_tok_s']:7.1f} tok/s  ({r['transformers_fraction_of_ceiling']:.0%} of ceiling)")
    print(f"  ratio minfer / transformers = {r['ratio']:.2f}x   (target >= 1.5x)")
    print(f"  ceiling: {r['weight_bytes'] / 1e6:.0f} MB of weights per token at {r['read_bandwidth_GBps']:.1f} GB/s "
          f"read bandwidth = {r['ceiling_tok_s']:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
