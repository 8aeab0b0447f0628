"""Where a served step's time goes: every process of one server (minfer or vLLM), sampled by py-spy under load.

    python benchmarks/step_profile.py --server minfer|vllm [--concurrency 16] [--num-prompts 32]
        [--input-len 192] [--output-len 48] [--rate 50] [--minfer-args "..."] [--json PATH] [--raw-dir DIR]
    python benchmarks/step_profile.py --fold RAW [--engine minfer|vllm]     # fold a saved raw file again

The server is started as `benchmarks/peer_vllm_serve.py` starts it (`server_cmd`, same flags, same model
directory) and driven by the same client (`minfer.bench.serve.run_benchmark`: random token-id prompts,
`ignore_eos`, temperature 0, a closed loop of `--concurrency` clients). While the client runs, this script
polls the server's `generation_tokens_total` counter and samples the steady part of the run: from the moment
`--start-frac` of the run's output tokens are out until `--stop-frac` are (the first wave of prefills and the
drain at the end are left out). Every process of the server (the API process and its children: minfer's
engine core, vLLM's EngineCore) gets its own `py-spy record --native --format raw`, so C++ frames show
(oneDNN/MKL GEMMs, minfer's csrc kernels, vLLM's attention ops).

Folding. py-spy's raw format is one line per distinct stack, `thread (tid): name;frame;frame;... count`,
root first; a frame is "function (file:line)" for Python and "symbol (library)" for native code. Each
engine has a small table of (category, kind, regex); a stack's category is found in passes:

0. a stack that waits (epoll, zmq poll, a lock, a sleep) is "idle": py-spy --native records some of those,
   and they are kept out of the busy seconds;
1. the innermost frame that names a kernel (a GEMM, the attention kernel, a fused element-wise kernel)
   decides: a GEMM called from the attention code is a GEMM;
2. otherwise the innermost frame that names a context (the scheduler, input preparation, the sampler, the
   detokenizer, IPC, HTTP, the model's forward) decides; the forward's context is "elementwise" when a torch
   kernel frame lies below it and "forward_py" (the forward's own Python: modules, views, the dispatcher's
   entry) when none does;
3. otherwise a generic torch frame makes it "elementwise", and a stack no pattern names is "other" (kept in
   the table, with its heaviest leaf frames in the JSON, so that what the patterns miss stays visible).

Seconds are samples / `--rate`: py-spy samples each thread of a process `--rate` times a second, so a
process's busy seconds are summed over its Python threads; `ms_per_token` divides them by the output tokens
the server generated in the window (its counter, read when sampling starts and stops), so that two servers of
different speeds compare per unit of work. OpenMP worker threads have no Python state and
are not sampled: the thread that starts a parallel region does its share of it, so a GEMM's seconds are wall
seconds of the step, not CPU seconds of both cores. Sampling with --native pauses the process briefly each
time: a profiled run is slower than an unprofiled one (the JSON has the client's numbers of both).

py-spy is a benchmark-only tool (`pip install py-spy`); it needs ptrace rights over the server's processes
(root, or `kernel.yama.ptrace_scope = 0`). This script stops with a message when it is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

CATEGORIES = ("schedule", "prepare", "gemm", "attention", "elementwise", "forward_py", "sample", "detokenize",
              "ipc", "http", "other")

IDLE = (r"epoll_wait|^poll \(|^select \(|PyThread_acquire_lock_timed|pthread_cond_(?:timed)?wait|"
        r"clock_nanosleep|sem_(?:timed)?wait|take_gil|^accept4 \(|^read \(libc")
# Kernels (pass 1): the innermost match wins; within a frame the first rule of the table, so attention comes
# before GEMM (vLLM's attention kernel has its own `gemm_micro` in cpu_attn_*.hpp).
_GEMM = (r"gemm|dnnl|mkl_|mkldnn|brgemm|jit_avx|jit_uni|panel_rows|at::native::(?:addmm|mm|bmm|linear)|"
         r"at::_ops::(?:addmm|mm|linear)::|cpublas|qgemm|gguf_matmul|int8_group|onednn")
_ELEMENTWISE_KERNELS = r"rms_norm|silu|rotary|fused_add|act_and_mul|minfer_fused|gelu|layer_norm|rotary_embedding"
# Generic torch kernels (pass 3, and what makes a forward context element-wise in pass 2).
TORCH_KERNEL = r"at::native::|at::vec::|Sleef|TensorIterator|at::internal::|c10::function_ref|at::_ops::"
PATTERNS: dict[str, list[tuple[str, str, str]]] = {
    "minfer": [
        ("attention", "kernel", r"paged_decode|minfer_prefill|prefill_cpu|flash_attn|scaled_dot_product"),
        ("gemm", "kernel", _GEMM),
        ("elementwise", "kernel", _ELEMENTWISE_KERNELS),
        ("sample", "context", r"Sampler|sampler\.py|sampling\.py|ModelRunner\._sample|verifier"),
        ("detokenize", "context", r"detokeniz|Detokenizer|output_processor|OutputProcessor|LLMEngine\._append_tokens|"
                                  r"tokenizers|stop_check"),
        ("ipc", "context", r"encode_step|decode_step \(minfer/serve|EngineCore\._send|EngineCore\._drain|"
                           r"EngineCore\._handle|Heartbeat|msgpack|zmq|minfer/serve/engine_client\.py|pickle"),
        ("schedule", "context", r"scheduler\.py|block_manager|prefix_cache|kv_cache_plan|EngineCore\._stats|"
                                r"engine_stats|LLMEngine\.(?:step|_update|_outputs|_retire)|step_hooks|"
                                r"minfer/extensions|sequence\.py|outputs\.py"),
        ("prepare", "context", r"prepare_inputs|ForwardContext|attn_metadata|slot_mapping"),
        ("schedule", "context", r"minfer/serve/engine_core\.py"),  # the engine loop's own Python
        ("attention", "context", r"minfer/attention/|minfer/cpu/attention\.py|Attention\.forward"),
        ("forward", "context", r"ModelRunner\.(?:run_model|compute_logits|execute_model)|minfer/model/|"
                               r"minfer/cpu/|torch/nn/modules"),
        ("http", "context", r"uvicorn|starlette|fastapi|h11|httptools|asyncio|minfer/serve/|pydantic|json|"
                            r"prometheus|anyio|uvloop"),
    ],
    "vllm": [
        ("attention", "kernel", r"paged_attention|cpu_attn|cpu_attention|flash_attn|scaled_dot_product|"
                                r"sdpa|AttentionImpl|mla_decode|varlen_attn"),
        ("gemm", "kernel", _GEMM),
        ("elementwise", "kernel", _ELEMENTWISE_KERNELS),
        ("sample", "context", r"/sample/|Sampler|sampler\.py|logits_processor|topk_topp|rejection_sampl"),
        ("detokenize", "context", r"detokeniz|Detokenizer|tokenizers|output_processor|OutputProcessor|"
                                  r"stop_checker|logprobs\.py"),
        ("ipc", "context", r"msgspec|msgpack|zmq|serial_utils|Msgpack(?:En|De)coder|process_input_sockets|"
                           r"process_output_sockets|core_client|pickle|shm_broadcast|MessageQueue"),
        ("schedule", "context", r"/sched/|scheduler\.py|kv_cache_manager|kv_cache_utils|block_pool|"
                                r"single_type_kv|v1/request\.py|update_from_output|make_stats|"
                                r"EngineCore\.step|engine/core\.py|v1/metrics/"),
        ("prepare", "context", r"_prepare_inputs|_update_states|input_batch|prepare_inputs|block_table|"
                               r"build_attn_metadata|attn_metadata|set_forward_context|_dummy|_preprocess"),
        ("attention", "context", r"vllm/attention/|attention/backends|v1/attention/|Attention\.forward|"
                                 r"unified_attention"),
        ("forward", "context", r"model_executor/models/|model_executor/layers/|torch/nn/modules|"
                               r"execute_model|_model_forward|v1/worker/|v1/executor/|custom_op"),
        ("http", "context", r"uvicorn|starlette|fastapi|h11|httptools|asyncio|entrypoints/|pydantic|json|"
                            r"prometheus|anyio|uvloop|openai/"),
    ],
}


def compile_patterns(engine: str) -> list[tuple[str, str, re.Pattern]]:
    """`engine`'s ("minfer" or "vllm") table with its regexes compiled."""
    return [(c, kind, re.compile(p)) for c, kind, p in PATTERNS[engine]]


