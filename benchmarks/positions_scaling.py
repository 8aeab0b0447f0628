"""RoPE scaling past the trained length, measured (article §2: "validate per task"): loss against position.

stories260K (Karpathy's tinyllamas, MIT; trained on 512-token TinyStories contexts) reads a text 4x longer
than it was trained on, under each RoPE setting minfer implements:

    none      the trained frequencies, positions 512..2047 never seen in training
    linear    positions divided by 4 (position interpolation, Chen et al. 2023)
    ntk       NTK-aware: base theta * 4^(d/(d-2)) (bloc97, 2023), no fine-tuning
    dynamic   dynamic NTK: the base grows with the current length (transformers' "dynamic")
    yarn      YaRN, factor 4 over 512 (Peng et al. 2023)

The text is CPython's LICENSE.txt (the PSF License and the licenses it includes; it ships with every Python),
not text the model wrote. It is out of TinyStories' domain, so the absolute loss is high; what the method
changes is how the loss moves past position 512. The loss of token t+1 given tokens 0..t is averaged over
`--segments` windows of the text and over buckets of 64 positions.

    python3 benchmarks/positions_scaling.py        # writes assets/benchmarks/positions_scaling.json (~1 min)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STORIES = ROOT.parent / "shared" / "models" / "stories260K"
TRAINED = 512
FACTOR = 4
METHODS = {
    "none": dict(max_position_embeddings=TRAINED * FACTOR),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": float(FACTOR)}),
    "ntk": dict(max_position_embeddings=TRAINED * FACTOR),  # theta set below from head_dim
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": float(FACTOR)}),
    "yarn": dict(max_position_embeddings=TRAINED * FACTOR,
                 rope_scaling={"rope_type": "yarn", "factor": float(FACTOR), "original_max_position_embeddings": TRAINED}),
}


def license_text() -> tuple[str, str]:
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    return path.read_text(), str(path)


def per_position_loss(model_dir: Path, segments: list[list[int]]) -> torch.Tensor:
    """Mean next-token loss at each position `[L - 1]` over the segments (minfer's simple path)."""
    from minfer.generate import SimpleGenerator
    from minfer.model.loader import load_model

    lm = load_model(str(model_dir), dtype="float32", device="cpu", max_model_len=len(segments[0]))
    gen = SimpleGenerator(lm.model)
    losses = []
    with torch.no_grad():
        for ids in segments:
            logits = gen.prefill_logits(ids, gen.new_cache(len(ids)))
            losses.append(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none"))
    return torch.stack(losses).mean(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "assets" / "benchmarks" / "positions_scaling.json"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from minfer.model.llama2c import llama2c_to_hf

    length = TRAINED * FACTOR
    text, text_path = license_text()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base = llama2c_to_hf(STORIES / "stories260K.bin", Path(tmp) / "base", STORIES / "tok512.model")
        tok = AutoTokenizer.from_pretrained(str(base))
        ids = [1] + tok(text, add_special_tokens=False)["input_ids"]
        stride = (len(ids) - length) // max(args.segments - 1, 1)
        if stride < 0:
            raise SystemExit(f"{text_path}: {len(ids)} tokens, fewer than {length}")
        segments = [([1] + ids[1 + i * stride:][:length - 1]) for i in range(args.segments)]
        cfg0 = json.loads((base / "config.json").read_text())
        head_dim = cfg0["head_dim"]
        results = {}
        for name, edits in METHODS.items():
            d = Path(tmp) / name
            d.mkdir()
            for f in ("model.safetensors", "tokenizer.model", "tokenizer_config.json"):
                (d / f).symlink_to(base / f)
            cfg = {**cfg0, **edits}
            if name == "ntk":
                cfg["rope_theta"] = cfg0["rope_theta"] * FACTOR ** (head_dim / (head_dim - 2))
            (d / "config.json").write_text(json.dumps(cfg))
            loss = per_position_loss(d, segments)
            b = args.bucket
            buckets = loss[: (len(loss) // b) * b].view(-1, b).mean(1)
            results[name] = {"rope": {k: cfg.get(k) for k in ("rope_theta", "rope_scaling", "max_position_embeddings")},
                             "loss_by_bucket": [round(float(x), 4) for x in buckets],
                             "mean_loss_within_trained": round(float(loss[:TRAINED - 1].mean()), 4),
                             "mean_loss_beyond_trained": round(float(loss[TRAINED - 1:].mean()), 4)}
            print(f"{name:8s} loss <512: {results[name]['mean_loss_within_trained']:.3f}   "
                  f">=512: {results[name]['mean_loss_beyond_trained']:.3f}")
    out = {
        "what": "next-token loss against position, stories260K (trained on 512 tokens) read out to 4x, per RoPE setting",
        "command": "python3 benchmarks/positions_scaling.py",
        "model": "stories260K (karpathy/tinyllamas, MIT), converted by minfer.model.llama2c",
        "text": "CPython LICENSE.txt (PSF License Version 2 and the licenses it includes), shipped with Python "
                f"{platform.python_version()}",
        "tokens_in_text": len(ids), "segments": args.segments, "segment_length": length, "bucket": args.bucket,
        "trained_length": TRAINED, "factor": FACTOR, "seconds": round(time.perf_counter() - t0, 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, a shared CPU (numbers are losses, "
                   "not timings, so sharing does not change them)",
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
