"""`python -m minfer.bench parallel`: tensor and pipeline parallelism measured (chapter 12)."""

from __future__ import annotations

from pathlib import Path


def save_random_llama(path, *, layers: int = 4, hidden: int = 64, heads: int = 8, kv_heads: int = 2,
                      intermediate: int = 128, vocab: int = 256, tied: bool = False, seed: int = 0,
                      max_positions: int = 1024) -> str:
    """A random Llama with a word-level tokenizer over `vocab` words ("w0" ...), saved as a Hugging Face
    directory at `path` (the tests', notebook's and benchmark's stand-in: even head counts split over 2 and 4
    ranks). The head is scaled up so greedy paths do not sit on near-ties. Returns the path as a string."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1,
                                   tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        for name, p in model.named_parameters():  # random norms: a misplaced norm cannot hide behind ones
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    words = [f"w{i}" for i in range(vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[2]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=words[0], eos_token=words[1],
                                         unk_token=words[2]).save_pretrained(path)
    return str(path)
