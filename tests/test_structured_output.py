"""Structured output (`SamplingParams(guided_decoding=GuidedDecodingParams(...))`, `minfer/structured_output.py`):

- the batched bitmask equals a plain per-token reference, and masks what it should;
- on a tiny random Llama with a byte-level character tokenizer (so that JSON can be spelled), sampled outputs
  under a JSON schema always parse and validate (jsonschema), regex outputs fullmatch, choices are one of
  the choices, a Lark grammar's output is in its language;
- guided and unguided requests in one batch: the unguided ones are token-for-token what they are alone;
- chunked prefill, recompute preemption (a pool too small for the batch) and an n-gram speculative
  engine give the same guided outputs as the plain engine, and no KV block leaks;
- a bad schema / regex / grammar is a ValueError at add_request and nothing is queued;
- on the real default model: a chat answer under a JSON schema parses and validates.

    PYTHONPATH=$PWD python -m pytest -q tests/test_structured_output.py
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.sampling import apply_token_bitmask  # noqa: E402
from minfer.sampling_params import GuidedDecodingParams  # noqa: E402

from .conftest import needs_default_model  # noqa: E402

CHARS = list('{}[]":,. -_0123456789abcdefghijklmnopqrstuvwxyz') + ['"name"', '"age"', 'true', 'false', 'null',
                                                                  '": ', ', "']
ENGINE = dict(max_model_len=256, seed=0, attention_backend="torch", kv_cache_memory_bytes=1 << 20)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = ["ab", "xyz q", "hello", "j", "no way", "0 1 2"]


def save_char_tiny(path, seed=0, layers=2, hidden=32):
    """A random Llama whose tokenizer is byte-level over single characters (plus a few multi-character
    tokens, as real vocabularies have), saved as a Hugging Face directory."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>"] + [c.replace(" ", "\u0120") for c in CHARS]  # byte-level's space
    vocab = len(words) + (-len(words)) % 8
    words += [f"<extra{i}>" for i in range(vocab - len(words))]
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("", "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(w, special=True) for w in words[:3]])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_char_tiny(tmp_path_factory.mktemp("so") / "m")


@pytest.fixture(scope="module")
def tiny(model):
    return LLM(model=model, **ENGINE)


def _json_params(seed, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, guided_decoding=GuidedDecodingParams(json=SCHEMA),
                          **kw)


# -- the mask -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [64, 70, 96])
def test_bitmask_equals_a_per_token_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g)
    words = (vocab + 31) // 32
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[1] = -1  # an unguided row: everything allowed
    got = apply_token_bitmask(logits, mask)
    ref = logits.clone()
    for b in range(3):
        for t in range(vocab):
            if not (int(mask[b, t // 32]) >> (t % 32)) & 1:
                ref[b, t] = float("-inf")
    assert torch.equal(got, ref)
    assert torch.equal(got[1], logits[1]) and torch.isinf(got[0]).any()


# -- outputs match --------------------------------------------------------------------------------------------
def test_json_schema_outputs_parse_and_validate(tiny):
    outs = tiny.generate(PROMPTS, [_json_params(i) for i in range(len(PROMPTS))])
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert tiny.llm_engine.all_blocks_free() and not tiny.llm_engine.extension("structured_output").manager.matchers


def test_json_object_regex_choice_and_grammar(tiny):
    kinds = [(GuidedDecodingParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
             (GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
             (GuidedDecodingParams(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
             (GuidedDecodingParams(grammar='start: "[" num ("," num)* "]"\nnum: /[0-9]{1,3}/'),
              lambda t: re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", t))]
    for guided, ok in kinds:
        # any JSON object may be long on a random model: room for it
        budget = 240 if guided.json_object else 60
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=budget, guided_decoding=guided) for s in range(4)]
        for o in tiny.generate(PROMPTS[:4], params):
            assert o.outputs[0].finish_reason == "stop" and ok(o.outputs[0].text), (guided, o.outputs[0].text)


def test_n_completions_each_follow_the_grammar(tiny):
    out = tiny.generate(["ab"], _json_params(7, n=3))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_unguided_requests_in_the_batch_are_unaffected(tiny):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS[:3], plain)]
    mixed = tiny.generate(PROMPTS[:3] + PROMPTS[3:], [plain] * 3 + [_json_params(i) for i in range(3)])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for o in mixed[3:]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


# -- the engine's paths ---------------------------------------------------------------------------------------
def _guided_batch():
    return ([p * 6 for p in PROMPTS],
            [SamplingParams(temperature=0, max_tokens=100, guided_decoding=GuidedDecodingParams(json=SCHEMA))] * 3
            + [_json_params(i) for i in range(3)])


@pytest.mark.parametrize("config", [
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    dict(max_model_len=160, kv_cache_memory_bytes=48 * 1024, block_size=4),  # 192 token slots: preemption
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
], ids=["chunked_prefill", "preemption", "ngram_speculation"])
def test_paths_give_the_plain_engines_outputs(model, tiny, config):
    prompts, params = _guided_batch()
    want = [o.outputs[0].token_ids for o in tiny.generate(prompts, params)]
    other = LLM(model=model, **{**ENGINE, **config})
    got = other.generate(prompts, params)
    # Guided requests speculate (tests/test_spec_decode_guided.py): the greedy ones are token-for-token the plain
    # engine's; the seeded sampled ones draw through the rejection sampler, from the same distribution, but not
    # the same tokens.
    same = 3 if "speculative_config" in config else len(params)
    assert [o.outputs[0].token_ids for o in got[:same]] == want[:same]
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    if "kv_cache_memory_bytes" in config:
        assert other.llm_engine.stats().num_preemptions > 0
    assert other.llm_engine.all_blocks_free() and not other.llm_engine.extension("structured_output").manager.matchers


# -- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("guided, match", [
    (dict(json={"type": "foo"}), "invalid guided_decoding json"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="a(b"), "invalid guided_decoding regex"),
    (dict(grammar="start: undefined_rule"), "invalid guided_decoding grammar"),
])
def test_bad_grammars_are_refused_before_queueing(tiny, guided, match):
    engine = tiny.llm_engine
    with pytest.raises(ValueError, match=match):
        engine.add_request(None, "ab", SamplingParams(max_tokens=5, guided_decoding=GuidedDecodingParams(**guided)))
    assert not engine.has_unfinished_requests() and engine.all_blocks_free()


@pytest.mark.parametrize("fields", [{}, dict(json={}, regex="a"), dict(choice=[]), dict(choice=["a", 3])])
def test_guided_decoding_params_need_one_valid_field(fields):
    with pytest.raises(ValueError, match="guided_decoding"):
        GuidedDecodingParams(**fields)


def test_sampling_params_take_a_dict():
    p = SamplingParams(guided_decoding={"regex": "a+"})
    assert isinstance(p.guided_decoding, GuidedDecodingParams) and p.guided_decoding.kind == "regex"
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding="a+")


# -- the real model -------------------------------------------------------------------------------------------
@needs_default_model
def test_real_model_chat_answer_validates(llm):
    real = llm  # conftest's SmolLM2-135M-Instruct engine
    # Bounded: unbounded, the 135M model writes digits until max_tokens ("3221222222...").
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    msgs = [[{"role": "user", "content": f"Describe {c} as JSON with its population."}] for c in ("Paris", "Tokyo")]
    params = [SamplingParams(temperature=0, max_tokens=60, guided_decoding=GuidedDecodingParams(json=schema)),
              SamplingParams(temperature=0.8, seed=1, max_tokens=60, guided_decoding=GuidedDecodingParams(json=schema))]
    for m, p in zip(msgs, params):
        text = real.chat(m, p)[0].outputs[0].text
        jsonschema.validate(json.loads(text), schema)
    yes = real.chat([{"role": "user", "content": "Is Paris in France?"}],
                    SamplingParams(temperature=0, max_tokens=5, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])))
    assert yes[0].outputs[0].text in ("yes", "no")
    assert real.llm_engine.all_blocks_free()