_IDLE, _TORCH = re.compile(IDLE), re.compile(TORCH_KERNEL)


def categorize(frames: list[str], rules) -> str:
    """The category of one stack (`frames` root first), by the passes of the module docstring; "idle" for a
    stack that waits."""
    if any(_IDLE.search(f) for f in frames[-4:]):  # the wait is at the leaf, under a frame or three of glue
        return "idle"
    inner_first = frames[::-1]
    for frame in inner_first:
        for cat, kind, rx in rules:
            if kind == "kernel" and rx.search(frame):
                return cat
    for depth, frame in enumerate(inner_first):
        for cat, kind, rx in rules:
            if kind == "context" and rx.search(frame):
                if cat != "forward":
                    return cat
                below = inner_first[:depth]
                return "elementwise" if any(_TORCH.search(f) for f in below) else "forward_py"
    if any(_TORCH.search(f) for f in frames):
        return "elementwise"
    return "other"


def parse_raw(text: str) -> list[tuple[str, list[str], int]]:
    """py-spy's raw output as (thread, frames root first, samples) per line. Lines without a count are skipped.

    With `--threads` the first frame is "thread (tid): name"; it is returned as the thread and not as a frame.
    """
    stacks = []
    for line in text.splitlines():
        line = line.rstrip()
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = ""
        if frames and frames[0].startswith("thread ("):
            thread = frames.pop(0)
        stacks.append((thread, frames, int(count)))
    return stacks


