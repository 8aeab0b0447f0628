"""Speculative decoding (minfer/spec_decode/, the engine/scheduler/worker hooks) against no speculation.

Tiny random Llamas with a 64-token word-level tokenizer stand in for target and draft, so every test runs in
seconds on a CPU:

- greedy output is token for token the output without speculation, for `ngram` and `draft_model`, in a
  batch with preemption (recompute and swap), prefix caching and chunked prefill, and no block leaks;
- sampled output has the target's distribution: the rejection sampler's emitted tokens against p with a
  chi-square test (small vocabulary), and an engine-level first-token frequency test;
- a quantized draft (int8, int4 of the draft and of the target) keeps greedy output equal to no speculation;
- the n-gram proposer's unit cases, rollback freeing exactly the rejected slots, and bad configs.

    PYTHONPATH=$PWD python -m pytest -q tests/test_spec_decode.py
"""

from __future__ import annotations

import math

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.config import EngineArgs, SpeculativeConfig
from minfer.spec_decode import NgramProposer, SpecDecodeMetrics, rejection_sample
from minfer.spec_decode.rejection import processed_probs

from .conftest import needs_default_model

VOCAB = 64
MIB = 1 << 20


def _save_tiny(path, seed, layers=2, hidden=32, vocab=VOCAB, tokens=None):
    """A random Llama and a word-level tokenizer over `vocab` words, saved as a Hugging Face directory."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than the default init: greedy paths with structure
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    words = tokens or [f"w{i}" for i in range(vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[2]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=words[0], eos_token=words[1],
                                                unk_token=words[2])
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return dict(target=str(_save_tiny(root / "target", 0)), draft=str(_save_tiny(root / "draft", 1, layers=1)),
                other_vocab=str(_save_tiny(root / "v80", 2, layers=1, vocab=80)),
                other_tok=str(_save_tiny(root / "tok", 3, layers=1, tokens=[f"x{i}" for i in range(VOCAB)])))


def _prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (9,), generator=g).tolist()  # a common prefix: prefix-cache hits
    out = []
    for i in range(n):
        base = torch.randint(3, VOCAB, (6 + i,), generator=g).tolist()
        out.append(shared + base * 3 + base[:2])  # repeated spans: prompt lookup finds them
    return out


def _run(model, prompts, params, **kw):
    llm = LLM(model=model, **{"max_model_len": 256, "seed": 0, "attention_backend": "torch", **kw})
    outs = llm.generate(prompts, params)
    eng = llm.llm_engine
    assert eng.all_blocks_free(), "target blocks leaked"
    assert not eng.has_unfinished_requests()
    if "spec_decode" in eng.extensions and hasattr(eng.extensions["spec_decode"].decoder.proposer, "bm"):
        bm = eng.extensions["spec_decode"].decoder.proposer.bm
        assert bm.num_free_blocks == bm.num_total_blocks, "draft blocks leaked"
    return llm, [o.outputs[0].token_ids for o in outs]


GREEDY = [SamplingParams(temperature=0, max_tokens=24 + 3 * i, ignore_eos=True) for i in range(6)]
ENGINE_CONFIGS = {
    "plain": dict(kv_cache_memory_bytes=8 * MIB),
    # 24 blocks of 4 tokens (1 KiB each: 2 layers x K,V x 2 heads x 8 dims x 4 tokens x 4 bytes) for
    # ~ 6 x 60 tokens: sequences are preempted and resumed
    "preempt-recompute": dict(block_size=4, kv_cache_memory_bytes=24 * 1024, max_model_len=96),
    "preempt-swap": dict(block_size=4, kv_cache_memory_bytes=24 * 1024, max_model_len=96, swap_space=0.001),
    "prefix-chunked": dict(kv_cache_memory_bytes=8 * MIB, enable_prefix_caching=True, enable_chunked_prefill=True,
                           max_num_batched_tokens=16, block_size=4, max_num_seqs=3),
}


@pytest.fixture(scope="module")
def reference(models):
    """The engine without speculation; itself checked against chapter 1's one-sequence path."""
    llm, toks = _run(models["target"], _prompts(), GREEDY, kv_cache_memory_bytes=8 * MIB)
    for p, sp, t in zip(_prompts(), GREEDY, toks):
        assert llm.generate_simple(p, sp)[0].outputs[0].token_ids == t
    return toks


