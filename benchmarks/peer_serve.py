"""The served headline: minfer's server against vLLM's and llama.cpp's, same client, same machine, same run.

    flock /tmp/minfer-bench.lock python benchmarks/peer_serve.py --out-dir assets/benchmarks/peer_serve \\
        [--servers minfer-f32,vllm-f32,minfer-q4_1,llama-q4_1,minfer-q4_0,llama-q4_0] [--rounds 2] \\
        [--concurrency 1,16,64] [--num-prompts N | --min-prompts 16 --prompts-per-stream 2] \\
        [--input-len 192] [--output-len 48] [--minfer-client] [--ports minfer=8100,vllm=8200,llama=8300] \\
        [--peaks-json PATH] [--dry-run]

`--out-dir DIR` receives everything: DIR/peer_serve.json (the result), DIR/logs/ (every server's log) and
DIR/runs/ (each client run's own result file); without it, `--json PATH` and `--log-dir` (default: a temporary
folder) as before. `--ports` fixes each engine's port (an engine left out gets a free one at each start).

Machine-portable verdicts (issue 41): before the first server starts, `benchmarks/peak_idiom.py` measures this
machine's float32 FMA peak (GFLOP/s) and the peak of the integer multiply-add idiom of its widest ISA (GOP/s),
recorded once under `machine_peaks` (`--peaks-json` reads an earlier measurement instead). Every server's median
throughput at every concurrency becomes achieved GFLOP/s (requests/s x `serve_roofline.flops_per_request`: prompt
and output tokens through every layer, the LM head for the outputs) and a fraction of the FMA peak (float32
servers) or of the idiom peak (the GGUF servers): `peak_fractions` in each client's summary, and both servers'
fractions in every comparison row. A ratio between two servers can move with the machine; a fraction of the
machine's own peak says how much of it each server turns into tokens, on a Zen 1, a Zen 3 or an AVX-512 machine.

llama-server and kept-alive connections: every request to llama-server (both clients, and the warm-up) carries
`Connection: close` (vllm bench's `--header`), so each opens its own connection; reusing one that llama-server
has closed between two requests fails that request. Each run records the headers it sent (`request_headers`).

The whole run takes ~40 min with --minfer-client at the defaults; `--lock-file /tmp/minfer-bench.lock` (instead
of the outer flock) holds the lock one server start at a time (a few minutes each), letting other timings in.

Six servers, each started in turn and stopped before the next one starts (one server on the machine at a time):

- `minfer-f32` / `vllm-f32`: `python -m minfer.serve` and `vllm serve` on the same float32 HF directory
  (`--model-dir`). vLLM runs in its default mode (torch.compile'd, no `--enforce-eager`): the configuration
  its users run, and its fastest one on this CPU (issue 32).
- `minfer-q4_1` / `llama-q4_1`: minfer (`--quantization gguf`, the file's own Q4 blocks) and llama.cpp's
  `llama-server` on the default GGUF (Q4_1).
- `minfer-q4_0` / `llama-q4_0`: the same on a Q4_0 re-quantization of it (`llama-quantize`), the format
  llama.cpp's fast x86 kernels take. `benchmarks/build_llama_cpp.sh` builds llama-server and that file.

Each round starts every server once (llama-server once per concurrency, see below) and drives it at each
`--concurrency` with `vllm bench serve --backend openai --endpoint /v1/completions` (random dataset, `--ignore-eos`,
`--temperature 0`) and, with `--minfer-client`, with minfer's own load client (`minfer.bench.serve.run_benchmark`)
as a second opinion.

Prompts: every server gets the same prompts at the same concurrency and client, and no prompt set is sent twice to
one server start (random offsets can still make two prompts share their first block by chance; the prefix-cache
counters would show it). `vllm bench serve`'s random dataset draws request i's prompt from the seed alone, whatever
`--num-prompts` is, so with one seed for every run the 32 prompts at 16 streams would begin with the 16 already
sent at 1 stream, and the 128 at 64 streams with those 32. vLLM's and minfer's servers cache prompt prefixes by
default (`--enable-prefix-caching`) and skip their prefill: with one seed (`--same-seed`, the earlier behaviour) vLLM
found 2,048 of the 6,144 prompt tokens at 16 streams in its cache (the first 128-token block of each of the 16
prompts sent before) and served 56.5 output tok/s against 47.8-51.3 with fresh prompts
(assets/benchmarks/peer_serve_same_seed_cpu.json). So each (concurrency, client) pair has its own seed
(`run_seed`), and each run records the server's prefix-cache counters (`prefix_cache`: prompt tokens looked up
and found, from /metrics) to show that nothing was reused. Rounds alternate the
servers (A B C ... A B C ...), so the slow drift of a shared machine hits all of them alike; the medians over
rounds are compared. The 1-minute load average is recorded before and after every client run.

llama-server: `-np C` slots for concurrency C (a restart per concurrency: its slots are fixed at start-up and
with an explicit `-np` each slot gets its own `-c / -np` context, so `-np C` is what a llama.cpp user sizes for
C streams, and at C = 1 the batch never carries 63 idle slots), `-c C * --max-model-len`, `-t`/`-tb`
`--llama-threads`, continuous batching on (its default, passed explicitly). `--llama-np N` starts it once per
round with N slots instead. `--cache-ram 0` (in `--llama-args`) turns off its host-memory prompt cache (8 GiB by
default): random prompts never hit it and this machine is shared.

ignore_eos: llama-server's OpenAI `/v1/completions` copies every body field it does not translate into its own
parameters (tools/server/server-common.cpp), so vllm bench's `"ignore_eos": true` reaches its native
`ignore_eos` (a -inf logit bias on every end-of-generation token, tools/server/server-schema.cpp) and
`"max_tokens"` is its `n_predict`. Token counts are checked twice per run: the client's `total_output_tokens`
and the server's own counter (`/metrics`: minfer:generation_tokens_total, vllm:generation_tokens_total,
llamacpp:tokens_predicted_total with `--metrics`, read before and after), each against num_prompts x output_len;
mismatches are printed and recorded under `token_check`. llama-server's last streamed chunk carries `choices`
and `usage` together, and vllm bench reads `usage` only from a chunk without choices, so it counts llama-server's
tokens by re-tokenizing the text: where that count is off but the server's counter is exact, the run's
throughput and TPOT are recomputed from vllm bench's own per-request timings with the server's count (`recount`;
vllm bench's figures are kept beside them under `as_counted_by_vllm_bench`).

Targets (issue 41, `TARGETS`): minfer/vLLM (float32) output throughput >= 1.1x at 16 and 64 streams with mean
TPOT no worse, where vLLM turns less than 0.75 of the FMA peak into tokens (above, the fractions are stated
instead); minfer/llama-server >= 1.5x at 16 and 64 with mean TTFT and TPOT no worse, on each GGUF; no failed
request on either side. The JSON holds per
server, concurrency and round the output tok/s, mean/p99 TTFT and TPOT, total output tokens and load averages,
the medians, the ratios and met/missed. A benchmark, never a test dependency (tests/test_peer_serve.py checks
the plan and the summary with no server).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NAME = "smollm2"  # the served model name every server answers to
VOCAB_SIZE = 49152  # SmolLM2's vocabulary, for minfer's client's random token ids
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Server:
    name: str
    engine: str   # "minfer", "vllm" or "llama"
    weights: str  # "f32" (the HF directory), "q4_1" (the default GGUF) or "q4_0" (its re-quantization)


SERVERS = {s.name: s for s in (
    Server("minfer-f32", "minfer", "f32"), Server("vllm-f32", "vllm", "f32"),
    Server("minfer-q4_1", "minfer", "q4_1"), Server("llama-q4_1", "llama", "q4_1"),
    Server("minfer-q4_0", "minfer", "q4_0"), Server("llama-q4_0", "llama", "q4_0"))}


@dataclass(frozen=True)
class Target:
    minfer: str
    peer: str
    throughput_ratio: float        # minfer / peer output tok/s must reach this
    concurrencies: tuple | None    # where the target applies (None: at every concurrency measured)
    no_worse: tuple = ()           # latencies whose mean must be <= the peer's too: "ttft", "tpot"
    # the target applies only where the peer turns less than this share of the machine's peak into tokens; where it
    # turns more, there is too little left to lead by and the fractions are stated instead (issue 41)
    peer_fraction_below: float | None = None


# Issue 41's must-holds: float32 >= 1.1x vLLM at 16 and 64 streams with TPOT no worse, where vLLM is below 0.75 of
# the FMA peak; GGUF >= 1.5x llama-server at 16 and 64 with TTFT and TPOT no worse. Every target also needs no
# failed request on either side.
TARGETS = (Target("minfer-f32", "vllm-f32", 1.1, (16, 64), ("tpot",), 0.75),
           Target("minfer-q4_1", "llama-q4_1", 1.5, (16, 64), ("ttft", "tpot")),
           Target("minfer-q4_0", "llama-q4_0", 1.5, (16, 64), ("ttft", "tpot")))

METRICS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
           "total_output_tokens", "total_input_tokens", "completed", "failed", "duration")


def parse_concurrency(text: str) -> list[int]:
    """"1,16,64" -> [1, 16, 64]; raises ValueError on anything but positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--concurrency takes integers >= 1, got {text!r}")
    if len(set(values)) != len(values):  # a repeat would resend its prompts to the same server start
        raise ValueError(f"--concurrency lists a value twice: {text!r}")
    return values


