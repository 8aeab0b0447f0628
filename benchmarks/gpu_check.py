"""The GPU check (issue 31): minfer's Triton kernels, the engine and CUDA graphs, in one run of at most 8 minutes.

    python benchmarks/gpu_check.py              # on a CUDA machine (TP=1, one GPU)
    python benchmarks/gpu_check.py --quick      # fewer sizes
    python benchmarks/gpu_check.py --dry-run    # on a CPU: every code path on tiny shapes, Triton's interpreter

Parts (each a key of the JSON; a part that fails records its error and the run goes on):
  1. tests      pytest on the kernel tests (TEST_FILES), MINFER_AUTOTUNE=0 so each variant compiles once.
  2. prefill    attention, causal, d = 128, 32 heads, bf16: minfer's flash_attn_varlen vs torch SDPA with the
                flash backend vs naive attention (materialized scores); TFLOP/s counted as 4 B H L^2 D / 2.
  3. decode     paged decode, 32 query / 8 KV heads (Llama-3-8B), block 16: bytes of K and V read / time vs the
                device's peak HBM bandwidth (PEAK_BW); torch SDPA over contiguous K/V as a baseline.
  4. end_to_end SmolLM2-135M (the GGUF loaded as bf16) through `LLM`: the torch and Triton attention backends,
                each eager and with CUDA graphs (`enforce_eager=False`), plus the Triton backend with int4
                weights (`triton+int4`) and with an int8 KV cache too; decode tokens/s and whether the greedy
                tokens equal the torch backend's.
  5. w4a16      chapter 5's int4 matmul vs bf16 torch.matmul vs dequantize-then-matmul, Llama-3-8B shapes.
  6. decode_kv_quant  paged decode over int8 / fp8_e4m3 codes with per-token scales vs the bf16 cache.
  7. notebook_gpu_sections  the guarded GPU cells of notebooks 04, 05 and 06 (`minfer/course/gpu/chNN.py`):
                what lessons 4, 5 and 6 claim, measured on the GPU (tiny shapes on the CPU in a dry run).
  8. cuda_graphs  the decode step of the Triton engine's model, eager vs replayed from `CudaGraphRunner`
                (minfer/cuda_graphs.py) at batch 1, 8, 32: ms per step, and replay == eager (greedy token).

Writes assets/benchmarks/gpu_check.json and assets/figures/gpu_check_*.png, and prints the targets (reported
against, not tuned to): prefill >= 0.8x SDPA-flash at L = 4096; paged decode >= 60% of peak HBM bandwidth at
32 x 4096; CUDA-graph decode faster than eager at batch 1.

--dry-run runs every part on tiny shapes on the CPU under TRITON_INTERPRET=1 (float32: the interpreter computes
in numpy, which has no bfloat16; the end-to-end rows on a tiny random Llama), so a typo costs no GPU minutes.
Its times mean nothing; what CUDA alone can do (SDPA's flash backend, capturing graphs) is skipped with a note.
Without --dry-run and without CUDA it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEST_FILES = ["tests/test_flash_attention.py", "tests/test_paged_decode.py", "tests/test_fused_kernels.py",
              "tests/test_w4a16.py", "tests/test_triton_kv_quant.py", "tests/test_triton_backend.py",
              "tests/test_cuda_graphs.py"]
OUT_JSON = ROOT / "assets" / "benchmarks" / "gpu_check.json"
FIG_DIR = ROOT / "assets" / "figures"
# Peak HBM bandwidth in bytes/s from the vendors' data sheets, matched on the device name.
PEAK_BW = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
           "A100 80GB": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "A10G": 0.6e12, "RTX 4090": 1.008e12}
TARGETS = {"prefill_4k_ratio_vs_torch_flash": 0.8, "decode_32x4k_frac_of_peak_bw": 0.6,
           "cuda_graph_decode_speedup_b1": 1.0}

# Sizes per mode. "full" and "quick" on a GPU; "dry" on the CPU under the interpreter.
SIZES = {
    "full": dict(prefill_lens=[512, 1024, 2048, 4096, 8192, 16384], prefill_tokens=16384, heads=32, kv_heads=8,
                 head_dim=128, decode_ctx=[1024, 4096, 16384], decode_batch=[1, 8, 32, 64], w4a16_m=[1, 4, 16, 64, 256],
                 w4a16_shapes=[(4096, 4096), (14336, 4096)], kvq_ctx=[4096], kvq_batch=[8, 32], e2e_prompts=32,
                 e2e_tokens=128, max_model_len=2048, graph_batch=[1, 8, 32], graph_ctx=1024),
    "quick": dict(prefill_lens=[1024, 4096], prefill_tokens=16384, heads=32, kv_heads=8, head_dim=128,
                  decode_ctx=[4096], decode_batch=[1, 32], w4a16_m=[1, 16, 64], w4a16_shapes=[(14336, 4096)],
                  kvq_ctx=[4096], kvq_batch=[32], e2e_prompts=16, e2e_tokens=64, max_model_len=2048,
                  graph_batch=[1, 32], graph_ctx=1024),
    "dry": dict(prefill_lens=[16, 32], prefill_tokens=32, heads=4, kv_heads=2, head_dim=16, decode_ctx=[32],
                decode_batch=[1, 2], w4a16_m=[1, 3], w4a16_shapes=[(64, 128)], kvq_ctx=[32], kvq_batch=[2],
                e2e_prompts=2, e2e_tokens=2, max_model_len=64, graph_batch=[1, 2], graph_ctx=16),
}


def log(msg: str) -> None:
    print(msg, flush=True)


class Run:
    """Where this run computes: `dev` ("cuda", or "cpu" in a dry run), `dtype` (bf16, or float32 in a dry run)."""

    def __init__(self, dry: bool):
        import torch

        self.dry = dry
        self.dev = "cpu" if dry else "cuda"
        self.dtype = torch.float32 if dry else torch.bfloat16

    def gen(self, seed: int = 0):
        import torch

        return torch.Generator(device=self.dev).manual_seed(seed)

    def bench_ms(self, fn) -> float:
        """Milliseconds per call: triton's do_bench (CUDA events, median); in a dry run one timed call."""
        if self.dry:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=40))

    def sync(self) -> None:
        import torch

        if self.dev == "cuda":
            torch.cuda.synchronize()

    def free(self) -> None:
        import torch

        if self.dev == "cuda":
            torch.cuda.empty_cache()


