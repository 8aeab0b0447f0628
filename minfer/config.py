"""Engine arguments with vLLM's names (article §9, §16), validated in one place.

`EngineArgs` is what `LLM(...)`, `LLMEngine.from_engine_args` and `python -m minfer.serve` all take. The
field names are vLLM's engine-argument names, so the article's vLLM command maps onto them flag by flag
(`--max-num-seqs` -> `max_num_seqs`, ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # what each is: minfer/attention/selector.py
KERNELS = ("auto", "reference")  # what each means: minfer/platform.py

# The one table of dtype names: name -> (torch dtype name or None, bytes per element). Model weights and
# activations take the float names (MODEL_DTYPES); the memory formulas of the chapters take all of them.
DTYPES = {
    "float32": ("float32", 4), "float": ("float32", 4), "fp32": ("float32", 4),
    "float16": ("float16", 2), "half": ("float16", 2), "fp16": ("float16", 2),
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "int8": ("int8", 1),
    "fp8": ("float8_e4m3fn", 1), "fp8_e4m3": ("float8_e4m3fn", 1), "float8_e4m3fn": ("float8_e4m3fn", 1),
    "fp8_e5m2": ("float8_e5m2", 1), "float8_e5m2": ("float8_e5m2", 1),
    "int4": (None, 0.5),
}
MODEL_DTYPES = tuple(n for n, (t, _) in DTYPES.items() if t in ("float32", "float16", "bfloat16"))
# `kv_cache_dtype` (vLLM's names): "auto" stores K/V in the model's dtype; a float name casts them; the 8-bit
# ones quantize them on store with one float32 scale per token and K/V head (minfer.attention.kv_quant).
# "fp8" is vLLM's alias of "fp8_e4m3".
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def read_json_object(value, name: str, kind: str) -> dict:
    """A setting given as a dict or as its JSON text (a flag's value), as a dict.

    Raises:
        ValueError: text that is not JSON, or a value that is not an object ("{name} must be {kind}").
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be {kind}, got {type(value).__name__}")
    return value


def torch_dtype(name: str):
    """The torch dtype of a name of `DTYPES` ("bf16" -> torch.bfloat16); a torch dtype passes through.

    Raises:
        ValueError: an unknown name, or one with no torch dtype ("int4").
    """
    import torch

    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.").lower()
    if key not in DTYPES or DTYPES[key][0] is None:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(n for n, (t, _) in DTYPES.items() if t)}")
    return getattr(torch, DTYPES[key][0])


SPECULATIVE_METHODS = ("ngram", "draft_model")


# The per-step token budget with chunked prefill (vLLM's `max_num_batched_tokens`), by device. The budget is what
# bounds a running stream's gap between tokens: a step computes at most this many prompt tokens beside the
# decodes. On a CPU a smaller step costs more per token (oneDNN's GEMM loses efficiency on fewer rows) and a
# larger one delays streams longer; 512 keeps a step of SmolLM2 on 2 cores under the 2 s bound
# tests/test_no_stall.py holds streams to, and gave the best throughput and TTFT of the budgets measured in
# lab notes 9b §9b.12. On a GPU a 2,048-token chunk is milliseconds (vLLM's default for the LLM class).
DEFAULT_CHUNK_BUDGET = {"cpu": 512, "cuda": 2048}


def default_max_num_batched_tokens(device_type: str, chunked: bool, max_model_len: int) -> int:
    """The step token budget when `max_num_batched_tokens` is None (tokens): the device's chunk budget with
    chunked prefill; without it, room for a whole `max_model_len` prompt in one step (at least 2048)."""
    if chunked:
        return DEFAULT_CHUNK_BUDGET.get(device_type, DEFAULT_CHUNK_BUDGET["cuda"])
    return max(max_model_len, 2048)


MAX_SPECULATIVE_TOKENS = 64  # upper bound on num_speculative_tokens (k)


