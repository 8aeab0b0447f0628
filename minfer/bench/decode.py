"""`python -m minfer.bench decode`: batch-1 decode speed, minfer vs transformers, and the bandwidth ceiling.

At batch 1 every decode step reads every weight once, so tokens/s can be at most
(memory read bandwidth) / (weight bytes). Both engines run the same model, dtype and thread count in the
same process, alternating runs so that a noisy machine hurts both alike; the script prints their ratio and
the fraction of the ceiling each reaches. Decode time is measured as time(N tokens) - time(1 token), which
removes the prefill from both sides the same way.

With `--quantization gguf` on the default model, llama.cpp (`llama-cpp-python`, the `bench` extra) runs the
same GGUF file with the same prompt tokens, greedy, the same thread count, in the same alternating loop
(`--no-llama-cpp` leaves it out); the printed ratio is minfer gguf / llama.cpp, the one the chapter's target
(>= 1.0x) is about, and the JSON also records the load average (the machine may be shared), the kernel's
instruction set, the GGUF's bytes against minfer's resident weight bytes, and how many of the first greedy
tokens the two agree on.
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
        quantization_config: dict | None = None, llama_cpp: bool = True, transformers: bool = True) -> dict:
    """Measure; `quantization` adds one minfer engine per method (int8, int4, gguf; `quantization_config`
    applies to int4), timed in the same alternating loop, each with its resident weight bytes. With "gguf" in
    `quantization`, `llama_cpp` adds llama.cpp on the same file (if llama-cpp-python is installed; else the
    result says so). `transformers=False` leaves transformers out (its fields are then None)."""
    import os

    from transformers import AutoModelForCausalLM

    from minfer import LLM, SamplingParams
    from minfer.memory import weight_bytes
    from minfer.model.sources import find_default_gguf

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model=model, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    ids = llm.tokenizer.encode(prompt)
    # "gguf:torch" is quantization="gguf" with quantization_config={"kernel": "torch"} (the older route)
    quant = {q: LLM(model=model, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                    quantization=q.split(":")[0], quantization_config=(
                        quantization_config if q == "int4" else {"kernel": q.split(":")[1]} if ":" in q else None))
             for q in (quantization or [])}
    path = find_default_gguf() if model == "smollm2-135m-instruct" else None
    hf = None
    if transformers and path is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    elif transformers:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if hf is not None:
        hf.eval()
    input_ids = torch.tensor([ids])
    lcpp, lcpp_note = None, None
    if llama_cpp and "gguf" in quant and path is not None:
        lcpp, lcpp_note = _load_llama_cpp(path, torch.get_num_threads())
    elif llama_cpp and "gguf" in quant:
        lcpp_note = "llama.cpp is compared on the default model's GGUF only"

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

    def llama_cpp_run(n):
        lcpp.reset()  # no prefix reuse between runs: each one prefills the prompt, as minfer's does
        t = time.perf_counter()
        for i, _ in enumerate(lcpp.generate(ids, temp=0.0, top_k=1, reset=True)):
            if i + 1 >= n:
                break
        return time.perf_counter() - t

    load_before = os.getloadavg()
    minfer_run(4)
    if hf is not None:
        hf_run(4)  # warm-up
    for q in quant.values():
        minfer_run(4, q)
    if lcpp is not None:
        llama_cpp_run(4)
    ours, theirs, lctimes, qtimes = [], [], [], {q: [] for q in quant}
    for _ in tqdm(range(repeats), desc="decode benchmark"):
        ours.append((minfer_run(new_tokens) - minfer_run(1)) / (new_tokens - 1))
        if hf is not None:
            theirs.append((hf_run(new_tokens) - hf_run(1)) / (new_tokens - 1))
        for q, engine in quant.items():
            qtimes[q].append((minfer_run(new_tokens, engine) - minfer_run(1, engine)) / (new_tokens - 1))
        if lcpp is not None:
            lctimes.append((llama_cpp_run(new_tokens) - llama_cpp_run(1)) / (new_tokens - 1))
    wbytes = weight_bytes(llm.llm_engine.worker.model)
    bw = measure_read_bandwidth()
    hf_tok_s = 1 / statistics.median(theirs) if theirs else None
    res = {
        "model": model, "dtype": "float32", "threads": torch.get_num_threads(), "new_tokens": new_tokens,
        "minfer_tok_s": 1 / statistics.median(ours), "transformers_tok_s": hf_tok_s,
        "weight_bytes": wbytes, "read_bandwidth_GBps": bw / 1e9, "ceiling_tok_s": bw / wbytes,
    }
    res["ratio"] = res["minfer_tok_s"] / hf_tok_s if hf_tok_s else None
    res["minfer_fraction_of_ceiling"] = res["minfer_tok_s"] / res["ceiling_tok_s"]
    res["transformers_fraction_of_ceiling"] = hf_tok_s / res["ceiling_tok_s"] if hf_tok_s else None
    res["quantized"] = {q: {"tok_s": 1 / statistics.median(t), "vs_float32": statistics.median(ours) / statistics.median(t),
                            "weight_bytes": weight_bytes(quant[q].llm_engine.worker.model),
                            "quantization_config": quant[q].engine_args.quantization_config}
                        for q, t in qtimes.items()}
    if "gguf" in quant:
        res["quantized"]["gguf"].update(_gguf_facts(quant["gguf"], path))
    if lcpp is not None:
        g = res["quantized"]["gguf"]
        mine, _ = quant["gguf"].generate_simple(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        theirs_ids = [t for t, _ in zip(lcpp.generate(ids, temp=0.0, top_k=1, reset=True), range(16))]
        lcpp.reset()
        agree = next((i for i, (a, b) in enumerate(zip(mine.outputs[0].token_ids, theirs_ids)) if a != b), 16)
        res["llama_cpp"] = {"tok_s": 1 / statistics.median(lctimes), "version": _llama_cpp_version(),
                            "greedy_tokens_agreeing_of_16": agree}
        res["gguf_vs_llama_cpp"] = g["tok_s"] / res["llama_cpp"]["tok_s"]
    elif lcpp_note:
        res["llama_cpp"] = {"skipped": lcpp_note}
    res["load_average_1min_before_after"] = [load_before[0], os.getloadavg()[0]]
    res["cpus"] = os.cpu_count()
    if quant:
        res["note"] = ("absolute speeds depend on the CPU and on what else runs (see the load average): "
                       "compare ratios from the same run")
    return res


def _load_llama_cpp(path, threads: int):
    """llama.cpp on `path` with `threads` threads -> (Llama or None, why not)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, "llama-cpp-python is not installed (pip install 'minfer[bench]')"
    return Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False,
                 seed=0), None