def fold(text: str, engine: str, rate: float) -> dict:
    """Fold one process's raw py-spy output into categories.

    Args:
        text: py-spy `--format raw --threads` output (one process).
        engine: "minfer" or "vllm" (which pattern table).
        rate: py-spy's sampling rate (samples per second per thread).
    Returns:
        {"samples": busy samples, "busy_s": seconds busy (samples / rate), "idle_s": seconds of recorded waits,
        "categories": {category: {"samples", "s", "share" (of busy)}} with every category present,
        "threads": {thread name: busy seconds}, "other_top_leaves": [[leaf frame, samples], ...] (the 8 heaviest
        leaf frames of "other", to see what the patterns miss)}.
    """
    rules = compile_patterns(engine)
    counts: dict[str, int] = defaultdict(int)
    threads: dict[str, int] = defaultdict(int)
    other_leaves: dict[str, int] = defaultdict(int)
    for thread, frames, n in parse_raw(text):
        cat = categorize(frames, rules)
        counts[cat] += n
        if cat == "idle":
            continue
        threads[thread.partition(": ")[2] or thread] += n
        if cat == "other" and frames:
            other_leaves[frames[-1]] += n
    busy = sum(counts[c] for c in CATEGORIES)
    cats = {c: {"samples": counts[c], "s": round(counts[c] / rate, 3),
                "share": round(counts[c] / busy, 4) if busy else 0.0} for c in CATEGORIES}
    top = sorted(other_leaves.items(), key=lambda kv: -kv[1])[:8]
    return {"samples": busy, "busy_s": round(busy / rate, 3), "idle_s": round(counts["idle"] / rate, 3),
            "categories": cats, "threads": {t: round(n / rate, 3) for t, n in sorted(threads.items())},
            "other_top_leaves": [[leaf[:160], n] for leaf, n in top]}


# -- the run ----------------------------------------------------------------------------------------------------

def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (psutil), parents first."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def process_label(pid: int, root: int) -> str:
    """"api" for the server's own process; "engine_core" (vLLM's VLLM::EngineCore title, minfer's multiprocessing
    spawn child), "worker" (vLLM's VLLM::Worker), "resource_tracker", else the process name and pid."""
    import psutil

    if pid == root:
        return "api"
    try:
        p = psutil.Process(pid)
        title = " ".join(p.cmdline()) or p.name()
    except psutil.NoSuchProcess:
        return f"pid{pid}"
    if "resource_tracker" in title:
        return "resource_tracker"
    if "EngineCore" in title or "spawn_main" in title:
        return "engine_core"
    if "Worker" in title:
        return "worker"
    return f"{p.name()}-{pid}"


def token_counters(url: str) -> dict[str, float] | None:
    """The server's `generation_tokens_total` and `prompt_tokens_total` counters (minfer: and vllm: names),
    each summed over its labels; None when /metrics does not answer."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    out = {}
    for kind in ("generation", "prompt"):
        rx = re.compile(rf"^(?:minfer|vllm):{kind}_tokens_total(?:\{{[^}}]*\}})?\s+(\S+)$", re.M)
        out[kind] = sum(float(v) for v in rx.findall(text))
    return out


def generation_tokens(url: str) -> float | None:
    """The server's `generation_tokens_total` counter (`token_counters`)."""
    counters = token_counters(url)
    return counters["generation"] if counters else None


class Sampler:
    """One `py-spy record` per process of a server, started and stopped together (SIGINT writes the file)."""

    def __init__(self, pids: dict[int, str], rate: int, out_dir: Path, native: bool = True):
        self.procs, self.files = [], {}
        for pid, label in pids.items():
            path = out_dir / f"{label}_{pid}.raw"
            cmd = ["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--threads",
                   "--output", str(path)] + (["--native"] if native else [])
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            self.files[pid] = (label, path)
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, list[str]]:
        """Stop every recorder; returns the window (seconds) and py-spy's last lines (samples, errors)."""
        window = time.perf_counter() - self.t0
        logs = []
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            logs += [ln for ln in out.splitlines() if "Samples" in ln or "rror" in ln][-3:]
        return window, logs


