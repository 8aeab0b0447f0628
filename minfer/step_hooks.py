"""What plugs into `LLMEngine.step` around the plain schedule -> execute -> update -> output loop.

    StructuredOutputHook   (chapter 7 §7.5)  prepare(batch): the grammars' token bitmasks before the forward
                                             accept(seq, token): advance the grammar by each emitted token
    SpecDecodeHook         (chapter 7b)      propose(running): drafts before scheduling (a draft model's
                                             forward counts as scheduling time)
                                             on_executed(batch) / on_emitted(seq, n) / end_step(batch): the
                                             verified rows' accounting after the forward

The two meet once: a guided sequence drafts and is verified under its grammar, so `SpecDecodeHook` asks the
structured-output hook for a draft guide and the verification masks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minfer.sampling_params import GuidedDecodingParams
    from minfer.scheduler import ScheduledBatch
    from minfer.sequence import Sequence
    from minfer.spec_decode.decoder import SpecDecoder
    from minfer.structured_output import StructuredOutputManager


class StructuredOutputHook:
    """Structured output in the engine step: one grammar matcher per guided sequence
    (`minfer.structured_output.StructuredOutputManager`), built on the first guided request (llguidance reads
    the tokenizer once, ~0.5 s).

    Args:
        tokenizer: the engine's `minfer.tokenizer.Tokenizer` (its Hugging Face tokenizer and EOS ids).
        vocab_size: the logits width V.
    """

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.manager: StructuredOutputManager | None = None

    def get_manager(self) -> "StructuredOutputManager":
        """The manager, built on first use."""
        if self.manager is None:
            from minfer.structured_output import StructuredOutputManager

            self.manager = StructuredOutputManager(self.tokenizer.hf, self.vocab_size,
                                                   tuple(self.tokenizer.eos_token_ids))
        return self.manager

    @property
    def active(self) -> bool:
        """True while some sequence is guided."""
        return self.manager is not None and bool(self.manager.matchers)

    def add(self, seq_ids: list[int], guided: "GuidedDecodingParams") -> None:
        """Compile the grammar of a request's sequences. Raises ValueError for a bad grammar (nothing kept)."""
        self.get_manager().add(seq_ids, guided)

    def prepare(self, batch: "ScheduledBatch", speculating: bool) -> None:
        """Set the batch's grammar bitmask (int32 `[len(batch.seqs), ceil(V/32)]`) and, with `speculating`,
        the per-position masks a guided row verifies its drafts under. Nothing when no row is guided."""
        if not self.active:
            return
        batch.grammar_bitmask = self.manager.bitmask(batch.seqs)
        if speculating:
            batch.spec_grammar_bitmasks = self.manager.spec_bitmasks(batch.seqs) or None

    def accept(self, seq: "Sequence", token: int) -> None:
        """Advance `seq`'s grammar by its new `token`; a complete grammar finishes the sequence ("stop")."""
        if self.manager is not None and self.manager.accept(seq, token) and not seq.is_finished:
            seq.finish_reason = "stop"  # nothing more may follow

    def release(self, seq_ids: list[int]) -> None:
        if self.manager is not None:
            self.manager.release(seq_ids)


class SpecDecodeHook:
    """Speculative decoding in the engine step, around a `SpecDecoder` (its proposer and metrics).

    Args:
        decoder: the `SpecDecoder` of `speculative_config`. structured: the engine's structured-output hook
            (guided sequences draft and verify under their grammar).
    """

    def __init__(self, decoder: "SpecDecoder", structured: StructuredOutputHook):
        self.decoder, self.structured = decoder, structured

    def propose(self, running: list["Sequence"]) -> None:
        """Drafts (`seq.spec_token_ids`) for the running sequences that decode this step. A guided sequence
        drafts under its grammar, and its drafts are cut at the first token the grammar refuses."""
        if self.structured.active:
            manager = self.structured.manager
            with manager.draft_guide() as guide:
                self.decoder.propose(running, guide)
            manager.truncate_drafts(running)
        else:
            self.decoder.propose(running)

    def on_executed(self, batch: "ScheduledBatch") -> None:
        """After the forward, before the scheduler's `finish_step`: a verified row counts one computed token
        until its accepted drafts are known (so no block holding a rejected draft is named)."""
        self.decoder.verified(batch)

    def on_emitted(self, seq: "Sequence", num_emitted: int) -> None:
        """`num_emitted` tokens of `seq`'s verified row were appended: count the accepted drafts, make them
        computed and give back the blocks of the rejected ones."""
        self.decoder.accept(seq, num_emitted, len(seq.spec_token_ids))

    def end_step(self, batch: "ScheduledBatch") -> None:
        """No draft outlives its step."""
        self.decoder.clear(batch.seqs)

    def release(self, seq_ids: list[int]) -> None:
        self.decoder.release(seq_ids)