@dataclass
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `speculative_config` shape (chapter 7b; Leviathan et al., 2023,
    "Fast Inference from Transformers via Speculative Decoding", arXiv:2211.17192).

    Attributes:
        method: "ngram" (prompt lookup: the longest suffix n-gram found earlier in the sequence proposes the
            tokens that followed it) or "draft_model" (a smaller model sharing the target's tokenizer).
        num_speculative_tokens: k, tokens proposed per step (1 <= k <= 64); the target verifies k + 1 positions.
        prompt_lookup_max / prompt_lookup_min: longest / shortest n-gram tried (ngram only; tokens).
        model: the draft model (draft_model only): anything `LLM(model=...)` loads.
        quantization: the draft's weight quantization, None (the draft's own weights as loaded, whatever the
            target uses) or one of "int8", "int4", "gguf" (`minfer.quantization`, as `LLM(quantization=...)`);
            draft_model only. A quantized draft proposes differently, never wrongly: the target verifies.
        quantization_config: that method's settings, a dict or JSON object string ({"group_size": 32}).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    model: str | None = None
    quantization: str | None = None
    quantization_config: dict | str | None = None

    @classmethod
    def from_dict(cls, d) -> "SpeculativeConfig":
        """Parse and check vLLM's dict (a JSON string is read first). Raises ValueError naming the field."""
        if isinstance(d, SpeculativeConfig):
            return d
        d = dict(read_json_object(d, "speculative_config", "a dict"))
        method = d.get("method")
        if method is None and d.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            method, d["model"] = "ngram", None
        if method is None and d.get("model"):
            method = "draft_model"
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                 "quantization", "quantization_config"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}")
        cfg = cls(method=method, num_speculative_tokens=d.get("num_speculative_tokens"),
                  prompt_lookup_max=d.get("prompt_lookup_max", 5), prompt_lookup_min=d.get("prompt_lookup_min", 1),
                  model=d.get("model"), quantization=d.get("quantization"),
                  quantization_config=d.get("quantization_config"))
        cfg.verify()
        return cfg

    def verify(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            # The bound: a step verifies k + 1 positions per sequence and the draft runs k forwards; past a few
            # tokens the acceptance rate alpha^k makes more useless work, and k near max_model_len is a typo.
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not is_int(lo) or not is_int(hi) or lo < 1 or hi < lo:
                raise ValueError("speculative_config needs integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got prompt_lookup_min={lo!r}, prompt_lookup_max={hi!r}")
            if self.model is not None:
                raise ValueError("speculative_config method 'ngram' takes no 'model'")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config method 'draft_model' needs 'model' (the draft to load)")
        if self.quantization == "none":
            self.quantization = None
        if self.method == "ngram" and (self.quantization is not None or self.quantization_config):
            raise ValueError("speculative_config method 'ngram' has no model to quantize: drop 'quantization'")
        if self.method == "draft_model":
            try:
                self.quantization_config = parse_quantization_config(self.quantization, self.quantization_config)
            except ValueError as e:
                raise ValueError(f"speculative_config (the draft): {e}") from None


# Texts that ship with minfer (minfer/data/README.md: the Python 3.11 docs, PSF license): perplexity
# (`minfer.eval`) and calibration (`minfer.quantization.calibrate`) read disjoint parts.
SHIPPED_TEXTS = {"eval": "eval_python_docs.txt", "calib": "calib_python_docs.txt"}


def load_shipped_text(which: str = "eval") -> str:
    """The shipped text `which` ("eval" or "calib", `minfer/data/`). Raises ValueError for another name."""
    from importlib import resources

    if which not in SHIPPED_TEXTS:
        raise ValueError(f"unknown text {which!r}: one of {', '.join(SHIPPED_TEXTS)}")
    return resources.files("minfer").joinpath("data", SHIPPED_TEXTS[which]).read_text(encoding="utf-8")


# Weight quantization (minfer/quantization/): the methods, and the settings each accepts.
QUANTIZATION_METHODS = ("int8", "int4", "gguf", "awq", "gptq")  # awq/gptq: a saved directory (minfer.quantize)
# Names vLLM has that minfer does not build (yet): refused with a message that says so.
NOT_BUILT_METHODS = ("fp8", "bitsandbytes", "marlin", "gptq_marlin", "awq_marlin")
# The keys each method's quantization_config accepts.
CONFIG_KEYS = {"int8": ("kernel",), "int4": ("group_size",), "gguf": ("kernel",), "awq": (), "gptq": ()}
GGUF_KERNELS = ("blocks", "torch")  # gguf's routes: the file's blocks in minfer's C++ kernel, or torch's ops
# int8's routes on a CPU: "qgemm", the integer GEMM, which also rounds the activations to int8 blocks of 32
# (W8A8); "torch", torch's int8-weight op on bfloat16 activations (weight-only, vLLM's W8A16; every other device)
INT8_KERNELS = ("qgemm", "torch")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU op supports


def parse_quantization_config(quantization: str | None, config) -> dict:
    """Validate `quantization` and its config (a dict, a JSON object string, or None) -> the config dict.

    Raises:
        ValueError: an unknown method (lists the known ones), a method that is not built, a config that is
            not a JSON object, an unknown key for the method, a config without a method, or a bad group size.
    """
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"quantization_config is not valid JSON ({e}): give an object such as "
                             '\'{"group_size": 64}\'') from None
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config must be a JSON object (a dict), got {type(config).__name__}")
    if quantization in (None, "none"):
        if config:
            raise ValueError(f"quantization_config={config!r} was given without a quantization method")
        return {}
    if quantization in NOT_BUILT_METHODS:
        raise ValueError(f"quantization={quantization!r} is not built in minfer yet; built: "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {quantization!r}; known: {', '.join(QUANTIZATION_METHODS)}")
    unknown = sorted(set(config) - set(CONFIG_KEYS[quantization]))
    if unknown:
        allowed = ", ".join(CONFIG_KEYS[quantization]) or "none"
        raise ValueError(f"quantization_config for {quantization!r} has unknown key(s) {unknown}; allowed: {allowed}")
    if quantization == "int4":
        g = config.get("group_size", None)
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g not in INT4_GROUP_SIZES):
            raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {g!r}")
    if quantization == "int8" and config.get("kernel", "qgemm") not in INT8_KERNELS:
        raise ValueError(f"int8 kernel must be one of {INT8_KERNELS}, got {config['kernel']!r}")
    if quantization == "gguf" and config.get("kernel", "blocks") not in GGUF_KERNELS:
        raise ValueError(f"gguf kernel must be one of {GGUF_KERNELS}, got {config['kernel']!r}")
    return dict(config)