ENGINES = ("minfer", "vllm", "llama")


def parse_ports(text: str) -> dict[str, int]:
    """"minfer=8100,vllm=8200,llama=8300" -> {"minfer": 8100, ...}; "" -> {}. Raises ValueError for an unknown
    engine, a port outside 1..65535, or a port or engine given twice."""
    ports: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        engine, sep, value = item.partition("=")
        engine = engine.strip()
        if not sep or engine not in ENGINES:
            raise ValueError(f"--ports takes ENGINE=PORT pairs with ENGINE one of {', '.join(ENGINES)}, got {item!r}")
        try:
            port = int(value)
        except ValueError:
            raise ValueError(f"--ports: {engine}'s port is not an integer: {value!r}") from None
        if not 1 <= port <= 65535 or engine in ports or port in ports.values():
            raise ValueError(f"--ports: {item!r} is out of 1..65535 or repeats an engine or a port")
        ports[engine] = port
    return ports


def port_for(args, server: Server) -> int:
    """The port `server` listens on: its engine's from --ports, else a free one."""
    from minfer.bench.serve import free_port

    return args.ports.get(server.engine) or free_port()


def request_headers(server: Server) -> dict:
    """Headers every benchmark request to `server` carries. llama-server closes an idle kept-alive connection
    between two requests of a client that reuses it, and the request sent on it then fails: with
    `Connection: close` every request opens its own connection, as no other server here needs."""
    return {"Connection": "close"} if server.engine == "llama" else {}