def warm_up(url: str) -> None:
    """A few short requests first: the first steps of a fresh server build kernels and caches."""
    from minfer.bench.serve import run_benchmark

    run_benchmark(url, num_prompts=8, max_concurrency=4, input_len=64, output_len=8, vocab_size=49152,
                  model="smollm2", disable_tqdm=True, poll_stats=False)


def run_client_sampled(url: str, root_pid: int, engine: str, args, raw_dir: Path) -> dict:
    """Drive the server with the shared client and sample its processes over the steady window."""
    from minfer.bench.serve import run_benchmark

    warm_up(url)
    base = generation_tokens(url) or 0.0
    total = args.num_prompts * args.output_len
    result: dict = {}

    def client():
        result.update(run_benchmark(url, num_prompts=args.num_prompts, max_concurrency=args.concurrency,
                                    input_len=args.input_len, output_len=args.output_len, vocab_size=49152,
                                    model="smollm2", disable_tqdm=True, poll_stats=False))

    th = threading.Thread(target=client, daemon=True)
    th.start()
    sampler, window, logs = None, 0.0, []
    tokens_at = [None, None]  # the counter when sampling started and stopped
    load_start = os.getloadavg()
    while th.is_alive():
        count = generation_tokens(url) or base
        done = (count - base) / total
        if sampler is None and done >= args.start_frac:
            pids = {p: process_label(p, root_pid) for p in process_tree(root_pid)}
            sampler, tokens_at[0] = Sampler(pids, args.rate, raw_dir), token_counters(url)
        elif sampler is not None and done >= args.stop_frac:
            window, logs = sampler.stop()
            tokens_at[1] = token_counters(url)
            break
        time.sleep(1.0)  # each poll renders /metrics in the API process: seldom, so it barely shows
    th.join()
    if sampler is not None and not window:
        window, logs = sampler.stop()
        tokens_at[1] = token_counters(url)
    window_prompt, window_tokens = None, None
    if None not in tokens_at:
        window_tokens = tokens_at[1]["generation"] - tokens_at[0]["generation"]
        window_prompt = tokens_at[1]["prompt"] - tokens_at[0]["prompt"]
    processes = {}
    for pid, (label, path) in (sampler.files.items() if sampler else []):
        text = path.read_text() if path.exists() else ""
        folded = fold(text, engine, args.rate) if text.strip() else None
        if folded and folded["samples"]:  # a process that only waited (the resource tracker) is left out
            processes[label] = {"pid": pid, "raw": str(path), **add_per_token(folded, window_tokens)}
    keep = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "mean_itl_ms", "completed", "failed", "duration_s")
    return {"client": {k: result.get(k) for k in keep}, "window_s": round(window, 2),
            "window_output_tokens": window_tokens, "window_prompt_tokens": window_prompt, "py_spy_log": logs,
            "load_average": {"start": load_start, "end": os.getloadavg()}, "processes": processes}


def run_client_plain(url: str, args) -> dict:
    """The same workload without the profiler: the numbers the profiled run's slowdown is read against."""
    from minfer.bench.serve import run_benchmark

    warm_up(url)
    r = run_benchmark(url, num_prompts=args.num_prompts, max_concurrency=args.concurrency, input_len=args.input_len,
                      output_len=args.output_len, vocab_size=49152, model="smollm2", disable_tqdm=True,
                      poll_stats=False)
    return {k: r.get(k) for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "completed", "failed")}


def profile_server(engine: str, args) -> dict:
    """Start `engine`'s server, run the workload once unprofiled and once sampled, stop it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peer_vllm_serve import ensure_vllm_metadata, server_cmd, stop_server, wait_healthy

    from minfer.bench.serve import free_port

    if engine == "vllm":
        ensure_vllm_metadata(args.vllm)
    port = free_port()
    cmd, env = server_cmd(engine, args, port)
    raw_dir = Path(args.raw_dir or tempfile.mkdtemp(prefix="step-profile-"))
    raw_dir.mkdir(parents=True, exist_ok=True)
    log = open(raw_dir / f"{engine}_server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        plain = run_client_plain(url, args) if args.plain else None
        sampled = run_client_sampled(url, proc.pid, engine, args, raw_dir)
    finally:
        stop_server(proc, log)
    return {"server": engine, "concurrency": args.concurrency, "num_prompts": args.num_prompts,
            "minfer_args": args.minfer_args if engine == "minfer" else None, "unprofiled": plain, **sampled}


def add_per_token(folded: dict, window_tokens: float | None) -> dict:
    """Each category's ms per output token of the window (engines of different speeds compare per unit of work)."""
    if window_tokens:
        for cat in folded["categories"].values():
            cat["ms_per_token"] = round(1000 * cat["s"] / window_tokens, 3)
    return folded