def error(e: BaseException, n: int = 160) -> str:
    return f"{type(e).__name__}: {str(e)[:n]}"


def peak_bandwidth(name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for key, bw in PEAK_BW.items():
        if key.lower() in name.lower():
            return bw
    return None


# ---------------------------------------------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------------------------------------------

def run_tests(timeout: int, dry: bool) -> dict:
    """The kernel tests in a subprocess. A dry run only collects them (running them under the interpreter is
    the CPU suite's job, not this script's)."""
    env = dict(os.environ, MINFER_AUTOTUNE="0")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["--collect-only"] if dry else []),
            *TEST_FILES]
    t0 = time.time()
    try:
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        summary, ok = (tail[-1] if tail else ""), proc.returncode == 0
        if not ok:
            log("\n".join(tail[-40:]))
    except subprocess.TimeoutExpired:
        ok, summary = False, f"timed out after {timeout} s"
    result = {"passed": ok, "summary": summary, "seconds": round(time.time() - t0, 1), "collect_only": dry}
    log(f"[tests] {'PASS' if ok else 'FAIL'}: {summary} ({result['seconds']} s)")
    return result


def naive_attention(q, k, v, scale):
    """[B, H, L, D]; materializes the [B, H, L, L] scores (what FlashAttention avoids)."""
    import torch

    L = q.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    s.masked_fill_(mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), v)


