"""Text in: the tokenizer and the chat template (the first step of a request; text out is
`minfer.detokenizer`).

Tokenization and chat templates are not what minfer teaches, so they come from Hugging Face
(transformers / tokenizers), including the tokenizer that transformers builds from GGUF metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import minfer.envs as envs
from minfer.chat import MAX_ROLE_CHARS, check_chat_template_kwargs, normalize_messages  # noqa: F401

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from minfer.model.sources import ModelSource


class Tokenizer:
    """A thin wrapper around a Hugging Face tokenizer with the few calls the engine needs.

    Attributes:
        eos_token_ids: ids that end generation (from generation_config.json / GGUF metadata / tokenizer).
    """

    def __init__(self, hf_tokenizer: "PreTrainedTokenizerBase", eos_token_ids: tuple = ()):
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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                            tools: list[dict] | None = None, normalize: bool = True) -> str:
        """Render `messages` with the model's chat template, after `normalize_messages`.

        The controls are vLLM's extra chat parameters (and Hugging Face's `apply_chat_template`'s):
        `add_generation_prompt` opens the assistant's turn after the last message; `continue_final_message`
        leaves the last (assistant) message open, without its end-of-turn, so that generation continues it
        (it cannot be combined with `add_generation_prompt`); `chat_template_kwargs` are extra variables for
        the template (e.g. `{"enable_thinking": false}`). `tools`: OpenAI's tool list for a template that
        renders them. `normalize=False`: the messages are already in the template's shape (tool calls).

        Raises:
            ValueError: messages that `normalize_messages` refuses, a model without a chat template, both
                `add_generation_prompt` and `continue_final_message`, a `continue_final_message` whose last
                message is not the assistant's, or `chat_template_kwargs` that are not an object of new names.
        """
        if normalize:
            messages = normalize_messages(messages)
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                             "add_generation_prompt to false to continue the last message")
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's, got "
                             f"{messages[-1].get('role')!r}")
        kwargs = check_chat_template_kwargs(chat_template_kwargs)
        return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **options) -> list[int]:
        """`apply_chat_template(messages, add_generation_prompt, **options)` as token ids."""
        # The template already writes any BOS it wants; adding special tokens again would double it.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **options),
                           add_special_tokens=False)


def load_tokenizer(source: "ModelSource", eos_token_ids: tuple = (), cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of a model directory (tokenizer.json or only tokenizer.model) or GGUF file.

    Args:
        source: a `minfer.model.sources.ModelSource` (anything with `kind` "hf" or "gguf" and `path`).
        eos_token_ids: the checkpoint's EOS ids (else the tokenizer's own).
        cache_dir: where a GGUF file's rebuilt tokenizer is kept (transformers rebuilds it from the file's
            metadata in a few seconds); None = no cache. Ignored for HF directories.
    """
    from transformers import AutoTokenizer

    if source.kind == "hf":
        return Tokenizer(AutoTokenizer.from_pretrained(str(source.path)), eos_token_ids)
    cache = cache_dir
    if cache is not None and (cache / "tokenizer_config.json").is_file() and not envs.MINFER_NO_CACHE:
        try:
            return Tokenizer(AutoTokenizer.from_pretrained(str(cache)), eos_token_ids)
        except Exception:
            pass  # rebuild below
    tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    if cache is not None and not envs.MINFER_NO_CACHE:
        try:
            tok.save_pretrained(str(cache))
        except OSError:
            pass
    return Tokenizer(tok, eos_token_ids)
