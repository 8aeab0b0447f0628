"""Checkpoint tensors -> model parameters: HF directories (config.json + safetensors shards) and GGUF files.

`load_model(name, dtype, device, max_model_len)` resolves the name (`minfer.model.sources`), reads the config
and tensors (`hf_config` + `iter_safetensors`, or `minfer.model.gguf.load_gguf`), builds the architecture's
model class (`minfer.model.registry`) on the target device, and streams the tensors through each parameter's
`weight_loader` (`load_weights`); then each `Linear`'s method repacks its weights once.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from tqdm.auto import tqdm

from minfer.config import DEFAULT_MODEL, MODEL_DTYPES, ModelConfig, torch_dtype
from minfer.memory import physical_memory_bytes
from minfer.model.gguf import load_gguf, load_gguf_blocks
from minfer.model.layers import BuildOptions, LinearMethodBase, default_weight_loader, process_weights_after_loading
from minfer.model.registry import config_from_hf, model_class
from minfer.model.sources import ModelSource, resolve_model
from minfer.parallel.parallel_state import get_parallel_state
from minfer.platform import Platform, default_device, get_platform
from minfer.quantization import get_quantization_method
from minfer.quantization.checkpoint import (
    SAVED_METHODS,
    PrequantizedLinearMethod,
    read_quantization_config,
    unpack_checkpoint,
)

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A loaded model: the module (eval mode), its config, where it came from, its EOS ids and dtype, and the
    platform it was built for (`minfer.platform`: the one a worker runs it with, built once, here)."""

    model: torch.nn.Module
    config: ModelConfig
    source: ModelSource
    eos_token_ids: tuple
    dtype: torch.dtype
    platform: Platform


