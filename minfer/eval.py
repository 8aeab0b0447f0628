"""Quality measured (article §5): perplexity on a text that ships with minfer, and greedy agreement.

    python -m minfer.eval ppl [--model M] [--quantization int4 --quantization-config '{"group_size": 64}']
                              [--dtype bfloat16] [--max-tokens 20480] [--window 512] [--json out.json]

Perplexity is exp of the mean negative log-likelihood of each token given the ones before it in its window:

    PPL = exp( -1/N  sum_i  log p(x_i | x_<i) )

The text (`minfer/data/eval_python_docs.txt`, the Python 3.11 documentation under the PSF license, see
`minfer/data/README.md`) is tokenized once and cut into non-overlapping windows of `window` tokens; each
window is one prompt, scored by the engine's `SamplingParams(prompt_logprobs=0)` (vLLM's field: the logprob of
every prompt token after the first). So every method is measured through the same engine path that serves
requests (paged KV, chunked prefill, its quantized linears), and N = windows x (window - 1). Windows do not
overlap, so a token sees at most `window - 1` tokens of context; the number depends on the window, and only
numbers measured with the same window and text compare.

`greedy_agreement(llm, prompts, reference)` is the fraction of the first `max_tokens` greedy tokens of each
prompt that equal a reference run's (float32's), counted up to the first difference (after one, the two
texts go on from different prefixes, so later positions do not compare).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

# The shipped texts are shared data (`minfer.config`): calibration (`minfer.quantization`) reads them too.
from minfer.config import SHIPPED_TEXTS as DATA
from minfer.config import load_shipped_text as load_text


def token_windows(ids: list[int], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of `window` tokens over the first `max_tokens` of `ids` (a shorter last one is
    dropped, so every window has the same context length).

    Raises:
        ValueError: window < 2, or fewer than `window` tokens (nothing to score).
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens (one to condition on, one to score), got {window}")
    ids = ids[:max_tokens] if max_tokens else ids
    n = len(ids) // window
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return [ids[i * window:(i + 1) * window] for i in range(n)]


@dataclass
class Perplexity:
    """Result of `perplexity`: `ppl` = exp(`nll`), `nll` the mean negative log-likelihood in nats per token
    over `num_tokens` scored tokens in `num_windows` windows of `window` tokens."""

    ppl: float
    nll: float
    num_tokens: int
    num_windows: int
    window: int


def perplexity(llm, text: str | None = None, window: int = 512, max_tokens: int | None = 20480,
               use_tqdm: bool = True) -> Perplexity:
    """Perplexity of `llm` (a `minfer.LLM`) on `text` (default: the shipped eval text), module docstring.

    Args:
        window: tokens per window (<= the engine's max_model_len).
        max_tokens: use the first this many tokens of the text (None: all of it).
        use_tqdm: a progress bar over the windows.

    Raises:
        ValueError: as `token_windows`, or a window longer than the engine's max_model_len.
    """
    from minfer.sampling_params import SamplingParams

    ids = llm.get_tokenizer().encode(text if text is not None else load_text("eval"), add_special_tokens=False)
    windows = token_windows(ids, window, max_tokens)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=use_tqdm)
    total, count = 0.0, 0
    for w, out in zip(windows, outs):
        for tok, lp in zip(w[1:], out.prompt_logprobs[1:]):
            total -= lp[tok]
            count += 1
    nll = total / count
    return Perplexity(ppl=math.exp(nll), nll=nll, num_tokens=count, num_windows=len(windows), window=window)


def greedy_tokens(llm, prompts: list, max_tokens: int = 64) -> list[list[int]]:
    """The first `max_tokens` greedy tokens of each prompt (EOS ignored, so every run has the same length)."""
    from minfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def greedy_agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of reference positions matched before each prompt's first difference (module docstring).

    Raises:
        ValueError: the two lists have different numbers of prompts.
    """
    if len(tokens) != len(reference):
        raise ValueError(f"{len(tokens)} token lists against {len(reference)} references")
    same = total = 0
    for a, b in zip(tokens, reference):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        same, total = same + n, total + len(b)
    return same / total if total else 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minfer.eval", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("ppl", help="perplexity on the shipped eval text (or --text FILE)")
    pp.add_argument("--model", default=None, help="as LLM(model=...); default: the default model")
    pp.add_argument("--dtype", default="auto")
    pp.add_argument("--quantization", default=None, help="int8, int4, gguf (a saved awq/gptq directory "
                    "needs none: its config.json says)")
    pp.add_argument("--quantization-config", default=None, help='JSON, e.g. \'{"group_size": 64}\'')
    pp.add_argument("--kv-cache-dtype", default=None)
    pp.add_argument("--text", default=None, help="a UTF-8 text file instead of the shipped eval text")
    pp.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    pp.add_argument("--max-tokens", type=int, default=20480, help="tokens of the text to use (default 20480)")
    pp.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)

    from minfer import LLM

    kwargs = {"dtype": args.dtype, "max_model_len": max(args.window, 64) + 1}
    if args.model:
        kwargs["model"] = args.model
    if args.quantization:
        kwargs["quantization"] = args.quantization
    if args.quantization_config:
        kwargs["quantization_config"] = args.quantization_config
    if args.kv_cache_dtype:
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    text = open(args.text, encoding="utf-8").read() if args.text else None
    try:
        llm = LLM(**kwargs)
        res = perplexity(llm, text, window=args.window, max_tokens=args.max_tokens)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {**{k: v for k, v in kwargs.items()}, **asdict(res),
           "text": args.text or f"minfer/data/{DATA['eval']}"}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
