"""The tiny RoPE and ALiBi models of chapter 2 (`benchmarks/train_tiny_positions.py`, weights in
`assets/models/tiny-{rope,alibi}-bytes/`): minfer loads them as the Llama and BLOOM checkpoints they are, and
its logits equal transformers' on held-out text, for ALiBi out to 4x the trained 128 positions.

    PYTHONPATH=$PWD python -m pytest -q tests/test_tiny_position_models.py
"""

from pathlib import Path

import pytest
import torch
import transformers

from minfer.generate import SimpleGenerator
from minfer.model.loader import load_model

from .conftest import assert_logits_close

ROOT = Path(__file__).resolve().parents[1]
TEXT = list((ROOT / "minfer" / "data" / "calib_python_docs.txt").read_bytes()[1000:1512])


@pytest.mark.parametrize("kind,arch,length", [("rope", "LlamaForCausalLM", 128), ("alibi", "BloomForCausalLM", 512)])
def test_saved_tiny_models_load_and_equal_transformers(kind, arch, length, tmp_path):
    src = ROOT / "assets" / "models" / f"tiny-{kind}-bytes"
    assert (src / "model.safetensors").stat().st_size < 2_000_000  # small enough to ship in the repository
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    if kind == "alibi":  # BLOOM has no position table: only minfer's length limit is lifted, as --tiny does
        hf.config.seq_length = length
        hf.save_pretrained(tmp_path)
        src = tmp_path
    lm = load_model(str(src), dtype="float32", device="cpu", max_model_len=length)
    ids = TEXT[:length]
    gen = SimpleGenerator(lm.model)
    ours = gen.prefill_logits(ids, gen.new_cache(length))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_logits_close(ours, ref)
    # trained: the next byte of held-out text is far better than chance (ln 256 = 5.5 nats)
    loss = torch.nn.functional.cross_entropy(ours[:-1], torch.tensor(ids[1:]))
    assert loss < 3.0
