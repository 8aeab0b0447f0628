"""benchmarks/serve_roofline.py's work count (issue 32): the FLOPs of one request against the weights of a real
minfer Llama layer and a token-by-token sum. Times are not checked (the script measures them; tests never do)."""

from __future__ import annotations

import pathlib

import pytest

from minfer.config import ModelConfig
from tests.benchmark_scripts import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_roofline():
    return load_benchmark("serve_roofline")


def test_flops_per_request_counts_the_real_layer_weights():
    from minfer.model.llama import LlamaForCausalLM

    cfg = ModelConfig("LlamaForCausalLM", 96, 32, 80, 3, 4, 2, 8, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg, max_positions=64)
    # every matmul weight of the decoder layers (norms and the embedding are not matmuls)
    layer_weights = sum(p.numel() for n, p in model.named_parameters()
                        if n.startswith("model.layers.") and p.dim() == 2)
    inp, out = 7, 5
    work = load_roofline().flops_per_request(cfg, inp, out)
    fed = inp + out - 1
    assert work["layers"] == 2 * layer_weights * fed
    q = cfg.num_attention_heads * cfg.head_dim
    assert work["attention"] == sum(4 * q * (p + 1) * cfg.num_hidden_layers for p in range(fed))
    assert work["lm_head"] == 2 * cfg.hidden_size * cfg.vocab_size * out
    assert work["total"] == work["layers"] + work["attention"] + work["lm_head"]


def test_flops_per_request_refuses_empty_requests():
    cfg = ModelConfig("LlamaForCausalLM", 96, 32, 80, 3, 4, 2, 8)
    with pytest.raises(ValueError, match="must be >= 1"):
        load_roofline().flops_per_request(cfg, 0, 4)
