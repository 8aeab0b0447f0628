"""Chapter 6's GPU section: static against continuous batching on one device, throughput and time to first token.

    from minfer.course.gpu import ch06
    ch06.run("cuda")              # SmolLM2-135M when its wheel is installed, else a random Llama of its size
    ch06.run("cpu", small=True)   # stories260K (or a tiny random Llama), 8 short requests: the CI dry run

Both systems get the same requests (random token ids, greedy, fixed output lengths) on the same device:

- static: transformers' `generate` on left-padded batches (`minfer.bench.engine.run_static_hf`); a request's
  TTFT is when its batch starts plus the batch's prefill (a `max_new_tokens=1` pass of that batch, timed apart).
- continuous: minfer's engine with every request queued at once; a request's TTFT is the end of the step that
  produced its first token.

Every clock is read after `minfer.course.sync(device)`, so on CUDA it times the kernels, not their launch.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from minfer.course import ROOT, machine, sync

STORIES = ROOT.parent / "shared" / "models" / "stories260K"


def _tiny_model(tmp: Path) -> str:
    """stories260K converted to a Hugging Face directory when ../shared has it, else a tiny random Llama."""
    if (STORIES / "stories260K.bin").is_file():
        from minfer.model.llama2c import llama2c_to_hf

        return str(llama2c_to_hf(STORIES / "stories260K.bin", tmp / "stories", STORIES / "tok512.model"))
    from minfer.bench.parallel import save_random_llama

    return save_random_llama(tmp / "tiny", layers=4, hidden=64, heads=8, kv_heads=2, intermediate=128, vocab=256)


def _models(device: str, small: bool, tmp: Path):
    """(minfer LLM, transformers model, name) on `device`, the same weights for both."""
    import torch
    from transformers import AutoModelForCausalLM

    from minfer import LLM

    if not small:
        try:
            from minfer.bench.engine import load_hf_model, make_llm

            llm = make_llm(device=device, max_model_len=1024)
            return llm, load_hf_model(llm), "SmolLM2-135M-Instruct (float32)"
        except Exception as e:  # the default model's wheel (or transformers' GGUF reader) is missing
            print(f"default model unavailable ({type(e).__name__}: {e}); using a random Llama of its shape")
            from minfer.bench.parallel import save_random_llama

            path = save_random_llama(tmp / "llama135m", layers=30, hidden=576, heads=9, kv_heads=3,
                                     intermediate=1536, vocab=49152)
            name = "random Llama, SmolLM2-135M's shape (float32)"
    else:
        path = _tiny_model(tmp)
        name = Path(path).name + " (float32)"
    kw = {} if str(device).startswith("cuda") else {"kv_cache_memory_bytes": 64 << 20}
    llm = LLM(model=path, seed=0, device=device, dtype="float32", max_model_len=1024 if not small else 256, **kw)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    return llm, hf, name


def _engine_run(llm, prompts, outs, device) -> dict:
    """Every request queued at once; seconds to the end, and each request's time to its first token."""
    from minfer.bench.engine import greedy

    engine = llm.llm_engine
    sync(device)
    t0 = time.perf_counter()
    ids = [engine.add_request(None, p, greedy(m)) for p, m in zip(prompts, outs)]
    first = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        sync(device)
        now = time.perf_counter() - t0
        for o in outputs:
            if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                first[o.request_id] = now
    return dict(seconds=time.perf_counter() - t0, ttft_s=[first[i] for i in ids])


def _static_ttft(hf, prompts, batch_size, batch_seconds, device) -> list[float]:
    """Each request's TTFT under static batching: its batch's start (the earlier batches' measured durations)
    plus the batch's prefill, timed as a `max_new_tokens=1` pass of that batch."""
    import torch

    out, start = [], 0.0
    for b, i in enumerate(range(0, len(prompts), batch_size)):
        ps = prompts[i:i + batch_size]
        width = max(map(len, ps))
        ids = torch.zeros((len(ps), width), dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for r, p in enumerate(ps):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=1, do_sample=False,
                        pad_token_id=0)
        sync(device)
        out += [start + time.perf_counter() - t] * len(ps)
        start += batch_seconds[b]
    return out


