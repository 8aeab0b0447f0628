"""One sequence being generated: its tokens, text, stop state and where its KV lives. Plain data only (ints,
strings, lists), so a sequence can be sent to another process.

Both the simple path (`minfer.generate`) and the engine grow sequences through `Sequence.append_token`
(stop token ids, max_tokens, max_model_len) and then `minfer.detokenizer.OutputProcessor` (text, stop
strings across token boundaries), so stop handling is written once.
"""

from __future__ import annotations

import enum
import itertools
import numbers
import re

from minfer.outputs import CompletionOutput
from minfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    OFFLOADED = "offloaded"  # preempted, its KV kept outside the pool by a preemption policy (minfer/swap.py)
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """A prompt and the tokens generated after it.

    Attributes:
        prompt_token_ids / output_token_ids: lists of int.
        num_computed_tokens: tokens whose K/V are in the cache (the engine advances it).
        block_table: the KV blocks of this sequence, in order (engine only).
        group_block_tables: with a hybrid KV cache (`minfer.kv_cache_groups`), the block tables of layer
            groups 1.. (group 0's is `block_table`); empty otherwise.
        spec_token_ids: draft tokens the target verifies this step (speculative decoding; engine only).
        text: the detokenized output so far; num_held_chars: its tail that may start a stop string, not shown
            yet (both kept by `minfer.detokenizer.OutputProcessor`).
    """

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 max_model_len: int):
        self.seq_id = next(_seq_counter)
        self.request_id, self.index = request_id, index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_model_len = max_model_len
        self.max_tokens = params.max_tokens or (max_model_len - len(prompt_token_ids))
        self.stop_ids = params.all_stop_token_ids
        self.status = SequenceStatus.WAITING
        self.text = ""
        self.num_held_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # vLLM's prompt_logprobs: entry i is {prompt token i: its logprob, top alternatives...}; the first
        # token has no context, so entry 0 is None. The worker fills it chunk by chunk as the prompt prefills.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.group_block_tables: list[list[int]] = []
        self.block_hashes: list[int] = []  # hash chain of the full, computed blocks (prefix caching)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        # Tokens proposed for verification this step (vLLM's `spec_token_ids`; speculative decoding's drafts, set
        # by its engine extension before scheduling, cleared after the step), and the proposer's q [k, V] (None
        # for a deterministic proposer).
        self.spec_token_ids: list[int] = []
        self.spec_token_probs = None

    # -- views --------------------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def visible_text(self) -> str:
        """Text safe to show now: all of it once finished, else without a tail that may start a stop string."""
        if self.is_finished or not self.num_held_chars:
            return self.text
        return self.text[:len(self.text) - self.num_held_chars]

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, text=self.visible_text(), token_ids=list(self.output_token_ids),
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                logprobs=None if self.logprobs is None else list(self.logprobs),
                                cumulative_logprob=self.cumulative_logprob)

    # -- growing --------------------------------------------------------------------------------------
    def append_token(self, token: int, logprob: float = 0.0, top_logprobs: dict[int, float] | None = None) -> None:
        """Add a sampled token and decide whether the sequence is finished by a stop token id or its length
        (stop strings are the output processor's: they need the text)."""
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            self.logprobs.append(top_logprobs or {token: logprob})
        if token in self.stop_ids:
            self.finish_reason, self.stop_reason = "stop", (None if token in self.params._eos_token_ids
                                                            and token not in self.params.stop_token_ids else token)
        elif len(self.output_token_ids) >= self.max_tokens or len(self) >= self.max_model_len:
            self.finish_reason = "length"

    @property
    def stopped_by_token(self) -> bool:
        """Finished by a stop token id (EOS or `stop_token_ids`): that token is not detokenized."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)

    def abort(self) -> None:
        if not self.is_finished:
            self.finish_reason = "abort"


# What the length errors below say, read by the server (`serve.protocol.engine_error`) to answer them as
# OpenAI's context overflow; group 1 is max_model_len
CONTEXT_LENGTH_ERROR = re.compile(r"(?:but max_model_len is |exceeds max_model_len \()(\d+)")


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """Check a prompt against the length budget (article §10: max_model_len bounds prompt + output).

    Raises:
        ValueError: empty prompt, token ids outside the vocabulary, a prompt that leaves no room for output,
            or prompt + max_tokens (or + min_tokens) above max_model_len (the message states all three numbers).
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    bad_bias = [t for t in (params.logit_bias or {}) if t >= vocab_size]
    if bad_bias:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}); got {bad_bias[:5]}")
    if n >= max_model_len:
        raise ValueError(
            f"the prompt has {n} tokens, but max_model_len is {max_model_len}: that leaves no room for output "
            f"(max_tokens={params.max_tokens}). Shorten the prompt or raise max_model_len.")
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds "
            f"max_model_len ({max_model_len}); at most {max_model_len - n} new tokens fit. "
            "Lower max_tokens or raise max_model_len.")
    if params.min_tokens and n + params.min_tokens > max_model_len:  # max_tokens None: min_tokens can not be met
        raise ValueError(
            f"prompt ({n} tokens) + min_tokens ({params.min_tokens}) = {n + params.min_tokens} exceeds "
            f"max_model_len ({max_model_len}); at most {max_model_len - n} new tokens fit. "
            "Lower min_tokens or raise max_model_len.")


def prompt_list(prompts: str | list | dict) -> list:
    """One prompt or a list of them (strings, token-id lists, vLLM's prompt dicts) as a list.

    Raises:
        TypeError: `prompts` is none of these forms.
    """
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                           and isinstance(prompts[0], numbers.Integral)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a string, a list of token ids, a dict with 'prompt' or "
                        f"'prompt_token_ids', or a list of these; got {type(prompts).__name__}")
    return list(prompts)
