"""minfer's decoder (minfer/model/llama.py, positions.py, layers.py, loader.py) against Hugging Face.

Small random-initialized models of every supported architecture are saved with `save_pretrained` and loaded
by minfer; prompt logits must equal transformers' within 1e-4 in float32.
"""

import json

import pytest
import torch
import transformers

from minfer.generate import SimpleGenerator
from minfer.model.loader import load_model
from tests.conftest import assert_logits_close

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)

CASES = {
    "llama-gqa-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-mha-untied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-mqa": ("LlamaConfig", dict(num_key_value_heads=1)),
    "llama-linear": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "llama-dynamic": ("LlamaConfig", dict(max_position_embeddings=16,
                                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "llama-yarn": ("LlamaConfig", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                        "original_max_position_embeddings": 16})),
    "llama3-rope": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral-window": ("MistralConfig", dict(sliding_window=8)),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


def make_hf_model(tmp_path, cfg_name, overrides, seed=0):
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases, so a wrong placement cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model


def minfer_logits(path, ids):
    lm = load_model(str(path), dtype="float32", device="cpu")
    gen = SimpleGenerator(lm.model)
    return gen.prefill_logits(ids, gen.new_cache(len(ids))), lm


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    cfg_name, overrides = CASES[case]
    hf = make_hf_model(tmp_path, cfg_name, overrides)
    ids = torch.randint(0, BASE["vocab_size"], (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours, _ = minfer_logits(tmp_path, ids)
    assert_logits_close(ours, ref)


def test_old_style_rope_config_keys(tmp_path):
    """Checkpoints written by transformers 4 use `rope_theta` + `rope_scaling`; both spellings load the same."""
    hf = make_hf_model(tmp_path, "LlamaConfig", CASES["llama-yarn"][1])
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = list(range(3, 27))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours, lm = minfer_logits(tmp_path, ids)
    assert lm.config.rope_scaling["rope_type"] == "yarn"
    assert_logits_close(ours, ref)


def test_sharded_safetensors(tmp_path):
    hf = make_hf_model(tmp_path / "m", "LlamaConfig", {})
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = list(range(5, 20))
    a, _ = minfer_logits(tmp_path / "m", ids)
    b, _ = minfer_logits(tmp_path / "sharded", ids)
    assert torch.equal(a, b)


def test_cached_decode_equals_full_recompute(tmp_path):
    """Logits of decode steps over the KV cache equal a fresh full forward over the same tokens."""
    make_hf_model(tmp_path, "Qwen2Config", {})
    lm = load_model(str(tmp_path), dtype="float32")
    gen = SimpleGenerator(lm.model)
    from minfer.attention import ForwardContext

    ids = list(range(10, 30))
    cache = gen.new_cache(len(ids))
    gen.prefill_logits(ids[:12], cache)
    with torch.inference_mode():
        for p in range(12, len(ids)):
            h = lm.model(torch.tensor([ids[p]]), ForwardContext(cache, positions=torch.tensor([p]), start_pos=p))
            step = lm.model.compute_logits(h)[0]
            full = gen.prefill_logits(ids[:p + 1], gen.new_cache(p + 1))[-1]
            assert_logits_close(step, full)


def test_dtype_auto_and_explicit(tmp_path):
    make_hf_model(tmp_path, "LlamaConfig", {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(tmp_path), dtype="auto", device="cpu").dtype == torch.float32  # half -> fp32 on CPU
    assert load_model(str(tmp_path), dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype="float8")