# -- grammars that match nothing ------------------------------------------------------------------------------
@pytest.mark.parametrize("guided", [dict(grammar="start: start"), dict(json={"$ref": "#"}),
                                    dict(regex="[^\\x00-\\x{10FFFF}]")], ids=["grammar", "json", "regex"])
def test_empty_language_is_refused_before_queueing(tiny, guided):
    # compiles, but no output is in the language: refused, not answered "" with "stop"
    engine = tiny.llm_engine
    with pytest.raises(ValueError, match="guided_decoding .*matches no output"):
        engine.add_request(None, "ab", SamplingParams(max_tokens=5, guided_decoding=GuidedDecodingParams(**guided)))
    assert not engine.has_unfinished_requests() and engine.all_blocks_free()


def test_matcher_in_error_aborts_only_its_request(tiny):
    # an object whose required "a" is that object again: starts fine ("{"), then cannot be completed
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = tiny.generate(["j"], plain)[0].outputs[0].token_ids
    outs = tiny.generate(["ab", "xyz", "j"], [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                                             guided_decoding=GuidedDecodingParams(json=schema))
                                              for s in range(2)] + [plain])
    for o in outs[:2]:
        assert o.outputs[0].finish_reason == "abort", o.outputs[0]
    assert outs[2].outputs[0].token_ids == alone and outs[2].outputs[0].finish_reason == "length"
    engine = tiny.llm_engine
    assert engine.all_blocks_free() and not engine.extension("structured_output").manager.matchers


def test_word_level_tokenizer_is_a_clear_error(tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from minfer.structured_output import llg_tokenizer

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # no decoder: llguidance cannot read its bytes
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    with pytest.raises(ValueError, match="tokenizer is not supported for structured output"):
        llg_tokenizer(hf, 8, (1,))
