"""llama2.c checkpoints (Karpathy's `run.c` format, e.g. the tinyllamas `stories260K.bin`) -> a Hugging Face
Llama directory that `minfer.model.loader` (and transformers) load.

The legacy version-0 layout: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
max_seq_len; a negative vocab_size means an unshared classifier), then float32 arrays: token embedding,
attention norms, wq, wk, wv, wo, FFN norms, w1 (gate), w2 (down), w3 (up), final norm, two RoPE tables
(skipped: minfer computes its own), then the classifier when unshared. Q/K rows are in the interleaved-pair
RoPE layout; HF rotates halves, so they are reordered with the same permutation as GGUF's
(`minfer.model.gguf.unpermute_rope`).

    llama2c_to_hf(bin_path, out_dir, tokenizer_model) -> out_dir
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from minfer.model.gguf import unpermute_rope


def llama2c_to_hf(bin_path: str | Path, out_dir: str | Path, tokenizer_model: str | Path | None = None,
                  rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5) -> Path:
    """Write `config.json`, `model.safetensors` (and the SentencePiece tokenizer, if given) to `out_dir`.

    Raises:
        ValueError: a file whose size does not match the header's shapes (not a version-0 llama2.c file).
    """
    from safetensors.torch import save_file

    bin_path, out_dir = Path(bin_path), Path(out_dir)
    raw = bin_path.read_bytes()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    head = dim // n_heads
    kv_dim = n_kv * head
    shapes = [("embed", (vocab, dim)), ("rms_att", (n_layers, dim)), ("wq", (n_layers, dim, dim)),
              ("wk", (n_layers, kv_dim, dim)), ("wv", (n_layers, kv_dim, dim)), ("wo", (n_layers, dim, dim)),
              ("rms_ffn", (n_layers, dim)), ("w1", (n_layers, hidden, dim)), ("w2", (n_layers, dim, hidden)),
              ("w3", (n_layers, hidden, dim)), ("rms_final", (dim,)), ("freq", (2, seq_len, head // 2))]
    if not shared:
        shapes.append(("wcls", (vocab, dim)))
    need = 28 + 4 * sum(torch.Size(s).numel() for _, s in shapes)
    if len(raw) != need:
        raise ValueError(f"{bin_path}: {len(raw)} bytes, but a version-0 llama2.c file with this header "
                         f"(dim={dim}, layers={n_layers}, vocab={vocab}) has {need}")
    flat = torch.frombuffer(bytearray(raw[28:]), dtype=torch.float32)
    w, off = {}, 0
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        w[name] = flat[off:off + n].view(shape)
        off += n
    t = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["rms_final"]}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = w["rms_att"][i]
        t[p + "self_attn.q_proj.weight"] = unpermute_rope(w["wq"][i], n_heads)
        t[p + "self_attn.k_proj.weight"] = unpermute_rope(w["wk"][i], n_kv)
        t[p + "self_attn.v_proj.weight"] = w["wv"][i]
        t[p + "self_attn.o_proj.weight"] = w["wo"][i]
        t[p + "post_attention_layernorm.weight"] = w["rms_ffn"][i]
        t[p + "mlp.gate_proj.weight"] = w["w1"][i]
        t[p + "mlp.down_proj.weight"] = w["w2"][i]
        t[p + "mlp.up_proj.weight"] = w["w3"][i]
    if not shared:
        t["lm_head.weight"] = w["wcls"]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in t.items()}, str(out_dir / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": dim,
           "intermediate_size": hidden, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
           "num_key_value_heads": n_kv, "head_dim": head, "max_position_embeddings": seq_len,
           "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta, "tie_word_embeddings": shared,
           "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32"}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer_model is not None:
        shutil.copy(tokenizer_model, out_dir / "tokenizer.model")
        (out_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return out_dir