# Features that have a flag but no implementation yet: starting with them set stops with this message,
# so that no flag is silently ignored.
_NOT_BUILT = "is not built in minfer yet (see the issues list); leave it at its default"


@dataclass
class EngineArgs:
    """Everything that configures an engine. Defaults follow vLLM where it makes sense on a CPU.

    Attributes:
        model: a local HF directory, a .gguf file, a hub id, or the alias "smollm2-135m-instruct".
        tokenizer: tokenizer directory if different from `model`.
        dtype: "auto", "float32", "bfloat16" or "float16".
        max_model_len: most tokens (prompt + output) per sequence; None = the model's own limit.
        seed: seed of the engine's default random generator.
        block_size: tokens per KV block (paged cache).
        gpu_memory_utilization: on CUDA, fraction of the device this process may use (weights + KV).
        kv_cache_memory_bytes: explicit KV pool size in bytes (any device); overrides the fraction.
        swap_space: CPU swap space for preempted sequences, GiB (0 = preempt by recompute only).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens (prefill + decode) in one step; None = `default_max_num_batched_tokens`
            (with chunked prefill: 512 on a CPU, 2048 on a GPU; `DEFAULT_CHUNK_BUDGET`).
        enable_chunked_prefill: split long prompts into chunks that share steps with decodes (default True, as
            vLLM v1): a long prompt then delays running streams by one chunk's step, not by its whole prefill.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes across requests.
        preemption_mode: "recompute" or "swap" (swap needs swap_space > 0).
        attention_backend: "auto" (default: "triton" on CUDA; "cpu" for a float32 or bfloat16 model on the CPU
            when its C++ kernel builds; else "torch"), "torch" (the plain-torch reference), "cpu" (decode
            attention by the C++ kernel of `minfer.cpu.attention`; an error where it cannot be built) or "triton"
            (FlashAttention + paged decode kernels).
        enforce_eager: vLLM's switch: True runs every step through the model's forward, op by op (the plain
            eager model), with the platform's step runner off: on a CPU the one-call decode step
            (`minfer.cpu.decode_step`), on CUDA the CUDA-graph replay. The kernels stay as `kernels` says.
            Default False (the step runner where the platform has one).
        kernels: "auto" (default: the fastest kernels this device has; on a CPU the wing `minfer/cpu/`: weight
            layouts, integer GEMMs, fused element-wise ops, C++ attention and sampler, the one-call decode
            step) or "reference" (the path the chapters teach: plain PyTorch model code, the torch attention
            reference, the torch sampler, no C++ loaded). `minfer.platform` turns it into those choices.
        quantization: weight quantization, None or one of "int8", "int4", "gguf" (`minfer.quantization`).
        quantization_config: the method's settings, a dict or a JSON object string ({"group_size": 64} for
            int4); parsed into a dict here.
        tensor_parallel_size: ranks each layer is split over (chapter 12): heads, MLP columns and the
            vocabulary are divided among them, with one all-reduce after attention and one after the MLP.
        pipeline_parallel_size: stages the layers are cut into (chapter 12), one rank group each.
        distributed_executor_backend: with more than one rank, who starts the workers: "mp" (the default:
            the engine spawns them, as vLLM's multiprocessing executor) or "torchrun" (every rank is started by
            `torchrun --nproc-per-node N [--nnodes ...]`, which runs the same command; rank 0 is the engine).
        pipeline_micro_batches: micro-batches a step's rows are cut into for the pipeline (minfer's knob,
            not vLLM's); None = one per stage. More shrink the bubble, (p - 1) / (m + p - 1).
        kv_cache_dtype: how the paged pool stores K/V (vLLM's names): "auto" (the model's dtype), "float32",
            "bfloat16", "float16", or quantized on store with a float32 scale per token and K/V head: "int8",
            "fp8" (= "fp8_e4m3") or "fp8_e5m2" (chapter 5, `minfer.attention.kv_quant`). The Triton backend
            reads the model's dtype or the quantized ones, not a cast pool (a clear error at start-up).
        data_parallel_size: whole-model replicas (engine processes) behind the server's router
            (`minfer.serve.router`, chapter 12b), an integer >= 1; one `LLMEngine` is one replica and
            refuses > 1, so it is only the server that runs N (`python -m minfer.serve --data-parallel-size N`).
        max_parallel_loading_workers: threads that read the checkpoint's tensors at load time (vLLM's flag;
            None or 1: one thread); changes only how fast the model loads.
        speculative_config: None, or vLLM's dict `{"method": "ngram" | "draft_model", "num_speculative_tokens":
            k, ...}` (a JSON string is accepted); parsed into `SpeculativeConfig` (chapter 7b).
        generation_config: where the default sampling parameters come from, vLLM's values: "auto" (the
            model's `generation_config.json`: in an HF directory, or beside a .gguf file; none there, no
            defaults), "vllm" (none: SamplingParams' own), or a directory holding a `generation_config.json`.
        override_generation_config: a dict (or JSON object string) of HF generation-config fields laid over
            it: `max_new_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`.
            `diff_sampling_param` turns both into the defaults of a request that omits a field (the server's)
            and of `LLM.generate` without SamplingParams.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 0.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    preemption_mode: str | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    kernels: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    pipeline_micro_batches: int | None = None
    quantization: str | None = None
    quantization_config: dict | str | None = None
    kv_cache_dtype: str = "auto"
    device: str | None = None
    speculative_config: dict | None = None  # vLLM's shape; see SpeculativeConfig (parsed in verify)
    max_parallel_loading_workers: int | None = None  # threads reading checkpoint tensors (load time only)
    generation_config: str = "auto"  # "auto", "vllm" or a directory (see diff_sampling_param)
    override_generation_config: dict | str | None = None  # HF generation fields over it; parsed in verify

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise `ValueError` for a value outside its range or a feature that is not built."""

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        import math

        for name in ("seed", "block_size", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size",
                     "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise bad(name, "an integer")
        if not 0 <= self.seed < 2 ** 63:
            raise bad("seed", "an integer in [0, 2**63)")
        for name in ("enforce_eager", "enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise bad(name, "an integer or None")
        for name in ("gpu_memory_utilization", "swap_space"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise bad(name, "a finite number")
        if self.dtype != "auto" and self.dtype not in MODEL_DTYPES:
            raise bad("dtype", "one of auto, float32, bfloat16, float16")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise bad("max_model_len", "an integer >= 1")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise bad("block_size", "a power of two from 1 to 128")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise bad("kv_cache_memory_bytes", "a positive number of bytes")
        if self.swap_space < 0:
            raise bad("swap_space", ">= 0 (GiB)")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", ">= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", ">= 1")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise bad("preemption_mode", "'recompute' or 'swap'")
        if self.preemption_mode == "swap" and self.swap_space <= 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of CPU memory for swapped KV)")
        if self.kernels not in KERNELS:
            raise bad("kernels", "one of " + ", ".join(map(repr, KERNELS)))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", "one of " + ", ".join(map(repr, ATTENTION_BACKENDS)))
        if self.attention_backend == "cpu" and self.dtype == "float16":
            raise ValueError(f"attention_backend='cpu' runs float32 or bfloat16 models; got dtype={self.dtype!r} "
                             "(use attention_backend='auto' or 'torch' for it)")
        if self.data_parallel_size < 1:
            raise bad("data_parallel_size", "an integer >= 1 (replicas of the whole model)")
        if self.max_parallel_loading_workers is not None and (
                not isinstance(self.max_parallel_loading_workers, int) or isinstance(self.max_parallel_loading_workers, bool)
                or self.max_parallel_loading_workers < 1):
            raise bad("max_parallel_loading_workers", "an integer >= 1 or None")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        if self.distributed_executor_backend not in (None, "mp", "torchrun"):
            raise bad("distributed_executor_backend", "None, 'mp' or 'torchrun'")
        m = self.pipeline_micro_batches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise bad("pipeline_micro_batches", "None or an integer >= 1")
        self.quantization_config = parse_quantization_config(self.quantization, self.quantization_config)
        if self.world_size > 1 and self.quantization == "gguf":
            raise ValueError("quantization='gguf' keeps the file's Q4 blocks whole and cannot be split over ranks "
                             "yet; with tensor or pipeline parallelism use int8 or int4 (or no quantization)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", "one of " + ", ".join(map(repr, KV_CACHE_DTYPES)))
        if (self.attention_backend == "cpu" and self.kv_cache_dtype == "float16"):
            raise ValueError(f"attention_backend='cpu' reads a float32, bfloat16, int8 or fp8 KV pool; got kv_cache_dtype="
                             f"{self.kv_cache_dtype!r} (use attention_backend='auto' or 'torch' for it)")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise bad("generation_config", "'auto', 'vllm' or a directory holding a generation_config.json")
        self.override_generation_config = parse_override_generation_config(self.override_generation_config)
        if self.generation_config not in ("auto", "vllm"):  # a directory: read now, not after the model loaded
            diff_sampling_param(None, self.generation_config, self.override_generation_config)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if self.world_size > 1 and self.speculative_config.method == "draft_model":
                raise ValueError("a draft model with tensor or pipeline parallelism is not built: use "
                                 "speculative_config method 'ngram', or tensor_parallel_size=pipeline_parallel_size=1")
        if self.device is not None:  # checked here, not left to torch's AssertionError deep inside loading
            import re

            import torch

            cuda = re.fullmatch(r"cuda(?::(\d+))?", str(self.device))
            if str(self.device) != "cpu" and cuda is None:
                raise bad("device", "None (the default), 'cpu', 'cuda' or 'cuda:N'")
            if cuda is not None and not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r}, but this torch ({torch.__version__}) finds no CUDA device "
                                 "(a CPU-only build, or no GPU visible): use device='cpu' or leave it unset")
            if cuda is not None and cuda.group(1) is not None and int(cuda.group(1)) >= torch.cuda.device_count():
                raise ValueError(f"device={self.device!r}, but torch finds {torch.cuda.device_count()} CUDA "
                                 "device(s), numbered from 0")


    @property
    def extensions(self) -> tuple[str, ...]:
        """The engine extensions attached at start (`minfer.extensions`): "spec_decode" with a
        `speculative_config`."""
        return ("spec_decode",) if self.speculative_config is not None else ()

    @property
    def world_size(self) -> int:
        """Ranks of the job: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size



PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


# The HF generation-config fields that become default sampling parameters, as vLLM's
# `ModelConfig.get_diff_sampling_param` takes them (`max_new_tokens` is vLLM's `max_tokens`), with the value
# each has in transformers' `GenerationConfig()`: a generation_config.json field equal to it is not a
# default of the model's (vLLM reads the file through `GenerationConfig.to_diff_dict`).
GENERATION_CONFIG_FIELDS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                            "min_p": None, "max_new_tokens": None}


def parse_override_generation_config(value) -> dict:
    """`override_generation_config` (a dict, a JSON object string or None) as a checked dict.

    Raises:
        ValueError: not a JSON object, a field outside `GENERATION_CONFIG_FIELDS` (vLLM would ignore it; here
            nothing is silently ignored), or a value SamplingParams refuses (`max_new_tokens` < 1, ...).
    """
    if value is None:
        return {}
    value = read_json_object(value, "override_generation_config", "a JSON object")
    unknown = sorted(set(value) - set(GENERATION_CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config has unknown field(s) {unknown}; known: "
                         f"{sorted(GENERATION_CONFIG_FIELDS)}")
    _check_sampling_defaults(sampling_defaults(value), "override_generation_config")
    return dict(value)


def sampling_defaults(config: dict) -> dict:
    """HF generation-config fields -> SamplingParams keywords: the `GENERATION_CONFIG_FIELDS` that are set,
    `max_new_tokens` renamed `max_tokens` (vLLM's mapping)."""
    out = {k: v for k, v in config.items() if k in GENERATION_CONFIG_FIELDS and v is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def _check_sampling_defaults(defaults: dict, where: str) -> None:
    from minfer.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {str(e).replace('SamplingParams.', '').replace('max_tokens', 'max_new_tokens')}") \
            from None


def diff_sampling_param(model_dir, generation_config: str = "auto", override: dict | None = None) -> dict:
    """The default sampling parameters of a model (vLLM's `ModelConfig.get_diff_sampling_param`): its
    generation config's `GENERATION_CONFIG_FIELDS` that differ from transformers' defaults, `override` laid
    over them, as SamplingParams keywords (`max_new_tokens` -> `max_tokens`). {} when none is set.

    Args:
        model_dir: the directory whose `generation_config.json` "auto" reads (an HF model's, or the one a
            .gguf file is in); None: no file.
        generation_config: "auto", "vllm" (no file: only `override`) or a directory holding the file.
        override: `EngineArgs.override_generation_config` (parsed).

    Raises:
        ValueError: a given directory without generation_config.json, a file that is not a JSON object, or
            defaults SamplingParams refuses (named with the file).
    """
    from pathlib import Path

    if generation_config == "vllm":
        path = None
    elif generation_config == "auto":
        path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
        path = path if path is not None and path.is_file() else None
    else:
        path = Path(generation_config).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config={generation_config!r}: no {path.name} in that directory "
                             "(give 'auto', 'vllm' or a directory holding one)")
    config = {}
    if path is not None:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable JSON file ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
        config = {k: v for k, v in config.items()
                  if k in GENERATION_CONFIG_FIELDS and v != GENERATION_CONFIG_FIELDS[k]}
        _check_sampling_defaults(sampling_defaults(config), str(path))
    return sampling_defaults({**config, **(override or {})})


def verify_parallel_config(cfg: "ModelConfig", tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Check that the model splits over the ranks, before any weight is loaded (vLLM's
    `verify_with_parallel_config`): query heads, KV heads (a multiple or a divisor of tp: fewer KV heads than
    ranks are replicated), the MLP width divisible by tensor_parallel_size; at least one layer per stage.

    Raises:
        ValueError: naming the size, the model's number and what would divide it.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp * pp == 1:
        return
    if cfg.architecture not in PARALLEL_ARCHITECTURES:
        raise ValueError(f"tensor/pipeline parallelism is built for {', '.join(PARALLEL_ARCHITECTURES)}; "
                         f"this model is {cfg.architecture}")

    def divisors(n):
        return [d for d in range(1, n + 1) if n % d == 0]

    h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    if h % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {h} attention heads "
                         f"(num_attention_heads); sizes that do: {divisors(h)}")
    if (kvh >= tp and kvh % tp) or (kvh < tp and tp % kvh):
        raise ValueError(f"tensor_parallel_size={tp} and the model's {kvh} KV heads (num_key_value_heads): tp must "
                         "divide them, or be a multiple of them (each KV head is then replicated)")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the MLP width {cfg.intermediate_size} "
                         "(intermediate_size)")
    if pp > cfg.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is larger than the model's {cfg.num_hidden_layers} layers "
                         "(num_hidden_layers): every stage needs at least one layer")


