"""The pieces beside the model files: the Llama family's config adapter (minfer/model/llama_config.py) and the
GELU feed-forward and HF activations of GPT-2, BLOOM and Gemma 3 (minfer/model/gelu_mlp.py).

    pytest tests/test_model_configs.py
"""

import pytest
import torch
import torch.nn.functional as F

from minfer.model.gelu_mlp import GeluMLP, activation
from minfer.model.llama_config import llama_config
from minfer.model.registry import ARCHITECTURES

BASE = {"num_attention_heads": 4, "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
        "vocab_size": 100}


def test_llama_config_reads_the_family_traits_and_defaults():
    cfg = llama_config({**BASE, "num_key_value_heads": 2}, ARCHITECTURES["LlamaForCausalLM"])
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.qkv_bias, cfg.rope_theta) == (8, 2, False, 10000.0)
    qwen2 = llama_config({**BASE, "sliding_window": 16}, ARCHITECTURES["Qwen2ForCausalLM"])
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.layer_windows == (None, None)  # window is opt-in
    scaled = llama_config({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}}, ARCHITECTURES["LlamaForCausalLM"])
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("change, needle", [({"vocab_size": None}, "missing required field 'vocab_size'"),
                                            ({"hidden_size": 0}, "hidden_size must be a positive integer"),
                                            ({"alibi": True}, "ALiBi and RoPE")])
def test_llama_config_refuses_what_it_cannot_build(change, needle):
    d = {**BASE, **change}
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(ValueError, match=needle):
        llama_config(d, ARCHITECTURES["LlamaForCausalLM"], source="cfg.json")


def test_activation_names_and_an_unknown_one():
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(activation("gelu_new")(x), F.gelu(x, approximate="tanh"))
    assert torch.equal(activation("gelu")(x), F.gelu(x))
    with pytest.raises(ValueError, match="activation 'swish9' is not supported"):
        activation("swish9")


def test_gelu_mlp_is_down_of_act_of_up():
    torch.manual_seed(0)
    mlp = GeluMLP(8, 16, "gelu_new", ("c_fc", "c_proj"))
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(3, 8)
    want = F.linear(F.gelu(F.linear(x, mlp.c_fc.weight, mlp.c_fc.bias), approximate="tanh"),
                    mlp.c_proj.weight, mlp.c_proj.bias)
    torch.testing.assert_close(mlp(x), want)
