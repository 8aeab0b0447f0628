"""Chat messages, checked before a chat template renders them: the one rule of `LLM.chat` and the server
(`normalize_messages`), and the template variables a request may add (`check_chat_template_kwargs`).
Also importable from `minfer.tokenizer`, which renders the template (`Tokenizer.apply_chat_template`).
"""

from __future__ import annotations

# Names the renderer passes itself: a chat_template_kwargs entry may not replace them
_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "chat_template", "return_dict",
                                      "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                                      "sanitize_control_tokens", "return_assistant_tokens_mask",
                                      # what the template's environment already defines (the tokenizer's special
                                      # tokens, Jinja's globals and the renderer's helpers)
                                      "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception",
                                      "strftime_now", "tokenizer", "loop", "range", "namespace", "dict", "lipsum",
                                      "cycler", "joiner"})


def check_chat_template_kwargs(kwargs) -> dict:
    """`chat_template_kwargs` (vLLM's extra variables for the chat template) checked: an object whose keys are
    not names the renderer sets itself. Raises ValueError otherwise; None -> {}."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be an object of template variables, got {kwargs!r:.100}")
    clash = sorted(k for k in kwargs if k in _RESERVED_TEMPLATE_NAMES or k.startswith("__"))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}: the request's own fields do")
    return dict(kwargs)


def normalize_messages(messages) -> list[dict]:
    """Chat messages as `[{"role": str, "content": str}, ...]`: the one rule of `LLM.chat` and the server.

    Each message is an object with a string "role" and a "content" that is a string, null (read as "": an
    assistant turn may have no text) or a list of text parts `[{"type": "text", "text": str}, ...]` (joined,
    as OpenAI's API sends them). Other keys are dropped.

    Raises:
        ValueError: `messages` is not a non-empty list, or a message breaks the rule (names `messages[i]`).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    return [{"role": _message_role(m, i), "content": _message_text(m, i)} for i, m in enumerate(messages)]


MAX_ROLE_CHARS = 64  # OpenAI's roles are short words (system, user, assistant, tool, developer)


def _message_role(m, i: int) -> str:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be an object with a string 'role', got {m!r:.200}")
    if not 1 <= len(m["role"]) <= MAX_ROLE_CHARS:
        raise ValueError(f"messages[{i}].role must have 1 to {MAX_ROLE_CHARS} characters, got {len(m['role'])}")
    return m["role"]


def _message_text(m: dict, i: int) -> str:
    if "content" not in m:  # null is a value ("" here); a message without the key is a mistake
        raise ValueError(f"messages[{i}] must have a 'content' (a string, null or a list of text parts)")
    content = m["content"]
    if content is None:
        return ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"messages[{i}].content: only text parts are supported "
                             "([{\"type\": \"text\", \"text\": ...}, ...])")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string, null or a list of text parts, "
                         f"got {type(content).__name__}")
    return content