def num_prompts(args, concurrency: int) -> int:
    """Prompts sent at one concurrency: --num-prompts if given, else max(--min-prompts, --prompts-per-stream x C)."""
    if args.num_prompts:
        return args.num_prompts
    return max(args.min_prompts, args.prompts_per_stream * concurrency)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(SERVERS),
                    help=f"servers to run, in alternation order, comma-separated from {', '.join(SERVERS)}")
    ap.add_argument("--rounds", type=int, default=2, help="times each server is started and measured")
    ap.add_argument("--concurrency", default="1,16,64", help="max concurrent requests, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=0,
                    help="prompts per run at every concurrency (0: max(--min-prompts, --prompts-per-stream x C))")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--prompts-per-stream", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=192, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=48, help="generated tokens (ignore_eos)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature vllm bench sends (0: greedy, the same work on every server)")
    ap.add_argument("--seed", type=int, default=0,
                    help="base of the random dataset's seeds (each concurrency and client adds its own offset)")
    ap.add_argument("--same-seed", action="store_true",
                    help="one seed for every run, as this script had (later runs resend earlier prompts: shows the "
                         "prefix-cache hits it gave vLLM)")
    ap.add_argument("--max-model-len", type=int, default=1024, help="context per sequence, every server")
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="minfer's and vLLM's --max-num-seqs (0: the largest --concurrency)")
    ap.add_argument("--minfer-client", action="store_true",
                    help="also drive every server with minfer's own client (a second opinion)")
    ap.add_argument("--vllm", default="/work/vllm-venv/bin/vllm", help="the `vllm` executable of its venv")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-hf"),
                    help="float32 HF directory (minfer-f32, vllm-f32; also every run's client tokenizer)")
    ap.add_argument("--gguf-q4-1", type=Path, default=None, help="the Q4_1 GGUF (default: find_default_gguf())")
    ap.add_argument("--gguf-q4-0", type=Path, default=Path("/work/smollm2-q4_0.gguf"),
                    help="its Q4_0 re-quantization (benchmarks/build_llama_cpp.sh makes it)")
    ap.add_argument("--llama-server", default="/work/llama.cpp-build/bin/llama-server")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t and -tb")
    ap.add_argument("--llama-np", type=int, default=0,
                    help="llama-server slots (0: -np = concurrency, restarted per concurrency)")
    ap.add_argument("--llama-args", default="--cache-ram 0", help="extra llama-server flags, one string")
    ap.add_argument("--minfer-args", default="", help="extra `python -m minfer.serve` flags, one string")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, one string")
    ap.add_argument("--lock-file", default=None,
                    help="take this flock around each server start (start-up and its runs) instead of around the "
                         "whole run, so other timings can go in between (e.g. /tmp/minfer-bench.lock)")
    ap.add_argument("--ports", default="",
                    help="fixed ports per engine, e.g. minfer=8100,vllm=8200,llama=8300 (an engine left out gets a "
                         "free port at each start)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="write everything under this folder: peer_serve.json, logs/, runs/ (every client run's "
                         "own result file); replaces --json and --log-dir")
    ap.add_argument("--peaks-json", type=Path, default=None,
                    help="the machine's peaks from this `peak_idiom.py --json` file instead of measuring them")
    ap.add_argument("--peak-threads", type=int, default=0,
                    help="threads peak_idiom.py measures the peaks on (0: every CPU this process may use)")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a new temporary folder)")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (every command) and exit")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.concurrency = parse_concurrency(args.concurrency)
    except ValueError as exc:
        ap.error(str(exc))
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in SERVERS]
    if not args.servers or unknown:
        ap.error(f"--servers: unknown {unknown or 'empty'}; choose from {', '.join(SERVERS)}")
    if len(set(args.servers)) != len(args.servers):
        ap.error("--servers lists a server twice")
    for flag in ("rounds", "min_prompts", "prompts_per_stream", "input_len", "output_len", "max_model_len"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.num_prompts < 0 or args.max_num_seqs < 0 or args.llama_np < 0:
        ap.error("--num-prompts, --max-num-seqs and --llama-np must be >= 0")
    if args.input_len + args.output_len > args.max_model_len:
        ap.error("--input-len + --output-len exceed --max-model-len")
    if args.llama_np and args.llama_np < max(args.concurrency):
        ap.error("--llama-np must be >= the largest --concurrency (or 0: one slot per stream)")
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)
    try:
        args.ports = parse_ports(args.ports)
    except ValueError as exc:
        ap.error(str(exc))
    if args.out_dir is not None and (args.json or args.log_dir):
        ap.error("--out-dir holds the JSON and the logs: drop --json and --log-dir")
    if args.peak_threads < 0:
        ap.error("--peak-threads must be >= 0")
    if args.gguf_q4_1 is None:
        from minfer.model.sources import find_default_gguf
        try:
            args.gguf_q4_1 = find_default_gguf()
        except Exception as exc:  # no default model installed: main() reports the missing file
            print(f"no default GGUF ({exc}); pass --gguf-q4-1", file=sys.stderr)
    return args


def weights_path(server: Server, args) -> Path:
    return {"f32": args.model_dir, "q4_1": args.gguf_q4_1 or Path("MISSING-Q4_1.gguf"),
            "q4_0": args.gguf_q4_0}[server.weights]