@pytest.mark.parametrize("config", sorted(ENGINE_CONFIGS))
@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_is_target"])
def test_greedy_equals_no_speculation(models, reference, method, config):
    spec = {"ngram": dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1),
            "draft_model": dict(method="draft_model", model=models["draft"], num_speculative_tokens=3),
            "draft_is_target": dict(method="draft_model", model=models["target"], num_speculative_tokens=3)}[method]
    llm, got = _run(models["target"], _prompts(), GREEDY, speculative_config=spec, **ENGINE_CONFIGS[config])
    assert got == reference
    st = llm.stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_draft_tokens > 0
    if "preempt" in config:
        assert st.num_preemptions > 0
    if "prefix" in config:
        assert st.prefix_cache_hits > 0
    if method == "draft_is_target":  # the target proposing for itself: every greedy draft is right
        assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens
    else:
        assert st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    assert sum(st.spec_decode_num_accepted_tokens_per_pos) == st.spec_decode_num_accepted_tokens


def test_ngram_proposer_cases():
    p = NgramProposer(4, prompt_lookup_max=3, prompt_lookup_min=2)
    assert p.propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]
    assert p.propose([1, 2, 3, 4, 5, 6]) == []  # no earlier [5, 6] or [6]... with min 2: nothing
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1, 2]  # longest n (3), latest match
    assert p.propose([5, 6, 7, 5, 6, 8, 9, 6, 7]) == [5, 6, 8, 9]  # only [6, 7] (n = 2) matches
    assert p.propose([1, 2, 3, 4, 2, 3], k=1) == [4]
    assert NgramProposer(4, 3, 1).propose([4, 1, 2, 3, 9, 3]) == [9, 3]  # n = 1 allowed
    assert p.propose([7]) == [] and p.propose([]) == []


