"""MIG slices and how many model replicas each holds (article §6-5). Computed, not measured: no GPU here.

Multi-Instance GPU (MIG) cuts one A100/H100/H200 into up to 7 GPU instances, each with its own SMs, L2 slices,
memory controllers and DRAM, so one tenant's kernels cannot slow another's. A profile `Ng.Mgb` has N of the
GPU's 7 compute slices and about M GB of its 8 memory slices. The table below is NVIDIA's Multi-Instance GPU
User Guide, "Supported MIG Profiles" (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/
supported-mig-profiles.html): each profile's fraction of memory and of SMs, and how many instances of it one
GPU can hold at once. Media-extension (`+me`) variants are left out (same memory and SMs).

A slice's memory is its fraction of the GPU's memory (the profile's name rounds it). A replica needs its
weights plus the KV cache it is given; like vLLM, only `gpu_memory_utilization` of the slice is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from minfer.config import ModelConfig
from minfer.memory import kv_cache_bytes


@dataclass(frozen=True)
class MigProfile:
    """One MIG profile of one GPU model (NVIDIA MIG User Guide, Supported MIG Profiles)."""

    gpu: str
    name: str                 # e.g. "1g.10gb"
    memory_fraction: Fraction  # of the GPU's memory (eighths)
    sm_fraction: Fraction      # of the GPU's SMs (sevenths)
    max_instances: int         # instances of this profile one GPU holds at once


# (gpu, memory in GB as NVIDIA names it): profiles as (name, memory eighths, SM sevenths, instances).
GPUS_GB = {"A100-40GB": 40, "A100-80GB": 80, "H100-80GB": 80, "H200-141GB": 141}
_SHAPES = [(1, 1, 7), (2, 1, 4), (2, 2, 3), (4, 3, 2), (4, 4, 1), (8, 7, 1)]  # A100/H100/H200 share them
_NAMES = {
    "A100-40GB": ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
    "A100-80GB": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H100-80GB": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H200-141GB": ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
}
MIG_PROFILES = [MigProfile(gpu, name, Fraction(mem, 8), Fraction(sm, 7), inst)
                for gpu, names in _NAMES.items() for name, (mem, sm, inst) in zip(names, _SHAPES)]


def num_parameters(config: ModelConfig) -> int:
    """Parameters of a Llama-architecture `config` (no biases): embeddings, q/k/v/o, gate/up/down, RMSNorms."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size + 2 * h
    embed = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return embed + config.num_hidden_layers * per_layer + h


def _llama(hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, tie_word_embeddings=tied)


# The shapes memory depends on, from each model's public config.json.
MODELS = {
    "SmolLM2-135M": _llama(576, 1536, 30, 9, 3, 64, 49152, True),
    "Llama-2-7B": _llama(4096, 11008, 32, 32, 32, 128, 32000, False),
    "Llama-3.1-70B": _llama(8192, 28672, 80, 64, 8, 128, 128256, False),
}

# Bytes per weight. int8/int4 add one float16 scale per group of 128 weights (minfer's and GPTQ/AWQ's usual
# group size; chapter 5).
WEIGHT_BYTES = {"bfloat16": 2.0, "float16": 2.0, "int8": 1.0 + 2 / 128, "int4": 0.5 + 2 / 128}


def slice_bytes(profile: MigProfile) -> float:
    """Memory of one instance of `profile` (bytes, 1 GB = 1e9 B): its fraction of the GPU's memory."""
    return float(profile.memory_fraction) * GPUS_GB[profile.gpu] * 1e9


def replica_bytes(model: ModelConfig, weight_dtype: str = "bfloat16", kv_tokens: int = 4096,
                  kv_dtype: str = "bfloat16") -> float:
    """Bytes one replica needs: its weights at `weight_dtype` plus a KV cache of `kv_tokens` tokens.

    Raises:
        ValueError: an unknown weight dtype, or a negative kv_tokens.
    """
    if weight_dtype not in WEIGHT_BYTES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; known: {sorted(WEIGHT_BYTES)}")
    if not isinstance(kv_tokens, int) or kv_tokens < 0:
        raise ValueError(f"kv_tokens must be a non-negative integer, got {kv_tokens!r}")
    kv = kv_cache_bytes(model.num_hidden_layers, 1, kv_tokens, model.num_key_value_heads, model.head_dim, kv_dtype)
    return num_parameters(model) * WEIGHT_BYTES[weight_dtype] + kv


def replicas_per_slice(profile: MigProfile, model: ModelConfig, weight_dtype: str = "bfloat16",
                       kv_tokens: int = 4096, kv_dtype: str = "bfloat16",
                       gpu_memory_utilization: float = 0.9) -> int:
    """How many replicas of `model` fit in one instance of `profile` (0: not even one).

    Raises:
        ValueError: gpu_memory_utilization outside (0, 1], or the errors of `replica_bytes`.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    return math.floor(slice_bytes(profile) * gpu_memory_utilization / replica_bytes(model, weight_dtype, kv_tokens,
                                                                                     kv_dtype))


def mig_table(weight_dtypes=("bfloat16", "int4"), kv_tokens: int = 4096, gpu_memory_utilization: float = 0.9,
              gpus=None) -> list[dict]:
    """One row per (GPU, profile): its memory and SM share, instances per GPU, and for each model and weight
    dtype the replicas one instance holds. Computed, not measured."""
    rows = []
    for p in MIG_PROFILES:
        if gpus is not None and p.gpu not in gpus:
            continue
        row = {"gpu": p.gpu, "profile": p.name, "memory_fraction": str(p.memory_fraction),
               "sm_fraction": str(p.sm_fraction), "max_instances": p.max_instances,
               "slice_gb": round(slice_bytes(p) / 1e9, 2)}
        for name, m in MODELS.items():
            for dt in weight_dtypes:
                row[f"{name} {dt}"] = replicas_per_slice(p, m, dt, kv_tokens,
                                                           gpu_memory_utilization=gpu_memory_utilization)
        rows.append(row)
    return rows
