"""`python -m minfer.generate`: stream one completion to the terminal through chapter 1's simple path
(`minfer.generate.SimpleGenerator`), then print prompt and decode tokens per second."""

from __future__ import annotations

import argparse
import sys

from minfer import LLM
from minfer.config import DEFAULT_MODEL
from minfer.sampling_params import SamplingParams
from minfer.sequence import validate_prompt


def main(argv: list[str] | None = None) -> int:
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
        validate_prompt(prompt_ids, params.clone(), llm.llm_engine.max_model_len,
                        llm.llm_engine.model_config.vocab_size)
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
