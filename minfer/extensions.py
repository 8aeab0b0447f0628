"""Engine extensions: features that plug into `LLMEngine.step` from outside the core.

The core engine runs a plain loop: schedule -> execute -> update -> output. A feature that must act inside
that loop is an `EngineExtension`, attached by name. The core calls its hooks and names no feature:

    add_request(seqs, params)   a request that asked for it arrives (may raise ValueError: nothing is queued)
    before_schedule(running)    e.g. speculative decoding's drafts (they take KV slots)
    before_forward(batch)       e.g. structured output's token bitmasks
    after_forward(batch)        right after the forward, before the scheduler's `finish_step`
    on_token(seq, token)        each appended token (e.g. a grammar advances)
    on_row(seq, num_appended)   after a sampled row's tokens were appended (e.g. accepted drafts)
    end_step(batch)             after the step's update
    release(seq_ids)            finished or aborted sequences
    stats()                     extra `EngineStats` fields

Which extensions run is decided by the settings, not by the core: `EngineArgs.extensions` names those the
engine attaches when it starts (speculative decoding), and `SamplingParams.extensions` those a request
needs (structured output, attached on the first such request). With default settings no extension is
attached, so stepping through `LLM.generate` visits only the core.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from minfer.config import EngineArgs
    from minfer.sampling_params import SamplingParams
    from minfer.scheduler import ScheduledBatch
    from minfer.sequence import Sequence

# name -> "module:class" of its EngineExtension (imported on first use)
EXTENSIONS = {
    "structured_output": "minfer.step_hooks:StructuredOutputHook",
    "spec_decode": "minfer.step_hooks:SpecDecodeHook",
}


class EngineExtension:
    """Base class of what plugs into the engine step; every hook does nothing unless overridden.

    Args:
        engine: the `LLMEngine` it is attached to (its tokenizer, scheduler, block manager, worker).
    """

    name = ""

    def __init__(self, engine: Any):
        self.engine = engine

    def add_request(self, seqs: list["Sequence"], params: "SamplingParams") -> None:
        pass

    def before_schedule(self, running: list["Sequence"]) -> None:
        pass

    def before_forward(self, batch: "ScheduledBatch") -> None:
        pass

    def after_forward(self, batch: "ScheduledBatch") -> None:
        pass

    def on_token(self, seq: "Sequence", token: int) -> None:
        pass

    def on_row(self, seq: "Sequence", num_appended: int) -> None:
        pass

    def end_step(self, batch: "ScheduledBatch") -> None:
        pass

    def release(self, seq_ids: list[int]) -> None:
        pass

    def stats(self) -> dict:
        return {}


# name -> "module:function" of the methods features add to the offline `LLM` (vLLM's `LLM.beam_search`); each
# takes the `LLM` first.
LLM_METHODS = {
    "beam_search": "minfer.beam_search:llm_beam_search",
}


def llm_method(name: str) -> Callable:
    """The function behind `LLM.<name>` that a feature adds (`LLM_METHODS`). Raises AttributeError otherwise."""
    if name not in LLM_METHODS:
        raise AttributeError(name)
    module, fn = LLM_METHODS[name].split(":")
    return getattr(importlib.import_module(module), fn)


def build_extension(name: str, engine: Any) -> EngineExtension:
    """The extension called `name`, attached to `engine` (the `minfer.engine.LLMEngine`). Raises ValueError for an
    unknown name."""
    if name not in EXTENSIONS:
        raise ValueError(f"unknown engine extension {name!r}: one of {sorted(EXTENSIONS)}")
    module, cls = EXTENSIONS[name].split(":")
    return getattr(importlib.import_module(module), cls)(engine)


def load_verifier(args: "EngineArgs", sampler: Any, generator: "torch.Generator") -> Any:
    """What a worker verifies rows carrying proposed tokens with: a `RejectionVerifier` when `args`
    (`EngineArgs`) speculate, else None (no row ever carries any)."""
    if "spec_decode" not in args.extensions:
        return None
    from minfer.spec_decode.verifier import RejectionVerifier

    return RejectionVerifier(sampler, generator)
