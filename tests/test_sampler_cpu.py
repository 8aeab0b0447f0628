"""The fused CPU sampler (`minfer/cpu/sampler.py`, `minfer/cpu/csrc/sampler_cpu.cpp`, chapter 7
§7.4) against the torch path of `minfer.sampling`: the same argmax for greedy rows (ties, bitmask,
penalties), the same distribution for sampled rows (frequencies of many draws against the torch path's
probabilities, within 5 standard errors: a test that fails for a wrong temperature or filter), the same
logprobs, seeded rows reproducible and independent of the batch, and the engine's greedy output unchanged.

    PYTHONPATH=$PWD python -m pytest -q tests/test_sampler_cpu.py
"""

from __future__ import annotations

import pytest
import torch

from minfer import SamplingParams
from minfer.cpu.sampler import CpuFusedSampler, cpu_sampler_available, fused_sample_cpu
from minfer.sampling import Sampler, apply_min_p, apply_token_bitmask, apply_top_k_top_p
from minfer.sequence import Sequence

from .conftest import needs_default_model

pytestmark = pytest.mark.skipif(not cpu_sampler_available(), reason="the C++ sampler cannot be built here")

V = 12
N = 100_000  # draws per distribution check


def row_probs(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
              bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path's distribution for one row `[1, V]` (what `Sampler._sample` draws from)."""
    if bitmask is not None:
        x = apply_token_bitmask(x, bitmask)
    x = x / temperature
    x = apply_top_k_top_p(x, torch.tensor([top_k]), torch.tensor([top_p]))
    return apply_min_p(x, torch.tensor([min_p])).softmax(-1)[0]


def draw(x: torch.Tensor, temperature, top_k, top_p, min_p, bitmask=None, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = x.expand(n, -1).contiguous()
    full = lambda v, dt=torch.float32: torch.full((n,), v, dtype=dt)  # noqa: E731
    tokens, _ = fused_sample_cpu(xs, full(temperature), full(top_k, torch.int64), full(top_p), full(min_p),
                                 torch.rand(n, generator=g),
                                 None if bitmask is None else bitmask.expand(n, -1).contiguous())
    return torch.bincount(tokens, minlength=x.shape[1]).double() / n


def assert_same_distribution(freq: torch.Tensor, probs: torch.Tensor, n=N):
    probs = probs.double()
    sigma = (probs * (1 - probs) / n).sqrt()
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-4), (freq, probs)


@pytest.fixture
def logits():
    # a spread-out row (no token near 0.8 of the mass), so top-p and min-p cut inside it
    return torch.tensor([[1.0, 0.2, 2.1, -0.5, 1.7, 0.9, -1.5, 1.2, 0.0, 2.0, -3.0, 0.6]])


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, V, 1.0, 0.0), (0.7, V, 1.0, 0.0), (1.6, 5, 1.0, 0.0), (1.0, V, 0.8, 0.0), (1.3, 6, 0.7, 0.0),
    (1.0, V, 1.0, 0.3), (0.9, 8, 0.9, 0.1), (1.0, 1, 1.0, 0.0), (1.0, V, 1e-9, 0.0)])
def test_draws_the_torch_paths_distribution(logits, temperature, top_k, top_p, min_p):
    probs = row_probs(logits, temperature, top_k, top_p, min_p)
    assert_same_distribution(draw(logits, temperature, top_k, top_p, min_p), probs)


def test_the_distribution_check_can_fail(logits):
    """A draw at another temperature or with another top-k is told apart by the same check."""
    with pytest.raises(AssertionError):
        assert_same_distribution(draw(logits, 1.0, V, 1.0, 0.0), row_probs(logits, 0.8, V, 1.0, 0.0))
    with pytest.raises(AssertionError):
        assert_same_distribution(draw(logits, 1.0, 6, 1.0, 0.0), row_probs(logits, 1.0, 5, 1.0, 0.0))


def test_bitmask_is_applied_inside_the_kernel(logits):
    allowed = [0, 3, 4, 7, 11]
    mask = torch.tensor([[sum(1 << t for t in allowed)]], dtype=torch.int32)
    freq = draw(logits, 1.0, 3, 0.95, 0.0, bitmask=mask)
    assert_same_distribution(freq, row_probs(logits, 1.0, 3, 0.95, 0.0, bitmask=mask))
    assert freq[[t for t in range(V) if t not in allowed]].sum() == 0