def test_rollback_frees_exactly_the_rejected_slots(models):
    """One sequence, block size 1: after each step it holds one block per computed token, no more."""
    llm = LLM(model=models["target"], max_model_len=256, seed=0, attention_backend="torch", block_size=1,
              kv_cache_memory_bytes=4 * MIB, speculative_config=dict(method="draft_model", model=models["draft"],
                                                                     num_speculative_tokens=4))
    eng = llm.llm_engine
    eng.add_request("r", _prompts(1)[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seq = eng.requests["r"].seqs[0]
    rejected_any = False
    while eng.has_unfinished_requests():
        before = eng.stats().spec_decode_num_draft_tokens - eng.stats().spec_decode_num_accepted_tokens
        eng.step()
        if seq.is_finished:
            break
        after = eng.stats().spec_decode_num_draft_tokens - eng.stats().spec_decode_num_accepted_tokens
        rejected_any |= after > before
        assert len(seq.block_table) == seq.num_computed_tokens == len(seq) - 1
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks - len(seq.block_table)
    assert rejected_any, "the test needs a step with rejected drafts"
    assert eng.all_blocks_free()


def test_free_tail_counts():
    from minfer.block_manager import BlockManager
    from minfer.sequence import Sequence

    bm = BlockManager(10, 4)
    s = Sequence("a", 0, list(range(5)), SamplingParams(), 100)
    bm.append_slots(s, 5 + 6)  # 11 tokens -> 3 blocks
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    assert bm.free_tail(s, 6) == 1 and len(s.block_table) == 2 and bm.num_free_blocks == 8
    assert bm.free_tail(s, 8) == 0


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (bins with expectation < 5 merged)."""
    from scipy.stats import chisquare

    n = counts.sum().item()
    exp = probs * n
    keep = exp >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)]).double()
    e = torch.cat([exp[keep], exp[~keep].sum().view(1)]).double()
    if e[-1] < 5:  # fold the tail into the largest bin
        obs, e = obs[:-1].clone(), e[:-1].clone()
        obs[e.argmax()] += counts[~keep].sum()
        e[e.argmax()] += exp[~keep].sum()
    return float(chisquare(obs.numpy(), e.numpy() * obs.sum().item() / e.sum().item()).pvalue)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_rejection_sampler_keeps_the_target_distribution(proposer):
    """Each emitted position is distributed as p, whatever q: the first token (p_1), and the second given
    the first (p_2 when it was the accepted draft)."""
    torch.manual_seed(0)
    v, k, trials = 8, 2, 8000
    logits = torch.randn(k + 1, v) * 1.5
    params = SamplingParams(temperature=1.0)
    p = processed_probs(logits, params)
    q = torch.softmax(torch.randn(k, v) * 1.5, dim=-1)
    g = torch.Generator().manual_seed(1)
    first = torch.zeros(v)
    for _ in range(trials):
        if proposer == "draft":
            d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
            out = rejection_sample(logits, d, params, q, g)
        else:
            out = rejection_sample(logits, [3, 5], params, None, g)
        first[out[0]] += 1
    assert _chi_square_p(first, p[0]) > 1e-3
    # The test can fail: the same counts against the draft's q (or the draft token's one-hot) are rejected.
    wrong = q[0] if proposer == "draft" else torch.nn.functional.one_hot(torch.tensor(3), v).float() * 0.5 + p[0] * 0.5
    assert _chi_square_p(first, wrong) < 1e-6


def test_rejection_sampler_greedy_is_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    params = SamplingParams(temperature=0)
    assert rejection_sample(logits, [1, 0], params) == [1, 0, 2]  # all accepted + bonus
    assert rejection_sample(logits, [1, 2], params) == [1, 0]  # second rejected, corrected
    assert rejection_sample(logits, [2, 0], params) == [1]


def test_sampled_engine_output_has_the_target_distribution(models):
    """The first two generated tokens of many seeded requests, with and without speculation (draft model):
    the same distribution by a chi-square two-sample test on the second token (the first is verified
    only at position 0 of a draft)."""
    from scipy.stats import chi2_contingency

    prompt = _prompts(1)[0]
    n = 300
    params = [SamplingParams(temperature=1.5, max_tokens=3, ignore_eos=True, seed=i) for i in range(n)]
    _, base = _run(models["target"], [prompt] * n, params, kv_cache_memory_bytes=32 * MIB)
    llm, spec = _run(models["target"], [prompt] * n, params, kv_cache_memory_bytes=32 * MIB,
                     speculative_config=dict(method="draft_model", model=models["draft"], num_speculative_tokens=2))
    assert llm.stats().spec_decode_num_drafts > 0
    for pos in (1, 2):
        a = torch.bincount(torch.tensor([t[pos] for t in base]), minlength=VOCAB)
        b = torch.bincount(torch.tensor([t[pos] for t in spec]), minlength=VOCAB)
        keep = (a + b) > 0
        table = torch.stack([a[keep], b[keep]]).numpy()
        assert chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("bad, match", [
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=-2), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=2.5), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=65), r"num_speculative_tokens must be an integer in \[1, 64\]"),
    (dict(method="eagle", num_speculative_tokens=2), "method"),
    (dict(num_speculative_tokens=2), "method"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup"),
    (dict(method="draft_model", num_speculative_tokens=2), "needs 'model'"),
    (dict(method="ngram", num_speculative_tokens=2, foo=1), "unknown field"),
    (dict(method="draft_model", model="x", num_speculative_tokens=2, quantization="int3"), "unknown quantization"),
    (dict(method="draft_model", model="x", num_speculative_tokens=2, quantization="bitsandbytes"), "not built"),
    (dict(method="draft_model", model="x", num_speculative_tokens=2, quantization="int4",
          quantization_config={"group_size": 48}), "group_size"),
    (dict(method="draft_model", model="x", num_speculative_tokens=2, quantization="int8",
          quantization_config={"group_size": 32}), "unknown key"),
    (dict(method="draft_model", model="x", num_speculative_tokens=2, quantization_config={"group_size": 32}),
     "without a quantization method"),
    (dict(method="ngram", num_speculative_tokens=2, quantization="int8"), "no model to quantize"),
    ("{not json", "JSON"),
])
def test_bad_speculative_configs(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=bad)


# A quantized draft (vLLM's speculative_config "quantization"): int8 / int4 copies of the draft and of the
# target itself. It proposes from other logits, so the acceptance changes, never the greedy output.
@pytest.mark.parametrize("quant, qcfg", [("int8", None), ("int4", {"group_size": 32}), ("int4", '{"group_size": 32}')])
@pytest.mark.parametrize("draft", ["draft", "target"])
def test_quantized_draft_greedy_equals_no_speculation(models, reference, draft, quant, qcfg):
    from minfer.quantization.base import QuantizedLinearMethod

    spec = dict(method="draft_model", model=models[draft], num_speculative_tokens=3, quantization=quant)
    if qcfg is not None:
        spec["quantization_config"] = qcfg
    llm, got = _run(models["target"], _prompts(), GREEDY, speculative_config=spec, **ENGINE_CONFIGS["plain"])
    assert got == reference
    eng = llm.llm_engine
    draft_methods = [type(m.method) for m in eng.extensions["spec_decode"].decoder.proposer.worker.model.modules() if hasattr(m, "method")]
    assert any(issubclass(t, QuantizedLinearMethod) for t in draft_methods), "the draft was not quantized"
    assert not any(isinstance(m.method, QuantizedLinearMethod) for m in eng.executor.driver_worker.model.modules()
                   if hasattr(m, "method")), "the target must stay unquantized"
    if quant == "int4":
        assert {m.group_size for m in eng.extensions["spec_decode"].decoder.proposer.worker.model.modules() if hasattr(m, "group_size")} \
            == {32}
    st = llm.stats()
    assert st.spec_decode_num_drafts > 0 and 0 < st.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("spec, match", [
    (dict(quantization="gguf"), "gguf"),  # the draft is a Hugging Face directory, no GGUF blocks to run
    (dict(quantization="int4", quantization_config={"group_size": 64}), "does not divide"),  # hidden 32
])
def test_quantized_draft_that_cannot_load_is_refused(models, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=models["target"], max_model_len=256, attention_backend="torch", kv_cache_memory_bytes=MIB,
            speculative_config=dict(method="draft_model", model=models["draft"], num_speculative_tokens=2, **spec))


def test_config_accepts_vllm_json():
    cfg = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 4, 1)


@pytest.mark.parametrize("which, match", [("other_vocab", "vocabulary"), ("other_tok", "another tokenizer")])
def test_draft_with_another_tokenizer_is_refused(models, which, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=models["target"], max_model_len=256, attention_backend="torch", kv_cache_memory_bytes=MIB,
            speculative_config=dict(method="draft_model", model=models[which], num_speculative_tokens=2))


def test_metrics_per_position():
    m = SpecDecodeMetrics()
    m.observe(3, 2)
    m.observe(2, 0)
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (2, 5, 2)
    assert m.num_accepted_tokens_per_pos == [1, 1, 0] and m.num_drafts_per_pos == [2, 2, 1]
    assert math.isclose(m.acceptance_rate, 0.4) and math.isclose(m.mean_accepted_length, 2.0)


def test_server_flag_and_metrics():
    from types import SimpleNamespace

    from minfer.serve.__main__ import build_parser, engine_args_from
    from minfer.serve.metrics import ServerMetrics

    args = build_parser().parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_args_from(args).speculative_config == SpeculativeConfig("ngram", 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_args_from(build_parser().parse_args(["--speculative-config", '{"method": "ngram"}']))
    m = ServerMetrics("m")
    m.update_from_stats(SimpleNamespace(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                                        spec_decode_num_accepted_tokens=7,
                                        spec_decode_num_accepted_tokens_per_pos=(4, 2, 1)))
    body = m.render()[0].decode()
    for line in ('minfer:spec_decode_num_drafts_total{model_name="m"} 4.0',
                 'minfer:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'minfer:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'minfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0'):
        assert line in body, line


def test_benchmark_formula():
    from minfer.bench.spec import alpha_from_round_length, predicted_speedup

    assert predicted_speedup(0.0, 4, 0.0) == 1.0 and predicted_speedup(1.0, 4, 0.0) == 5.0
    assert math.isclose(predicted_speedup(0.5, 2, 0.5), (1 - 0.125) / 0.5 / 2)
    for a in (0.1, 0.5, 0.9):
        assert math.isclose(alpha_from_round_length(predicted_speedup(a, 4, 0.0), 4), a, abs_tol=1e-9)


@needs_default_model
@pytest.mark.slow
def test_quantized_self_draft_on_smollm2_equals_no_speculation():
    """The article's pair: SmolLM2 drafting for itself with int8 weights (float32 target), greedy."""
    prompt = "The capital of France is Paris. The capital of France is"
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM(max_model_len=128, seed=0, kv_cache_memory_bytes=16 * MIB)
    want = base.generate(prompt, sp)[0].outputs[0].token_ids
    spec = LLM(max_model_len=128, seed=0, kv_cache_memory_bytes=16 * MIB,
               speculative_config=dict(method="draft_model", model="smollm2-135m-instruct",
                                       num_speculative_tokens=3, quantization="int8"))
    assert spec.generate(prompt, sp)[0].outputs[0].token_ids == want
    st = spec.stats()
    assert st.spec_decode_num_draft_tokens > 0 and st.spec_decode_num_accepted_tokens > 0
