"""The model runner (nano-vllm's `ModelRunner`): what one scheduled step does on the device.

    prepare_inputs(batch)   the step's flat input ids and its `ForwardContext`: positions, the slot of each
                            new token, block tables, context lengths, and which rows sample
    run_model(ids, ctx)     the platform's step runner where it covers the step (one-call CPU decode, CUDA
                            graph replay), else the model op by op
    execute_model(batch)    block copies, forward, logits of the sampling rows, sampling: a `ModelRunnerOutput`

`minfer.worker.Worker` is a `ModelRunner` that also loads the model and allocates the KV pool.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from minfer.attention import ForwardContext
from minfer.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    from minfer.scheduler import ScheduledBatch


class ModelRunner:
    """Runs scheduled steps over a loaded model and its KV pool. Its attributes are set by `minfer.worker.Worker`:
    model, device, block_size, pool (`KVCachePool`), backend (`AttentionBackend`), kv_groups, sampler, verifier,
    generator, step_runner, build_time_s (seconds spent turning batches into tensors)."""

    def prepare_inputs(self, batch: "ScheduledBatch") -> tuple[torch.Tensor, ForwardContext, list[int]]:
        """Flat input ids `[num_tokens]` and the ForwardContext of a batch; also which batch rows sample this
        step (those whose prompt is complete). The index arithmetic is vectorized, so the per-step cost does
        not grow with a Python loop over tokens, and done in numpy: it is a few hundred integers, and torch's
        `repeat_interleave` runs even that as an OpenMP region, a fork-join of both cores per call that costs
        a scheduler wake-up whenever the other thread was descheduled (a busy machine; lab notes 9b)."""
        dev = self.device
        seqs, counts = batch.seqs, batch.num_new_tokens
        ids: list[int] = []
        for s, n in zip(seqs, counts):
            a = s.num_computed_tokens
            if n == 1 and s.output_token_ids and a == len(s) - 1:
                ids.append(s.output_token_ids[-1])  # decode: no list concatenation
            elif s.spec_token_ids:  # speculative verification: the last token and the k drafts
                ids.extend(s.all_token_ids[a:] + s.spec_token_ids)
            else:
                ids.extend(s.all_token_ids[a:a + n])
        starts_np = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        n_np = np.asarray(counts, dtype=np.int64)
        cu_np = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(n_np, out=cu_np[1:])
        seq_idx_np = np.repeat(np.arange(len(seqs)), n_np)  # the batch row of each new token
        positions_np = starts_np[seq_idx_np] + np.arange(cu_np[-1]) - cu_np[:-1][seq_idx_np]
        starts, n_t, cu_q = torch.from_numpy(starts_np), torch.from_numpy(n_np), torch.from_numpy(cu_np)
        seq_idx, positions = torch.from_numpy(seq_idx_np), torch.from_numpy(positions_np)
        context_lens = starts + n_t
        if self.kv_groups is None:
            max_blocks = max(len(s.block_table) for s in seqs)
            tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
                                  dtype=torch.int32)
        else:  # several layer groups: [G, B, max_blocks], and slots [G, T] below (the backend splits them)
            tables = self.kv_groups.block_tables(seqs)
        slots = (tables[..., seq_idx, positions // self.block_size].long() * self.block_size
                 + positions % self.block_size)
        num_prefills = sum(1 for n in counts if n > 1)
        n_pt = int(cu_np[num_prefills])
        spec = [len(s.spec_token_ids) for s in seqs]
        sample_rows = [j for j, s in enumerate(seqs) if s.num_computed_tokens + counts[j] == len(s) + spec[j]]
        # A speculating row needs the logits of its last k + 1 positions (verification), others of their last.
        n_logits = np.asarray([1 + spec[j] for j in sample_rows], dtype=np.int64)
        ends = np.repeat(cu_np[1:][sample_rows], n_logits)
        offsets = np.arange(n_logits.sum()) - np.repeat(np.cumsum(n_logits) - n_logits, n_logits)
        logits_indices = torch.from_numpy(ends - np.repeat(n_logits, n_logits) + offsets)
        ctx = ForwardContext(
            attn_backend=self.backend, positions=positions.to(dev), num_prefills=num_prefills,
            num_prefill_tokens=n_pt,
            cu_seqlens_q=cu_q[:num_prefills + 1].to(torch.int32).to(dev),
            cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(context_lens[:num_prefills], 0)]
                                   ).to(torch.int32).to(dev),
            max_seqlen_q=int(n_t[:num_prefills].max()) if num_prefills else 0,
            max_seqlen_k=int(context_lens[:num_prefills].max()) if num_prefills else 0,
            slot_mapping=slots.to(dev), block_tables=tables.to(dev), context_lens=context_lens.to(torch.int32).to(dev),
            logits_indices=logits_indices.to(dev))
        return torch.tensor(ids, dtype=torch.long, device=dev), ctx, sample_rows

    @torch.inference_mode()
    def execute_model(self, batch: "ScheduledBatch") -> ModelRunnerOutput:
        """The block copies the step asks for, the forward, sampling under the rows' token masks (`ModelRunnerOutput`)."""
        rows, logits = self.compute_logits(batch)
        mask = None if batch.token_bitmask is None or not rows else batch.token_bitmask[rows]
        return self._sample(batch, rows, logits, mask, batch.verify_token_bitmasks)

    def _sample(self, batch: "ScheduledBatch", rows: list[int], logits: torch.Tensor | None,
                mask: torch.Tensor | None = None, verify_masks: dict | None = None) -> ModelRunnerOutput:
        """The tokens of a step's sampling `rows` from their logits float32 `[n, V]` (n = len(rows), plus k per
        row carrying k proposed tokens): the sampler, or the `verifier` when a row carries proposed tokens.
        `mask`: the rows' allowed-token bitmask int32 `[len(rows), ceil(V/32)]`; `verify_masks`: {batch row:
        its verification masks}."""
        plp = {s.seq_id: s.prompt_logprobs for s in batch.seqs if s.prompt_logprobs is not None}
        if not rows:
            return ModelRunnerOutput(rows, [], prompt_logprobs=plp)
        seqs = [batch.seqs[j] for j in rows]
        if self.verifier is not None and any(s.spec_token_ids for s in seqs):
            verify_masks = verify_masks or {}
            tokens, chosen, tops = self.verifier(logits, seqs, mask, [verify_masks.get(j) for j in rows])
        else:
            t, c, tp = self.sampler(logits, seqs, mask)
            tokens = [[x] for x in t.tolist()]
            chosen = None if c is None else [[x] for x in c.tolist()]
            tops = None if tp is None else [[x] for x in tp]
        return ModelRunnerOutput(rows, tokens, chosen, tops, plp)

    @torch.inference_mode()
    def compute_logits(self, batch: "ScheduledBatch") -> tuple[list[int], torch.Tensor | None]:
        """The forward without sampling: (batch rows whose prompt is complete, their next-token logits
        float32 `[len(rows), V]`, or None when no row is). Beam search scores these itself.

        Also fills `seq.prompt_logprobs` of the rows that asked for them (vLLM's prompt_logprobs), from the
        hidden states of every prompt position this step computed."""
        self.pool.before_forward(batch)  # block copies the step asks for (copy-on-write, CPU memory)
        t0 = time.perf_counter()
        input_ids, ctx, rows = self.prepare_inputs(batch)
        self.build_time_s += time.perf_counter() - t0
        hidden = self.run_model(input_ids, ctx)
        if any(s.prompt_logprobs is not None for s in batch.seqs):
            self._prompt_logprobs(batch, hidden)
        if not rows:
            return rows, None
        return rows, self.model.compute_logits(hidden[ctx.logits_indices]).float()

    def run_model(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One forward of the step (nano-vllm's `ModelRunner.run_model`): the platform's step runner where it
        covers the step (on a CPU the one-call decode, `minfer.cpu.decode_step`; on CUDA, graph replay), else
        the model, op by op. Returns the hidden states `[T, hidden]`."""
        if self.step_runner is not None:
            hidden = self.step_runner.run(input_ids, ctx)
            if hidden is not None:
                return hidden
        return self.model(input_ids, ctx)

    def _prompt_logprobs(self, batch: "ScheduledBatch", hidden: torch.Tensor) -> None:
        """For each row that wants prompt logprobs, the logprob of prompt token p+1 given tokens 0..p, for the
        prompt positions p of this step's chunk, plus the row's top-k alternatives (one log_softmax over the
        chunk: `[positions, V]`). Entries are written at their index, so a prompt computed again after a
        preemption (recompute) overwrites instead of appending twice."""
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, k = seq.num_computed_tokens, seq.params.prompt_logprobs
            m = min(n, seq.num_prompt_tokens - 1 - start)  # positions whose next token is a prompt token
            if seq.prompt_logprobs is not None and m > 0:
                logp = self.model.compute_logits(hidden[offset:offset + m]).float().log_softmax(dim=-1)
                nxt = torch.tensor(seq.prompt_token_ids[start + 1:start + 1 + m], device=logp.device)
                chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
                entries = [{t: c} for t, c in zip(nxt.tolist(), chosen)]
                if k:
                    vals, ids = logp.topk(k, dim=-1)
                    entries = [{**dict(zip(i, v)), **e} for i, v, e in zip(ids.tolist(), vals.tolist(), entries)]
                del seq.prompt_logprobs[start + 1:]
                seq.prompt_logprobs.extend(entries)
            offset += n

    def release(self, seq_ids: list[int]) -> None:
        """Drop the per-sequence state of retired sequences (their seeded random streams)."""
        if self.sampler is not None:
            self.sampler.release(seq_ids)