# The largest shapes minfer takes from a config, about 4x (16x for positions) the largest public models:
# Llama 3.1 405B has 126 layers, hidden 16,384, MLP 53,248, 128 heads; Gemma 3 a 262,144-token vocabulary and
# head_dim 256; Llama 4 Scout 10 M positions. A config over one of them is corrupt or hostile: 1,000,000 layers
# were built one by one until memory ran out. Checked before anything is allocated (`ModelConfig`).
MODEL_SIZE_BOUNDS = {
    "num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 262144, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "head_dim": 1024, "vocab_size": 2**21, "max_position_embeddings": 2**24,
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# RoPE rotates pair i of a head by position * base^(-2i/d): a base <= 1 gives frequencies that do not fall
# with i (all 1 at base 1, growing below), and a NaN or inf base turns every angle into NaN.
ROPE_BASE_WHY = " (RoPE's base: its powers base^(-2i/d) must fall from 1 as i grows)"


SHAPE_FIELDS = ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                "num_key_value_heads", "head_dim")


def check_shape_fields(d: dict, source: str = "config.json") -> None:
    """Refuse a shape field of a parsed HF config (`SHAPE_FIELDS`) that is present but not a positive integer
    (a bool is not one). Raises ValueError naming `source` and the field."""
    for name in SHAPE_FIELDS:
        v = d.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{source}: {name} must be a positive integer, got {v!r}")


