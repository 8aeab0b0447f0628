"""llama2.c checkpoints (minfer/model/llama2c.py): stories260K converted to an HF directory greedy-decodes what
its README says, in minfer and in transformers alike (skips without ../shared/models/stories260K)."""

import pytest
import torch

from tests.conftest import SHARED, assert_logits_close

STORIES = SHARED / "models" / "stories260K"
pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"{STORIES} is not here")


def test_stories260k_greedy_matches_its_readme_and_transformers(tmp_path):
    import transformers

    from minfer import LLM, SamplingParams
    from minfer.model.llama2c import llama2c_to_hf

    path = llama2c_to_hf(STORIES / "stories260K.bin", tmp_path, STORIES / "tok512.model")
    llm = LLM(model=str(path), max_model_len=512, kv_cache_memory_bytes=1 << 22, device="cpu")
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.text.startswith("Once upon a time, there was a little girl named Lily. She loved to play outside")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = [1] + out.token_ids[:30]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    from minfer.generate import SimpleGenerator

    gen = SimpleGenerator(llm.llm_engine.worker.model)
    assert_logits_close(gen.prefill_logits(ids, gen.new_cache(len(ids))), ref)


def test_truncated_file_is_a_clear_error(tmp_path):
    from minfer.model.llama2c import llama2c_to_hf

    bad = tmp_path / "bad.bin"
    bad.write_bytes((STORIES / "stories260K.bin").read_bytes()[:1000])
    with pytest.raises(ValueError, match="version-0 llama2.c file"):
        llama2c_to_hf(bad, tmp_path / "out")