def vllm_env() -> dict:
    """vLLM's CPU build on both cores, 1 GiB of KV cache (as minfer's --kv-cache-memory-bytes)."""
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def server_cmd(server: Server, args, port: int, slots: int) -> tuple[list[str], dict]:
    """The command line and environment that start `server` on `port` (`slots`: llama-server's -np)."""
    model = str(weights_path(server, args))
    if server.engine == "llama":
        return ([args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--alias", NAME,
                 "-np", str(slots), "-c", str(slots * args.max_model_len), "-t", str(args.llama_threads),
                 "-tb", str(args.llama_threads), "--cont-batching", "--metrics", *shlex.split(args.llama_args)],
                dict(os.environ))
    common = ["--port", str(port), "--max-model-len", str(args.max_model_len), "--max-num-seqs",
              str(args.max_num_seqs), "--served-model-name", NAME]
    if server.engine == "vllm":
        return ([args.vllm, "serve", model, *common, "--dtype", "float32", "--no-enable-log-requests",
                 *shlex.split(args.vllm_args)], vllm_env())
    quant = ["--dtype", "float32"] if server.weights == "f32" else ["--quantization", "gguf"]
    return ([sys.executable, "-m", "minfer.serve", "--model", model, *common, *quant,
             "--kv-cache-memory-bytes", str(1 << 30), "--disable-log-requests", "--uvicorn-log-level", "warning",
             *shlex.split(args.minfer_args)], {**os.environ, "PYTHONUNBUFFERED": "1"})


def vllm_bench_cmd(args, url: str, concurrency: int, result_dir: str, headers: dict | None = None) -> list[str]:
    """`vllm bench serve`'s command line for one run; `headers` (`request_headers`) go with every request."""
    header = ["--header", *(f"{k}={v}" for k, v in headers.items())] if headers else []
    return [args.vllm, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", url, "--model", NAME, "--tokenizer", str(args.model_dir), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(num_prompts(args, concurrency)), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--temperature", str(args.temperature),
            "--seed", str(run_seed(args, concurrency, "client_vllm")),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "99",
            "--ready-check-timeout-sec", "0", "--save-result", "--save-detailed", "--result-dir", result_dir,
            "--result-filename", "result.json", "--disable-tqdm", *header]


def run_seed(args, concurrency: int, client: str) -> int:
    """The random dataset's seed for one run: the same on every server, different for every (concurrency, client)
    pair of one server start (see the module docstring). The offset follows the concurrency's place in
    `--concurrency`, so compare runs of one invocation."""
    if args.same_seed:  # the old behaviour, kept to show what it did
        return args.seed
    return args.seed + 1000 * args.concurrency.index(concurrency) + (0 if client == "client_vllm" else 500)


def starts(args) -> list[tuple[int, Server, int, list[int]]]:
    """The plan: (round, server, llama slots, concurrencies driven on that start), in run order."""
    plan = []
    for rnd in range(args.rounds):
        for name in args.servers:
            server = SERVERS[name]
            if server.engine == "llama" and not args.llama_np:
                plan += [(rnd, server, c, [c]) for c in args.concurrency]
            else:
                plan.append((rnd, server, args.llama_np or max(args.concurrency), list(args.concurrency)))
    return plan


# ---------------------------------------------------------------------------------------------------------------
# running


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 1200) -> None:
    """vLLM compiles its graphs before /health answers: minutes on this CPU, hence the long timeout."""
    from minfer.bench.serve import wait_until_healthy

    wait_until_healthy(url, proc, timeout_s=timeout, interval_s=1.0)


@contextlib.contextmanager
def bench_lock(path: str | None):
    """An exclusive flock on `path` for the duration (nothing when None): one timing on the machine at a time."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_vllm_bench(args, url: str, concurrency: int, headers: dict | None = None, save_dir: Path | None = None) -> dict:
    """One `vllm bench serve` run; its saved result reduced to METRICS (plus `error` when it failed). `headers`:
    sent with every request; `save_dir`: where its result.json stays (default: a temporary folder, removed).

    The per-request lists (`--save-detailed`) are kept under `_detail` for `recount`, and dropped before saving.
    """
    out = str(save_dir) if save_dir is not None else tempfile.mkdtemp(prefix="peer-serve-")
    Path(out).mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run(vllm_bench_cmd(args, url, concurrency, out, headers), env=vllm_env(), capture_output=True,
                           text=True, timeout=3600)
        try:
            r = json.loads((Path(out) / "result.json").read_text())
        except (OSError, ValueError):
            return {"error": f"vllm bench serve exited {p.returncode}: {(p.stderr or p.stdout)[-1500:]}"}
    finally:
        if save_dir is None:
            shutil.rmtree(out, ignore_errors=True)
    res = {k: r.get(k) for k in METRICS}
    lens = r.get("output_lens") or []
    res["output_lens_min_max"] = [min(lens), max(lens)] if lens else None
    errors = [e for e in r.get("errors") or [] if e]
    if errors:
        res["errors"] = errors[:3]
    res["_detail"] = {k: r.get(k) for k in ("ttfts", "latencies", "duration")}
    return res


def percentile(values: list[float], q: float) -> float:
    """numpy.percentile's default (linear interpolation), as vllm bench computes its p99s."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def recount(res: dict, tokens_per_request: int) -> dict:
    """vllm bench's metrics again with every request's output count set to `tokens_per_request`.

    For a server whose count vllm bench could not read: llama-server's last streamed `/v1/completions` chunk
    carries `choices` and `usage` together, and vllm bench reads `usage` only from a chunk without choices, so it
    re-tokenizes the generated text instead (which need not give back the ids generated). The caller checks the
    server's own counter first. TTFT is unchanged; throughput and TPOT are computed as vllm bench does
    (TPOT = (latency - TTFT) / (output tokens - 1), per request) from its own per-request timings.
    """
    d = res["_detail"]
    n = len(d["latencies"])
    tpots = [(lat - ttft) / (tokens_per_request - 1) * 1000 for lat, ttft in zip(d["latencies"], d["ttfts"])] \
        if tokens_per_request > 1 else [0.0] * n
    fixed = dict(res, total_output_tokens=n * tokens_per_request,
                 output_throughput=n * tokens_per_request / d["duration"],
                 mean_tpot_ms=sum(tpots) / n, p99_tpot_ms=percentile(tpots, 99),
                 output_lens_min_max=[tokens_per_request, tokens_per_request])
    fixed["as_counted_by_vllm_bench"] = {k: res[k] for k in ("total_output_tokens", "output_throughput",
                                                             "mean_tpot_ms", "p99_tpot_ms", "output_lens_min_max")}
    return fixed


