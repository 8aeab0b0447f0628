"""Chapter 1's simple path: prefill the prompt in one forward, then decode one token per step.

    prefill:  logits = model(prompt[0:P])          fills K/V rows 0..P-1, O(P^2) attention, sets TTFT
    decode:   logits = model(token_t) at pos t     writes K/V row t, reads rows 0..t, O(t) per token

This path handles one sequence at a time with a contiguous, preallocated KV cache. The serving engine
(`minfer.engine`) is tested token for token against it.

Command line: `python -m minfer.generate --prompt "..." [--chat] [--model M]` streams text and ends with
prompt and decode tokens per second.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from minfer.model.attention import ContiguousKVCache, ForwardContext
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
    """Generate one sequence at a time: prefill, then a decode loop over a contiguous KV cache."""

    def __init__(self, model: torch.nn.Module, sampler: Sampler | None = None):
        self.model = model
        self.cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.sampler = sampler or Sampler()

    def new_cache(self, max_len: int) -> ContiguousKVCache:
        return ContiguousKVCache(self.cfg.num_hidden_layers, max_len, self.cfg.num_key_value_heads,
                                 self.cfg.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def prefill_logits(self, prompt_ids: list[int], cache: ContiguousKVCache) -> torch.Tensor:
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
        return timings


def main(argv: list[str] | None = None) -> int:
    from minfer.config import DEFAULT_MODEL
    from minfer.llm import LLM
    from minfer.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(prog="python -m minfer.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model alias, directory, .gguf or hub id (default {DEFAULT_MODEL})")
    ap.add_argument("--prompt", default="The capital of France is",
                    help="the prompt text (default: a completion prompt; with --chat, ask a question)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=128, help="most new tokens (default 128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    ap.add_argument("--top-k", type=int, default=-1, help="top-k sampling, -1 = off (default -1)")
    ap.add_argument("--seed", type=int, default=None, help="per-request random seed (default none)")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (default auto)")
    ap.add_argument("--max-model-len", type=int, default=None, help="prompt + output token limit (default: model's)")
    args = ap.parse_args(argv)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len)
        prompt_ids = (llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
                      else llm.tokenizer.encode(args.prompt))
        from minfer.sequence import validate_prompt

        validate_prompt(prompt_ids, params.clone(), llm.llm_engine.max_model_len, llm.llm_engine.hf_config.vocab_size)
        printed = [0]

        def on_token(seq):
            text = seq.visible_text()
            sys.stdout.write(text[printed[0]:])
            sys.stdout.flush()
            printed[0] = len(text)

        if not args.chat:
            sys.stdout.write(args.prompt)
        _, t = llm.generate_simple(prompt_ids, params, on_token=on_token)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    print(f"[prompt: {t.prompt_tokens} tokens, {t.prefill_tps:.1f} tok/s | "
          f"decode: {t.decode_tokens} tokens, {t.decode_tps:.1f} tok/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
