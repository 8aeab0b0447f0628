"""Guided decoding inside speculative decoding (`StructuredOutputManager.truncate_drafts` / `spec_bitmasks`,
the model runner's verifier (`minfer.spec_decode.verifier`), `minfer.step_hooks`, the engine's
`_append_tokens`; chapter 7 §7.5 and chapter 7b): a
guided request speculates, its drafts are verified under the grammar's mask at each draft position
(llguidance's rollback brings the matcher back), and

- greedy guided output is token-for-token the output without speculation, for `ngram` and `draft_model`,
  and drafts were proposed and accepted (so the requests did speculate);
- sampled guided output with speculation is always valid (parses and validates against the schema);
- the masks of a speculating row equal the masks of a fresh matcher advanced by the drafts, the matcher ends
  where it started, and drafts are cut at the first token the grammar refuses;
- no KV block leaks and no matcher is left behind.

    PYTHONPATH=$PWD python -m pytest -q tests/test_spec_decode_guided.py
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.sampling_params import GuidedDecodingParams  # noqa: E402
from minfer.sequence import Sequence  # noqa: E402

from .test_structured_output import ENGINE, PROMPTS, SCHEMA, save_char_tiny  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("specguided")
    return dict(target=save_char_tiny(root / "target"), draft=save_char_tiny(root / "draft", seed=1, layers=1))


@pytest.fixture(scope="module")
def plain(models):
    return LLM(model=models["target"], **ENGINE)


def greedy_json(max_tokens=100):
    return SamplingParams(temperature=0, max_tokens=max_tokens, guided_decoding=GuidedDecodingParams(json=SCHEMA))


# Prompts that already hold a JSON object, so the n-gram proposer finds the output's n-grams in the prompt.
GROUNDED = ['{"name": "ab", "age": 7} ' * 2, '{"name": "xyz", "age": 12, "tags": ["a"]} ' * 2,
            '{"name": "q", "age": 100} ', "hello"]


@pytest.mark.parametrize("spec", [NGRAM, "draft_model"], ids=["ngram", "draft_model"])
def test_greedy_guided_output_equals_no_speculation_and_speculates(models, plain, spec):
    if spec == "draft_model":
        spec = {"method": "draft_model", "model": models["target"], "num_speculative_tokens": 3}
    params = greedy_json()
    want = [o.outputs[0].token_ids for o in plain.generate(GROUNDED, params)]
    llm = LLM(model=models["target"], **ENGINE, speculative_config=spec)
    got = llm.generate(GROUNDED, params)
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0, stats
    engine = llm.llm_engine
    assert engine.all_blocks_free() and not engine.extension("structured_output").manager.matchers


def test_sampled_guided_output_with_speculation_is_valid(models):
    llm = LLM(model=models["target"], **ENGINE,
              speculative_config={"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 3})
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, guided_decoding=GuidedDecodingParams(json=SCHEMA))
              for s in range(8)]
    outs = llm.generate((GROUNDED + PROMPTS)[:8], params)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert llm.stats().spec_decode_num_draft_tokens > 0
    assert llm.llm_engine.all_blocks_free() and not llm.llm_engine.extension("structured_output").manager.matchers


def test_spec_masks_are_the_matchers_masks_along_the_drafts(plain):
    engine = plain.llm_engine
    so = engine.extension("structured_output").get_manager()
    tok = engine.tokenizer.hf
    seq = Sequence("r", 0, [0], greedy_json(), 256)
    so.add([seq.seq_id], seq.params.guided_decoding)
    try:
        good = tok.encode('{"name": "ab", "age"', add_special_tokens=False)
        bad = tok.encode("}", add_special_tokens=False)  # refused after a key: ": " must follow
        seq.spec_token_ids = good + bad + good[:2]
        before = so.bitmask([seq])
        masks = so.spec_bitmasks([seq])[0]
        assert masks.shape == (len(seq.spec_token_ids) + 1, before.shape[1])
        assert torch.equal(so.bitmask([seq]), before)  # rolled back: the matcher is where it was
        fresh = so.compile(seq.params.guided_decoding)
        for i in range(len(good) + 1):
            ref = torch.full_like(before[0], -1)
            fresh.unsafe_compute_mask_ptr(ref.data_ptr(), ref.numel() * 4)
            assert torch.equal(masks[i], ref), i
            if i < len(good):
                fresh.consume_token(good[i])
        assert torch.equal(masks[len(good) + 1:], masks[len(good)].expand(len(masks) - len(good) - 1, -1))
        so.truncate_drafts([seq])  # greedy: cut at the refused draft
        assert seq.spec_token_ids == good
    finally:
        so.release([seq.seq_id])