GENERATED_COUNTER = {"minfer": "minfer:generation_tokens_total", "vllm": "vllm:generation_tokens_total",
                     "llama": "llamacpp:tokens_predicted_total"}


def counter_value(metrics_text: str, name: str) -> float | None:
    """The sum over labels of counter `name` in a Prometheus text exposition (None if absent)."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(None, 1)[-1])
            seen = True
    return total if seen else None


# prompt tokens looked up in / found in the prefix cache (llama-server has no such counter)
PREFIX_COUNTERS = {"minfer": ("minfer:prefix_cache_queries_total", "minfer:prefix_cache_hits_total"),
                   "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}


def metrics_text(url: str) -> str | None:
    import httpx

    try:
        r = httpx.get(url + "/metrics", timeout=10)
        return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def server_generated(url: str, engine: str, text: str | None = None) -> float | None:
    """Tokens the server says it generated so far (its /metrics counter; `text`, if already read), None if it
    cannot tell."""
    text = metrics_text(url) if text is None else text
    return None if text is None else counter_value(text, GENERATED_COUNTER[engine])


def prefix_cache_counts(url: str, engine: str, text: str | None = None) -> dict | None:
    """{"queries": prompt tokens looked up, "hits": found} so far by the server's /metrics (`text`, if already
    read); None if it has no such counters."""
    if engine not in PREFIX_COUNTERS:
        return None
    text = metrics_text(url) if text is None else text
    if text is None:
        return None
    queries, hits = (counter_value(text, name) for name in PREFIX_COUNTERS[engine])
    return None if queries is None or hits is None else {"queries": queries, "hits": hits}


def counts_since(before: dict | None, after: dict | None) -> dict | None:
    return None if before is None or after is None else {k: int(after[k] - before[k]) for k in before}


def run_minfer_client(args, url: str, concurrency: int, headers: dict | None = None,
                      save_dir: Path | None = None) -> dict:
    """One run of minfer's client (`minfer.bench.serve.run_benchmark`), reduced to METRICS; `headers` go with
    every request, `save_dir` (if given) receives its full result as result.json."""
    from minfer.bench.serve import run_benchmark

    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
    r = run_benchmark(url, num_prompts=num_prompts(args, concurrency), max_concurrency=concurrency,
                      input_len=args.input_len, output_len=args.output_len,
                      seed=run_seed(args, concurrency, "client_minfer"), vocab_size=VOCAB_SIZE,
                      model=NAME, disable_tqdm=True, poll_stats=False, headers=headers,
                      result_json=None if save_dir is None else str(Path(save_dir) / "result.json"))
    res = {k: r.get(k) for k in METRICS if k != "duration"}
    res["duration"] = r.get("duration_s")
    lens = [n for n in r.get("output_lens") or []]
    res["output_lens_min_max"] = [min(lens), max(lens)] if lens else None
    if r.get("errors"):
        res["errors"] = r["errors"][:3]
    return res


def warm_up(url: str, headers: dict | None = None) -> None:
    """A few short requests after start-up, outside the measurement (first-call allocations, compiled graphs)."""
    from minfer.bench.serve import run_benchmark

    run_benchmark(url, num_prompts=4, max_concurrency=4, input_len=16, output_len=4, vocab_size=VOCAB_SIZE,
                  model=NAME, disable_tqdm=True, poll_stats=False, headers=headers)


def measure_start(args, rnd: int, server: Server, slots: int, concurrencies: list[int], log_dir: str,
                  runs_dir: Path | None = None) -> dict:
    """Start `server` once, drive it at each concurrency with each client, stop it: {concurrency: run}.
    `runs_dir`: where each client run keeps its own result file (one folder per run); None keeps none."""
    from minfer.bench.serve import stop_server

    port = port_for(args, server)
    headers = request_headers(server)
    cmd, env = server_cmd(server, args, port, slots)
    log_path = Path(log_dir) / f"r{rnd}_{server.name}_np{slots}_{port}.log"
    url = f"http://127.0.0.1:{port}"
    out: dict[int, dict] = {}
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc)
            startup_s = round(time.time() - t0, 1)
            warm_up(url, headers)
            for c in concurrencies:
                run = {"round": rnd, "startup_s": startup_s, "log": str(log_path), "port": port}
                if headers:
                    run["request_headers"] = headers
                clients = [("client_vllm", run_vllm_bench)]
                if args.minfer_client:
                    clients.append(("client_minfer", run_minfer_client))
                for key, fn in clients:
                    before, text = load_average(), metrics_text(url)  # one /metrics read for both counters
                    tokens_before = server_generated(url, server.engine, text)
                    cache_before = prefix_cache_counts(url, server.engine, text)
                    save = None if runs_dir is None else runs_dir / f"r{rnd}_{server.name}_np{slots}_c{c}_{key}"
                    res = fn(args, url, c, headers=headers, save_dir=save)
                    res["load_average_before_after"] = [before, load_average()]
                    res["prefix_cache"] = counts_since(cache_before, prefix_cache_counts(url, server.engine))
                    res["server_output_tokens"] = generated_since(url, server.engine, tokens_before,
                                                                  num_prompts(args, c) * args.output_len)
                    if (res.get("_detail") and res.get("total_output_tokens") is not None and not res.get("failed")
                            and res["total_output_tokens"] != num_prompts(args, c) * args.output_len
                            and res["server_output_tokens"] == num_prompts(args, c) * args.output_len):
                        res = recount(res, args.output_len)
                    res.pop("_detail", None)
                    run[key] = res
                    print(f"round {rnd} {server.name:12s} c={c:<3d} {key:13s} {fmt_run(res)}", flush=True)
                out[c] = run
        except Exception as exc:  # one server failing to start or answer must not lose the others' results
            print(f"round {rnd} {server.name}: {type(exc).__name__}: {exc} (log: {log_path})", flush=True)
            for c in concurrencies:
                out.setdefault(c, {"round": rnd, "error": f"{type(exc).__name__}: {exc}", "log": str(log_path)})
        finally:
            stop_server(proc)
    return out


def generated_since(url: str, engine: str, before: float | None, expected: int, wait_s: float = 3.0) -> int | None:
    """Tokens generated since `before` by the server's counter; waits up to `wait_s` for it to reach `expected`
    (a counter may be updated just after the last token was streamed)."""
    if before is None:
        return None
    deadline = time.time() + wait_s
    while True:
        now = server_generated(url, engine)
        if now is None or now - before >= expected or time.time() > deadline:
            return None if now is None else int(now - before)
        time.sleep(0.2)


def fmt_run(res: dict) -> str:
    if res.get("error") or res.get("output_throughput") is None:
        return f"FAILED {res.get('error', '')[:300]}"
    return (f"{res['output_throughput']:7.1f} tok/s  TTFT {res['mean_ttft_ms']:8.1f} ms (p99 {res['p99_ttft_ms']:8.1f})"
            f"  TPOT {res['mean_tpot_ms']:7.1f} ms (p99 {res['p99_tpot_ms']:7.1f})"
            f"  out tokens {res['total_output_tokens']}"
            + (f"  prefix-cache hits {pc['hits']}/{pc['queries']}" if (pc := res.get("prefix_cache")) else ""))


# ---------------------------------------------------------------------------------------------------------------
# summary (pure functions of the recorded runs: tests/test_peer_serve.py checks them on canned results)


def medians(runs: dict, client: str) -> dict:
    """{server: {concurrency: {metric: median over rounds}}} of one client's runs, rounds that failed left out;
    `failed`: the requests that failed in the rounds kept, summed (a dropped request is never a median's detail)."""
    keys = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "total_output_tokens")
    out: dict = {}
    for server, by_c in runs.items():
        for c, rounds in by_c.items():
            ok = [r[client] for r in rounds if r.get(client) and (r[client].get("output_throughput") or 0) > 0]
            if ok:
                out.setdefault(server, {})[c] = {k: statistics.median(r[k] for r in ok) for k in keys} | \
                    {"rounds": len(ok), "failed": sum(r.get("failed") or 0 for r in ok)}
    return out


