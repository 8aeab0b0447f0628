"""Engine arguments with vLLM's names (article §9, §16), validated in one place.

`EngineArgs` is what `LLM(...)`, `LLMEngine.from_engine_args` and `python -m minfer.serve` all take. The
field names are vLLM's engine-argument names, so the article's vLLM command maps onto them flag by flag
(`--max-num-seqs` -> `max_num_seqs`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DEFAULT_MODEL = "smollm2-135m-instruct"
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")

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
        max_num_batched_tokens: most tokens (prefill + decode) in one step; None = chosen from the others.
        enable_chunked_prefill: split long prompts into chunks that share steps with decodes.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes across requests.
        preemption_mode: "recompute" or "swap" (swap needs swap_space > 0).
        attention_backend: "auto" (default: "cpu" for a float32 model on the CPU when its C++ kernel builds,
            else "torch"), "torch" (the plain-torch reference), "cpu" (decode attention by the C++ kernel of
            `minfer.model.paged_attention_cpu`; an error where it cannot be built) or "triton"
            (FlashAttention + paged decode kernels).
        enforce_eager: accepted for vLLM compatibility; minfer always runs eagerly.
        tensor_parallel_size, pipeline_parallel_size, quantization, kv_cache_dtype: later chapters.
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
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    preemption_mode: str | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    device: str | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise `ValueError` for a value outside its range or a feature that is not built."""

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        import math

        for name in ("seed", "block_size", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise bad(name, "an integer")
        if not 0 <= self.seed < 2 ** 63:
            raise bad("seed", "an integer in [0, 2**63)")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise bad(name, "an integer or None")
        for name in ("gpu_memory_utilization", "swap_space"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise bad(name, "a finite number")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"):
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
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", "one of " + ", ".join(map(repr, ATTENTION_BACKENDS)))
        if self.attention_backend == "cpu" and self.dtype in ("bfloat16", "float16"):
            raise ValueError(f"attention_backend='cpu' runs float32 only; got dtype={self.dtype!r} "
                             "(use attention_backend='auto' or 'torch' for it)")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} {_NOT_BUILT}")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} {_NOT_BUILT}")
        if self.quantization not in (None, "none"):
            raise ValueError(f"quantization={self.quantization!r} {_NOT_BUILT}")
        if self.kv_cache_dtype not in ("auto",):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} {_NOT_BUILT}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# Architectures minfer's decoder implements, and what distinguishes each from plain Llama.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=None, qk_norm=True),
}


@dataclass
class ModelConfig:
    """The model's shape, read from a Hugging Face `config.json` (or GGUF metadata).

    Attribute names are Hugging Face's, so `memory.kv_cache_bytes` and the chapters can use any config.
    `rope_scaling` is the dict of HF's `rope_scaling` / `rope_parameters` (with `rope_type`), or None.
    `layer_windows[i]` is the sliding window of layer i in tokens (None = full attention).
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

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Build from a parsed HF config dict; handles both `rope_theta`+`rope_scaling` (transformers 4)
        and `rope_parameters` (transformers 5).

        Raises:
            ValueError: unknown architecture or a missing required field (message names `source`).
        """
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
            arch = by_type.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or d.get('model_type')!r}; "
                f"minfer implements {sorted(SUPPORTED_ARCHITECTURES)}")
        try:
            n_heads = d["num_attention_heads"]
            hidden = d["hidden_size"]
            n_layers = d["num_hidden_layers"]
            inter = d["intermediate_size"]
            vocab = d["vocab_size"]
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
        head_dim = d.get("head_dim") or hidden // n_heads
        rope = d.get("rope_parameters") or {}
        if "rope_theta" in rope and not isinstance(rope.get("rope_theta"), dict):
            theta = rope["rope_theta"]
        else:
            theta = d.get("rope_theta", 10000.0)
        scaling = dict(d.get("rope_scaling") or rope or {})
        scaling.pop("rope_theta", None)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        traits = SUPPORTED_ARCHITECTURES[arch]
        qkv_bias = traits["qkv_bias"] if traits["qkv_bias"] is not None else bool(d.get("attention_bias", False))
        o_bias = bool(d.get("attention_bias", False)) and arch != "Qwen2ForCausalLM"
        window = d.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not d.get("use_sliding_window", False):
            window = None
        layer_types = d.get("layer_types")
        if window and layer_types:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = tuple([window] * n_layers)
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=n_layers, num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads, head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=traits["qk_norm"], layer_windows=windows,
            hidden_act=d.get("hidden_act", "silu"), bos_token_id=d.get("bos_token_id"), eos_token_ids=eos,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"))
