"""`python -m minfer.bench serve`: load-test an OpenAI-compatible server, as `vllm bench serve` does.

Requests are sent to `/v1/completions` with `stream=true` and `ignore_eos=true` (so every request generates
exactly `--output-len` tokens), at `--request-rate` requests/s (Poisson arrivals, or all at once with `inf`),
never more than `--max-concurrency` in flight. For each request the client measures:

- TTFT: request sent -> first streamed text;
- ITL: gaps between consecutive streamed chunks (one chunk per engine step);
- TPOT: (E2E - TTFT) / (output tokens - 1);
- E2E: request sent -> last byte.

It reports request and token throughput and the mean, median and p99 of each (milliseconds), as a table and
as JSON (`--result-json`). While it runs it also polls the server's `/v1/stats` (minfer only) to record KV
usage and the running/waiting queues over time.

Datasets (prompts are token-id lists, so their length is exact on any tokenizer):

- random: `--input-len` random token ids per prompt.
- shared-prefix: one random prefix of `--prefix-len` ids shared by every prompt, then `--input-len` random ids
  (the case prefix caching speeds up).

From Python (e.g. a notebook): `run_benchmark("http://127.0.0.1:8000", num_prompts=16, request_rate=4)`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency, but the client works without it
    tqdm = None


@dataclass
class BenchRequest:
    prompt: list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    start_time: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), for a server a benchmark starts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(base_url: str, proc=None, timeout_s: float = 600.0, interval_s: float = 0.5) -> float:
    """Poll `GET base_url/health` until it answers 200; returns the seconds waited.

    `proc` (a `subprocess.Popen` of the server, optional): RuntimeError as soon as it exits. RuntimeError too
    after `timeout_s` seconds without a 200. Every server a benchmark compares (minfer's, `vllm serve`,
    `llama-server`) answers `/health` with 200 once it serves."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was healthy")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s")