def check_finite_numbers(d, source: str = "config.json", max_items: int = 1_000_000) -> None:
    """Refuse a NaN or an infinity anywhere in a parsed config (dicts and lists walked without recursion).

    JSON has neither (RFC 8259), but Python's parser reads `NaN`, `Infinity` and `1e999` as floats, and a field
    the architecture's adapter does not read, or reads only when another is absent (a top-level `rope_theta`
    beside `rope_parameters`), would otherwise load silently.

    Raises:
        ValueError: "<source>: <dotted path> = nan: must be a finite number (JSON has no NaN or Infinity)".
    """
    stack = [("", d)]
    seen = 0
    while stack:
        path, v = stack.pop()
        seen += 1
        if seen > max_items:
            return  # a config this large is refused elsewhere, or is a huge list of ordinary values
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{source}: {path or 'value'} = {v!r}: must be a finite number (JSON has no NaN or "
                             "Infinity)")
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))


def check_model_config(cfg: "ModelConfig") -> None:
    """Every size of `cfg` a positive integer within `MODEL_SIZE_BOUNDS`, every float finite and in its range
    (`rms_norm_eps` in (0, 1), a RoPE base > 1, scales and rope_scaling factors > 0, `partial_rotary_factor` in
    (0, 1]), Q heads a multiple of KV heads. No tensor is needed: this runs in microseconds.

    Raises:
        ValueError: "<field> = <value>: must be <bound>", for the first field that breaks its rule.
    """
    for name, bound in MODEL_SIZE_BOUNDS.items():
        v = getattr(cfg, name)
        if not _is_int(v) or not 1 <= v <= bound:
            raise ValueError(f"{name} = {v!r}: must be an integer in [1, {bound}] (minfer's bound for {name}, "
                             "above every public model)")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"num_attention_heads = {cfg.num_attention_heads} must be a multiple of "
                         f"num_key_value_heads = {cfg.num_key_value_heads} (each KV head serves a group of Q heads)")
    # name: (value, low, high, why): the value must be finite, > low, and below high (None: no upper bound;
    # a float: < high; an inclusive bound is written as a one-item tuple)
    ranges = {
        "rms_norm_eps": (cfg.rms_norm_eps, 0.0, 1.0, " (added to the mean square under the square root; models use "
                         "1e-12 to 1e-5)"),
        "rope_theta": (cfg.rope_theta, 1.0, None, ROPE_BASE_WHY),
    }
    if cfg.rope_local_theta is not None:
        ranges["rope_local_theta"] = (cfg.rope_local_theta, 1.0, None, ROPE_BASE_WHY)
    if cfg.query_pre_attn_scalar is not None:
        ranges["query_pre_attn_scalar"] = (cfg.query_pre_attn_scalar, 0.0, None, " (the softmax scale divides by it)")
    for key, v in (cfg.rope_scaling or {}).items():
        if key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                   "attention_factor", "beta_fast", "beta_slow") and v is not None:
            ranges[f"rope_scaling.{key}"] = (v, 0.0, None, "")
        elif key == "partial_rotary_factor" and v is not None:
            ranges[f"rope_scaling.{key}"] = (v, 0.0, (1.0,), " (the share of head_dim that is rotated)")
    for name, (v, low, high, why) in ranges.items():
        inclusive = isinstance(high, tuple)
        top = high[0] if inclusive else high
        if (not _is_real(v) or not math.isfinite(v) or v <= low
                or (top is not None and (v > top if inclusive else v >= top))):
            bound = f"> {low:g}" + ("" if top is None else f" and {'<=' if inclusive else '<'} {top:g}")
            raise ValueError(f"{name} = {v!r}: must be a finite number {bound}{why}")
    for name in ("mscale", "mscale_all_dim"):
        v = (cfg.rope_scaling or {}).get(name)
        if v is not None and (not _is_real(v) or not math.isfinite(v)):
            raise ValueError(f"rope_scaling.{name} = {v!r}: must be a finite number")