def run(device: str = "cuda", small: bool = False) -> dict:
    """Static (transformers, padded batches) against continuous batching (minfer's engine) on `device`:
    output tokens/s of each and their ratio, and the median and p90 TTFT of each. Returns the numbers."""
    import torch

    from minfer.bench.engine import Settings, make_workload, run_static_hf, static_batch_slots

    info = machine(device)
    s = (Settings(num_requests=8, prompt_len=(8, 32), output_len=(4, 16), static_batch_size=4) if small
         else Settings.full())
    with tempfile.TemporaryDirectory() as tmp:
        llm, hf, name = _models(device, small, Path(tmp))
        vocab = min(llm.llm_engine.model_config.vocab_size, hf.config.vocab_size)
        prompts, outs = make_workload(s.num_requests, s.prompt_len, s.output_len, vocab, s.seed)
        prompts = [[max(t, 3) for t in p] for p in prompts]  # no bos/eos/pad ids inside a prompt
        # warm-up of both (kernels, allocator, CUDA graphs), untimed
        _engine_run(llm, prompts[:2], [2, 2], device)
        run_static_hf(hf, prompts[:2], [2, 2], 2, progress=False)
        cont = _engine_run(llm, prompts, outs, device)
        batch_seconds = []
        for i in range(0, len(prompts), s.static_batch_size):
            r = run_static_hf(hf, prompts[i:i + s.static_batch_size], outs[i:i + s.static_batch_size],
                              s.static_batch_size, progress=False)
            batch_seconds.append(r["seconds"])
        static_ttft = _static_ttft(hf, prompts, s.static_batch_size, batch_seconds, device)
        del llm, hf
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    out_tokens = sum(outs)
    static_s = sum(batch_seconds)
    res = dict(device=str(device), gpu=info.get("gpu"), cpu=info["cpu"], load_average_1min=info["load_average_1min"],
               model=name, small=small, num_requests=s.num_requests, prompt_len=list(s.prompt_len),
               output_len=list(s.output_len), static_batch_size=s.static_batch_size,
               static_slots=static_batch_slots([len(p) for p in prompts], outs, s.static_batch_size),
               continuous_seconds=cont["seconds"], static_seconds=static_s,
               continuous_output_tok_s=out_tokens / cont["seconds"], static_output_tok_s=out_tokens / static_s,
               continuous_ttft_median_s=statistics.median(cont["ttft_s"]),
               static_ttft_median_s=statistics.median(static_ttft),
               continuous_ttft_p90_s=sorted(cont["ttft_s"])[int(0.9 * (len(outs) - 1))],
               static_ttft_p90_s=sorted(static_ttft)[int(0.9 * (len(outs) - 1))])
    res["throughput_ratio"] = res["continuous_output_tok_s"] / res["static_output_tok_s"]
    print(f"{name} on {device}: {s.num_requests} requests, prompts {s.prompt_len[0]}-{s.prompt_len[1]}, "
          f"outputs {s.output_len[0]}-{s.output_len[1]}, static batches of {s.static_batch_size}")
    print(f"  continuous (minfer engine): {res['continuous_output_tok_s']:9.1f} output tok/s, "
          f"TTFT median {res['continuous_ttft_median_s'] * 1e3:8.1f} ms, p90 {res['continuous_ttft_p90_s'] * 1e3:8.1f} ms")
    print(f"  static (transformers):      {res['static_output_tok_s']:9.1f} output tok/s, "
          f"TTFT median {res['static_ttft_median_s'] * 1e3:8.1f} ms, p90 {res['static_ttft_p90_s'] * 1e3:8.1f} ms")
    print(f"  continuous / static throughput: {res['throughput_ratio']:.2f}x")
    return res
