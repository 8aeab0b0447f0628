"""GGUF files (llama.cpp's format, read with the `gguf` package): metadata -> `ModelConfig`, tensor names ->
Hugging Face's, blocks -> float32 (dequantized once and cached), or the raw quantized blocks as stored.

    load_gguf(path)            config, EOS ids and (HF name, float32 tensor) pairs, through the cache
    iter_gguf_blocks(reader)   the tensors as stored (`GGUFBlocks`), for methods that run the file's blocks
    gguf_cache_path(path)      where the dequantized weights and the rebuilt tokenizer are cached

The GGUF spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from tqdm.auto import tqdm

import minfer.envs as envs
from minfer.config import ModelConfig
from minfer.model.registry import architecture_for_gguf, config_from_hf

# llama.cpp's tensor names -> Hugging Face's (blk.N.<base>.<kind> -> model.layers.N.<hf>.<kind>).
GGUF_TO_HF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Architectures whose norms are named differently: Gemma 3 has a norm before AND after attention and MLP.
GGUF_TO_HF_NAMES_BY_ARCH = {
    "gemma3": {**GGUF_TO_HF_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
# Architectures whose GGUF norm weights hold 1 + w (llama.cpp's converter adds Gemma's 1; HF stores w).
NORM_PLUS_ONE = ("gemma3",)


def open_gguf(path: Path):
    """`gguf.GGUFReader` for `path`. Raises ValueError naming the file when the header is not GGUF."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, path: Path) -> tuple[ModelConfig, tuple]:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, ...). Raises ValueError for other archs."""
    arch = gguf_field(reader, "general.architecture")
    architecture = architecture_for_gguf(arch, str(path))

    def get(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    d = {
        "architectures": [architecture.name], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"), "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads, "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": get("attention.key_length") or hidden // n_heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6), "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if get("attention.sliding_window") is not None:
        d["sliding_window"] = get("attention.sliding_window")
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        d["rope_scaling"] = {"rope_type": scaling_type, "factor": get("rope.scaling.factor"),
                             "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    cfg = config_from_hf(d, source=str(path))
    return cfg, cfg.eos_token_ids


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows in the interleaved-pair RoPE layout; HF (and minfer) rotate halves.
    This undoes llama.cpp's `permute` (its convert_hf_to_gguf.py): rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Hugging Face's name for a GGUF tensor name ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj
    .weight"); None for tensors minfer derives instead (e.g. `rope_freqs`, from the config)."""
    names = GGUF_TO_HF_NAMES_BY_ARCH.get(arch, GGUF_TO_HF_NAMES)
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, kind = parts[1], parts[2], parts[3]
        return f"model.layers.{layer}.{names[base]}.{kind}"
    base, kind = parts[0], parts[1]
    if base not in names:
        return None
    return f"{names[base]}.{kind}"


@dataclass
class GGUFBlocks:
    """One tensor of a GGUF file as stored, not expanded: for quantization methods that run the file's own
    blocks (Q4_0, Q4_1, Q8_0, K-quants).

    Attributes:
        name: Hugging Face's name of the tensor. gguf_name: the file's own.
        tensor_type: `gguf.GGMLQuantizationType` (F32, F16, Q4_1, Q6_K, ...).
        shape: the logical shape, rows first (`[out, in]` for a weight), as torch would show it.
        data: the raw bytes as numpy (a view of the memory-mapped file: `np.array(data)` to own them).
        rope_permuted: Q/K rows still in llama.cpp's interleaved-pair RoPE order (see `unpermute_rope`).
    """

    name: str
    gguf_name: str
    tensor_type: object
    shape: tuple[int, ...]
    data: object
    rope_permuted: bool


def iter_gguf_blocks(reader) -> Iterator[GGUFBlocks]:
    """Every tensor of a GGUF file as `GGUFBlocks`, with HF names, in file order."""
    arch = gguf_field(reader, "general.architecture")
    permuted = arch == "llama"
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        base = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        yield GGUFBlocks(name, t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape)), t.data,
                         permuted and base in ("attn_q", "attn_k"))


def iter_gguf(reader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of a GGUF file, dequantized with `gguf.quants` (every type
    it reads: F32/F16, Q4_0/Q4_1/Q5_0/Q8_0 and the K-quants Q4_K/Q6_K of Gemma 3's Q4_K_M file)."""
    import numpy as np
    from gguf.quants import dequantize

    plus_one = gguf_field(reader, "general.architecture") in NORM_PLUS_ONE
    for b in tqdm(list(iter_gguf_blocks(reader)), desc="Dequantizing GGUF tensors", leave=False):
        w = torch.from_numpy(np.array(dequantize(b.data, b.tensor_type), dtype=np.float32))  # own, writable copy
        if plus_one and b.name.endswith("norm.weight"):
            w -= 1.0
        if b.rope_permuted:
            heads = cfg.num_attention_heads if ".q_proj." in b.name else cfg.num_key_value_heads
            w = unpermute_rope(w, heads)
        yield b.name, w


def _cache_dir() -> Path:
    return envs.MINFER_CACHE


def gguf_cache_path(path: Path) -> Path:
    """Where the dequantized float32 weights of a GGUF file are cached (keyed by path, size, mtime).

    Dequantizing takes seconds; every later load of the same file maps the cached safetensors instead.
    Set `envs.MINFER_CACHE` to move the cache, `envs.MINFER_NO_CACHE`=1 to disable it.
    """
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return _cache_dir() / "gguf" / f"{path.stem}-{key}"


def load_gguf(path: Path, max_workers: int | None = None) -> tuple[ModelConfig, tuple, Iterable[tuple[str, torch.Tensor]]]:
    """Config, EOS ids and (HF name, float32 tensor) pairs of a GGUF file, through the cache when possible.

    Parsing the metadata and dequantizing take seconds; the cache holds the config and the float32 weights
    as safetensors, which later loads map from disk. With `max_workers` set (even 1) the cache is read lazily
    by `loader.iter_safetensors` with that many threads, instead of all at once by `load_file`.
    """
    from dataclasses import asdict

    from safetensors.torch import load_file, save_file

    cache = gguf_cache_path(path)
    use_cache = not envs.MINFER_NO_CACHE
    if use_cache and (cache / "model.safetensors").is_file() and (cache / "minfer_config.json").is_file():
        try:
            meta = json.loads((cache / "minfer_config.json").read_text())
            cfg = ModelConfig(**{**meta, "layer_windows": tuple(meta["layer_windows"]),
                                 "eos_token_ids": tuple(meta["eos_token_ids"])})
            if max_workers is not None:  # the same (memory-mapped) read path for every worker count
                from minfer.model.loader import iter_safetensors  # noqa: PLC0415 - loader imports this module

                return cfg, cfg.eos_token_ids, iter_safetensors(cache, max_workers)
            return cfg, cfg.eos_token_ids, load_file(str(cache / "model.safetensors")).items()
        except Exception:
            pass  # a broken cache is rebuilt, never trusted
    reader = open_gguf(path)
    cfg, eos = gguf_config(reader, path)
    tensors = dict(iter_gguf(reader, cfg))
    if use_cache:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(cache / "model.safetensors.tmp"))
            (cache / "model.safetensors.tmp").replace(cache / "model.safetensors")
            (cache / "minfer_config.json").write_text(json.dumps(asdict(cfg)))
        except OSError:
            pass  # a read-only home only costs the next load its seconds
    return cfg, eos, tensors.items()


def load_gguf_blocks(path: Path) -> tuple[ModelConfig, tuple, Iterator[tuple[str, torch.Tensor]]]:
    """Config, EOS ids and (HF name, tensor) pairs of a GGUF file for `quantization="gguf"`: Q4_0/Q4_1
    Linear weights as their raw blocks (`minfer.quantization.gguf.gguf_tensor`), the rest as float32.
    Not cached: reading the blocks is a copy, not a dequantization."""
    from minfer.quantization.gguf import gguf_tensor

    reader = open_gguf(path)
    cfg, eos = gguf_config(reader, path)
    plus_one = gguf_field(reader, "general.architecture") in NORM_PLUS_ONE

    def tensors():
        for b in iter_gguf_blocks(reader):
            t = gguf_tensor(b, cfg, unpermute_rope)
            if plus_one and b.name.endswith("norm.weight"):  # the same rule as `iter_gguf`: HF stores w
                t = t - 1.0
            yield b.name, t

    return cfg, eos, tensors()