def bench_prefill(r: Run, sz: dict) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minfer.kernels import flash_attn_varlen

    heads, head_dim = sz["heads"], sz["head_dim"]
    rows = []
    for L in sz["prefill_lens"]:
        B = max(1, sz["prefill_tokens"] // L)
        g = r.gen()
        q, k, v = (torch.randn(B, heads, L, head_dim, device=r.dev, dtype=r.dtype, generator=g) for _ in range(3))
        # the packed varlen layout [B*L, H, D] for minfer
        qp, kp, vp = (t.transpose(1, 2).reshape(B * L, heads, head_dim).contiguous() for t in (q, k, v))
        cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=r.dev)
        scale = 1 / math.sqrt(head_dim)
        flops = 4 * B * heads * L * L * head_dim / 2
        row = {"seq_len": L, "batch": B, "heads": heads, "head_dim": head_dim, "dtype": str(r.dtype)}

        def minfer_fn():
            return flash_attn_varlen(qp, kp, vp, cu, cu, L, L, causal=True)

        # SDPA's flash backend is CUDA's; on the CPU (dry run) SDPA picks its own (its math path here).
        backend = SDPBackend.FLASH_ATTENTION if r.dev == "cuda" else SDPBackend.MATH

        def sdpa_fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        for name, fn in (("minfer", minfer_fn), ("torch_flash", sdpa_fn),
                         ("naive", lambda: naive_attention(q, k, v, scale))):
            try:
                ms = r.bench_ms(fn)
                row[f"{name}_ms"] = ms
                row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
            except Exception as e:  # naive attention runs out of memory at long L
                row[f"{name}_error"] = error(e)
                r.free()
        try:  # the speed only counts if the kernel is right at this size too
            ref = sdpa_fn().transpose(1, 2).reshape(B * L, heads, head_dim)
            row["max_abs_err_vs_sdpa"] = float((minfer_fn().float() - ref.float()).abs().max())
        except Exception as e:
            row["check_error"] = error(e)
        rows.append(row)
        log("[prefill] L={seq_len:6d} B={batch:3d}  minfer {m:7.1f}  torch-flash {t:7.1f}  naive {n:7.1f} TFLOP/s"
            .format(m=row.get("minfer_tflops", float("nan")), t=row.get("torch_flash_tflops", float("nan")),
                    n=row.get("naive_tflops", float("nan")), **row))
        q = k = v = qp = kp = vp = None  # the timed closures hold these names: free the tensors, keep the names
        r.free()
    return rows


def paged_inputs(r: Run, B: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int = 16):
    """Random K/V in B * ctx / block_size blocks handed out scattered (as after a while of serving)."""
    import torch

    blocks_per_seq = max(1, ctx // block_size)
    num_blocks = B * blocks_per_seq
    g = r.gen()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=r.dev, dtype=r.dtype, generator=g)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks, device=r.dev, generator=g).view(B, blocks_per_seq).int()
    context_lens = torch.full((B,), ctx, dtype=torch.int32, device=r.dev)
    q = torch.randn(B, heads, head_dim, device=r.dev, dtype=r.dtype, generator=g)
    return q, k_cache, v_cache, block_table, context_lens


def bench_decode(r: Run, sz: dict, peak: float | None, block_size: int = 16) -> list[dict]:
    import torch

    from minfer.kernels import paged_attention_decode

    heads, kv_heads, head_dim = sz["heads"], sz["kv_heads"], sz["head_dim"]
    rows = []
    for B in sz["decode_batch"]:
        for ctx in sz["decode_ctx"]:
            q, k_cache, v_cache, block_table, context_lens = paged_inputs(r, B, ctx, heads, kv_heads, head_dim,
                                                                          block_size)
            kv_bytes = 2 * B * ctx * kv_heads * head_dim * k_cache.element_size()
            row = {"batch": B, "context": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                   "block_size": block_size, "kv_bytes": kv_bytes}
            kc = k_cache[block_table.long()].flatten(1, 2).transpose(1, 2)  # [B, KVH, ctx, D], contiguous K/V
            vc = v_cache[block_table.long()].flatten(1, 2).transpose(1, 2)
            qs = q[:, :, None, :]
            try:
                ms = r.bench_ms(lambda: paged_attention_decode(q, k_cache, v_cache, block_table, context_lens))
                row.update(minfer_ms=ms, minfer_bw=kv_bytes / (ms * 1e-3))
                if peak:
                    row["minfer_frac_of_peak"] = row["minfer_bw"] / peak
                ref = torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True)[:, :, 0]
                out = paged_attention_decode(q, k_cache, v_cache, block_table, context_lens)
                row["max_abs_err_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
            except Exception as e:
                row["minfer_error"] = error(e)
            try:  # baseline: SDPA over contiguous K/V (no paging), GQA without copying K/V
                ms = r.bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True))
                row.update(torch_sdpa_contiguous_ms=ms, torch_sdpa_contiguous_bw=kv_bytes / (ms * 1e-3))
            except Exception as e:
                row["torch_error"] = error(e)
            rows.append(row)
            frac = row.get("minfer_frac_of_peak")
            log(f"[decode] B={B:3d} ctx={ctx:6d}  minfer {row.get('minfer_bw', float('nan')) / 1e12:5.2f} TB/s"
                + (f" ({100 * frac:4.1f}% of peak)" if frac else "")
                + f"  torch-sdpa(contiguous) {row.get('torch_sdpa_contiguous_bw', float('nan')) / 1e12:5.2f} TB/s")
            k_cache = v_cache = kc = vc = None  # (as above)
            r.free()
    return rows


