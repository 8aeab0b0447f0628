"""`LLM`: vLLM's offline API over minfer's engine.

    from minfer import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", max_model_len=2048, seed=0)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)

`generate` queues every prompt in the engine and steps it until all finish (continuous batching over the
paged KV pool). `generate_simple` runs chapter 1's one-sequence prefill/decode path: the oracle that the
engine is tested against. vLLM's `LLM.beam_search` comes from its own module (`minfer.beam_search`), found
by `__getattr__` in `minfer.extensions.LLM_METHODS`, so this file stays the plain path.

One `LLM` may be shared by several threads: its calls are serialised by a lock (one engine steps one batch at a
time; a second thread's `generate` waits for the first to return, then runs). For calls that overlap in the
engine (continuous batching across callers), serve the model (`python -m minfer.serve`) instead.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from minfer.config import DEFAULT_MODEL, EngineArgs
from minfer.detokenizer import OutputProcessor
from minfer.engine import LLMEngine
from minfer.extensions import llm_method
from minfer.generate import GenerationTimings, SimpleGenerator
from minfer.outputs import RequestOutput
from minfer.sampling import Sampler
from minfer.sampling_params import SamplingParams
from minfer.sequence import Sequence, prompt_list, validate_prompt

if TYPE_CHECKING:
    from minfer.outputs import EngineStats
    from minfer.tokenizer import Tokenizer


def _serialised(method):
    """Run `method` holding the LLM's lock: the engine is driven by one caller at a time (reentrant, so `chat`
    may call `generate`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class LLM:
    """Load a model once; generate for batches of prompts. Thread-safe: calls from several threads run one at
    a time (a lock; see the module docstring).

    Args:
        model: alias, local directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct).
        **kwargs: any `EngineArgs` field with vLLM's name: dtype, max_model_len, seed, block_size, generation_config,
            override_generation_config (the defaults of `get_default_sampling_params`),
            kv_cache_memory_bytes, gpu_memory_utilization, swap_space, max_num_seqs, max_num_batched_tokens,
            enable_chunked_prefill, enable_prefix_caching, attention_backend, speculative_config (vLLM's
            dict, e.g. {"method": "ngram", "num_speculative_tokens": 4}; chapter 7b), ...
            kernels: "auto" (default: the fastest kernels this device has; on a CPU the `minfer/cpu/` wing) or
                "reference" (the path the chapters teach: plain PyTorch model code, the torch attention
                reference, the torch sampler, no C++ loaded; `LLM(kernels="reference")`). Both give the same
                greedy tokens. `minfer.platform` says what each picks.
            enforce_eager: True runs every step through the model's forward, op by op (no one-call CPU
                decode step, no CUDA graphs), with the kernels `kernels` chose (default False).

    Raises:
        TypeError: an unknown keyword. ValueError / ModelNotFoundError: bad values or an unknown model.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; known: {sorted(known)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self.tokenizer = self.llm_engine.tokenizer
        self._simple = None
        self._lock = threading.RLock()

    def __getattr__(self, name: str) -> Any:
        """Methods that features add to the offline API from outside (vLLM's `LLM.beam_search`; the table is
        `minfer.extensions.LLM_METHODS`). Raises AttributeError for any other missing name."""
        return types.MethodType(llm_method(name), self)

    def get_tokenizer(self) -> "Tokenizer":
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate`, `chat` (and `generate_simple`) use when given none, as vLLM's
        `LLM.get_default_sampling_params`: SamplingParams' own defaults with the model's generation config
        laid over them (`generation_config` and `override_generation_config`, `minfer.config.diff_sampling_param`;
        its `max_new_tokens` is `max_tokens`)."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def stats(self) -> "EngineStats":
        """`EngineStats` of the underlying engine (queues, KV usage, prefix-cache hits, preemptions)."""
        return self.llm_engine.stats()

    # -- the engine path ------------------------------------------------------------------------------
    @_serialised
    def generate(self, prompts: str | list | dict, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists). Returns outputs in prompt order.

        A prompt is a string, a list of token ids, or a dict with `"prompt"` or `"prompt_token_ids"` (vLLM's
        prompt dicts); `prompts` is one prompt or a list of them.

        Raises:
            ValueError: a bad prompt (too long, empty, ...) — raised before anything is queued.
            TypeError: `prompts` is none of the forms above.
        """
        prompts = prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm)
        try:
            for p, sp in zip(prompts, params):
                ids.append(engine.add_request(None, p, sp))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            # All or nothing: a bad prompt, an error in a step or a Ctrl-C leaves no request behind.
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    @_serialised
    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (list of {"role", "content"}) or a list of them.

        Messages follow the server's rule (`minfer.tokenizer.normalize_messages`): a content is a string,
        null (read as "") or a list of text parts `[{"type": "text", "text": ...}]`.

        Raises:
            ValueError: empty or malformed messages (naming `messages[i]`).
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects "
                             "(or a list of such lists)")
        convs = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # -- the simple path (chapter 1) --------------------------------------------------------------------
    @_serialised
    def generate_simple(self, prompt: str | list[int] | dict, sampling_params: SamplingParams | None = None,
                        on_token: Callable[[int], None] | None = None) -> tuple[RequestOutput, GenerationTimings]:
        """One request through the simple prefill/decode path with a contiguous KV cache.

        Returns the RequestOutput and its prefill/decode timings. `on_token(seq)` streams.
        """
        engine = self.llm_engine
        params = (sampling_params or self.get_default_sampling_params()).clone(
            _eos_token_ids=tuple(self.tokenizer.eos_token_ids))
        text, ids = engine.tokenize_prompt(prompt)
        validate_prompt(ids, params, engine.max_model_len, engine.model_config.vocab_size)
        if engine.args.world_size > 1:  # rank 0's model is a shard: its all-reduces need the other ranks
            raise ValueError("the simple path runs one process's model; with tensor_parallel_size or "
                             "pipeline_parallel_size > 1 use generate()")
        if self._simple is None:
            worker = engine.worker
            self._simple = SimpleGenerator(worker.model, Sampler(worker.generator), OutputProcessor(self.tokenizer),
                                           kv_cache_dtype=engine.args.kv_cache_dtype,
                                           attention_backend=engine.args.attention_backend,
                                           platform=worker.platform)
        outs, timings = [], []
        for i in range(params.n):
            seq = Sequence("simple", i, ids, params, engine.max_model_len)
            timings.append(self._simple.generate(seq, on_token))
            outs.append(seq.to_output())
        out = RequestOutput("simple", text, ids, outs, finished=True)
        return out, timings[0]  # the first completion's timings
