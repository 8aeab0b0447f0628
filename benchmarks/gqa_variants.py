"""Article §4-2, "why keep the Q heads": SmolLM2-135M's 9 query / 3 KV heads (GQA) converted to MQA and to a
model with fewer query heads, each scored by perplexity and KV bytes per token (chapter 4).

    python benchmarks/gqa_variants.py [--max-tokens 4096] [--window 512]
                                      [--json assets/benchmarks/gqa_variants.json]

The variants are built from the trained weights with no training (the checkpoint conversions of the GQA paper,
Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints",
arXiv:2305.13245, §2.1, which mean-pools heads and then up-trains; there is no up-training here, so the numbers
are what the conversion alone costs):

- `GQA 9q/3kv`: the model as trained.
- `MHA 9q/9kv`: each KV head repeated for the 3 query heads that share it. The same function, 3x the KV
  bytes: its perplexity must equal GQA's (the check that the conversion code is right).
- `MQA 9q/1kv`: the 3 KV heads mean-pooled into one (k_proj and v_proj rows averaged per head dimension).
- `3q/3kv`: the 3 query heads of each group mean-pooled into one (q_proj rows averaged), and the three
  o_proj column blocks of the group summed (if the three heads attended alike, the layer's output is unchanged).
  The KV heads, and so the KV bytes, are GQA's: fewer query heads save compute in the projections and the
  scores, not KV memory.

Each variant is saved as an HF directory (config with `num_attention_heads`, `num_key_value_heads`, `head_dim`)
and scored by `minfer.eval.perplexity` (float32, windows of --window tokens over the first --max-tokens of the
shipped eval text). KV bytes per token are `minfer.memory.kv_bytes_per_token` of each variant's config, in
bfloat16 (2 bytes; the article's unit) and float32 (this run's).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_hf():
    """SmolLM2-135M-Instruct (the default GGUF, dequantized to float32) as a transformers model + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minfer.model.sources import find_default_gguf

    gguf = find_default_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(model.config, "quantization_config"):  # already dequantized: save a plain copy
        del model.config.quantization_config
    return model, tok


def convert(state: dict, n_layers: int, heads: int, kv_heads: int, d: int, variant: str) -> tuple[dict, int, int]:
    """The variant's state dict (a new dict; tensors shared where unchanged) and its (query heads, KV heads).

    q_proj.weight is [heads * d, hidden], k_proj/v_proj [kv_heads * d, hidden], o_proj [hidden, heads * d];
    query head h reads KV head h // (heads // kv_heads) (the grouping of HF's `repeat_kv`)."""
    group = heads // kv_heads
    out = dict(state)
    for i in range(n_layers):
        p = f"model.layers.{i}.self_attn."
        q, k, v, o = (state[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        hidden = q.shape[1]
        if variant == "GQA 9q/3kv":
            continue
        if variant == "MHA 9q/9kv":
            for n, w in (("k_proj", k), ("v_proj", v)):
                out[p + n + ".weight"] = w.view(kv_heads, 1, d, hidden).expand(kv_heads, group, d, hidden).reshape(-1, hidden)
        elif variant == "MQA 9q/1kv":
            for n, w in (("k_proj", k), ("v_proj", v)):
                out[p + n + ".weight"] = w.view(kv_heads, d, hidden).mean(0)
        elif variant == "3q/3kv":
            out[p + "q_proj.weight"] = q.view(kv_heads, group, d, hidden).mean(1).reshape(kv_heads * d, hidden)
            out[p + "o_proj.weight"] = o.view(o.shape[0], kv_heads, group, d).sum(2).reshape(o.shape[0], kv_heads * d)
        else:
            raise ValueError(f"unknown variant {variant!r}")
    new_heads = kv_heads if variant == "3q/3kv" else heads
    new_kv = {"MHA 9q/9kv": heads, "MQA 9q/1kv": 1}.get(variant, kv_heads)
    return {k: t.contiguous() for k, t in out.items()}, new_heads, new_kv


VARIANTS = ("GQA 9q/3kv", "MHA 9q/9kv", "MQA 9q/1kv", "3q/3kv")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/minfer-gqa-variants")
    ap.add_argument("--json", default=str(ROOT / "assets/benchmarks/gqa_variants.json"))
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from minfer import LLM
    from minfer.eval import perplexity
    from minfer.memory import kv_bytes_per_token

    torch.set_num_threads(args.threads)
    model, tok = load_hf()
    cfg = model.config
    heads, kv_heads, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    state = model.state_dict()
    del model
    result = {"command": f"python benchmarks/gqa_variants.py --max-tokens {args.max_tokens} --window {args.window}",
              "model": "smollm2-135m-instruct (float32)", "text": "minfer/data/eval_python_docs.txt",
              "window": args.window, "max_tokens": args.max_tokens, "machine": platform.machine(),
              "loadavg_start": os.getloadavg(), "source_heads": {"query": heads, "kv": kv_heads, "head_dim": d,
                                                                 "layers": layers}, "rows": []}
    for variant in VARIANTS:
        sd, h, kvh = convert(state, layers, heads, kv_heads, d, variant)
        vcfg = cfg.__class__.from_dict({**cfg.to_dict(), "num_attention_heads": h, "num_key_value_heads": kvh,
                                        "head_dim": d})
        out = Path(args.workdir) / variant.replace(" ", "_").replace("/", "-")
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(vcfg, dtype=torch.float32)
        m.load_state_dict(sd, assign=True)
        m.tie_weights()
        m.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        del m, sd
        gc.collect()
        t = time.perf_counter()
        llm = LLM(model=str(out), dtype="float32", max_model_len=args.window + 1, seed=0)
        res = perplexity(llm, window=args.window, max_tokens=args.max_tokens, use_tqdm=False)
        mcfg = llm.llm_engine.model_config.config  # the engine's own reading of the saved config
        row = {"name": variant, "query_heads": h, "kv_heads": kvh, "head_dim": d, "ppl": res.ppl, "nll": res.nll,
               "num_tokens": res.num_tokens, "kv_bytes_per_token_bf16": kv_bytes_per_token(mcfg, "bfloat16"),
               "kv_bytes_per_token_f32": kv_bytes_per_token(mcfg, "float32"),
               "seconds": time.perf_counter() - t, "loadavg": os.getloadavg()}
        result["rows"].append(row)
        print(f"{variant:12s} q={h} kv={kvh}  ppl {res.ppl:9.3f}  KV {row['kv_bytes_per_token_bf16']} B/token (bf16)",
              flush=True)
        del llm
        gc.collect()
    base = result["rows"][0]
    for row in result["rows"]:
        row["ppl_vs_gqa"] = row["ppl"] / base["ppl"] - 1
        row["kv_bytes_vs_gqa"] = row["kv_bytes_per_token_bf16"] / base["kv_bytes_per_token_bf16"]
    result["loadavg_end"] = os.getloadavg()
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