def _llama_cpp_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


def _gguf_facts(engine, path) -> dict:
    """The gguf engine's kernel, whether it decodes in one call, and its bytes against the file's."""
    from minfer.cpu.qgemm import active_isa, qgemm_available

    model = engine.llm_engine.worker.model
    routes = sorted({m.gguf_route for m in model.modules() if hasattr(m, "gguf_route")})
    facts = {"routes": routes, "kernel_isa": active_isa() if qgemm_available() else None}
    # whether its one-token steps run all layers in one C++ call (minfer.cpu.decode_step)
    facts["one_call_decode"] = engine.llm_engine.worker.step_runner is not None
    if path is not None:
        facts["gguf_file_bytes"] = path.stat().st_size
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.bench decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model (default: the embedded SmolLM2)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--quantization", default=None, metavar="M[,M]",
                    help="also time minfer with these weight quantizations: int8, int4, gguf, gguf:torch (gguf's "
                         "older route) (comma-separated)")
    ap.add_argument("--quantization-config", default=None, metavar="JSON",
                    help='settings for int4, e.g. \'{"group_size": 64}\'')
    ap.add_argument("--no-llama-cpp", action="store_true", help="with gguf: do not time llama.cpp beside it")
    ap.add_argument("--no-transformers", action="store_true", help="do not time transformers")
    args = ap.parse_args(argv)
    qcfg = json.loads(args.quantization_config) if args.quantization_config else None
    r = run(args.model, args.new_tokens, args.repeats, args.threads,
            quantization=args.quantization.split(",") if args.quantization else None, quantization_config=qcfg,
            llama_cpp=not args.no_llama_cpp, transformers=not args.no_transformers)
    print(f"model {r['model']} float32, {r['threads']} threads, batch 1, {r['new_tokens']} new tokens")
    print(f"  minfer        {r['minfer_tok_s']:7.1f} tok/s  ({r['minfer_fraction_of_ceiling']:.0%} of ceiling)")
    if r["transformers_tok_s"]:
        print(f"  transformers  {r['transformers_tok_s']:7.1f} tok/s  ({r['transformers_fraction_of_ceiling']:.0%} of ceiling)")
        print(f"  ratio minfer / transformers = {r['ratio']:.2f}x   (target >= 1.5x)")
    print(f"  ceiling: {r['weight_bytes'] / 1e6:.0f} MB of weights per token at {r['read_bandwidth_GBps']:.1f} GB/s "
          f"read bandwidth = {r['ceiling_tok_s']:.1f} tok/s")
    for q, v in r.get("quantized", {}).items():
        print(f"  minfer {q:6s} {v['tok_s']:7.1f} tok/s  ({v['vs_float32']:.2f}x float32; "
              f"{v['weight_bytes'] / 1e6:.0f} MB resident weights)")
    lc = r.get("llama_cpp")
    if lc and "tok_s" in lc:
        g = r["quantized"]["gguf"]
        print(f"  llama.cpp     {lc['tok_s']:7.1f} tok/s  (same GGUF, {r['threads']} threads; "
              f"{lc['greedy_tokens_agreeing_of_16']}/16 first greedy tokens agree)")
        print(f"  ratio minfer gguf / llama.cpp = {r['gguf_vs_llama_cpp']:.2f}x   (target >= 1.0x); weight bytes "
              f"{g['weight_bytes'] / g['gguf_file_bytes']:.2f}x the file's (target <= 1.1x); kernel {g['kernel_isa']}; "
              f"{'one C++ call a step' if g.get('one_call_decode') else 'per-op decode'}")
    elif lc:
        print(f"  llama.cpp: {lc['skipped']}")
    print(f"  load average {r['load_average_1min_before_after'][0]:.1f} -> "
          f"{r['load_average_1min_before_after'][1]:.1f} on {r['cpus']} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