def bench_w4a16(r: Run, sz: dict, group_sizes=(64, 128)) -> list[dict]:
    """y = x W^T for W [N, K], x [M, K]: minfer's W4A16 kernel vs bf16 matmul vs dequantize + matmul."""
    import torch

    from minfer.kernels.w4a16 import w4a16_matmul
    from minfer.quantization.int4 import dequantize_int4, pack_int4_blocked, quantize_int4

    rows = []
    for n, k in sz["w4a16_shapes"]:
        g_ = r.gen()
        w = torch.randn(n, k, device=r.dev, dtype=r.dtype, generator=g_) * 0.02
        for gs in group_sizes:
            codes, scale, zero = quantize_int4(w.float(), gs)
            qweight = pack_int4_blocked(codes)
            sz_ = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
            w_bytes = qweight.numel() + sz_.numel() * sz_.element_size()
            for m in sz["w4a16_m"]:
                x = torch.randn(m, k, device=r.dev, dtype=r.dtype, generator=g_)
                flops = 2 * m * n * k
                row = {"M": m, "N": n, "K": k, "group_size": gs, "int4_weight_bytes": w_bytes,
                       "bf16_weight_bytes": 2 * n * k}
                fns = {"minfer_w4a16": lambda: w4a16_matmul(x, qweight, sz_, gs, True),
                       "torch_bf16_matmul": lambda: x @ w.t(),
                       "dequantize_then_matmul": lambda: x @ dequantize_int4(codes, scale, zero, r.dtype).t()}
                for name, fn in fns.items():
                    try:
                        ms = r.bench_ms(fn)
                        row[f"{name}_ms"] = ms
                        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
                    except Exception as e:
                        row[f"{name}_error"] = error(e)
                try:  # correctness on the real shape: against dequantize-then-matmul in float32
                    ref = x.float() @ dequantize_int4(codes, scale, zero, torch.bfloat16).float().t()
                    row["max_rel_err"] = float((w4a16_matmul(x, qweight, sz_, gs, True).float() - ref).abs().max()
                                               / ref.abs().max())
                except Exception as e:
                    row["check_error"] = error(e)
                if "minfer_w4a16_ms" in row:
                    row["minfer_weight_gbps"] = w_bytes / (row["minfer_w4a16_ms"] * 1e-3) / 1e9
                    if "torch_bf16_matmul_ms" in row:
                        row["speedup_vs_bf16"] = row["torch_bf16_matmul_ms"] / row["minfer_w4a16_ms"]
                    if "dequantize_then_matmul_ms" in row:
                        row["speedup_vs_dequantize"] = row["dequantize_then_matmul_ms"] / row["minfer_w4a16_ms"]
                rows.append(row)
                log(f"[w4a16] {n}x{k} g{gs} M={m:4d}  minfer {row.get('minfer_w4a16_tflops', float('nan')):7.2f} "
                    f"TFLOP/s  bf16 {row.get('torch_bf16_matmul_tflops', float('nan')):7.2f}  x"
                    f"{row.get('speedup_vs_bf16', float('nan')):.2f} vs bf16, "
                    f"err {row.get('max_rel_err', float('nan')):.1e}")
            codes = scale = zero = qweight = sz_ = None  # (as above)
        w = None
        r.free()
    return rows


