"""Chapter 1's simple path: prefill the prompt in one forward, then decode one token per step.

    prefill:  logits = model(prompt[0:P])          fills K/V rows 0..P-1, O(P^2) attention, sets TTFT
    decode:   logits = model(token_t) at pos t     writes K/V row t, reads rows 0..t, O(t) per token

This path handles one sequence at a time with a contiguous, preallocated KV cache. The serving engine
(`minfer.engine`) is tested token for token against it.

Command line (`minfer/generate/__main__.py`): `python -m minfer.generate --prompt "..." [--chat] [--model M]`
streams text and ends with prompt and decode tokens per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minfer.attention import ContiguousBackend, ForwardContext
from minfer.detokenizer import OutputProcessor
from minfer.sampling import Sampler
from minfer.sequence import Sequence


@dataclass
class GenerationTimings:
    """Seconds spent in prefill and decode, and token counts, for tokens-per-second reports."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    decode_tokens: int = 0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


class SimpleGenerator:
    """Generate one sequence at a time: prefill, then a decode loop over a contiguous KV cache.

    `output_processor` (a `minfer.detokenizer.OutputProcessor`) detokenizes and applies stop strings; without
    one, sequences get token ids only (no text) and stop on stop token ids and length. `kv_cache_dtype`:
    how the cache stores K/V (`minfer.attention.kv_quant`; "auto" = the model's dtype).
    """

    def __init__(self, model: torch.nn.Module, sampler: Sampler | None = None,
                 output_processor: OutputProcessor | None = None, kv_cache_dtype: str = "auto",
                 attention_backend: str = "auto"):
        self.model = model
        self.kv_cache_dtype = kv_cache_dtype
        self.attention_backend = attention_backend
        self.cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.sampler = sampler or Sampler()
        self.output_processor = output_processor

    def new_cache(self, max_len: int) -> ContiguousBackend:
        """A contiguous cache of `max_len` tokens. A float32 or bfloat16 model on the CPU gets
        `CpuContiguousBackend`: its decode steps attend with the C++ kernel the engine decodes with (same ops on
        both sides of the engine-vs-simple-path tests, and one kernel call per layer); elsewhere, or where the
        kernel does not build (`MINFER_CPU_KERNELS=0`), or with `attention_backend="torch"` (the engine's choice,
        followed here so that both sides attend alike), the torch reference."""
        args = (self.cfg.num_hidden_layers, max_len, self.cfg.num_key_value_heads, self.cfg.head_dim, self.dtype,
                self.device, self.kv_cache_dtype)
        if (self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
                and self.attention_backend != "torch"):
            from minfer.attention.cpu import CpuContiguousBackend, CpuKernelUnavailable

            try:
                return CpuContiguousBackend(*args)
            except CpuKernelUnavailable:
                pass
        return ContiguousBackend(*args)

    @torch.inference_mode()
    def prefill_logits(self, prompt_ids: list[int], cache: ContiguousBackend) -> torch.Tensor:
        """Run the whole prompt once; returns logits of every prompt position `[P, vocab]` (float32)."""
        ids = torch.tensor(prompt_ids, device=self.device)
        ctx = ForwardContext(cache, positions=torch.arange(len(prompt_ids), device=self.device), start_pos=0)
        return self.model.compute_logits(self.model(ids, ctx))

    @torch.inference_mode()
    def generate(self, seq: Sequence, on_token=None) -> GenerationTimings:
        """Grow `seq` until it finishes. `on_token(seq)` is called after each new token (streaming)."""
        timings = GenerationTimings(prompt_tokens=seq.num_prompt_tokens)
        cache = self.new_cache(min(seq.max_model_len, seq.num_prompt_tokens + seq.max_tokens))
        t0 = time.perf_counter()
        ids = torch.tensor(seq.prompt_token_ids, device=self.device)
        pos = torch.arange(seq.num_prompt_tokens, device=self.device)
        hidden = self.model(ids, ForwardContext(cache, positions=pos, start_pos=0))
        logits = self.model.compute_logits(hidden[-1:])
        timings.prefill_s = time.perf_counter() - t0
        token_buf = torch.empty(1, dtype=torch.long, device=self.device)
        pos_buf = torch.empty(1, dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        while True:
            tokens, chosen, tops = self.sampler(logits, [seq])
            seq.append_token(int(tokens[0]), float(chosen[0]) if chosen is not None else 0.0,
                             tops[0] if tops else None)
            if self.output_processor is not None:
                self.output_processor.process(seq)
            if on_token is not None:
                on_token(seq)
            if seq.is_finished:
                break
            p = len(seq) - 1  # position of the token just sampled
            token_buf.copy_(tokens)
            pos_buf.fill_(p)
            hidden = self.model(token_buf, ForwardContext(cache, positions=pos_buf, start_pos=p))
            logits = self.model.compute_logits(hidden)
            timings.decode_tokens += 1
        timings.decode_s = time.perf_counter() - t0
        if self.output_processor is not None:
            self.output_processor.free(seq)
        self.sampler.release([seq.seq_id])
        return timings
