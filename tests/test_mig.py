"""MIG slice arithmetic (chapter 12c, article §6-5): computed, not measured, so checked against independent
sources: transformers' own Llama for the parameter counts, NVIDIA's profile names for the slice sizes."""

import math
import re

import pytest
import torch

from minfer.memory import kv_cache_bytes
from minfer.parallel.mig import (
    GPUS_GB,
    MIG_PROFILES,
    MODELS,
    WEIGHT_BYTES,
    mig_table,
    num_parameters,
    replica_bytes,
    replicas_per_slice,
    slice_bytes,
)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameter_count_equals_transformers_llama(name):
    transformers = pytest.importorskip("transformers")
    m = MODELS[name]
    cfg = transformers.LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                                   num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                                   num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
                                   vocab_size=m.vocab_size, tie_word_embeddings=m.tie_word_embeddings)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert num_parameters(m) == sum(p.numel() for p in model.parameters())


def test_smollm2_count_equals_the_shipped_model():
    """The SmolLM2 row is the model minfer ships: same parameter count as the loaded weights."""
    from minfer import LLM

    llm = LLM(dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20)
    model = llm.llm_engine.worker.model
    seen, n = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel()
    assert num_parameters(MODELS["SmolLM2-135M"]) == n


def test_profiles_match_their_names_and_fill_the_gpu():
    for p in MIG_PROFILES:
        g, gb = map(int, re.fullmatch(r"(\d)g\.(\d+)gb", p.name).groups())
        assert p.sm_fraction * 7 == g                               # "Ng": N of 7 compute slices
        assert abs(slice_bytes(p) / 1e9 - gb) <= 0.6 + 0.01 * gb      # the name rounds the memory share
        # an instance's share of memory and SMs times the instances a GPU holds never exceeds the GPU
        assert p.max_instances * p.memory_fraction <= 1 and p.max_instances * p.sm_fraction <= 1
    assert {p.gpu for p in MIG_PROFILES} == set(GPUS_GB)


def test_replicas_per_slice_is_memory_over_need():
    p = next(q for q in MIG_PROFILES if q.gpu == "A100-80GB" and q.name == "1g.10gb")
    m = MODELS["Llama-2-7B"]
    need = num_parameters(m) * 2 + kv_cache_bytes(32, 1, 4096, 32, 128, "bfloat16")
    assert replica_bytes(m, "bfloat16", 4096) == need
    assert replicas_per_slice(p, m, "bfloat16") == math.floor(10e9 * 0.9 / need) == 0  # 7B bf16: no 1g.10gb
    assert replicas_per_slice(p, m, "int4") == 1                                      # int4 fits
    seventy = MODELS["Llama-3.1-70B"]
    h200 = {q.name: q for q in MIG_PROFILES if q.gpu == "H200-141GB"}
    assert replicas_per_slice(h200["7g.141gb"], seventy, "bfloat16") == 0   # 141 GB of bf16 weights alone
    assert replicas_per_slice(h200["3g.71gb"], seventy, "int4") == 1
    assert WEIGHT_BYTES["int4"] < WEIGHT_BYTES["int8"] < WEIGHT_BYTES["bfloat16"]


def test_table_and_errors():
    rows = mig_table(gpus=["H100-80GB"])
    assert [r["profile"] for r in rows] == ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    assert all(r["SmolLM2-135M bfloat16"] >= 1 for r in rows)
    p = MIG_PROFILES[0]
    with pytest.raises(ValueError, match="unknown weight dtype"):
        replicas_per_slice(p, MODELS["SmolLM2-135M"], "fp3")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        replicas_per_slice(p, MODELS["SmolLM2-135M"], gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_tokens"):
        replica_bytes(MODELS["SmolLM2-135M"], kv_tokens=-1)
