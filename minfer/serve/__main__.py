"""`python -m minfer.serve`: serve a model with an OpenAI-compatible API (article §9 and §16).

With no arguments it serves the default model (smollm2-135m-instruct) on http://127.0.0.1:8000. The flags
carry vLLM's names and meanings (`vllm serve MODEL --max-num-seqs ...`), each mapped onto one `EngineArgs`
field. A flag whose feature minfer has not built (tensor/pipeline parallelism, AWQ/GPTQ)
stops start-up with the reason and exit status 2: none is silently ignored.

    python -m minfer.serve --max-model-len 2048 --max-num-seqs 64 --port 8000

Prefix caching is on by default, as in vLLM V1's server (`--no-enable-prefix-caching` turns it off).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import fields

import minfer.envs as envs
from minfer.config import ATTENTION_BACKENDS, DEFAULT_CHUNK_BUDGET, DEFAULT_MODEL, KERNELS, EngineArgs
from minfer.serve.engine_client import ENGINE_HEARTBEAT_TIMEOUT
from minfer.serve.limits import ServerLimits
from minfer.serve.router import ROUTER_POLICIES

logger = logging.getLogger("minfer.serve")

_DEFAULTS = {f.name: f.default for f in fields(EngineArgs)}
# vLLM V1 serves with prefix caching on (its `--enable-prefix-caching` defaults to True): a chat's every turn
# resends the history, which then costs no prefill. The server follows it whatever EngineArgs' offline default.
SERVER_PREFIX_CACHING = True
# The exit status when the engine process died (or was killed as stalled): the server does not restart it
# itself; its supervisor (systemd Restart=on-failure, Kubernetes, docker --restart) restarts the whole server
# (chapter 15, "When the engine dies").
ENGINE_DIED_EXIT_STATUS = 3
_LIMITS = ServerLimits()


def _bytes(text: str) -> int:
    """'1073741824', '512M', '1.5G', '2GiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (use e.g. 536870912, 512M, 2G)")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minfer.serve",
        description="Serve a model with an OpenAI-compatible API (flags named as vLLM's).",
        epilog="OpenMP: unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set, this process sets OMP_WAIT_POLICY=PASSIVE "
               f"as it starts and its engine process GOMP_SPINCOUNT={envs.ENGINE_CORE_SPINCOUNT} "
               f"({envs.ENGINE_CORE_SPINCOUNT_NICED} when niced); `import minfer` sets nothing.\n"
               "Environment variables (minfer.envs):\n" + envs.help_text(),
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=44, width=160))
    d = _DEFAULTS
    a = p.add_argument
    a("model_tag", nargs="?", default=None, metavar="MODEL",
      help="model, as in `vllm serve MODEL` (same as --model)")
    a("--model", default=None, metavar="NAME", help=f"HF directory, .gguf file or alias (default: {DEFAULT_MODEL})")
    a("--tokenizer", default=None, metavar="DIR", help="tokenizer directory if not the model's (default: the model's)")
    a("--served-model-name", nargs="+", default=None, metavar="NAME",
      help="name(s) clients use in 'model' (default: the --model value)")
    a("--host", default="127.0.0.1", metavar="ADDR", help="address to listen on (default: 127.0.0.1)")
    a("--port", type=_port, default=8000, metavar="N", help="TCP port (default: 8000)")
    a("--api-key", default=envs.MINFER_API_KEY, metavar="KEY",
      help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and the demo page / "
           "(default: none; the environment's key, listed below)")
    a("--tensor-parallel-size", "-tp", type=int, metavar="N", default=d["tensor_parallel_size"],
      help=f"ranks (GPUs, or CPU processes) to split each layer over by heads (default: {d['tensor_parallel_size']})")
    a("--pipeline-parallel-size", "-pp", type=int, metavar="N", default=d["pipeline_parallel_size"],
      help=f"pipeline stages the layers are cut into, one rank group each (default: {d['pipeline_parallel_size']})")
    a("--distributed-executor-backend", choices=("mp", "torchrun"), default=d["distributed_executor_backend"],
      help="who starts the ranks: mp (the server spawns them) or torchrun (run under torchrun; default: mp)")
    a("--data-parallel-size", "-dp", type=int, metavar="N", default=d["data_parallel_size"],
      help="replicas of the whole model, each an engine process, behind this server's router (chapter 12b; "
           f"default: {d['data_parallel_size']})")
    a("--router-policy", choices=list(ROUTER_POLICIES), default="round_robin",
      help="how requests are spread over the replicas: round_robin, least_outstanding, or prefix_aware "
           "(prompts with the same first KV blocks go to the same replica) (default: round_robin)")
    a("--max-model-len", type=int, metavar="N", default=d["max_model_len"],
      help="most tokens per sequence, prompt + output (tokens; default: the model's limit)")
    a("--gpu-memory-utilization", type=float, metavar="FRAC", default=d["gpu_memory_utilization"],
      help=f"fraction of GPU memory for weights + KV cache, CUDA only (0-1; default: {d['gpu_memory_utilization']})")
    a("--kv-cache-memory-bytes", type=_bytes, metavar="BYTES", default=d["kv_cache_memory_bytes"],
      help="KV pool size, overrides the fraction (bytes, e.g. 512M; default: 1 GiB on a CPU, --gpu-memory-utilization on CUDA)")
    a("--dtype", default=d["dtype"], metavar="DTYPE", help=f"weight/activation dtype: auto, float32, bfloat16, float16 "
                                          f"(default: {d['dtype']})")
    a("--quantization", "-q", default=d["quantization"], metavar="METHOD",
      help="weight quantization: int8, int4 or gguf (the .gguf file's own Q4 blocks); awq/gptq read a saved directory. "
           "int8/int4 are the article's names, not vLLM's: vLLM's methods are awq, gptq, fp8, ... (default: none)")
    a("--quantization-config", default=None, metavar="JSON",
      help='the method\'s settings as a JSON object, e.g. \'{"group_size": 64}\' for int4 (default: none)')
    a("--kv-cache-dtype", default=d["kv_cache_dtype"], metavar="DTYPE",
      help="how the KV pool stores K/V: auto (the model's dtype), float32, bfloat16, "
           "float16, int8, fp8 (= fp8_e4m3), fp8_e5m2 (8-bit ones with a "
           "scale per token and head); the article's short names fp16/"
           "bf16 and int8 are not vLLM's values "
           f"(default: {d['kv_cache_dtype']})")
    a("--block-size", type=int, metavar="N", default=d["block_size"], help=f"tokens per KV block (tokens; default: {d['block_size']})")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=SERVER_PREFIX_CACHING,
      help="reuse the KV blocks of prompt prefixes earlier requests computed (chat history, a shared system "
           "prompt), as vLLM V1's server does by default; --no-enable-prefix-caching turns it off. Its cost when "
           "no prompt hits: benchmarks/prefix_cache_cost.py (default: on; offline LLM / EngineArgs: "
           f"{'on' if d['enable_prefix_caching'] else 'off'})")
    a("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d["enable_chunked_prefill"],
      help=f"split long prompts into chunks batched with decodes (default: {d['enable_chunked_prefill']})")
    a("--max-num-batched-tokens", type=int, metavar="N", default=d["max_num_batched_tokens"],
      help="most tokens (prefill + decode) in one step (tokens; default with chunked prefill: "
           f"{DEFAULT_CHUNK_BUDGET['cpu']} on a CPU, {DEFAULT_CHUNK_BUDGET['cuda']} on a GPU; without it: "
           "max(--max-model-len, 2048))")
    a("--max-num-seqs", type=int, metavar="N", default=d["max_num_seqs"],
      help=f"most sequences in one step (sequences; default: {d['max_num_seqs']})")
    a("--swap-space", type=float, metavar="GIB", default=d["swap_space"],
      help="CPU memory for swapped-out KV of preempted sequences (GiB; the article's flag, which vLLM 0.32 no "
           f"longer has; default: {d['swap_space']})")
    a("--preemption-mode", choices=["recompute", "swap"], default=d["preemption_mode"],
      help="what to do with a preempted sequence's KV (default: recompute, or swap if --swap-space > 0)")
    a("--enforce-eager", action=argparse.BooleanOptionalAction, default=d["enforce_eager"],
      help="run every step through the PyTorch model, op by op (vLLM's flag). On a CPU: decode without the "
           "one-call C++ decode step (minfer/cpu/decode_step.py); prefill, kernels and sampler unchanged. On CUDA: "
           "no CUDA-graph capture at start-up and no replay. Measured on a CPU (chapter 15 §15.8): no shorter "
           f"start-up, a slower decode (default: {d['enforce_eager']})")
    a("--kernels", choices=list(KERNELS), default=d["kernels"],
      help="auto: the fastest kernels this device has (on a CPU the minfer/cpu/ wing); reference: the path the "
           "chapters teach, plain PyTorch model code, torch attention and sampler, no C++ "
           f"(default: {d['kernels']})")
    a("--attention-backend", choices=list(ATTENTION_BACKENDS), default=d["attention_backend"],
      help="auto: the C++ paged decode kernel for float32 on the CPU, else torch; torch: the plain-torch "
           "reference; cpu: the C++ kernel or an error; triton: the Triton kernels (default: "
           f"{d['attention_backend']})")
    a("--enable-flash-attn", action="store_true",
      help="the article's flag, not vLLM's (vLLM picks its attention kernel with --attention-backend): here "
           "--attention-backend triton, the Triton FlashAttention + paged-decode kernels (default: off)")
    a("--device", default=d["device"], metavar="DEV", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    a("--speculative-config", default=None, metavar="JSON",
      help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
           '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}\' '
           "(default: off)")
    a("--seed", type=int, metavar="N", default=d["seed"], help=f"engine random seed (default: {d['seed']})")
    a("--engine-process", action=argparse.BooleanOptionalAction, default=True,
      help="run the engine core in a process of its own, beside the HTTP server, as vLLM v1 does; "
           "--no-engine-process runs it in a thread of the server's process (default: on)")
    a("--engine-heartbeat-timeout", type=float, metavar="SECONDS", default=ENGINE_HEARTBEAT_TIMEOUT,
      help="seconds during which the engine process sends no heartbeat (its heartbeat thread beats every 0.5 s "
           "beside the step) and uses no CPU before it counts as stalled: /health turns 503, the process is "
           "killed, its requests end with a 503, and the server exits with status "
           f"{ENGINE_DIED_EXIT_STATUS}. A slow engine that uses CPU is never stalled; a dead one is seen at once "
           f"(default: {ENGINE_HEARTBEAT_TIMEOUT:g})")
    # Test hook (tests/test_engine_liveness.py), not for use: the engine's first step holds the GIL busy for
    # SECONDS, silencing its heartbeat thread while it works.
    a("--test-hook-slow-step", type=float, metavar="SECONDS", default=0.0, help=argparse.SUPPRESS)
    a("--disable-log-requests", action="store_true",
      help="do not log each request (the article's flag; vLLM 0.32 logs none unless --enable-log-requests; "
           "default: log them)")
    a("--uvicorn-log-level", default="info", metavar="LEVEL", choices=["critical", "error", "warning", "info", "debug", "trace"],
      help="uvicorn's log level: critical, error, warning, info, debug, trace (default: info)")
    a("--max-parallel-loading-workers", type=int, metavar="N", default=None,
      help="threads reading the checkpoint's tensors while the model loads (load time only; default: 1)")
    _add_request_default_flags(p.add_argument_group(
        "request defaults: what a request that omits a field gets, and what minfer adds to a chat prompt"))
    _add_limit_flags(p.add_argument_group("admission control and timeouts (chapter 9, section 9.8)"))
    _add_fallback_flags(p.add_argument_group("fallbacks (chapter 15): off unless given"))
    return p


def _add_request_default_flags(group) -> None:
    """vLLM's --generation-config / --override-generation-config, and minfer's --tool-prompt."""
    from minfer.serve.tools import DEFAULT_TOOL_PROMPT_MAX_TOKENS, TOOL_PROMPT_MODES  # noqa: PLC0415

    a = group.add_argument
    a("--generation-config", default=_DEFAULTS["generation_config"], metavar="auto|vllm|DIR",
      help="where the server's sampling defaults come from: auto (the model's generation_config.json, in its HF "
           "directory or beside its .gguf file; the default model has none), vllm (none), or a directory holding "
           "a generation_config.json. A request that omits max_tokens (max_completion_tokens, max_output_tokens), "
           "temperature, top_p, top_k, min_p or repetition_penalty gets the value from there; a request that sets "
           "one keeps its own. Without any: temperature 1, top_p 1, top_k -1 (all), min_p 0, repetition_penalty 1, "
           "and max_tokens 16 on /v1/completions, what max_model_len leaves after the prompt on chat and "
           "/v1/responses (default: auto)")
    a("--override-generation-config", default=None, metavar="JSON",
      help='generation-config fields laid over it, as a JSON object: \'{"max_new_tokens": 512, "temperature": 0.7, '
           '"top_p": 0.9, "top_k": 40, "min_p": 0, "repetition_penalty": 1.1}\'; max_new_tokens is the max_tokens '
           "of a request that omits it (capped to what max_model_len leaves; default: none)")
    a("--tool-prompt", choices=list(TOOL_PROMPT_MODES), default="template",
      help="tools in a chat whose chat template ignores them (SmolLM2's): template, as vLLM, shows them to the "
           "template only, so tool_choice auto (or unset) adds nothing to the prompt, while \"required\" and a named "
           "function get minfer's tool prompt for their guided call; minfer writes that prompt for auto too, "
           "within --tool-prompt-max-tokens (default: template)")
    a("--tool-prompt-max-tokens", type=int, metavar="N", default=DEFAULT_TOOL_PROMPT_MAX_TOKENS,
      help="with --tool-prompt minfer, the most tokens minfer's tool prompt may add to a tool_choice auto request; "
           "over it the tools are not shown (as with template) and a warning is logged "
           f"(tokens; default: {DEFAULT_TOOL_PROMPT_MAX_TOKENS})")


def _add_fallback_flags(group) -> None:
    """The flags of `fallbacks.FallbackConfig` (chapter 15): each off by default."""
    a = group.add_argument
    a("--max-waiting-requests", type=int, metavar="N", default=None,
      help="most requests waiting for their first token; one more is answered 503 with Retry-After, and no "
           "admitted request is dropped (requests; default: no limit)")
    a("--request-timeout", type=float, metavar="S", default=None,
      help="a request still running this long after it arrived ends with what it has, finish_reason "
           "\"timeout\"; a request's own request_timeout field may lower it (seconds; default: none)")
    a("--kv-pressure-threshold", type=float, metavar="FRAC", default=None,
      help="KV-cache usage (0-1) from which new requests get --kv-pressure-max-tokens as their max_tokens "
           "cap, reported in the answer's \"fallback\" field and X-Max-Tokens-Capped header (default: off)")
    a("--kv-pressure-max-tokens", type=int, metavar="N", default=None,
      help="the max_tokens cap under KV pressure (tokens; default: off; needs --kv-pressure-threshold)")


def fallbacks_from(args: argparse.Namespace):
    """FallbackConfig from parsed flags; raises ValueError for a bad value."""
    from minfer.serve.fallbacks import FallbackConfig  # noqa: PLC0415

    return FallbackConfig(max_waiting_requests=args.max_waiting_requests, request_timeout=args.request_timeout,
                          kv_pressure_threshold=args.kv_pressure_threshold,
                          kv_pressure_max_tokens=args.kv_pressure_max_tokens)


def _add_limit_flags(group) -> None:
    """The flags of `ServerLimits` (each with its unit and default), the API docs and CORS."""
    lim, a = _LIMITS, group.add_argument
    a("--max-request-body-bytes", type=_bytes, metavar="BYTES", default=lim.max_request_body_bytes,
      help="largest request body; a bigger Content-Length is refused (413) before it is read, a chunked body "
           f"is cut off at it (bytes, e.g. 16M; default: {lim.max_request_body_bytes} = 16 MiB)")
    a("--max-prompt-chars", type=int, metavar="N", default=lim.max_prompt_chars,
      help="longest prompt, or a chat's message contents together, refused (400) before tokenizing "
           "(characters; default: max-model-len x the longest token of the vocabulary, which no longer prompt "
           "can fit in: 8192 x 81 = 663552 for SmolLM2)")
    a("--max-seqs-per-request", type=int, metavar="N", default=lim.max_seqs_per_request,
      help=f"most sequences one request adds, prompts x n (sequences; default: {lim.max_seqs_per_request})")
    a("--body-read-timeout", type=float, metavar="S", default=lim.body_read_timeout,
      help=f"most time to send a request body; slower is a 408 (seconds; default: {lim.body_read_timeout:g})")
    a("--header-read-timeout", type=float, metavar="S", default=lim.header_read_timeout,
      help="most time to send a request's headers, from the connection's start or the request's first byte; "
           f"slower is closed (seconds; default: {lim.header_read_timeout:g})")
    a("--timeout-keep-alive", type=float, metavar="S", default=lim.timeout_keep_alive,
      help=f"an idle connection is closed after (seconds; default: {lim.timeout_keep_alive:g}, uvicorn's)")
    a("--h11-max-incomplete-event-size", type=_bytes, metavar="BYTES", default=lim.h11_max_incomplete_event_size,
      help="largest header section; bigger is a 400 (bytes; default: "
           f"{lim.h11_max_incomplete_event_size} = 16 KiB, h11's)")
    a("--max-stored-responses", type=int, metavar="N", default=lim.max_stored_responses,
      help="most responses /v1/responses keeps for previous_response_id and GET /v1/responses/{id}; the oldest "
           f"go first (responses; default: {lim.max_stored_responses})")
    a("--max-response-store-bytes", type=_bytes, metavar="BYTES", default=lim.max_response_store_bytes,
      help="most memory those stored responses take together, as their JSON; the oldest go first, and one "
           f"larger alone is served but not stored (bytes, e.g. 128M; default: {lim.max_response_store_bytes} "
           "= 128 MiB)")
    docs = group.add_mutually_exclusive_group().add_argument
    docs("--enable-fastapi-docs", action="store_true",
      help="serve the OpenAPI schema at /openapi.json, behind --api-key if set; the interactive /docs and /redoc "
           "are never served, as they load scripts from a CDN (default: off)")
    docs("--disable-fastapi-docs", action="store_true",
      help="vLLM's flag, accepted so its command lines run: the docs are already off by default (default: off)")
    a("--allowed-origins", nargs="+", metavar="ORIGIN", default=None,
      help="CORS origins: not built, and any value stops start-up; minfer sends no Access-Control-* header, so "
           "only the server's own page can call it from a browser (default: none)")


def limits_from(args: argparse.Namespace) -> ServerLimits:
    """ServerLimits from parsed flags; raises ValueError for a bad value or a CORS origin (not built)."""
    if args.allowed_origins:
        raise ValueError(f"--allowed-origins {' '.join(args.allowed_origins)}: CORS is not built in minfer; "
                         "leave it unset (only same-origin pages, such as the demo page, can call the API)")
    return ServerLimits(
        max_request_body_bytes=args.max_request_body_bytes, max_prompt_chars=args.max_prompt_chars,
        max_seqs_per_request=args.max_seqs_per_request, body_read_timeout=args.body_read_timeout,
        header_read_timeout=args.header_read_timeout, timeout_keep_alive=args.timeout_keep_alive,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        max_stored_responses=args.max_stored_responses, max_response_store_bytes=args.max_response_store_bytes)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags; raises ValueError for a bad value or a feature that is not built."""
    model = args.model or args.model_tag or DEFAULT_MODEL
    if args.model and args.model_tag and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    if args.enable_flash_attn and args.attention_backend not in ("auto", "triton"):
        raise ValueError(f"--enable-flash-attn means --attention-backend triton, not {args.attention_backend!r}")
    return EngineArgs(
        model=model, tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=args.max_model_len,
        seed=args.seed, block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, swap_space=args.swap_space,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        attention_backend="triton" if args.enable_flash_attn else args.attention_backend,
        enforce_eager=args.enforce_eager, kernels=args.kernels, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend, quantization=args.quantization,
        quantization_config=args.quantization_config,
        kv_cache_dtype=kv_cache_dtype_from(args.kv_cache_dtype, args.dtype), device=args.device,
        speculative_config=getattr(args, "speculative_config", None),
        max_parallel_loading_workers=getattr(args, "max_parallel_loading_workers", None),
        generation_config=getattr(args, "generation_config", "auto"),
        override_generation_config=getattr(args, "override_generation_config", None))


_FLOAT_KV = {"fp16": "float16", "float16": "float16", "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
             "fp32": "float32", "float32": "float32"}


def kv_cache_dtype_from(kv_cache_dtype: str, dtype: str) -> str:
    """--kv-cache-dtype as EngineArgs takes it. The article's command gives a float type by its short name
    ("fp16"): a float type equal to --dtype means "auto" (the KV cache in the model's dtype); another one is
    the KV cache stored in that type (`LLM(kv_cache_dtype="float16")`, chapter 5 §5.10). Anything else (auto,
    int8, fp8, ...) goes to the engine as is, which checks it."""
    want = _FLOAT_KV.get(kv_cache_dtype.lower())
    if want is None:
        return kv_cache_dtype
    return "auto" if dtype == want else want


def _fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from(args)
        limits = limits_from(args)
        fallbacks = fallbacks_from(args)
        if args.tool_prompt_max_tokens < 1:
            raise ValueError(f"--tool-prompt-max-tokens must be >= 1, got {args.tool_prompt_max_tokens}")
    except ValueError as exc:
        print(f"python -m minfer.serve: error: {exc}", file=sys.stderr)
        return 2

    from prometheus_client import disable_created_metrics  # noqa: PLC0415

    disable_created_metrics()  # no `*_created` series (as vLLM): this process is the server, nothing else
    from minfer.serve.metrics import ServerMetrics  # noqa: PLC0415

    names = args.served_model_name or [engine_args.model]
    server_box: dict = {}  # the uvicorn.Server, once made: a dead engine tells it to stop
    # Loading, building the KV pool and (on a first start) compiling the CPU kernels take from seconds to a couple
    # of minutes on a small machine: say so, so that a quiet terminal does not look like a hang.
    logger.info("loading %s and starting the engine (a first start also compiles the CPU kernels)...",
                engine_args.model)
    try:
        if engine_args.data_parallel_size > 1:  # N engine processes behind the router (chapter 12b)
            from minfer.serve.router import DPEngineClient  # noqa: PLC0415

            if not args.engine_process:
                raise ValueError("--data-parallel-size > 1 runs one engine process per replica; drop "
                                 "--no-engine-process")
            engine_loop = DPEngineClient.from_engine_args(engine_args, names[0], policy=args.router_policy)
            engine_loop.start()
            engine = engine_loop.engine_view
        elif args.engine_process:  # the model loads in the engine process; this one gets a view of it
            from minfer.serve.engine_client import MPEngineClient  # noqa: PLC0415

            if not args.engine_heartbeat_timeout > 0:
                raise ValueError(f"--engine-heartbeat-timeout must be > 0, got {args.engine_heartbeat_timeout}")
            engine_loop = MPEngineClient(engine_args, ServerMetrics(names[0]),
                                         heartbeat_timeout=args.engine_heartbeat_timeout,
                                         test_slow_step_s=args.test_hook_slow_step,
                                         on_death=lambda: _engine_died(server_box))
            engine_loop.start()
            engine = engine_loop.engine_view
        else:
            from minfer.engine import LLMEngine  # noqa: PLC0415 - heavy import after the flags are checked
            from minfer.serve.engine_loop import EngineLoop  # noqa: PLC0415

            engine = LLMEngine.from_engine_args(engine_args)
            engine_loop = EngineLoop(engine, ServerMetrics(names[0]))
    except ValueError as exc:  # a setting the engine refuses (e.g. a KV pool too small for max_model_len)
        print(f"python -m minfer.serve: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, ImportError) as exc:  # model files missing, out of memory, ...
        logger.exception("could not start the engine")
        print(f"python -m minfer.serve: error: could not load {engine_args.model!r}: {exc}", file=sys.stderr)
        return 1

    import uvicorn  # noqa: PLC0415

    from minfer.serve.connection import uvicorn_options  # noqa: PLC0415
    from minfer.serve.routes import build_app  # noqa: PLC0415

    pool = engine.kv_pool_info()
    mc = engine.model_config
    logger.info("model: %s (served as %s), dtype: %s, max_model_len: %d", getattr(engine, "model_name", engine_args.model),
                ", ".join(names), getattr(mc, "dtype", engine_args.dtype), mc.max_model_len)
    logger.info("KV pool: %d blocks x %d tokens = %d tokens, %s", pool.get("num_blocks", 0),
                pool.get("block_size", 0), pool.get("num_tokens", 0), _fmt_bytes(pool.get("bytes", 0)))
    logger.info("engine args: %s", engine_args)
    app = build_app(engine, served_model_names=names, api_key=args.api_key,
                    log_requests=not args.disable_log_requests, engine_loop=engine_loop, limits=limits,
                    enable_docs=args.enable_fastapi_docs, fallbacks=fallbacks, tool_prompt=args.tool_prompt,
                    tool_prompt_max_tokens=args.tool_prompt_max_tokens)
    logger.info("limits: %s", app.state.serving.limits)
    logger.info("fallbacks: %s", fallbacks)
    logger.info("request defaults (generation config): %s; tool prompt: %s",
                app.state.serving.default_sampling_params or "none", args.tool_prompt)
    logger.info("serving on http://%s:%d (OpenAI API at /v1, metrics at /metrics, demo page at /)%s",
                args.host, args.port, ", API key required" if args.api_key else "")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                          timeout_graceful_shutdown=2, **uvicorn_options(limits)))
    server_box["server"] = server
    if server_box.get("engine_died"):  # it died while the app was being built
        return ENGINE_DIED_EXIT_STATUS
    server.run()
    if server_box.get("engine_died"):
        logger.error("the engine process died; exiting with status %d so that a supervisor restarts the server",
                     ENGINE_DIED_EXIT_STATUS)
        return ENGINE_DIED_EXIT_STATUS
    return 0


def _engine_died(server_box: dict) -> None:
    """`MPEngineClient.on_death`: stop serving (in-flight requests already got their 503s; uvicorn's graceful
    shutdown lets those answers go out) so that `main` returns `ENGINE_DIED_EXIT_STATUS`."""
    server_box["engine_died"] = True
    server = server_box.get("server")
    if server is not None:
        server.should_exit = True


if __name__ == "__main__":
    sys.exit(main())
