"""Text in, text out: the tokenizer, chat templates, incremental detokenization and stop strings.

Tokenization and chat templates are not what minfer teaches, so they come from Hugging Face
(transformers / tokenizers), including the tokenizer that transformers builds from GGUF metadata.
What an inference engine must add on top is here: turning a growing list of token ids into text one
step at a time (a token may be half a UTF-8 character, or change how the previous one prints), and
finding stop strings that span token boundaries without showing a client the start of one.
"""

from __future__ import annotations

import os
from minfer.model.loader import ModelSource, gguf_cache_path


class Tokenizer:
    """A thin wrapper around a Hugging Face tokenizer with the few calls the engine needs.

    Attributes:
        eos_token_ids: ids that end generation (from generation_config.json / GGUF metadata / tokenizer).
    """

    def __init__(self, hf_tokenizer, eos_token_ids: tuple = ()):
        self.hf = hf_tokenizer
        ids = list(eos_token_ids)
        if not ids and hf_tokenizer.eos_token_id is not None:
            ids = [hf_tokenizer.eos_token_id]
        self.eos_token_ids = tuple(ids)
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": str}, ...]) with the model's chat template.

        Raises:
            ValueError: empty or malformed messages, or a model without a chat template.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content', got {m!r}")
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes any BOS it wants; adding special tokens again would double it.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def load_tokenizer(source: ModelSource, eos_token_ids: tuple = ()) -> Tokenizer:
    """The tokenizer of a model directory (tokenizer.json or only tokenizer.model) or GGUF file.

    GGUF tokenizers are rebuilt by transformers from the file's metadata (a few seconds) and cached
    next to the dequantized weights.
    """
    from transformers import AutoTokenizer

    if source.kind == "hf":
        return Tokenizer(AutoTokenizer.from_pretrained(str(source.path)), eos_token_ids)
    cache = gguf_cache_path(source.path) / "tokenizer"
    if (cache / "tokenizer_config.json").is_file() and os.environ.get("MINFER_NO_CACHE") != "1":
        try:
            return Tokenizer(AutoTokenizer.from_pretrained(str(cache)), eos_token_ids)
        except Exception:
            pass  # rebuild below
    tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    if os.environ.get("MINFER_NO_CACHE") != "1":
        try:
            tok.save_pretrained(str(cache))
        except OSError:
            pass
    return Tokenizer(tok, eos_token_ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    Decoding each new token alone is wrong: byte-level tokens can be half a UTF-8 character (decoded as
    U+FFFD until the rest arrives), and SentencePiece prints a token's leading space depending on what
    came before. So we decode a short window of earlier tokens plus the new ones and emit only the part
    that is new and complete (the approach of vLLM's `detokenize_incrementally`). Cost per step is
    independent of the sequence length.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # a little prompt context, for the first token's spacing
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def step(self, new_ids: list[int]) -> str:
        """Add `new_ids`; return the text they complete (may be "" while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            # Keep the window short so each step decodes a handful of tokens, not the whole history.
            if self.prefix_offset > 64:
                drop = self.prefix_offset - 8
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            return full[len(prefix):]
        return ""


def find_stop(text: str, stops: list[str], new_chars: int) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_chars` characters of `text`.

    Only the tail can hold a new match: a stop string of length L that was not there before must end in the
    new characters, so we search from `len(text) - new_chars - L + 1`. Returns (start index, stop) or None.
    """
    best = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string (so are not shown yet)."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