def stop_server(proc, grace_s: float = 60.0) -> None:
    """SIGTERM a server process a benchmark started, SIGKILL it if it has not exited after `grace_s` seconds."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sample_requests(dataset: str = "random", num_prompts: int = 16, input_len: int = 32, output_len: int = 16,
                    prefix_len: int = 0, seed: int = 0, vocab_size: int = 32000,
                    min_token_id: int | None = None) -> list[BenchRequest]:
    """Synthetic prompts as token-id lists.

    Args:
        dataset: "random" (independent prompts) or "shared-prefix" (a common prefix of `prefix_len` ids,
            then `input_len` random ids).
        num_prompts, input_len, output_len, prefix_len: sizes (tokens).
        seed: random seed (same seed, same prompts).
        vocab_size, min_token_id: token ids are drawn from [min_token_id, vocab_size) (skips special tokens);
            min_token_id defaults to min(1000, vocab_size // 2).

    Raises:
        ValueError: unknown dataset or sizes out of range.
    """
    if dataset not in ("random", "shared-prefix"):
        raise ValueError(f"dataset must be 'random' or 'shared-prefix', got {dataset!r}")
    if num_prompts < 1 or input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError("num_prompts, input_len and output_len must be >= 1 and prefix_len >= 0")
    if min_token_id is None:
        min_token_id = min(1000, vocab_size // 2)
    if not 0 <= min_token_id < vocab_size:
        raise ValueError("need 0 <= min_token_id < vocab_size")
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(min_token_id, vocab_size) for _ in range(n)]

    prefix = ids(prefix_len) if dataset == "shared-prefix" else []
    reqs = []
    for _ in range(num_prompts):
        prompt = prefix + ids(input_len) if dataset == "shared-prefix" else ids(input_len + prefix_len)
        reqs.append(BenchRequest(prompt, len(prompt), output_len))
    return reqs


async def _send(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, t0: float,
                extra_body: dict | None) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len)
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    payload.update(extra_body or {})
    start = time.perf_counter()
    res.start_time = start - t0
    last = start
    chunks = 0
    text = []
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"].get("message", str(obj["error"]))
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                piece = "".join(c.get("text") or "" for c in obj.get("choices", []))
                if piece:
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    text.append(piece)
        res.latency = time.perf_counter() - start
        res.generated_text = "".join(text)
        res.output_tokens = res.output_tokens or chunks
        res.success = chunks > 0
        if not res.success:
            res.error = "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def _poll_stats(client: httpx.AsyncClient, base_url: str, t0: float, timeline: list, stop: asyncio.Event,
                      interval: float) -> None:
    while not stop.is_set():
        try:
            r = await client.get(base_url + "/v1/stats", timeout=5)
            if r.status_code == 404:
                return
            s = r.json().get("stats", {})
            timeline.append({"t": time.perf_counter() - t0, "kv_cache_usage": s.get("kv_cache_usage"),
                             "num_running": s.get("num_running"), "num_waiting": s.get("num_waiting"),
                             "num_preemptions": s.get("num_preemptions"),
                             "num_free_blocks": s.get("num_free_blocks")})
        except (httpx.HTTPError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


def _summary(values: list[float], name: str) -> dict:
    ms = [v * 1000 for v in values]
    if not ms:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0, f"std_{name}_ms": 0.0}
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if len(ordered) > 1 else ordered[0]
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"p99_{name}_ms": p99, f"std_{name}_ms": statistics.pstdev(ms)}


async def benchmark(base_url: str, requests: list[BenchRequest], request_rate: float = math.inf,
                    max_concurrency: int | None = None, model: str | None = None, burstiness: float = 1.0,
                    seed: int = 0, poll_stats: bool = True, stats_interval: float = 0.25,
                    disable_tqdm: bool = False, extra_body: dict | None = None, api_key: str | None = None,
                    headers: dict | None = None) -> dict:
    """Send `requests` to `base_url` and measure; see the module doc. `headers` go with every request (e.g.
    {"Connection": "close"}: a new connection per request). Returns the result dict."""
    base_url = base_url.rstrip("/")
    headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) + 4,
                          max_keepalive_connections=max_concurrency or len(requests) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits,
                                 headers=headers) as client:
        if model is None:
            r = await client.get(base_url + "/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        rng = random.Random(seed)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = tqdm(total=len(requests), desc="requests", disable=disable_tqdm) if tqdm else None
        timeline: list[dict] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        poller = asyncio.create_task(_poll_stats(client, base_url, t0, timeline, stop, stats_interval)) \
            if poll_stats else None

        async def limited(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await _send(client, base_url + "/v1/completions", model, req, t0, extra_body)
            else:
                async with sem:
                    res = await _send(client, base_url + "/v1/completions", model, req, t0, extra_body)
            if pbar is not None:
                pbar.update(1)
            return res

        tasks = []
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(limited(req)))
            if i + 1 < len(requests) and request_rate != math.inf:
                # Poisson process (burstiness 1) or gamma-distributed gaps, mean 1/request_rate
                theta = 1.0 / (request_rate * burstiness)
                await asyncio.sleep(rng.gammavariate(burstiness, theta))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        if poller is not None:
            await poller
        if pbar is not None:
            pbar.close()

    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    result = {
        "base_url": base_url, "model": model, "num_prompts": len(requests),
        "request_rate": "inf" if request_rate == math.inf else request_rate, "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        **_summary([r.ttft for r in ok], "ttft"),
        **_summary(tpots, "tpot"),
        **_summary([g for r in ok for g in r.itl], "itl"),
        **_summary([r.latency for r in ok], "e2el"),
        "max_kv_cache_usage": max((p["kv_cache_usage"] or 0 for p in timeline), default=None),
        "ttfts": [r.ttft for r in ok], "tpots": tpots, "e2els": [r.latency for r in ok],
        "itls": [r.itl for r in ok], "start_times": [r.start_time for r in ok],
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
        "errors": [r.error for r in results if not r.success],
        "kv_timeline": timeline,
    }
    return result


def run_benchmark(base_url: str = "http://127.0.0.1:8000", num_prompts: int = 16,
                  request_rate: float | str = math.inf, max_concurrency: int | None = None,
                  dataset: str = "random", input_len: int = 32, output_len: int = 16, prefix_len: int = 0,
                  seed: int = 0, vocab_size: int = 32000, model: str | None = None, burstiness: float = 1.0,
                  poll_stats: bool = True, disable_tqdm: bool = False, api_key: str | None = None,
                  result_json: str | None = None, headers: dict | None = None) -> dict:
    """Build the dataset and run `benchmark`; works inside a running event loop (Jupyter) too. `headers`: sent
    with every request (`benchmark`).

    Returns:
        the result dict: throughputs, mean/median/p99/std of ttft/tpot/itl/e2el in ms, per-request lists
        (seconds), errors, and `kv_timeline` (KV usage and queue lengths over time, from /v1/stats).
    """
    rate = math.inf if str(request_rate).lower() in ("inf", "infinity") else float(request_rate)
    if not rate > 0:
        raise ValueError(f"request_rate must be > 0 or inf, got {request_rate!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    reqs = sample_requests(dataset, num_prompts, input_len, output_len, prefix_len, seed, vocab_size)
    coro = benchmark(base_url, reqs, rate, max_concurrency, model=model, burstiness=burstiness, seed=seed,
                     poll_stats=poll_stats, disable_tqdm=disable_tqdm, api_key=api_key, headers=headers)
    try:
        asyncio.get_running_loop()
        running = True
    except RuntimeError:
        running = False
    if running:  # e.g. in Jupyter: run the benchmark's own loop in a helper thread
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            result = pool.submit(asyncio.run, coro).result()
    else:
        result = asyncio.run(coro)
    result["config"] = {"dataset": dataset, "num_prompts": num_prompts, "input_len": input_len,
                        "output_len": output_len, "prefix_len": prefix_len, "seed": seed,
                        "request_rate": "inf" if rate == math.inf else rate, "max_concurrency": max_concurrency}
    if result_json:
        with open(result_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def format_result(r: dict) -> str:
    """vLLM-style result table."""
    rows = [
        ("Successful requests:", f"{r['completed']}"),
        ("Failed requests:", f"{r['failed']}"),
        ("Request rate (req/s):", f"{r['request_rate']}"),
        ("Maximum concurrency:", f"{r['max_concurrency']}"),
        ("Benchmark duration (s):", f"{r['duration_s']:.2f}"),
        ("Total input tokens:", f"{r['total_input_tokens']}"),
        ("Total generated tokens:", f"{r['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}"),
    ]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{a:<40}{b:>10}" for a, b in rows]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "p99"):
            lines.append(f"{(stat.capitalize() + ' ' + key.upper() + ' (ms):'):<40}{r[f'{stat}_{key}_ms']:>10.2f}")
    if r.get("max_kv_cache_usage") is not None:
        lines.append("{s:{c}^50}".format(s=" Server (from /v1/stats) ", c="-"))
        lines.append(f"{'Peak KV cache usage:':<40}{r['max_kv_cache_usage'] * 100:>9.1f}%")
    lines.append("=" * 50)
    if r["errors"]:
        lines.append(f"first error: {r['errors'][0]}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minfer.bench serve",
                                description="Benchmark an OpenAI-compatible server (like `vllm bench serve`).")
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000", help="server address (default: http://127.0.0.1:8000)")
    a("--model", default=None, help="model name to send (default: the first of /v1/models)")
    a("--num-prompts", type=int, default=100, help="requests to send (default: 100)")
    a("--request-rate", default="inf", help="requests/s, Poisson arrivals, or inf = all at once (default: inf)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson (default: 1.0)")
    a("--max-concurrency", type=int, default=None, help="most requests in flight (default: unlimited)")
    a("--dataset", "--dataset-name", choices=["random", "shared-prefix"], default="random",
      help="random or shared-prefix prompts (default: random)")
    a("--input-len", type=int, default=128, help="random prompt tokens per request (tokens; default: 128)")
    a("--output-len", type=int, default=32, help="tokens generated per request (tokens; default: 32)")
    a("--prefix-len", type=int, default=0, help="shared (or extra random) prefix tokens (tokens; default: 0)")
    a("--vocab-size", type=int, default=32000, help="draw prompt ids below this (default: 32000)")
    a("--seed", type=int, default=0, help="random seed for prompts and arrivals (default: 0)")
    a("--api-key", default=None, help="sent as Authorization: Bearer (default: none)")
    a("--no-stats", action="store_true", help="do not poll /v1/stats (default: poll)")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--result-json", default=None, help="write the full result to this JSON file (default: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run_benchmark(args.base_url, args.num_prompts, args.request_rate, args.max_concurrency,
                               args.dataset, args.input_len, args.output_len, args.prefix_len, args.seed,
                               args.vocab_size, args.model, args.burstiness, poll_stats=not args.no_stats,
                               disable_tqdm=args.disable_tqdm, api_key=args.api_key,
                               result_json=args.result_json)
    except (ValueError, httpx.HTTPError) as exc:
        print(f"python -m minfer.bench serve: error: {exc}", file=sys.stderr)
        return 2
    print(format_result(result))
    if args.result_json:
        print(f"result written to {args.result_json}")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