def bench_decode_kv_quant(r: Run, sz: dict, peak: float | None, block_size: int = 16) -> list[dict]:
    """Paged decode on the model-dtype cache vs int8 / fp8_e4m3 codes with per-token float32 scales."""
    from minfer.attention.kv_quant import kv_cache_spec, quantize_kv
    from minfer.kernels import paged_attention_decode

    rows = []
    for B in sz["kvq_batch"]:
        for ctx in sz["kvq_ctx"]:
            q, k16, v16, block_table, context_lens = paged_inputs(r, B, ctx, sz["heads"], sz["kv_heads"],
                                                                  sz["head_dim"], block_size)
            ref = paged_attention_decode(q, k16, v16, block_table, context_lens)
            for name in ("model_dtype", "int8", "fp8_e4m3"):
                row = {"batch": B, "context": ctx, "kv_cache_dtype": name if name != "model_dtype" else str(r.dtype)}
                try:
                    if name == "model_dtype":
                        args, kw = (k16, v16), {}
                        kv_bytes = 2 * k16.numel() * k16.element_size()
                    else:
                        spec = kv_cache_spec(name, r.dtype)
                        kc, ks = quantize_kv(k16.flatten(0, 1), spec)
                        vc, vs = quantize_kv(v16.flatten(0, 1), spec)
                        args = (kc.view(k16.shape), vc.view(k16.shape))
                        kw = dict(k_scale=ks.view(k16.shape[:-1]), v_scale=vs.view(k16.shape[:-1]))
                        kv_bytes = 2 * (kc.numel() + ks.numel() * 4)
                    ms = r.bench_ms(lambda: paged_attention_decode(q, *args, block_table, context_lens, **kw))
                    out = paged_attention_decode(q, *args, block_table, context_lens, **kw)
                    row.update(ms=ms, kv_bytes=kv_bytes, bw=kv_bytes / (ms * 1e-3),
                               max_abs_diff_vs_unquantized=float((out.float() - ref.float()).abs().max()))
                    if peak:
                        row["frac_of_peak"] = row["bw"] / peak
                except Exception as e:
                    row["error"] = error(e)
                rows.append(row)
                log(f"[decode-kvq] B={B:3d} ctx={ctx:6d} {row['kv_cache_dtype']:14s} "
                    f"{row.get('ms', float('nan')):7.3f} ms"
                    f"  {row.get('bw', float('nan')) / 1e12:5.2f} TB/s  |diff| "
                    f"{row.get('max_abs_diff_vs_unquantized', float('nan')):.3f}")
            r.free()
    return rows


def e2e_configs(dry: bool) -> dict[str, dict]:
    """The engine configurations of the end-to-end rows. Graph rows set enforce_eager=False; a backend whose
    decode path cannot be captured (the torch reference) then runs eagerly, which its row says."""
    configs = {"torch": dict(attention_backend="torch"), "torch+cuda_graphs": dict(attention_backend="torch",
                                                                                    enforce_eager=False),
               "triton": dict(attention_backend="triton"),
               "triton+cuda_graphs": dict(attention_backend="triton", enforce_eager=False),
               "triton+int4": dict(attention_backend="triton", quantization="int4"),
               "triton+int4+kv_int8": dict(attention_backend="triton", quantization="int4", kv_cache_dtype="int8")}
    return configs


def graphs_of(llm) -> dict:
    """What the engine's worker captured, as far as this build says (`Worker.cuda_graphs`, a CudaGraphRunner,
    once the engine wires it)."""
    runner = getattr(llm.llm_engine.worker, "cuda_graphs", None)
    if runner is None:
        return {"captured_sizes": [], "note": "this engine build captures no graphs (no Worker.cuda_graphs)"}
    return {"captured_sizes": runner.sizes, "why_not": runner.why_not}


def bench_end_to_end(r: Run, sz: dict, model: str, graph_rows: list | None = None) -> dict:
    """Decode tokens/s of the whole engine per configuration, the model in bf16 (float32 in a dry run); the
    greedy tokens of each row against the torch row's. The Triton row also runs `bench_graph_decode` on its
    model. Failures are recorded, not raised."""
    import torch

    from minfer import LLM, SamplingParams

    results, reference = {}, None
    prompts = [f"Write a short story about the number {i}." for i in range(sz["e2e_prompts"])]
    if r.dry:  # the tiny random Llama's word-level vocabulary
        prompts = [" ".join(f"w{3 + (i * 7 + j) % 60}" for j in range(6)) for i in range(sz["e2e_prompts"])]
    params = SamplingParams(temperature=0.0, max_tokens=sz["e2e_tokens"], ignore_eos=True)
    dtype = "bfloat16" if r.dtype == torch.bfloat16 else "float32"
    for name, kwargs in e2e_configs(r.dry).items():
        llm = None
        try:
            llm = LLM(model=model, dtype=dtype, seed=0, device=r.dev, max_model_len=sz["max_model_len"], **kwargs)
            if not r.dry:  # compile and autotune before the clock starts
                llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))
            r.sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            r.sync()
            dt = time.perf_counter() - t0
            tokens = [o.outputs[0].token_ids for o in outs]
            n = sum(len(t) for t in tokens)
            row = {"config": kwargs, "dtype": dtype, "prompts": len(prompts), "generated_tokens": n, "seconds": dt,
                   "tokens_per_s": n / dt, "first_output": outs[0].outputs[0].text[:80], **graphs_of(llm)}
            if name == "torch":
                reference = tokens
            if reference is not None:
                row["same_greedy_tokens_as_torch"] = sum(a == b for a, b in zip(tokens, reference)) / len(tokens)
            results[name] = row
            log(f"[e2e] {name:20s}: {n} tokens in {dt:.2f} s = {n / dt:.0f} tok/s, same tokens as torch: "
                f"{row.get('same_greedy_tokens_as_torch', float('nan')):.0%}")
            if name == "triton" and graph_rows is not None:
                graph_rows.extend(bench_graph_decode(r, sz, llm))
        except Exception as e:
            results[name] = {"config": kwargs, "error": error(e, 300)}
            log(f"[e2e] {name}: not measured ({error(e, 200)})")
        del llm
        r.free()
    return results


