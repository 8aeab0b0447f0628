"""`python -m minfer.quantize`: quantize a model once and save it as a directory `LLM(model=DIR)` loads.

    python -m minfer.quantize --model smollm2-135m-instruct --method awq --group-size 64 --out smollm2-awq
    python -m minfer.quantize --model M --method gptq|int4|int8 [--group-size G] --out DIR

- awq   AWQ (minfer.quantization.awq), saved in AutoAWQ's "gemm" layout, `quant_method: "awq"`
- gptq  GPTQ (minfer.quantization.gptq), saved in AutoGPTQ's v1 layout, `quant_method: "gptq"`; with
        `--desc-act`, act-order (`"desc_act": true` and AutoGPTQ's `g_idx`)
- int4  round to nearest (no calibration), saved in the GPTQ layout (RTN is GPTQ without its error feedback)
- int8  per-channel symmetric INT8 (minfer.quantization.int8), saved as 8-bit GPTQ, group_size -1, sym

The directory holds `model.safetensors` (the packed codes, float16 scales, every other tensor in float32),
`config.json` (the model's config plus `quantization_config`; for a GGUF source it is written from the
GGUF's metadata) and the tokenizer files. The layouts are in `minfer.quantization.formats`; vLLM's `awq`
and `gptq` methods read the same tensors. Calibration (awq, gptq) runs the model layer by layer on the
shipped calibration text (`minfer/data/calib_python_docs.txt`) on the CPU, with a progress bar
(`minfer.quantization.calibrate`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from minfer.config import DEFAULT_MODEL, INT4_GROUP_SIZES
from minfer.quantization import formats
from minfer.quantization.calibrate import QuantizedWeights, calibrate, calibration_samples, load_for_calibration

CLI_METHODS = ("awq", "gptq", "int4", "int8")


def hf_config_dict(cfg) -> dict:
    """A Hugging Face `config.json` dict for a Llama-family `ModelConfig` (a GGUF source has none)."""
    d = {"architectures": [cfg.architecture], "model_type": cfg.architecture.replace("ForCausalLM", "").lower(),
         "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
         "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
         "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
         "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
         "hidden_act": cfg.hidden_act, "attention_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias,
         "bos_token_id": cfg.bos_token_id, "torch_dtype": "float32"}
    if cfg.rope_scaling:
        d["rope_scaling"] = cfg.rope_scaling
    if cfg.eos_token_ids:
        d["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
    return d


def quantize_int8_weights(model) -> QuantizedWeights:
    """minfer's int8 (`quantize_int8`) of every decoder linear, as (codes + 128, scale [out, 1], zp = 128)."""
    from minfer.quantization.calibrate import PARTS
    from minfer.quantization.int8 import quantize_int8

    qw = QuantizedWeights(method="int8", group_size=-1, bits=8)
    for li, layer in enumerate(model.model.layers):
        for name, parts in PARTS.items():
            lin = layer.get_submodule(name)
            q, scale = quantize_int8(lin.weight.data)
            row = 0
            for part, size in zip(parts, lin.output_sizes):
                qw.linears[f"model.layers.{li}.{part}"] = (
                    q[row:row + size].to(torch.int32) + 128, scale[row:row + size].float()[:, None],
                    torch.full((size, 1), 128, dtype=torch.int32))
                row += size
    for name, p in model.named_parameters():
        if not (name.endswith("_proj.weight") and ".layers." in name):
            key = "model.embed_tokens.weight" if model.config.tie_word_embeddings and name == "lm_head.weight" else name
            qw.float_state[key] = p.data.clone()
    return qw


def quantization_config(qw: QuantizedWeights) -> dict:
    """The config.json entry for `qw` (module docstring)."""
    if qw.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": qw.group_size, "zero_point": True,
                "version": "gemm"}
    return {"quant_method": "gptq", "bits": qw.bits, "group_size": qw.group_size, "desc_act": bool(qw.g_idx),
            "sym": qw.bits == 8, "checkpoint_format": "gptq", "minfer_method": qw.method}