def compare(med: dict, targets=TARGETS) -> list[dict]:
    """minfer against each peer at each concurrency both were measured at: ratios and met/missed.

    `throughput_ratio` = minfer / peer output tok/s (higher is better); `ttft_ratio` and `tpot_ratio` = minfer /
    peer mean TTFT and TPOT (<= 1 is no worse). `met` needs the throughput ratio, the target's latencies no worse and
    no failed request on either side; it is None where the target does not apply at that concurrency
    (`apply_peak_condition` may set it to None later, from the peak fractions).
    """
    rows = []
    for t in targets:
        if t.minfer not in med or t.peer not in med:
            continue
        for c in sorted(set(med[t.minfer]) & set(med[t.peer])):
            m, p = med[t.minfer][c], med[t.peer][c]
            row = {"minfer": t.minfer, "peer": t.peer, "concurrency": c,
                   "throughput_ratio": round(m["output_throughput"] / p["output_throughput"], 3),
                   "ttft_ratio": round(m["mean_ttft_ms"] / p["mean_ttft_ms"], 3),
                   "tpot_ratio": round(m["mean_tpot_ms"] / p["mean_tpot_ms"], 3),
                   "target_throughput_ratio": t.throughput_ratio,
                   "target_no_worse": list(t.no_worse),
                   "failed": [m.get("failed", 0), p.get("failed", 0)]}
            met = (row["throughput_ratio"] >= t.throughput_ratio and not any(row["failed"])
                   and all(row[f"{lat}_ratio"] <= 1 for lat in t.no_worse))
            applies = t.concurrencies is None or c in t.concurrencies
            row["met"] = met if applies else None
            rows.append(row)
    return rows


def apply_peak_condition(rows: list[dict], targets=TARGETS) -> None:
    """A target with `peer_fraction_below` does not apply where the peer's share of the peak reached it: that row's
    `met` becomes None and `verdict` says to read the fractions (rows need `peer_peak_fraction`; unknown applies)."""
    limits = {(t.minfer, t.peer): t.peer_fraction_below for t in targets}
    for row in rows:
        limit, fraction = limits.get((row["minfer"], row["peer"])), row.get("peer_peak_fraction")
        if row["met"] is not None and limit is not None and fraction is not None and fraction >= limit:
            row["met"] = None
            row["verdict"] = f"the peer turns {fraction:.2f} >= {limit} of the peak into tokens: compare the fractions"


