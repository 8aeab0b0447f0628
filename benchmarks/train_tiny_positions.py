"""Train two tiny models that differ only in their positions, RoPE and ALiBi, to measure extrapolation (article §2).

No pretrained ALiBi model is available offline, so ALiBi's claim ("Train Short, Test Long", Press et al., 2022)
is tested on two models trained here on the same text, with the same budget and seed:

    rope    LlamaForCausalLM:  4 layers, hidden 128, 4 heads (head_dim 32), SwiGLU 344, RMSNorm, RoPE base 10,000
    alibi   BloomForCausalLM:  4 layers, hidden 128, 4 heads, GELU 512, LayerNorm, ALiBi slopes 1/4 .. 1/256

Both have ~0.86M parameters (their attention and MLP matrices have the same sizes), tied embeddings, and a
byte-level vocabulary: token id = one UTF-8 byte (256 ids, no special tokens), so no tokenizer file is needed.
They are trained on random 128-token windows of `minfer/data/eval_python_docs.txt` (Python documentation, PSF
License), batch 16, AdamW, cosine learning rate, `--steps` 250 steps (the same windows for both), with
transformers' own modules (training is not what minfer teaches). `minfer/data/calib_python_docs.txt`, other topics
of the same documentation, is held out: `benchmarks/positions_scaling.py --tiny` reads it out to 512 tokens (4x).

The weights are saved in float16 (~1.7 MB a model) under `assets/models/tiny-{rope,alibi}-bytes/` as
Hugging Face directories (config.json + model.safetensors) that `minfer.model.loader.load_model` loads as the
Llama / BLOOM checkpoints they are.

    nice -n 19 python3 benchmarks/train_tiny_positions.py   # both models; 18-20 min each took one core of a loaded shared machine

The saved weights were made with `--kinds rope --threads 1` and `--kinds alibi --threads 1` run side by side
(another thread count sums in another order: the weights would differ in the last bits, the losses would not).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
TRAIN_TEXT = ROOT / "minfer" / "data" / "eval_python_docs.txt"
HELD_OUT_TEXT = ROOT / "minfer" / "data" / "calib_python_docs.txt"
OUT = ROOT / "assets" / "models"
TRAINED = 128  # the training window, tokens


def byte_ids(path: Path) -> torch.Tensor:
    """The text as byte ids `[N]` int64 (the models' whole tokenizer)."""
    return torch.tensor(list(path.read_bytes()), dtype=torch.long)


def build(kind: str):
    """A fresh transformers model of the given kind ("rope" or "alibi"), seeded the same way."""
    from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "rope":
        cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=TRAINED,
                          rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                          pad_token_id=None, attention_dropout=0.0)
        return LlamaForCausalLM(cfg)
    if kind == "alibi":
        cfg = BloomConfig(vocab_size=256, hidden_size=128, n_layer=4, n_head=4, bos_token_id=None,
                          eos_token_id=None, pad_token_id=None, hidden_dropout=0.0, attention_dropout=0.0,
                          seq_length=TRAINED)
        return BloomForCausalLM(cfg)
    raise ValueError(f"unknown kind {kind!r}: rope or alibi")


def train(kind: str, steps: int, batch: int, lr: float) -> dict:
    data = byte_ids(TRAIN_TEXT)
    model = build(kind)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)  # the same windows, in the same order, for both models
    warmup = max(steps // 20, 1)
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        starts = torch.randint(0, len(data) - TRAINED - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + TRAINED + 1] for s in starts.tolist()])
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
        if step % 25 == 0 or step == steps - 1:
            print(f"{kind} step {step:4d} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = OUT / f"tiny-{kind}-bytes"
    model.eval()
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    info = {"kind": kind, "architecture": type(model).__name__, "parameters": n_params, "steps": steps,
            "batch": batch, "train_window": TRAINED, "lr": lr, "seconds": round(time.perf_counter() - t0, 1),
            "final_train_loss_mean_last_20": round(sum(losses[-20:]) / len(losses[-20:]), 4),
            "train_text": TRAIN_TEXT.relative_to(ROOT).as_posix(), "tokenizer": "bytes (token id = UTF-8 byte)",
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, a shared CPU"}
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    print("wrote", out, info, flush=True)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="rope,alibi")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for kind in args.kinds.split(","):
        train(kind, args.steps, args.batch, args.lr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
