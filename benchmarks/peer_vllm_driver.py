"""The driver `benchmarks/peer_vllm.py` runs once per measurement, in a fresh process: one engine (vLLM's or
minfer's offline `LLM`), one workload file in, one result file out. Standard library at the top level, so the
same file runs under the vLLM venv's python (which has no minfer) and under minfer's.

    python benchmarks/peer_vllm_driver.py --engine {vllm,minfer} --model-dir DIR --workload IN.json --out OUT.json

The workload file holds `prompts` (token-id lists), `max_tokens` (one per prompt), `batch1_prompt` (token ids),
`batch1_max_tokens`, `max_model_len`, `max_num_seqs`, `kv_cache_bytes` and `max_num_batched_tokens` (or null:
each engine's default). Every request is greedy with `ignore_eos`, so both engines generate exactly the
requested number of tokens. The result holds the load time, the throughput run's time and token counts, the
batch-1 run's times, and every output's token ids (so the caller can check that the two engines agree).

vLLM's engine starts a process of its own (multiprocessing spawn), which is why everything here is under
`if __name__ == "__main__":` (issue 15: without it, the spawned child re-runs the script and dies).
"""

import argparse
import json
import os
import time


def make_engine(name: str, w: dict, model_dir: str):
    """(llm, sampling-params factory, prompt wrapper) for `name`."""
    common = dict(max_model_len=w["max_model_len"], max_num_seqs=w["max_num_seqs"], seed=0, dtype="float32")
    if w.get("max_num_batched_tokens"):
        common["max_num_batched_tokens"] = w["max_num_batched_tokens"]
    if name == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        # The KV pool's size comes from VLLM_CPU_KVCACHE_SPACE (GiB), set by the caller from kv_cache_bytes.
        llm = LLM(model=model_dir, enforce_eager=True, **common)
        return (llm, lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                lambda ids: TokensPrompt(prompt_token_ids=ids))
    from minfer import LLM, SamplingParams

    llm = LLM(model=model_dir, kv_cache_memory_bytes=w["kv_cache_bytes"], **common)
    return (llm, lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
            lambda ids: {"prompt_token_ids": ids})


def generate(llm, sp, wrap, prompts, max_tokens):
    """(seconds, output token ids per prompt) of one `LLM.generate` call over all prompts."""
    t0 = time.perf_counter()
    outs = llm.generate([wrap(p) for p in prompts], [sp(m) for m in max_tokens], use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [list(o.outputs[0].token_ids) for o in outs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("vllm", "minfer"), required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.workload) as f:
        w = json.load(f)

    t0 = time.perf_counter()
    llm, sp, wrap = make_engine(args.engine, w, args.model_dir)
    load_s = time.perf_counter() - t0
    generate(llm, sp, wrap, [list(range(100, 116))] * 2, [4, 4])  # warm-up: first-call costs out of the timings

    thr_s, thr_ids = generate(llm, sp, wrap, w["prompts"], w["max_tokens"])
    b1 = w["batch1_prompt"]
    ttft_s, _ = generate(llm, sp, wrap, [b1], [1])  # prefill + one token: subtracted to get the decode rate
    b1_s, b1_ids = generate(llm, sp, wrap, [b1], [w["batch1_max_tokens"]])

    n_out = sum(len(x) for x in thr_ids)
    n_b1 = len(b1_ids[0])
    res = {
        "engine": args.engine,
        "pid": os.getpid(),
        "load_s": load_s,
        "throughput": {"seconds": thr_s, "prompt_tokens": sum(map(len, w["prompts"])), "output_tokens": n_out,
                       "output_tok_s": n_out / thr_s,
                       "total_tok_s": (n_out + sum(map(len, w["prompts"]))) / thr_s},
        "batch1": {"prompt_tokens": len(b1), "output_tokens": n_b1, "seconds": b1_s, "tok_s": n_b1 / b1_s,
                   "one_token_seconds": ttft_s,
                   "decode_tok_s": (n_b1 - 1) / (b1_s - ttft_s) if b1_s > ttft_s else None},
        "token_ids": {"throughput": thr_ids, "batch1": b1_ids[0]},
    }
    with open(args.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