def test_greedy_is_torch_argmax_with_ties_and_masks():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (64, 49152), generator=g).float()  # many exact ties: the lowest index wins
    x[5] = float("-inf")
    x[5, 777] = 0.0
    b = x.shape[0]
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (b, 49152 // 32), generator=g, dtype=torch.int64).to(torch.int32)
    zeros, ones = torch.zeros(b), torch.ones(b)
    for m in (None, mask):
        tokens, _ = fused_sample_cpu(x, zeros, torch.full((b,), -1), ones, zeros, torch.rand(b, generator=g), m)
        ref = (x if m is None else apply_token_bitmask(x, m)).argmax(-1)
        assert torch.equal(tokens, ref)


def test_logprob_of_the_drawn_token_is_the_raw_log_softmax():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 49152, generator=g) * 5
    b = x.shape[0]
    tokens, lp = fused_sample_cpu(x, torch.full((b,), 0.8), torch.full((b,), 40), torch.full((b,), 0.9),
                                  torch.zeros(b), torch.rand(b, generator=g), raw_logits=x)
    # float32 log-sum-exp over 49,152 terms: the C++ and torch's sums differ in order (and in exp/log by ISA),
    # so a few ulps of the ~1-10 nats logprob, relative
    torch.testing.assert_close(lp, x.log_softmax(-1).gather(1, tokens[:, None])[:, 0], rtol=1e-5, atol=1e-5)


def seq(i, **kw):
    sp = SamplingParams(max_tokens=8, **kw).clone(_eos_token_ids=(0,))
    s = Sequence(f"r{i}", 0, [1, 2, 3], sp, 4096)
    s.output_token_ids = [4, 4, 5]
    return s


def test_sampler_matches_torch_sampler_on_greedy_rows_and_logprobs():
    """A mixed batch: greedy rows (with penalties and a bitmask) get the torch Sampler's tokens; every row
    gets the torch Sampler's logprob dicts for its own chosen token and the same top-n."""
    g = torch.Generator().manual_seed(3)
    vocab = 300
    x = torch.randn(6, vocab, generator=g) * 3
    seqs = [seq(0, temperature=0, logprobs=3), seq(1, temperature=0, repetition_penalty=1.5, logprobs=0),
            seq(2, temperature=0.9, top_k=20, logprobs=2), seq(3, temperature=0, presence_penalty=2.0),
            seq(4, temperature=1.2, top_p=0.8, seed=11), seq(5, temperature=0, logit_bias={7: 9.0})]
    mask = torch.full((6, (vocab + 31) // 32), -1, dtype=torch.int32)
    mask[3, :] = 0
    mask[3, 2] = 0b1011  # row 3 may only say 64, 65 or 67
    fused_tokens, fused_lp, fused_tops = CpuFusedSampler(torch.Generator().manual_seed(0))(x, seqs, mask)
    ref_tokens, _, _ = Sampler(torch.Generator().manual_seed(0))(x, seqs, mask)
    greedy = [0, 1, 3, 5]
    assert fused_tokens[greedy].tolist() == ref_tokens[greedy].tolist()
    assert int(fused_tokens[3]) in (64, 65, 67) and int(fused_tokens[5]) == 7
    logp = x.log_softmax(-1)
    torch.testing.assert_close(fused_lp, logp.gather(1, fused_tokens[:, None])[:, 0], rtol=0, atol=1e-5)
    assert set(fused_tops[0]) == set(logp[0].topk(3).indices.tolist()) | {int(fused_tokens[0])}
    assert set(fused_tops[2]) == set(logp[2].topk(2).indices.tolist()) | {int(fused_tokens[2])}
    assert fused_tops[3] == {int(fused_tokens[3]): pytest.approx(float(fused_lp[3]))}


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(4)) * 2

    def run(batch):
        sampler = CpuFusedSampler(torch.Generator().manual_seed(len(batch)))
        return [int(sampler(x[:len(batch)], batch)[0][0]) for _ in range(20)]

    alone = run([seq(0, temperature=1.0, seed=42)])
    mixed = run([seq(0, temperature=1.0, seed=42)] + [seq(i, temperature=1.0) for i in range(1, 5)])
    assert alone == mixed and len(set(alone)) > 1


def test_bad_tensors_are_refused():
    x = torch.randn(2, 10)
    ok = dict(temperature=torch.ones(2), top_k=torch.full((2,), -1), top_p=torch.ones(2), min_p=torch.zeros(2),
              uniform=torch.rand(2))
    with pytest.raises(ValueError, match="logits"):
        fused_sample_cpu(x.double(), **ok)
    with pytest.raises(ValueError, match="top_p"):
        fused_sample_cpu(x, **{**ok, "top_p": torch.ones(3)})
    with pytest.raises(ValueError, match="bitmask"):
        fused_sample_cpu(x, **ok, bitmask=torch.zeros(2, 1, dtype=torch.int64))


@needs_default_model
def test_engine_uses_it_and_greedy_rows_of_mixed_batches_are_unchanged():
    from minfer import LLM

    llm = LLM(max_model_len=512, seed=0, kv_cache_memory_bytes=64 << 20)
    assert isinstance(llm.llm_engine.worker.sampler, CpuFusedSampler)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [llm.generate_simple(p, greedy)[0].outputs[0].token_ids for p in prompts]
    outs = llm.generate(prompts + prompts, [greedy] * 3 + [SamplingParams(temperature=1.0, max_tokens=12)] * 3)
    assert [o.outputs[0].token_ids for o in outs[:3]] == ref
    assert llm.llm_engine.all_blocks_free()
