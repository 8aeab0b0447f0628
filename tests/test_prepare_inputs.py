"""`ModelRunner.prepare_inputs` on a mixed batch (a prefill chunk, a speculating row, plain decodes): the flat ids,
positions, slots, context lengths and logits rows, with no torch `repeat_interleave` (an OpenMP fork-join of both
cores per call, for a few hundred integers; benchmarks/step_profile.py found it in every served step)."""

import torch

from minfer.model_runner import ModelRunner
from minfer.sampling_params import SamplingParams
from minfer.scheduler import ScheduledBatch
from minfer.sequence import Sequence

BLOCK = 4


def seq(prompt_len: int, outputs: int, computed: int, blocks: list[int], spec: list[int] = ()) -> Sequence:
    s = Sequence("r", 0, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=64), max_model_len=256)
    s.output_token_ids = list(range(500, 500 + outputs))
    s.num_computed_tokens, s.block_table, s.spec_token_ids = computed, list(blocks), list(spec)
    return s


class NoMetadata:
    """An attention backend that builds no metadata (ForwardContext asks it once)."""

    def prepare(self, ctx):
        return "none"


def runner() -> ModelRunner:
    r = ModelRunner()
    r.device, r.block_size, r.kv_groups, r.backend = torch.device("cpu"), BLOCK, None, NoMetadata()
    return r


def test_mixed_batch(monkeypatch):
    def no_omp_region(*a, **k):
        raise AssertionError("prepare_inputs called torch.repeat_interleave")

    monkeypatch.setattr(torch, "repeat_interleave", no_omp_region)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", no_omp_region)
    chunk = seq(10, 0, 4, [7, 8, 9])            # prompt tokens 4..9 this step (a final chunk: it samples)
    partial = seq(12, 0, 0, [3, 4, 5])          # tokens 0..4 of 12: no sample yet
    spec = seq(5, 2, 6, [1, 2, 13], spec=[900, 901])  # last token + 2 drafts: 3 logits rows
    dec = seq(3, 3, 5, [6, 11])                 # one decode at position 5
    batch = ScheduledBatch(seqs=[chunk, partial, spec, dec], num_new_tokens=[6, 5, 3, 1])
    ids, ctx, rows = runner().prepare_inputs(batch)

    assert ids.tolist() == list(range(104, 110)) + list(range(100, 105)) + [501, 900, 901] + [502]
    assert ctx.positions.tolist() == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 6, 7, 8, 5]
    table = {0: [7, 8, 9], 1: [3, 4, 5], 2: [1, 2, 13], 3: [6, 11]}
    rows_of = [0] * 6 + [1] * 5 + [2] * 3 + [3]
    want_slots = [table[r][p // BLOCK] * BLOCK + p % BLOCK for r, p in zip(rows_of, ctx.positions.tolist())]
    assert ctx.slot_mapping.tolist() == want_slots
    assert ctx.context_lens.tolist() == [10, 5, 9, 6]
    assert rows == [0, 2, 3]
    # the chunk's last token (5), the speculating row's three (11, 12, 13), the decode's one (14)
    assert ctx.logits_indices.tolist() == [5, 11, 12, 13, 14]
    assert ctx.num_prefills == 3 and ctx.num_prefill_tokens == 14  # rows with more than one new token
    assert ctx.cu_seqlens_q.tolist() == [0, 6, 11, 14] and ctx.max_seqlen_q == 6
    assert ctx.cu_seqlens_k.tolist() == [0, 10, 15, 24] and ctx.max_seqlen_k == 10
    assert ctx.positions.dtype == ctx.slot_mapping.dtype == ctx.logits_indices.dtype == torch.long


def test_decode_only_batch():
    decs = [seq(3, k + 1, 3 + k, [k, 10 + k]) for k in range(3)]
    ids, ctx, rows = runner().prepare_inputs(ScheduledBatch(seqs=decs, num_new_tokens=[1, 1, 1]))
    assert ids.tolist() == [500, 501, 502] and ctx.positions.tolist() == [3, 4, 5]
    assert ctx.slot_mapping.tolist() == [0 * BLOCK + 3, 11 * BLOCK + 0, 12 * BLOCK + 1]
    assert rows == [0, 1, 2] and ctx.logits_indices.tolist() == [0, 1, 2] and ctx.num_prefills == 0
    assert ctx.max_seqlen_q == 0 and ctx.cu_seqlens_q.tolist() == [0]
