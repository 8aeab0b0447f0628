"""The fused CPU sampler (minfer/cpu/sampler.py) against the torch path (minfer/sampling.py), chapter 7
§7.4 ("Fused sampling on the device").

    python benchmarks/fused_sampler_cpu.py            # about 3 minutes on 2 idle cores; run it under
                                                      # flock /tmp/minfer-bench.lock

Part 1, the sampler alone: the time of one sampling step (`Sampler.__call__` vs `CpuFusedSampler.__call__`)
for batch sizes 1..64 over SmolLM2's vocabulary (49,152), per preset (temperature only; top-k 50; top-p 0.9;
top-k 40 + top-p 0.95 + min-p 0.05), on random logits of the real scale. The two samplers run in turn, a
median over repeats, so both see the same machine load.
Part 1b, what k and p cost: at batch 8 (and 1 and 64 for top-p 0.3 / 0.95), both samplers on the settings of
notebook 07 §1 (greedy, temperature, top-k 5 / 200, top-p 0.3 / 0.95, both small, min-p, penalties): the
article's claim that a small top-k / top-p makes sampling faster, answered for each path.
Part 2, a whole decode: `LLM.generate` on the default model with B sampled requests, once with each sampler
(swapped in the worker), timing the sampler's calls inside the run: its share of the run's time.
Writes assets/benchmarks/fused_sampler_cpu.json with the load average before and after. The machine is shared
with other jobs: the load average says how quiet the run was; compare the two samplers within a row.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from minfer import SamplingParams  # noqa: E402
from minfer.cpu.sampler import CpuFusedSampler  # noqa: E402
from minfer.sampling import Sampler  # noqa: E402
from minfer.sequence import Sequence  # noqa: E402

VOCAB = 49152
PRESETS = {
    "temperature 0.8": dict(temperature=0.8),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "top_k 40 + top_p 0.95 + min_p 0.05": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
}
# notebook 07 §1's settings (temperature 0.8 unless greedy)
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature only": dict(temperature=0.8),
    "top_k=5": dict(temperature=0.8, top_k=5),
    "top_k=200": dict(temperature=0.8, top_k=200),
    "top_p=0.3": dict(temperature=0.8, top_p=0.3),
    "top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "top_k=5, top_p=0.3": dict(temperature=0.8, top_k=5, top_p=0.3),
    "min_p=0.1": dict(temperature=0.8, min_p=0.1),
    "+ penalties": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.5),
}


def sampler_step_ms(batch: int, params: dict, repeats: int) -> dict:
    seqs = [Sequence(str(i), 0, [1, 2, 3], SamplingParams(max_tokens=8, **params), 4096) for i in range(batch)]
    # SmolLM2's logits have a standard deviation of about 2-3 and a few large values: randn * 2.5
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 2.5
    samplers = {"torch": Sampler(torch.Generator().manual_seed(0)),
                "fused": CpuFusedSampler(torch.Generator().manual_seed(0))}
    times = {k: [] for k in samplers}
    for k, s in samplers.items():
        s(logits, seqs)  # warm-up (and the build of the kernel)
    for _ in range(repeats):
        for k, s in samplers.items():  # in turn, so both see the same load
            t0 = time.perf_counter()
            s(logits, seqs)
            times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": batch, "torch_ms": round(med["torch"], 3), "fused_ms": round(med["fused"], 3),
            "speedup": round(med["torch"] / med["fused"], 2)}


class Timed:
    """Wraps a sampler and adds up the wall time of its calls."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def decode_share(batch: int, max_tokens: int, params: dict) -> dict:
    from minfer import LLM

    llm = LLM(max_model_len=512, seed=0, kv_cache_memory_bytes=256 << 20)
    worker = llm.llm_engine.worker
    prompts = [f"Write a short story about a robot number {i}." for i in range(batch)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    row = {"batch": batch, "max_tokens": max_tokens}
    for name, sampler in (("torch", Sampler(worker.generator)), ("fused", CpuFusedSampler(worker.generator))):
        worker.sampler = timed = Timed(sampler)
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        total = time.perf_counter() - t0
        row[name] = {"run_s": round(total, 3), "sampler_s": round(timed.seconds, 3),
                     "sampler_share": round(timed.seconds / total, 3),
                     "sampler_ms_per_step": round(timed.seconds / max(1, timed.calls) * 1e3, 3),
                     "tokens_per_s": round(batch * max_tokens / total, 1)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--decode-batches", default="1,8,32")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "assets/benchmarks/fused_sampler_cpu.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    result = {"what": "one sampling step (ms), torch path vs fused C++ sampler, vocab 49152; and the sampler's "
                      "share of LLM.generate on the default model (SmolLM2-135M Q4_1)",
              "command": "flock /tmp/minfer-bench.lock python " + " ".join(sys.argv),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"torch {torch.__version__}, {torch.get_num_threads()} threads; the load average says "
                         "how quiet it was; compare the two samplers within a row",
              "gpu": "none lent: the Triton fused sampler (minfer/kernels/sampler.py) was not measured",
              "load_average_before": [round(x, 2) for x in load_before], "sampler_step": {}, "decode": []}
    for name, params in PRESETS.items():
        rows = [sampler_step_ms(int(b), params, args.repeats) for b in args.batches.split(",")]
        result["sampler_step"][name] = rows
        for r in rows:
            print(f"{name:38s} B={r['batch']:3d} torch {r['torch_ms']:9.3f} ms  fused {r['fused_ms']:8.3f} ms  "
                  f"x{r['speedup']}", flush=True)
    result["settings_step"] = {}
    for name, params in SETTINGS.items():
        batches = [1, 8, 64] if name in ("top_p=0.3", "top_p=0.95") else [8]
        rows = [sampler_step_ms(b, params, args.repeats) for b in batches]
        result["settings_step"][name] = rows
        for r in rows:
            print(f"{name:38s} B={r['batch']:3d} torch {r['torch_ms']:9.3f} ms  fused {r['fused_ms']:8.3f} ms", flush=True)
    decode_params = PRESETS["top_k 40 + top_p 0.95 + min_p 0.05"]
    result["decode_params"] = decode_params
    for b in args.decode_batches.split(","):
        row = decode_share(int(b), args.decode_tokens, decode_params)
        result["decode"].append(row)
        print(json.dumps(row), flush=True)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