def read_json(path: Path) -> dict:
    """A JSON object file as a dict. Raises ValueError naming the file if it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # [[[[...]]]] thousands deep: valid JSON, but no config nests like that
        raise ValueError(f"{path}: nested too deeply to be a config (more levels than Python's JSON parser "
                         "takes)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object {{...}}, got {type(data).__name__}")
    return data


def hf_config(path: Path) -> tuple[ModelConfig, tuple]:
    """ModelConfig and EOS ids (generation_config.json first, then config.json) of an HF directory."""
    cfg = config_from_hf(read_json(path / "config.json"), source=str(path / "config.json"))
    eos = cfg.eos_token_ids
    gen = path / "generation_config.json"
    if gen.is_file():
        g = read_json(gen).get("eos_token_id")
        if g is not None:
            eos = tuple(g) if isinstance(g, list) else (g,)
    return cfg, eos


def iter_safetensors(path: Path, max_workers: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from `model.safetensors` or the shards listed in `model.safetensors.index.json`.

    `max_workers` > 1 (vLLM's `--max-parallel-loading-workers`): the tensors are read by a pool of that many
    threads (reading copies out of the memory-mapped file and releases the GIL), still yielded in the file's
    order; at most 2 x max_workers tensors are read ahead, so memory stays bounded. Load-time I/O only.

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
    handles = []
    for fname in files:
        fpath = path / fname
        if not fpath.is_file():
            raise FileNotFoundError(f"{fpath}: shard listed in {index.name} is missing")
        try:
            handles.append(safe_open(str(fpath), framework="pt"))
        except Exception as e:
            raise ValueError(f"{fpath}: corrupt or unreadable safetensors file ({e})") from None
    work = [(f, name) for f in handles for name in f.keys()]
    if not max_workers or max_workers <= 1:
        for f in tqdm(handles, desc="Loading safetensors shards", disable=len(files) < 2):
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="minfer-load") as pool:
        ahead: deque = deque()
        todo = iter(work)
        for f, name in todo:  # keep the pool busy, at most 2 x max_workers tensors read but not yet used
            ahead.append((name, pool.submit(f.get_tensor, name)))
            if len(ahead) >= 2 * max_workers:
                n, fut = ahead.popleft()
                yield n, fut.result()
        while ahead:
            n, fut = ahead.popleft()
            yield n, fut.result()


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], source: str,
                 max_workers: int | None = None) -> None:
    """Copy checkpoint tensors into `model`, each through its parameter's `weight_loader`.

    Names are mapped through the model's `packed_modules_mapping` (checkpoint `q_proj` -> our `qkv_proj`,
    shard 0). A parameter's `weight_loader(param, tensor, shard)` (set by its module or linear method)
    does the copy, in whatever dtype the parameter has (int codes of a quantized weight stay ints);
    parameters without one take `default_weight_loader`. A parameter with `num_shards > 1` must receive
    every shard. Every floating tensor must be finite: a NaN or an infinity in a weight would only show as
    empty or garbage text later (`check_finite`: one sum per tensor, ~3% of the load time).

    `max_workers` > 1 (`--max-parallel-loading-workers`): the check and the copy of each tensor (the work
    that touches its bytes, and for a quantization method the quantizing) run in a pool of that many threads;
    each tensor goes to its own parameter or shard, so the copies do not overlap. Names are mapped, and
    every error is raised, as with one thread.

    Raises:
        ValueError: a checkpoint tensor with no place in the model, one holding NaN or infinite values, a
            shape or dtype mismatch (an integer tensor for a floating parameter, say), a value that overflows
            the model's dtype, or a parameter (or shard) the checkpoint does not provide (names them).
    """
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = model.config.tie_word_embeddings
    remap = getattr(model, "remap_checkpoint", None)
    if remap is not None:
        # A model whose checkpoint names/layouts are not Llama's (GPT-2's transposed Conv1D, BLOOM's per-head
        # interleaved QKV) renames and reshapes its tensors itself and handles its own tied head.
        named_tensors, tied = remap(named_tensors), False
    skip = getattr(model, "skip_checkpoint_tensor", None)  # pipeline parallelism: the other stages' tensors
    loaded: set[str] = set()

    def copy(name: str, ckpt_name: str, tensor: torch.Tensor, shard) -> None:
        check_finite(tensor, f"{source}: checkpoint tensor {ckpt_name!r}")
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"{source}: {name}: {e}") from None

    pool = None
    if max_workers is not None and max_workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="minfer-load")
    pending = []
    for name, tensor in named_tensors:
        ckpt_name = name
        if "rotary_emb.inv_freq" in name:
            continue
        if tied and name == "lm_head.weight":
            continue  # tied checkpoints may repeat the table; the embedding's copy is the one we load
        if tied and name == "model.embed_tokens.weight":
            name = "lm_head.weight"
        if skip is not None and skip(name):
            continue  # another pipeline stage holds this tensor
        shard = None
        for ckpt, (ours, idx) in mapping.items():
            if f".{ckpt}." in name:
                name, shard = name.replace(f".{ckpt}.", f".{ours}."), idx
                break
        if name not in params:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
            raise ValueError(f"{source}: checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if pool is None:
            copy(name, ckpt_name, tensor, shard)
        else:
            pending.append(pool.submit(copy, name, ckpt_name, tensor, shard))
        loaded.add(name if shard is None else f"{name}#{shard}")
    if pool is not None:
        try:
            for fut in pending:  # in order: the first failure is the one a single thread would have raised
                fut.result()
        finally:
            pool.shutdown(cancel_futures=True)
    expected = set()
    for name, param in params.items():
        n = getattr(param, "num_shards", 1)
        expected.update({f"{name}#{i}" for i in range(n)} if n > 1 else {name})
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")


def read_model_config(source: ModelSource) -> ModelConfig:
    """The `ModelConfig` of a resolved model without reading its weights (the parallel executor checks the
    split before any rank loads). Raises ValueError as `hf_config` / `gguf_config`."""
    if source.kind == "gguf":
        from minfer.model.gguf import gguf_config, open_gguf

        return gguf_config(open_gguf(source.path), source.path)[0]
    return hf_config(source.path)[0]


def estimate_model_bytes(cfg: ModelConfig, dtype: torch.dtype, max_positions: int, quantized: bool = False) -> int:
    """A lower bound on the bytes a model of `cfg` allocates: the embedding (and an untied LM head), every
    layer's attention and MLP matrices (two MLP matrices: gated MLPs have three), and a RoPE cos/sin table of
    `max_positions` rows (float32). A quantized model's matrices count at 4 bits a weight, the fewest any method
    of minfer stores. Biases and norms are left out: this is for refusing what cannot fit, not for planning.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    per_layer = attn + 2 * h * cfg.intermediate_size
    matrices = cfg.num_hidden_layers * per_layer + (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)
    table = 2 * max_positions * (hd // 2) * 4 if cfg.position_embedding == "rope" else 0
    return int(cfg.vocab_size * h * elem + matrices * (0.5 if quantized else elem) + table)


def device_memory_bytes(device: torch.device) -> int:
    """All the memory of `device`: the GPU's, or this machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return physical_memory_bytes()


def check_fits_in_memory(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                         quantized: bool = False) -> None:
    """ValueError, before any tensor is made, when `estimate_model_bytes` is more than the device's memory
    (`device_memory_bytes`); the message gives both and the config's sizes. The KV pool is checked against
    the same memory where it is sized (`minfer.kv_cache_plan.determine_num_blocks`)."""
    need, have = estimate_model_bytes(cfg, dtype, max_positions, quantized), device_memory_bytes(device)
    if need > have:
        raise ValueError(
            f"this config needs at least {need / 2**30:.1f} GiB for its weights and position table but the "
            f"{device.type} has {have / 2**30:.1f} GiB (num_hidden_layers={cfg.num_hidden_layers}, hidden_size="
            f"{cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}, "
            f"max positions={max_positions}, {dtype})")


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """Raise ValueError("<what> holds NaN or infinite values ...") if a floating `tensor` is not all finite.
    Integer tensors (a quantized method's codes) have no NaN and pass.

    A NaN or an infinity makes the sum NaN or infinite, so a finite sum proves the tensor finite: one
    reduction, about 20x faster than `isfinite(t).all()`, which allocates a mask (0.4 s for SmolLM2's 135M
    float32 weights on 2 cores, against a 0.7 s load). Only a sum that overflows is looked at element-wise.
    """
    if not tensor.dtype.is_floating_point or bool(torch.isfinite(tensor.sum())):
        return
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{what} holds NaN or infinite values ({bad} of {tensor.numel()}): the checkpoint is "
                         "corrupt or was converted badly")


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """"auto" -> the checkpoint's dtype, except half types on CPU become float32 (CPU half matmuls are slow
    and less exact); names or torch dtypes pass through.

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        try:
            ck = torch_dtype(str(checkpoint_dtype or "float32"))
        except ValueError:
            ck = torch.float32
        return torch.float32 if device.type == "cpu" and ck in (torch.float16, torch.bfloat16) else ck
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return torch_dtype(dtype)


def load_model(name: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
               max_model_len: int | None = None, source: ModelSource | None = None,
               fused_ops: bool | str = "auto", linear_method: LinearMethodBase | None = None,
               quantization: str | None = None, quantization_config: dict | str | None = None,
               max_parallel_loading_workers: int | None = None, kernels: str = "auto",
               enforce_eager: bool = False) -> LoadedModel:
    """Load a model by name (see `minfer.model.sources.resolve_model`) onto `device` in `dtype`.

    The platform (`minfer.platform.get_platform(kernels, device, dtype, enforce_eager)`) is built here, once the
    dtype is known from the checkpoint, and returned with the model (`LoadedModel.platform`): the worker runs
    the model with that same platform.

    Args:
        fused_ops: build RMSNorm, SiLU-and-mul and RoPE as fused kernels, as the platform hands them over
            (`Platform.fused_ops`): "auto" (the default, the worker's too) what it picks (on a CPU with
            kernels="auto" the C++ loops of the CPU wing for a float32 model whose kernels build, else plain
            torch); "triton" (or True) the Triton ones (the Triton backend); "cpu" the C++ loops where they apply
            (float32 on a CPU, kernels="auto"), else plain torch; False plain torch. One default for the engine
            and for any model loaded here, so both compute with the same ops (the loops are batch-invariant: a
            row's result does not depend on the batch; the C++ source says how).
        linear_method: how every Linear stores and multiplies its weight; default the platform's
            (`Platform.linear_method`: the fastest CPU layout, "nn" on a GPU or with kernels="reference").
        kernels, enforce_eager: `EngineArgs.kernels` ("auto" or "reference") and `EngineArgs.enforce_eager`, the
            platform's settings: its choices of the Linear layout, the quantized methods' CPU kernels and the
            fused ops here, of the attention backend, sampler and step runner in the worker.
        quantization, quantization_config: a weight-quantization method of `minfer.quantization` and its
            settings; the layers it keeps in float (the tied LM head) use `linear_method`. "gguf" reads a
            GGUF file's Q4_0/Q4_1 blocks as stored instead of the dequantized float32 cache. A directory whose
            config.json has a `quantization_config` (AWQ / GPTQ, `python -m minfer.quantize`) loads its
            saved codes (`minfer.quantization.checkpoint`); `quantization` may then be None or that method.
        max_parallel_loading_workers: threads reading checkpoint tensors (`iter_safetensors`; a GGUF's float32
            cache too); None or 1: one.

    Returns:
        LoadedModel with the module in eval mode, its config and EOS ids.

    Raises:
        ModelNotFoundError, ValueError, FileNotFoundError: as `resolve_model`, `hf_config`, `load_weights`;
        ValueError when `max_model_len` exceeds what the model was trained for, for a bad quantization
        method or config (a group size that does not divide a layer), "gguf" with a model that is no GGUF, or
        a `fused_ops` or `kernels` value not listed above.
    """
    device = torch.device(device or default_device())
    source = source or resolve_model(name)
    if quantization == "gguf":
        if source.kind != "gguf":
            raise ValueError(f"quantization='gguf' runs a .gguf file's own blocks, but {source.path} is a "
                             f"{source.kind} model: leave quantization unset for a directory that "
                             f"`python -m minfer.quantize` saved (its config.json says how it is quantized), or "
                             f"use int8 or int4 to quantize full-precision weights at load time")
        cfg, eos, tensors = load_gguf_blocks(source.path)
        ckpt_dtype = "float32"
    elif source.kind == "gguf":
        cfg, eos, tensors = load_gguf(source.path, max_workers=max_parallel_loading_workers)
        ckpt_dtype = "float32"
    else:
        cfg, eos = hf_config(source.path)
        tensors = iter_safetensors(source.path, max_parallel_loading_workers)
        ckpt_dtype = cfg.torch_dtype
        saved = read_quantization_config(source.path)
        if saved is not None:  # a directory `python -m minfer.quantize` (or AutoAWQ / AutoGPTQ) wrote
            if quantization not in (None, "none", saved["quant_method"]):
                raise ValueError(f"{source.path} holds {saved['quant_method']} weights (its config.json's "
                                 f"quantization_config); quantization={quantization!r} cannot re-quantize them")
            quantization, saved_tensors = saved["quant_method"], unpack_checkpoint(tensors, saved, str(source.path))
            tensors = saved_tensors
    if quantization in SAVED_METHODS and (source.kind != "hf" or read_quantization_config(source.path) is None):
        raise ValueError(f"quantization={quantization!r} loads a calibrated directory: run `python -m "
                         f"minfer.quantize --model {name} --method {quantization} --out DIR`, then load DIR")
    limit = cfg.max_position_embeddings
    if (cfg.rope_scaling or {}).get("rope_type") in ("linear", "dynamic"):
        limit = int(limit * cfg.rope_scaling.get("factor", 1.0))  # these scalings stretch the trained length
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is longer than the model's limit ({limit} positions: "
            f"max_position_embeddings, times the rope_scaling factor if any); positions beyond it were never "
            "trained. Lower max_model_len, or load a checkpoint whose config extends the context.")
    dtype_ = resolve_dtype(dtype, ckpt_dtype, device)
    platform = get_platform(kernels, device, dtype_, enforce_eager)
    linear_method = linear_method or platform.linear_method()
    if quantization in SAVED_METHODS:
        if quantization_config:
            raise ValueError(f"quantization_config={quantization_config!r}: a saved {quantization} directory "
                             "takes its settings from its config.json")
        linear_method = PrequantizedLinearMethod(quantization, fallback=linear_method,
                                                 **platform.quantization_options())
    elif quantization not in (None, "none"):
        linear_method = get_quantization_method(quantization, quantization_config, fallback=linear_method,
                                                **platform.quantization_options())
    build = BuildOptions(linear_method=linear_method, fused_ops=_fused_ops(platform, fused_ops))
    # Position tables (RoPE's cos/sin) cover the positions the engine will use, max_model_len, not every
    # position the config names: 10^8 of them were a 3.2 GB table under max_model_len=256.
    max_positions = max_model_len or cfg.max_position_embeddings
    check_fits_in_memory(cfg, dtype_, device, max_positions, quantized=quantization not in (None, "none"))
    # Built straight on the device in its dtype (vLLM's `set_default_torch_dtype` + target device): the linear
    # methods' `torch.empty` weights cost no initialization, and each parameter keeps the `weight_loader`
    # attribute its method gave it (moving a module with `.to()` would replace the parameters).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype_)
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg, max_positions=max_positions, build=build)
            if get_parallel_state().world_size > 1:  # this rank's shard of the model (chapter 12)
                from minfer.parallel.apply import parallelize

                parallelize(model)
    except RuntimeError as exc:  # the allocator's own words ("can't allocate memory") name no field
        if "alloc" not in str(exc) and "out of memory" not in str(exc):
            raise
        need = estimate_model_bytes(cfg, dtype_, max_positions) / 2**30
        raise ValueError(f"{source.path}: building the model ran out of memory (at least {need:.1f} GiB for "
                         f"weights and tables; {str(exc).splitlines()[0][:200]})") from None
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, tensors, str(source.path), max_parallel_loading_workers)
    layout = process_weights_after_loading(model)
    logger.info("Linear weight layout: %s", layout)
    model.eval()
    return LoadedModel(model=model, config=cfg, source=source, eos_token_ids=tuple(eos), dtype=dtype_,
                       platform=platform)


def _fused_ops(platform: Platform, setting: bool | str):
    """The fused ops object (`minfer.model.layers.FusedOps`, or None: plain torch) that `platform` hands over for
    `load_model`'s `fused_ops` setting ("cpu": the C++ loops where the platform takes them, else None). Raises
    ValueError for another setting."""
    if setting is False or setting is None:
        return None
    if setting is True:
        setting = "triton"
    if setting not in ("auto", "triton", "cpu"):
        raise ValueError(f"fused_ops must be 'auto', 'triton', 'cpu', True or False, got {setting!r}")
    return platform.fused_ops(setting)