def token_check(runs: dict, expected: dict, client: str = "client_vllm") -> dict:
    """Every run generated num_prompts x output_len tokens (so all servers the same at each concurrency), as the
    client counted them and as the server's own /metrics counter did.

    Args:
        runs: {server: {concurrency: [run, ...]}} as `main` records them.
        expected: {concurrency: num_prompts x output_len}.
    Returns:
        {"ok": bool, "expected": ..., "mismatches": [str, ...], "recounted": [str, ...]}: one mismatch line per
        run that failed or generated another count; one recounted line per run whose client count was replaced
        by the server's (see `recount`), which is not a mismatch.
    """
    bad, recounted = [], []
    for server, by_c in runs.items():
        for c, rounds in by_c.items():
            for r in rounds:
                res, where = r.get(client), f"{server} c={c} round {r.get('round')}"
                if not res or res.get("total_output_tokens") is None:
                    bad.append(f"{where}: no result ({r.get('error') or res})")
                    continue
                if res["total_output_tokens"] != expected[c] or res.get("failed"):
                    bad.append(f"{where}: {res['total_output_tokens']} output tokens, expected {expected[c]}; "
                               f"{res.get('failed') or 0} failed; per request min/max {res.get('output_lens_min_max')}")
                server_count = res.get("server_output_tokens")
                if server_count is not None and server_count != expected[c]:
                    bad.append(f"{where}: the server's counter says {server_count} tokens generated, "
                               f"expected {expected[c]}")
                if "as_counted_by_vllm_bench" in res:
                    recounted.append(f"{where}: vllm bench counted "
                                     f"{res['as_counted_by_vllm_bench']['total_output_tokens']} by re-tokenizing "
                                     f"the text, the server {server_count}: metrics recounted")
    return {"client": client, "ok": not bad, "expected": expected, "mismatches": bad, "recounted": recounted}


# ---------------------------------------------------------------------------------------------------------------
# the machine's peaks: every server's arithmetic as a fraction of what this machine's units give, so that a verdict
# from a Zen 1, a Zen 3 or an AVX-512 machine reads the same

# the peak each server's arithmetic is held against: float32 weights run FMAs, GGUF's Q4 blocks the integer idiom
PEAK_KIND = {"f32": "fma_gflops", "q4_1": "int8_idiom_gops", "q4_0": "int8_idiom_gops"}


def _import_sibling(name: str):
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import importlib

    return importlib.import_module(name)


def measure_peaks(args) -> dict:
    """This machine's float32 FMA and integer-idiom peaks (`peak_idiom.measure`, GFLOP/s and GOP/s), or those
    read from --peaks-json; `source` says which. A kernel that cannot be built gives {"error": ...} (the run
    goes on without fractions) rather than an exception."""
    if args.peaks_json is not None:
        return {**json.loads(Path(args.peaks_json).read_text()), "source": str(args.peaks_json)}
    try:
        peaks = _import_sibling("peak_idiom").measure(threads=args.peak_threads or None)
    except Exception as exc:  # no compiler, no OpenMP: the servers can still be compared with each other
        return {"error": f"{type(exc).__name__}: {exc}", "source": "peak_idiom.py"}
    return {**peaks, "source": "peak_idiom.py, measured at the start of this run"}


def request_flops(args) -> float:
    """FLOPs of one request (`--input-len` prompt and `--output-len` output tokens) on --model-dir's model, as
    `serve_roofline.flops_per_request` counts them (every server runs the same model)."""
    from minfer.model.registry import config_from_hf

    cfg = config_from_hf(json.loads((Path(args.model_dir) / "config.json").read_text()))
    return _import_sibling("serve_roofline").flops_per_request(cfg, args.input_len, args.output_len)["total"]


def peak_fractions(med: dict, peaks: dict | None, flops_per_request: float, output_len: int) -> dict:
    """{server: {concurrency: {"achieved_gflops", "peak", "peak_gflops", "fraction"}}} from `medians`' output:
    achieved GFLOP/s = requests/s (output tok/s / output_len, every request generating output_len tokens) x
    `flops_per_request` / 1e9, held against the FMA peak for float32 servers and the integer-idiom peak for the
    GGUF ones (`PEAK_KIND`). `fraction` is None where the peak is unknown."""
    out: dict = {}
    for server, by_c in med.items():
        kind = PEAK_KIND[SERVERS[server].weights]
        peak = (peaks or {}).get(kind)
        for c, m in by_c.items():
            achieved = m["output_throughput"] / output_len * flops_per_request / 1e9
            out.setdefault(server, {})[c] = {"achieved_gflops": round(achieved, 3), "peak": kind, "peak_gflops": peak,
                                             "fraction": round(achieved / peak, 5) if peak else None}
    return out


def summarize(runs: dict, expected: dict, clients=("client_vllm", "client_minfer"), peaks: dict | None = None,
              flops_per_request: float | None = None, output_len: int | None = None) -> dict:
    """Per client: the medians, the comparisons and the token check; with `flops_per_request` and `output_len`,
    also `peak_fractions` (each comparison row then carries both servers' fractions)."""
    out = {}
    for client in clients:
        med = medians(runs, client)
        if med:
            s = {"medians": med, "comparisons": compare(med), "token_check": token_check(runs, expected, client)}
            if flops_per_request and output_len:
                fr = s["peak_fractions"] = peak_fractions(med, peaks, flops_per_request, output_len)
                for row in s["comparisons"]:
                    row["minfer_peak_fraction"] = fr[row["minfer"]][row["concurrency"]]["fraction"]
                    row["peer_peak_fraction"] = fr[row["peer"]][row["concurrency"]]["fraction"]
                apply_peak_condition(s["comparisons"])
            out[client] = s
    return out


