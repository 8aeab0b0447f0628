"""`--max-parallel-loading-workers` (vLLM's flag): checkpoint tensors read by a thread pool give the same
tensors, in the same order, as one thread; the flag reaches EngineArgs and bad values are refused.

    pytest -q tests/test_parallel_loading.py
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from minfer.config import EngineArgs
from minfer.model.loader import iter_safetensors


def _shards(tmp_path):
    g = torch.Generator().manual_seed(0)
    shards = {"a.safetensors": {f"w{i}": torch.randn(64, 32, generator=g) for i in range(5)},
              "b.safetensors": {f"v{i}": torch.randn(17, generator=g) for i in range(7)}}
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(tmp_path / fname))
        weight_map.update({k: fname for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return shards


@pytest.mark.parametrize("workers", [2, 4, 16])
def test_parallel_reads_equal_sequential(tmp_path, workers):
    _shards(tmp_path)
    seq = list(iter_safetensors(tmp_path))
    par = list(iter_safetensors(tmp_path, max_workers=workers))
    assert [n for n, _ in par] == [n for n, _ in seq] and len(seq) == 12
    for (_, a), (_, b) in zip(seq, par):
        assert torch.equal(a, b)


def test_flag_reaches_engine_args_and_bad_values_refused():
    from minfer.serve.__main__ import build_parser, engine_args_from

    args = engine_args_from(build_parser().parse_args(["--max-parallel-loading-workers", "4"]))
    assert args.max_parallel_loading_workers == 4
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_parallel_loading_workers"):
            EngineArgs(max_parallel_loading_workers=bad)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_parallel_load_model_equals_one_thread(tmp_path, quantization):
    """A tiny random Llama (HF directory, safetensors shards) loaded with 1 and 4 threads: the same weights."""
    import transformers

    from minfer.model.loader import load_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="40KB")  # several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    one = load_model(str(tmp_path), device="cpu", quantization=quantization, max_parallel_loading_workers=1)
    four = load_model(str(tmp_path), device="cpu", quantization=quantization, max_parallel_loading_workers=4)
    a, b = dict(one.model.state_dict()), dict(four.model.state_dict())
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
