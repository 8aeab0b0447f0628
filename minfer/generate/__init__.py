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
from minfer.platform import Platform, get_platform
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
    how the cache stores K/V (`minfer.attention.kv_quant`; "auto" = the model's dtype). `kernels` and
    `enforce_eager` are the engine's (`EngineArgs`): "reference" keeps the torch attention reference and
    runs every step through the model; "auto" takes the platform's cache and its step runner
    (`minfer.platform`), as the engine's worker does. `platform`: the engine worker's (`Worker.platform`), so
    both run the model alike; None: one built here from `kernels` and `enforce_eager`.
    """

    def __init__(self, model: torch.nn.Module, sampler: Sampler | None = None,
                 output_processor: OutputProcessor | None = None, kv_cache_dtype: str = "auto",
                 attention_backend: str = "auto", kernels: str = "auto", enforce_eager: bool = False,
                 platform: Platform | None = None):
        self.model = model
        self.kv_cache_dtype = kv_cache_dtype
        self.cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.platform = platform or get_platform(kernels, self.device, self.dtype, enforce_eager)
        self.attention_backend = attention_backend
        self.step_runner = self.platform.step_runner(model)
        self.sampler = sampler or Sampler()
        self.output_processor = output_processor

    def new_cache(self, max_len: int) -> ContiguousBackend:
        """A contiguous cache of `max_len` tokens, the platform's (`Platform.contiguous_cache`): on a CPU with
        kernels="auto", `CpuContiguousBackend`, whose decode steps attend with the C++ kernel the engine decodes
        with (same ops on both sides of the engine-vs-simple-path tests); else the torch reference."""
        return self.platform.contiguous_cache(self.cfg.num_hidden_layers, max_len, self.cfg.num_key_value_heads,
                                              self.cfg.head_dim, self.kv_cache_dtype, self.attention_backend)

    def run_model(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The hidden states `[T, hidden]` of one step: the platform's step runner where it covers the step,
        else the model (as the engine's `Worker.run_model`)."""
        if self.step_runner is not None:
            hidden = self.step_runner.run(input_ids, ctx)
            if hidden is not None:
                return hidden
        return self.model(input_ids, ctx)

    @torch.inference_mode()
    def prefill_logits(self, prompt_ids: list[int], cache: ContiguousBackend) -> torch.Tensor:
        """Run the whole prompt once; returns logits of every prompt position `[P, vocab]` (float32)."""
        ids = torch.tensor(prompt_ids, device=self.device)
        ctx = ForwardContext(cache, positions=torch.arange(len(prompt_ids), device=self.device), start_pos=0)
        return self.model.compute_logits(self.run_model(ids, ctx))

    def _clock(self) -> float:
        """`time.perf_counter()` after the device's queued work is done: a CUDA kernel launch returns before
        the kernel ends, so without the synchronize a GPU's TTFT would time the launches, not the prefill."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def generate(self, seq: Sequence, on_token=None) -> GenerationTimings:
        """Grow `seq` until it finishes. `on_token(seq)` is called after each new token (streaming)."""
        timings = GenerationTimings(prompt_tokens=seq.num_prompt_tokens)
        cache = self.new_cache(min(seq.max_model_len, seq.num_prompt_tokens + seq.max_tokens))
        t0 = self._clock()
        ids = torch.tensor(seq.prompt_token_ids, device=self.device)
        pos = torch.arange(seq.num_prompt_tokens, device=self.device)
        hidden = self.run_model(ids, ForwardContext(cache, positions=pos, start_pos=0))
        logits = self.model.compute_logits(hidden[-1:])
        timings.prefill_s = self._clock() - t0
        token_buf = torch.empty(1, dtype=torch.long, device=self.device)
        pos_buf = torch.empty(1, dtype=torch.long, device=self.device)
        t0 = self._clock()
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
            hidden = self.run_model(token_buf, ForwardContext(cache, positions=pos_buf, start_pos=p))
            logits = self.model.compute_logits(hidden)
            timings.decode_tokens += 1
        timings.decode_s = self._clock() - t0
        if self.output_processor is not None:
            self.output_processor.free(seq)
        self.sampler.release([seq.seq_id])
        return timings