def refold(path: Path) -> None:
    """Fold every process of every run in the JSON at `path` again from its raw file, in place."""
    doc = json.loads(path.read_text())
    for run in doc["runs"]:
        for label, proc in run["processes"].items():
            folded = fold(Path(proc["raw"]).read_text(), run["server"], doc["py_spy_rate_hz"])
            run["processes"][label] = {"pid": proc["pid"], "raw": proc["raw"],
                                       **add_per_token(folded, run.get("window_output_tokens"))}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def print_table(run: dict) -> None:
    """Seconds and shares per category, one column per process."""
    procs = run["processes"]
    print(f"\n{run['server']} c={run['concurrency']}: window {run['window_s']} s, {run['window_output_tokens']} "
          f"output tokens, client {run['client']}")
    print(f"  {'category':12s}" + "".join(f"{name:>34s}" for name in procs))
    for c in CATEGORIES:
        cells = "".join(f"{p['categories'][c]['s']:8.2f} s {100 * p['categories'][c]['share']:5.1f} % "
                        f"{p['categories'][c].get('ms_per_token', float('nan')):6.2f} ms/tok  "
                        for p in procs.values())
        print(f"  {c:12s}{cells}")
    print(f"  {'busy':12s}" + "".join(f"{p['busy_s']:8.2f} s {'':24s}" for p in procs.values()))


def cpu_model() -> str:
    from minfer.course import cpu_name

    return cpu_name()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", choices=("minfer", "vllm"), default="minfer")
    ap.add_argument("--vllm", default="/tmp/vllm-venv/bin/vllm")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-hf"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 2 x --concurrency")
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second per thread")
    ap.add_argument("--start-frac", type=float, default=0.15,
                    help="sample from this fraction of the run's output tokens (0: from the start)")
    ap.add_argument("--stop-frac", type=float, default=0.85,
                    help="... to this one (1: to the end; 0 and 1 give two servers the same work to compare)")
    ap.add_argument("--no-plain", dest="plain", action="store_false", help="skip the unprofiled run")
    ap.add_argument("--minfer-args", default="", help="extra flags for `python -m minfer.serve`, one string")
    ap.add_argument("--old-log-flag", action="store_true", help="vLLM --disable-log-requests (older vLLMs)")
    ap.add_argument("--raw-dir", default=None, help="where py-spy's raw files and the server log go")
    ap.add_argument("--json", default=None, help="append this run to the JSON file's `runs` (created if missing)")
    ap.add_argument("--label", default=None, help="a name for this run in the JSON (which code, which flags)")
    ap.add_argument("--fold", default=None, help="only fold this raw file and print its categories")
    ap.add_argument("--engine", choices=("minfer", "vllm"), default="minfer", help="the pattern table of --fold")
    ap.add_argument("--refold", default=None,
                    help="fold every run of this JSON again from its raw files (after the patterns changed)")
    args = ap.parse_args(argv)
    if args.fold:
        print(json.dumps(fold(Path(args.fold).read_text(), args.engine, args.rate), indent=2))
        return 0
    if args.refold:
        refold(Path(args.refold))
        return 0
    if shutil.which("py-spy") is None:
        print("py-spy not found: `pip install py-spy` (a benchmark-only tool; needs ptrace rights)", file=sys.stderr)
        return 2
    if args.server == "vllm" and not Path(args.vllm).exists():
        print(f"no vLLM at {args.vllm} (see benchmarks/peer_vllm_serve.py)", file=sys.stderr)
        return 2
    args.num_prompts = args.num_prompts or 2 * args.concurrency
    run = profile_server(args.server, args)
    run["label"] = args.label
    print_table(run)
    if args.json:
        path = Path(args.json)
        doc = json.loads(path.read_text()) if path.exists() else {
            "note": "py-spy --native samples of each server process over the steady part of a served run "
                    "(benchmarks/step_profile.py); seconds = samples / rate, busy time per process",
            "cpu": cpu_model(), "py_spy_rate_hz": args.rate, "runs": []}
        run["load_average"]["cpu_count"] = os.cpu_count()
        doc["runs"].append(run)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