def save_quantized(qw: QuantizedWeights, config: dict, tokenizer, out: Path) -> Path:
    """Write `qw` as a directory (module docstring): model.safetensors, config.json, tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.float().contiguous() for name, t in qw.float_state.items()}
    for name, (q, s, zp) in qw.linears.items():
        packed = (formats.pack_awq(q, s, zp) if qw.method == "awq"
                  else formats.pack_gptq(q, s, zp, qw.bits, qw.g_idx.get(name)))
        tensors.update({f"{name}.{k}": v for k, v in packed.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(config, quantization_config=quantization_config(qw), torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.hf.save_pretrained(str(out))
    return out


def _prepare_out(model: str, out: Path, overwrite: bool) -> bool:
    """Check `out` before the (long) load and quantization, and create it; True when this call made it.

    Raises:
        ValueError naming --out: the model's own directory (the source checkpoint would be overwritten), an
            existing file, a directory that already holds a checkpoint (unless `overwrite`), or one that
            cannot be created or written.
    """
    src = Path(model).expanduser()
    if src.exists() and src.resolve() == out.resolve():
        raise ValueError(f"--out {out} is the model's own directory: quantizing there would overwrite the source "
                         "checkpoint; give another directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is an existing file, not a directory")
    if out.is_dir() and not overwrite and ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
        raise ValueError(f"--out {out} already holds a checkpoint (config.json / *.safetensors): give a new or "
                         "empty directory, or --overwrite to replace it")
    existed = out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create or write the directory ({exc.strerror or exc})") from None
    return not existed


def quantize_model(model: str, method: str, group_size: int, out: str | Path, n_samples: int = 32,
                   seq_len: int = 256, use_tqdm: bool = True, calib_text: str | None = None,
                   overwrite: bool = False, **calib_kwargs) -> dict:
    """Load `model`, quantize it with `method` (calibrated on `n_samples` windows of `seq_len` tokens of the
    shipped text, or of `calib_text`), save it to `out`. Returns a summary dict (seconds, sizes,
    AWQ's losses per layer and group).

    Raises:
        ValueError: an unknown method, a group size the int4 op lacks or that does not divide a layer, a
            model that is not Llama-family or already quantized, n_samples or seq_len below 1 or seq_len past
            the model's positions, an `out` refused by `_prepare_out` (nothing is written then).
    """
    if method not in CLI_METHODS:
        raise ValueError(f"unknown method {method!r}: one of {', '.join(CLI_METHODS)}")
    if method != "int8" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"--samples and --seq-len must be at least 1, got {n_samples} and {seq_len}")
    out = Path(out)
    made = _prepare_out(model, out, overwrite)
    try:
        return _quantize_into(model, method, group_size, out, n_samples, seq_len, use_tqdm, calib_text,
                              calib_kwargs)
    except BaseException:
        if made and not any(out.iterdir()):  # leave no empty directory behind a refusal
            out.rmdir()
        raise


def _quantize_into(model, method, group_size, out: Path, n_samples, seq_len, use_tqdm, calib_text,
                   calib_kwargs) -> dict:
    from minfer.model.loader import read_json
    from minfer.model.positions import RotaryEmbedding
    from minfer.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    loaded = load_for_calibration(model)
    if loaded.source.path.resolve() == out.resolve():  # a model name that resolves to the --out directory
        raise ValueError(f"--out {out} is the model's own directory: quantizing there would overwrite the source "
                         "checkpoint; give another directory")
    if loaded.source.kind == "hf":
        qc = read_json(loaded.source.path / "config.json").get("quantization_config")
        if qc:
            raise ValueError(f"--model {model} is already quantized (quantization_config quant_method "
                             f"{qc.get('quant_method')!r}): quantize the original float checkpoint")
    if method in ("awq", "gptq"):  # calibration runs windows of seq_len positions through the model
        rope = next((m for m in loaded.model.modules() if isinstance(m, RotaryEmbedding)), None)
        limit = rope.cos_sin.shape[1] if rope is not None else loaded.config.max_position_embeddings
        if seq_len > limit:
            raise ValueError(f"--seq-len {seq_len} is past the model's {limit} positions")
    tokenizer = load_tokenizer(loaded.source, loaded.eos_token_ids)
    t1 = time.perf_counter()
    if method == "int8":
        qw = quantize_int8_weights(loaded.model)
    else:
        samples = (calibration_samples(tokenizer, n_samples, seq_len, calib_text) if method in ("awq", "gptq")
                   else calibration_samples(tokenizer, 1, 8, calib_text))  # RTN reads no activations
        qw = calibrate(loaded.model, samples, method, group_size, use_tqdm=use_tqdm, **calib_kwargs)
    t2 = time.perf_counter()
    config = (read_json(loaded.source.path / "config.json") if loaded.source.kind == "hf"
              else hf_config_dict(loaded.config))
    config.pop("quantization_config", None)
    save_quantized(qw, config, tokenizer, out)
    return {"model": model, "method": method, "group_size": qw.group_size, "out": str(out),
            "load_s": t1 - t0, "quantize_s": t2 - t1, "calibration_tokens": n_samples * seq_len
            if method in ("awq", "gptq") else 0, "awq_losses": qw.awq_losses}


def _positive_int(text: str) -> int:
    value = int(text)  # argparse turns a ValueError here into "invalid _positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minfer.quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="as LLM(model=...), a Llama-family model")
    p.add_argument("--method", required=True, choices=CLI_METHODS)
    p.add_argument("--group-size", type=int, default=64, help=f"inputs per scale, one of {INT4_GROUP_SIZES} "
                   "(int8: per channel, ignored)")
    p.add_argument("--out", required=True, help="the directory to write (new or empty; not the model's own)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    p.add_argument("--samples", type=_positive_int, default=32, help="calibration windows (awq, gptq)")
    p.add_argument("--seq-len", type=_positive_int, default=256, help="tokens per calibration window")
    p.add_argument("--desc-act", action="store_true", help="gptq: act-order (columns by decreasing Hessian "
                   "diagonal; saved with AutoGPTQ's g_idx)")
    args = p.parse_args(argv)
    if args.desc_act and args.method != "gptq":
        p.error("--desc-act is for --method gptq")
    try:
        extra = {"desc_act": True} if args.desc_act else {}
        summary = quantize_model(args.model, args.method, args.group_size, args.out, args.samples, args.seq_len,
                                 overwrite=args.overwrite, **extra)
    except ValueError as e:
        p.print_usage(sys.stderr)  # argparse's form, and its exit status 2
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary['out']} ({args.method}, group size {summary['group_size']}) in "
          f"{summary['quantize_s']:.1f} s; load it with LLM(model={summary['out']!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
