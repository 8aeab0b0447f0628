"""minfer/memory.py: the KV cache formula (article §1) against the bytes of tensors minfer really allocates.

No model is loaded: every config here is a tiny `ModelConfig` built by hand, so the file runs in well under
a second.
"""

import os

import pytest
import torch

from minfer import memory
from minfer.attention import ContiguousBackend
from minfer.config import ModelConfig
from minfer.kv_cache import KVCachePool
from minfer.kv_cache_plan import bytes_per_block
from minfer.swap import SwappingKVCachePool


def tiny_config(layers=3, heads=4, kv_heads=2, head_dim=8, hidden=32) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=hidden, intermediate_size=48,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [  # (layers, max_len, kv_heads, head_dim)
    (1, 1, 1, 1),
    (2, 7, 1, 16),
    (3, 33, 2, 8),
    (4, 128, 4, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers,max_len,kv_heads,head_dim", SHAPES)
def test_formula_matches_contiguous_cache_tensors(dtype, layers, max_len, kv_heads, head_dim):
    cache = ContiguousBackend(layers, max_len, kv_heads, head_dim, dtype)
    formula = memory.kv_cache_bytes(layers, 1, max_len, kv_heads, head_dim, dtype)
    assert cache.nbytes == formula
    # The torch dtype and its name give the same answer.
    name = str(dtype).removeprefix("torch.")
    assert memory.kv_cache_bytes(layers, 1, max_len, kv_heads, head_dim, name) == formula


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_is_a_factor(dtype):
    one = memory.kv_cache_bytes(4, 1, 100, 2, 16, dtype)
    # batch sequences of the same length: batch contiguous caches, batch times the bytes.
    caches = [ContiguousBackend(4, 100, 2, 16, dtype) for _ in range(5)]
    assert sum(c.nbytes for c in caches) == memory.kv_cache_bytes(4, 5, 100, 2, 16, dtype) == 5 * one


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_blocks,block_size", [(1, 1), (3, 16), (10, 8), (7, 32)])
def test_pool_bytes_are_its_tokens_through_the_formula(dtype, num_blocks, block_size):
    cfg = tiny_config()
    pool = KVCachePool(cfg, num_blocks, block_size, dtype, torch.device("cpu"))
    tokens = num_blocks * block_size
    expect = memory.kv_cache_bytes(cfg.num_hidden_layers, 1, tokens, cfg.num_key_value_heads, cfg.head_dim, dtype)
    assert pool.nbytes == expect
    assert bytes_per_block(cfg, block_size, dtype) * num_blocks == expect


def test_pool_swap_space_is_not_counted_in_device_bytes():
    cfg = tiny_config()
    pool = SwappingKVCachePool(cfg, 4, 8, torch.float32, torch.device("cpu"), num_cpu_blocks=3)
    assert pool.nbytes == memory.kv_cache_bytes(3, 1, 32, 2, 8, torch.float32)
    cpu = sum(t.numel() * t.element_size() for t in pool.cpu_layers)
    assert cpu == memory.kv_cache_bytes(3, 1, 24, 2, 8, torch.float32)


@pytest.mark.parametrize("dtype,elem", [("float32", 4), ("bfloat16", 2), ("float16", 2), ("int8", 1)])
def test_kv_bytes_per_token_of_a_config(dtype, elem):
    cfg = tiny_config(layers=5, heads=6, kv_heads=3, head_dim=16)
    per_token = memory.kv_bytes_per_token(cfg, dtype)
    assert per_token == 5 * 3 * 16 * 2 * elem
    assert per_token * 123 == memory.kv_cache_bytes(5, 1, 123, 3, 16, dtype)
    if dtype != "int8":
        assert per_token * 10 == ContiguousBackend(5, 10, 3, 16, getattr(torch, dtype)).nbytes


def test_kv_bytes_per_token_default_dtype_is_two_bytes():
    cfg = tiny_config()
    assert memory.kv_bytes_per_token(cfg) == memory.kv_bytes_per_token(cfg, "bfloat16")


@pytest.mark.parametrize("name", sorted(memory.KNOWN_ARCHS))
def test_gqa_savings_follow_the_shapes(name):
    arch = memory.KNOWN_ARCHS[name]
    g = memory.gqa_savings(arch, seq_len=1000, batch=2, dtype="bfloat16")
    assert g["model"] == arch.name
    assert g["saving"] == pytest.approx(arch.num_attention_heads / arch.num_key_value_heads)
    assert g["mha_bytes"] == memory.kv_cache_bytes(arch.num_hidden_layers, 2, 1000, arch.num_attention_heads,
                                                   arch.head_dim, "bfloat16")
    assert g["gqa_bytes"] == memory.kv_cache_bytes(arch.num_hidden_layers, 2, 1000, arch.num_key_value_heads,
                                                   arch.head_dim, "bfloat16")
    assert g["mqa_bytes"] * arch.num_key_value_heads == g["gqa_bytes"]
    assert g["mqa_bytes"] <= g["gqa_bytes"] <= g["mha_bytes"]


def test_known_archs_are_consistent():
    for arch in memory.KNOWN_ARCHS.values():
        assert arch.num_attention_heads % arch.num_key_value_heads == 0
    # Llama-2-7B is plain multi-head attention: GQA saves nothing there.
    assert memory.gqa_savings(memory.KNOWN_ARCHS["Llama-2-7B"])["saving"] == 1


def test_smollm2_entry_matches_a_config_of_that_shape():
    arch = memory.KNOWN_ARCHS["SmolLM2-135M"]
    cfg = tiny_config(layers=arch.num_hidden_layers, heads=arch.num_attention_heads,
                      kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim, hidden=576)
    g = memory.gqa_savings(arch, seq_len=1, batch=1, dtype="float32")
    assert g["gqa_bytes"] == memory.kv_bytes_per_token(cfg, "float32") == 30 * 3 * 64 * 2 * 4


@pytest.mark.parametrize("dtype,expect", [
    (torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2), (torch.int8, 1),
    ("fp32", 4), ("torch.float16", 2), ("BF16", 2), ("fp8", 1), ("int4", 0.5),
])
def test_dtype_bytes(dtype, expect):
    assert memory.dtype_bytes(dtype) == expect


@pytest.mark.parametrize("bad", ["float64x", "nope", "", "int3"])
def test_dtype_bytes_unknown_name(bad):
    with pytest.raises(ValueError, match="unknown dtype"):
        memory.dtype_bytes(bad)
    with pytest.raises(ValueError, match="unknown dtype"):
        memory.kv_cache_bytes(1, 1, 1, 1, 1, bad)


def test_int4_rounds_to_whole_bytes():
    assert memory.kv_cache_bytes(1, 1, 3, 1, 1, "int4") == 3  # 3 * 2 * 0.5


@pytest.mark.parametrize("field", ["num_layers", "batch", "seq_len", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [-1, 2.5, "8", None])
def test_bad_sizes_raise(field, bad):
    args = dict(num_layers=2, batch=1, seq_len=4, num_kv_heads=1, head_dim=8)
    args[field] = bad
    with pytest.raises(ValueError, match=field):
        memory.kv_cache_bytes(**args)


def test_zero_size_is_zero_bytes():
    assert memory.kv_cache_bytes(2, 0, 4, 1, 8) == 0
    assert memory.kv_cache_bytes(2, 1, 0, 1, 8) == 0


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (1 << 20, "1.00 MiB"), (3 * (1 << 30) // 2, "1.50 GiB"), (1 << 40, "1.00 TiB"), (5 * (1 << 50), "5120.00 TiB"),
])
def test_human_bytes(n, text):
    assert memory.human_bytes(n) == text


def test_weight_bytes_counts_tied_weights_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict(dict(emb=emb, head=head))
    assert memory.weight_bytes(model) == 10 * 4 * 4
    model.register_buffer("scale", torch.ones(3, dtype=torch.float16))
    assert memory.weight_bytes(model) == 10 * 4 * 4 + 3 * 2


def _smaps_entry(addr: int) -> dict[str, str]:
    """This process's /proc/self/smaps fields of the mapping holding `addr`."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= addr < hi
            if inside:
                fields["flags"] = line.split()[1]
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _thp_available() -> bool:
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    return os.path.exists("/proc/self/smaps") and os.path.exists(path) and "[never]" not in open(path).read()


@pytest.mark.skipif(not _thp_available(), reason="Linux with transparent huge pages")
def test_a_cpu_pool_is_a_private_mapping_eligible_for_huge_pages():
    """The CPU pool asks for transparent huge pages (lab notes 9b §9b.17): a private mapping (Python's mmap default is
    shared, which THP skips in the kernel's default modes) with MADV_HUGEPAGE set, and still zeroed."""
    from minfer.kv_cache import zeros

    t = zeros((2, 64, 16, 4, 64), torch.float32, torch.device("cpu"))  # 2 MB per K/V half: 4 MB
    assert t.abs().sum().item() == 0
    entry = _smaps_entry(t.data_ptr())
    assert entry["flags"][3] == "p", entry["flags"]  # rw-p: private
    assert "hg" in entry.get("VmFlags", "").split(), entry.get("VmFlags")  # hg: MADV_HUGEPAGE