def bench_graph_decode(r: Run, sz: dict, llm) -> list[dict]:
    """The decode step of `llm`'s model over its KV pool: eager `model(ids, ctx)` against a replay of
    `CudaGraphRunner`, for each batch size of `sz["graph_batch"]` at context `sz["graph_ctx"]`; the greedy
    token of each row from both (they must agree). In a dry run (no CUDA) the runner covers nothing: the
    eager rows run and the replay is skipped with its reason."""
    import torch

    from minfer.attention import ForwardContext
    from minfer.cuda_graphs import CudaGraphRunner

    worker = llm.llm_engine.worker
    model, backend, bs = worker.model, worker.backend, worker.block_size
    width = -(-sz["graph_ctx"] // bs)
    batches = [b for b in sz["graph_batch"] if b * width <= worker.pool.num_blocks]
    rows = []
    with torch.inference_mode():
        runner = CudaGraphRunner.build(model, backend, max_num_seqs=max(batches), max_blocks_per_seq=width)
        for B in batches:
            pos = sz["graph_ctx"] - 1
            tables = torch.arange(B * width, dtype=torch.int32, device=r.dev).view(B, width)
            ctx = ForwardContext(attn_backend=backend, positions=torch.full((B,), pos, device=r.dev),
                                 slot_mapping=(tables[:, pos // bs].long() * bs + pos % bs),
                                 block_tables=tables, context_lens=torch.full((B,), pos + 1, dtype=torch.int32,
                                                                              device=r.dev),
                                 logits_indices=torch.arange(B, device=r.dev))
            ids = torch.randint(3, 50, (B,), device=r.dev, generator=r.gen(B))
            row = {"batch": B, "context": sz["graph_ctx"], "captured_sizes": runner.sizes}
            try:
                row["eager_ms"] = r.bench_ms(lambda: model(ids, ctx))
                want = model.compute_logits(model(ids, ctx)).argmax(-1)
                if runner.sizes:
                    row["graph_ms"] = r.bench_ms(lambda: runner.run(ids, ctx))
                    got = model.compute_logits(runner.run(ids, ctx)).argmax(-1)
                    row["speedup"] = row["eager_ms"] / row["graph_ms"]
                    row["same_greedy_token"] = bool(torch.equal(got, want))
                else:
                    row["graph_skipped"] = runner.why_not
            except Exception as e:
                row["error"] = error(e, 300)
            rows.append(row)
            log(f"[graphs] B={B:3d} eager {row.get('eager_ms', float('nan')):8.3f} ms  graph "
                f"{row.get('graph_ms', float('nan')):8.3f} ms  x{row.get('speedup', float('nan')):.2f}"
                + (f"  (replay skipped: {row['graph_skipped']})" if "graph_skipped" in row else ""))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Targets and figures
# ---------------------------------------------------------------------------------------------------------------

def run_notebook_sections(r: Run) -> dict:
    """The guarded GPU sections of the notebooks (04, 05, 06: `minfer/course/gpu/chNN.py`), the code the notebooks
    run when CUDA is present: on the GPU at full size, in a dry run on tiny shapes on the CPU, so CI runs the same
    code path a learner with a GPU would."""
    from minfer.course.gpu import sections

    out = {}
    for mod in sections():
        name = mod.__name__.rsplit(".", 1)[1]
        try:
            out[name] = mod.run(r.dev, small=r.dry)
        except Exception as e:  # one broken section must not cost the others
            out[name] = {"error": error(e, 300)}
            log(f"[notebook {name}] failed: {error(e, 300)}")
    return out


def targets_of(report: dict) -> dict:
    """Each target's measured value against its bound (TARGETS), where the run measured it."""
    out = {}
    p4k = next((x for x in report.get("prefill", []) if x["seq_len"] == 4096), None)
    if p4k and "minfer_tflops" in p4k and "torch_flash_tflops" in p4k:
        out["prefill_4k_ratio_vs_torch_flash"] = p4k["minfer_tflops"] / p4k["torch_flash_tflops"]
    d = next((x for x in report.get("decode", []) if x["batch"] == 32 and x["context"] == 4096), None)
    if d and "minfer_frac_of_peak" in d:
        out["decode_32x4k_frac_of_peak_bw"] = d["minfer_frac_of_peak"]
    g = next((x for x in report.get("cuda_graphs", []) if x["batch"] == 1 and "speedup" in x), None)
    if g:
        out["cuda_graph_decode_speedup_b1"] = g["speedup"]
    return {k: {"value": v, "target": TARGETS[k], "met": v >= TARGETS[k] if k != "cuda_graph_decode_speedup_b1"
                else v > TARGETS[k]} for k, v in out.items()}


def write_figures(report: dict, fig_dir: pathlib.Path) -> list[str]:
    """One PNG per part with numbers: prefill TFLOP/s, decode bandwidth, W4A16 speed-up, end-to-end tok/s,
    CUDA-graph step times. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    dev = report["device"]
    written = []

    def save(fig, name):
        path = fig_dir / f"gpu_check_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))

    pre = [x for x in report.get("prefill", []) if "minfer_tflops" in x]
    if pre:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in (("minfer_tflops", "minfer flash_attn_varlen"), ("torch_flash_tflops", "torch SDPA (flash)"),
                           ("naive_tflops", "naive (materialized scores)")):
            pts = [(x["seq_len"], x[key]) for x in pre if key in x]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set(xscale="log", xlabel="sequence length L", ylabel="TFLOP/s", title=f"causal prefill attention, {dev}")
        ax.legend()
        save(fig, "prefill")
    dec = [x for x in report.get("decode", []) if "minfer_bw" in x]
    if dec:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for B in sorted({x["batch"] for x in dec}):
            pts = [(x["context"], x["minfer_bw"] / 1e12) for x in dec if x["batch"] == B]
            ax.plot(*zip(*pts), marker="o", label=f"batch {B}")
        if report.get("peak_hbm_bytes_per_s"):
            ax.axhline(report["peak_hbm_bytes_per_s"] / 1e12, color="k", ls="--", label="peak HBM")
        ax.set(xscale="log", xlabel="context length", ylabel="TB/s of K and V read", title=f"paged decode, {dev}")
        ax.legend()
        save(fig, "decode")
    w4 = [x for x in report.get("w4a16", []) if "speedup_vs_bf16" in x]
    if w4:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in sorted({(x["N"], x["K"], x["group_size"]) for x in w4}):
            pts = [(x["M"], x["speedup_vs_bf16"]) for x in w4 if (x["N"], x["K"], x["group_size"]) == key]
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]}x{key[1]}, group {key[2]}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xscale="log", xlabel="tokens M", ylabel="speed-up vs bf16 matmul", title=f"W4A16 matmul, {dev}")
        ax.legend()
        save(fig, "w4a16")
    e2e = {k: v for k, v in report.get("end_to_end", {}).items() if isinstance(v, dict) and "tokens_per_s" in v}
    if e2e:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.barh(list(e2e), [v["tokens_per_s"] for v in e2e.values()])
        ax.invert_yaxis()
        ax.set(xlabel="decode tokens/s", title=f"SmolLM2-135M end to end, {dev}")
        save(fig, "end_to_end")
    gr = [x for x in report.get("cuda_graphs", []) if "eager_ms" in x]
    if gr:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(gr))
        ax.bar([i - 0.2 for i in xs], [x["eager_ms"] for x in gr], width=0.4, label="eager")
        ax.bar([i + 0.2 for i in xs], [x.get("graph_ms", 0) for x in gr], width=0.4, label="CUDA graph replay")
        ax.set_xticks(list(xs), [f"batch {x['batch']}" for x in gr])
        ax.set(ylabel="ms per decode step", title=f"decode step, eager vs CUDA graph, {dev}")
        ax.legend()
        save(fig, "cuda_graphs")
    return written


# ---------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--dry-run", action="store_true", help="every code path on tiny shapes, on the CPU under "
                    "TRITON_INTERPRET=1 (CUDA-only parts skipped with a note); times mean nothing")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--model", default=None, help="end-to-end model (default: SmolLM2's GGUF; a tiny random "
                    "Llama in a dry run)")
    ap.add_argument("--peak-tbps", type=float, default=None, help="peak HBM bandwidth if the device is not known")
    ap.add_argument("--test-timeout", type=int, default=200)
    ap.add_argument("--out", default=None, help=f"JSON path (default {OUT_JSON.relative_to(ROOT)}; a dry run "
                    "writes only where told)")
    ap.add_argument("--figures", default=None, help=f"figure folder (default {FIG_DIR.relative_to(ROOT)}, "
                    "beside --out in a dry run)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported (by minfer)
        os.environ.setdefault("MINFER_DEVICE", "cpu")

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        log("gpu_check.py needs a CUDA GPU; none is visible (torch.cuda.is_available() is False). "
            "On a CPU: python benchmarks/gpu_check.py --dry-run")
        return 2
    import triton

    r = Run(args.dry_run)
    sz = SIZES["dry" if args.dry_run else "quick" if args.quick else "full"]
    name = "CPU (dry run, Triton interpreter)" if args.dry_run else torch.cuda.get_device_name()
    peak = None if args.dry_run else peak_bandwidth(name, args.peak_tbps)
    report = {"device": name, "dry_run": args.dry_run, "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "peak_hbm_bytes_per_s": peak, "dtype": str(r.dtype),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sizes": sz, "notes": []}
    if args.dry_run:
        report["notes"] += ["dry run: times mean nothing (one interpreted call each)",
                            "SDPA's flash backend is CUDA-only: the torch rows use SDPA's math backend",
                            "CUDA graphs are CUDA-only: the replay rows are skipped, the eager rows run"]
    log(f"device: {name}, peak HBM {peak / 1e12 if peak else float('nan'):.2f} TB/s, torch {torch.__version__}, "
        f"triton {triton.__version__}")
    t_start = time.time()
    report["tests"] = run_tests(args.test_timeout, args.dry_run) if not args.skip_tests else {"skipped": True}
    for part, fn in (("prefill", lambda: bench_prefill(r, sz)), ("decode", lambda: bench_decode(r, sz, peak)),
                     ("w4a16", lambda: bench_w4a16(r, sz)),
                     ("decode_kv_quant", lambda: bench_decode_kv_quant(r, sz, peak))):
        try:
            report[part] = fn()
        except Exception as e:  # one broken part must not cost the others' numbers
            report[part] = [{"error": error(e, 300)}]
            log(f"[{part}] failed: {error(e, 300)}")
    report["notebook_gpu_sections"] = run_notebook_sections(r)
    if args.skip_e2e:
        report["end_to_end"], report["cuda_graphs"] = {"skipped": True}, []
    else:
        model = args.model
        tmp = None
        if model is None and args.dry_run:
            import tempfile

            from minfer.bench.parallel import save_random_llama

            tmp = tempfile.TemporaryDirectory()
            model = save_random_llama(pathlib.Path(tmp.name) / "llama", layers=2, hidden=64, heads=4, kv_heads=2,
                                      intermediate=128, vocab=64, max_positions=512)
        graph_rows: list = []
        report["end_to_end"] = bench_end_to_end(r, sz, model or "smollm2-135m-instruct", graph_rows)
        report["cuda_graphs"] = graph_rows
        if tmp is not None:
            tmp.cleanup()
    report["targets"] = targets_of(report)
    report["seconds"] = round(time.time() - t_start, 1)

    out = pathlib.Path(args.out) if args.out else (None if args.dry_run else OUT_JSON)
    fig_dir = pathlib.Path(args.figures) if args.figures else (out.parent if args.dry_run and out else FIG_DIR)
    if out is not None:
        try:
            report["figures"] = [str(pathlib.Path(p).relative_to(ROOT)) if pathlib.Path(p).is_relative_to(ROOT)
                                 else p for p in write_figures(report, fig_dir)]
        except Exception as e:
            report["figures_error"] = error(e, 300)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log(f"\nwrote {out}")
    log("targets:")
    for key, t in report["targets"].items():
        log(f"  {key}: {t['value']:.3f} (target {'>' if 'graph' in key else '>='} {t['target']}) "
            f"{'MET' if t['met'] else 'NOT MET'}")
    if not report["targets"]:
        log("  (none computed" + (": a dry run" if args.dry_run else ": a part failed, see the JSON") + ")")
    log(f"tests: {report['tests']}  ({report['seconds']} s)")
    return 0 if report["tests"].get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