@dataclass
class ModelConfig:
    """The model's shape, read from a Hugging Face `config.json` (or GGUF metadata) by the architecture's
    config adapter (`minfer.model.registry`).

    Attribute names are Hugging Face's, so `memory.kv_cache_bytes` and the chapters can use any config.
    `rope_scaling` is the dict of HF's `rope_scaling` / `rope_parameters` (with `rope_type`), or None.
    `layer_windows[i]` is the sliding window of layer i in tokens (None = full attention).
    `position_embedding` says how positions enter the model (article §2): "rope" (rotated Q/K, Llama),
    "learned" (a table added to the token embedding, GPT-2) or "alibi" (a per-head linear bias on the scores,
    BLOOM). `rms_norm_eps` is the epsilon of the model's norms, LayerNorm's for GPT-2 and BLOOM.
    `rope_local_theta` is the RoPE base of the sliding-window layers where it differs (Gemma 3), and
    `query_pre_attn_scalar` the softmax scale's denominator where it is not head_dim (Gemma 3).

    Raises:
        ValueError: a size outside `MODEL_SIZE_BOUNDS`, a non-finite or non-positive float
            (`check_model_config`), an unknown position embedding, a bad sliding window.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple = ()
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    torch_dtype: str | None = None
    position_embedding: str = "rope"
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        check_model_config(self)
        if self.position_embedding not in ("rope", "learned", "alibi"):
            raise ValueError(f"position_embedding must be 'rope', 'learned' or 'alibi', got {self.position_embedding!r}")
        if self.position_embedding == "alibi" and self.rope_scaling is not None:
            raise ValueError("ALiBi and RoPE are both set (position_embedding='alibi' with a rope_scaling): a model "
                             "takes one of them; ALiBi adds distance to the scores, RoPE rotates Q and K")
        for i, w in enumerate(self.layer_windows):
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"sliding window of layer {i} must be None (full attention) or an integer >= 1 "
                                 f"(tokens), got {w!r}")