def print_summary(summary: dict) -> None:
    for client, s in summary.items():
        print(f"\n[{client}] medians over rounds")
        for server, by_c in s["medians"].items():
            for c, m in sorted(by_c.items()):
                print(f"  {server:12s} c={c:<3d} {m['output_throughput']:7.1f} tok/s  TTFT {m['mean_ttft_ms']:8.1f} ms "
                      f"(p99 {m['p99_ttft_ms']:8.1f})  TPOT {m['mean_tpot_ms']:7.1f} ms (p99 {m['p99_tpot_ms']:7.1f})")
        for row in s["comparisons"]:
            verdict = row.get("verdict") or {True: "met", False: "MISSED", None: "no target here"}[row["met"]]
            print(f"  {row['minfer']} / {row['peer']} c={row['concurrency']}: {row['throughput_ratio']:.2f}x "
                  f"(target >= {row['target_throughput_ratio']}), TTFT {row['ttft_ratio']:.2f}x, "
                  f"TPOT {row['tpot_ratio']:.2f}x: {verdict}")
        for server, by_c in s.get("peak_fractions", {}).items():
            for c, f in sorted(by_c.items()):
                frac = "peak unknown" if f["fraction"] is None else f"{100 * f['fraction']:.2f}% of the {f['peak']} peak"
                print(f"  {server:12s} c={c:<3d} {f['achieved_gflops']:8.2f} GFLOP/s achieved, {frac}")
        tc = s["token_check"]
        print("  output tokens: " + ("all equal, as expected" if tc["ok"] else "MISMATCH"))
        for line in tc["mismatches"] + tc["recounted"]:
            print("    " + line)


def environment(args) -> dict:
    def out(cmd):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            return (p.stdout + p.stderr).strip()[-400:]
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unavailable: {exc}"

    from minfer.course import cpu_name

    cpu = cpu_name()
    vpy = str(Path(args.vllm).with_name("python"))
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "minfer_commit": out(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
            "vllm": out([vpy, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]),
            "llama_server": out([args.llama_server, "--version"]),
            "gguf_q4_1": str(args.gguf_q4_1), "gguf_q4_0": str(args.gguf_q4_0), "model_dir": str(args.model_dir)}


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = starts(args)
    expected = {c: num_prompts(args, c) * args.output_len for c in args.concurrency}
    if args.dry_run:
        print("peaks: " + (f"read from {args.peaks_json}" if args.peaks_json else
                           f"measured by benchmarks/peak_idiom.py on {args.peak_threads or 'every'} thread(s)"))
        print(f"output: {args.out_dir or args.json or '(no JSON)'}")
        for rnd, server, slots, concs in plan:
            cmd, _ = server_cmd(server, args, args.ports.get(server.engine, 0), slots)
            print(f"round {rnd} {server.name}: {shlex.join(cmd)}")
            for c in concs:
                bench = vllm_bench_cmd(args, 'http://127.0.0.1:PORT', c, 'DIR', request_headers(server))
                print(f"    c={c}: {shlex.join(bench)}")
                if args.minfer_client:
                    print(f"    c={c}: minfer's client, seed {run_seed(args, c, 'client_minfer')}")
        return 0

    needs = {SERVERS[s].engine for s in args.servers}
    tools = [args.vllm] + ([args.llama_server] if "llama" in needs else [])  # vllm bench serve drives every run
    paths = {*map(Path, tools), args.model_dir / "config.json", *(weights_path(SERVERS[s], args) for s in args.servers)}
    missing = sorted(str(p) for p in paths if not p.exists())
    if missing:
        print(f"missing: {', '.join(missing)} (vLLM: see peer_vllm_serve.py's docstring; llama-server and the "
              "Q4_0 file: benchmarks/build_llama_cpp.sh; the HF directory: peer_vllm_serve.export_hf_dir)")
        return 2
    sys.path.insert(0, str(Path(__file__).parent))
    from peer_vllm_serve import ensure_vllm_metadata

    ensure_vllm_metadata(args.vllm)  # vllm bench drives every run, and its CLI asks for `vllm`'s version
    if args.out_dir is not None:
        log_dir, runs_dir, json_path = args.out_dir / "logs", args.out_dir / "runs", args.out_dir / "peer_serve.json"
    else:
        log_dir, runs_dir, json_path = args.log_dir or tempfile.mkdtemp(prefix="peer-serve-logs-"), None, args.json
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}", flush=True)

    started = time.time()
    with bench_lock(args.lock_file):  # a quiet machine for the peaks too
        peaks = measure_peaks(args)
    flops = request_flops(args)
    print(f"machine peaks: {json.dumps(peaks)}\nFLOPs per request: {flops / 1e9:.3f} GFLOP", flush=True)
    runs: dict = {s: {c: [] for c in args.concurrency} for s in args.servers}
    for rnd, server, slots, concs in plan:
        with bench_lock(args.lock_file):
            measured = measure_start(args, rnd, server, slots, concs, str(log_dir), runs_dir)
        for c, run in measured.items():
            runs[server.name][c].append(run)
    summary = summarize(runs, expected, peaks=peaks, flops_per_request=flops, output_len=args.output_len)
    print_summary(summary)
    if json_path:
        result = {"command": shlex.join([sys.executable, *sys.argv]),
                  "note": "one server at a time on a shared machine, servers alternated over rounds in one run; "
                          "compare the ratios",
                  "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "environment": environment(args), "wall_s": round(time.time() - started, 1),
                  "expected_output_tokens": expected, "machine_peaks": peaks, "flops_per_request": flops,
                  "runs": runs, "summary": summary}
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
    ok = all(s["token_check"]["ok"] for s in summary.values()) and bool(summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
