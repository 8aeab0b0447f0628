"""The two features that plug into `LLMEngine.step` as engine extensions (`minfer.extensions`).

    StructuredOutputHook   (chapter 7 §7.5)  before_forward(batch): the grammars' token bitmasks
                                             on_token(seq, token): advance the grammar by each emitted token
    SpecDecodeHook         (chapter 7b)      before_schedule(running): drafts (a draft model's forward counts
                                             as scheduling time); after_forward / on_row / end_step: the
                                             verified rows' accounting

The two meet once: a guided sequence drafts and is verified under its grammar, so `SpecDecodeHook` asks the
structured-output hook for a draft guide and the verification masks. Like the engine, this module assembles
pieces from every layer (a draft model's worker and tokenizer), so it sits with the entry points.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from minfer.extensions import EngineExtension

if TYPE_CHECKING:
    from minfer.engine import LLMEngine
    from minfer.sampling_params import SamplingParams
    from minfer.scheduler import ScheduledBatch
    from minfer.sequence import Sequence
    from minfer.structured_output import StructuredOutputManager


class StructuredOutputHook(EngineExtension):
    """Structured output in the engine step: one grammar matcher per guided sequence
    (`minfer.structured_output.StructuredOutputManager`), built on first use (llguidance reads the tokenizer
    once, ~0.5 s).

    Args:
        engine: the engine (its `tokenizer`, a `minfer.tokenizer.Tokenizer`, and the logits width V).
    """

    name = "structured_output"

    def __init__(self, engine: "LLMEngine"):
        super().__init__(engine)
        self.tokenizer, self.vocab_size = engine.tokenizer, engine.model_config.vocab_size
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

    def add_request(self, seqs: list["Sequence"], params: "SamplingParams") -> None:
        """Compile the grammar of a request's sequences. Raises ValueError for a bad grammar (nothing kept)."""
        self.get_manager().add([s.seq_id for s in seqs], params.guided_decoding)

    def before_forward(self, batch: "ScheduledBatch") -> None:
        """Set the batch's token bitmask (int32 `[len(batch.seqs), ceil(V/32)]`) and, when rows carry drafts,
        the per-position masks a guided row verifies them under. Nothing when no row is guided."""
        if not self.active:
            return
        batch.token_bitmask = self.manager.bitmask(batch.seqs)
        if any(s.spec_token_ids for s in batch.seqs):
            batch.verify_token_bitmasks = self.manager.spec_bitmasks(batch.seqs) or None

    def on_token(self, seq: "Sequence", token: int) -> None:
        """Advance `seq`'s grammar by its new `token`; a complete grammar finishes the sequence ("stop")."""
        if self.manager is not None and self.manager.accept(seq, token) and not seq.is_finished:
            seq.finish_reason = "stop"  # nothing more may follow

    def release(self, seq_ids: list[int]) -> None:
        if self.manager is not None:
            self.manager.release(seq_ids)


class SpecDecodeHook(EngineExtension):
    """Speculative decoding in the engine step, around a `SpecDecoder` (its proposer and metrics), built from
    the engine's `speculative_config`.

    Raises:
        ValueError: a draft whose vocabulary or tokenizer is not the target's, or that is shorter-lived
            (max_position_embeddings) than max_model_len.
    """

    name = "spec_decode"

    def __init__(self, engine: "LLMEngine"):
        super().__init__(engine)
        self.decoder = build_spec_decoder(engine)

    def _structured(self) -> StructuredOutputHook | None:
        hook = self.engine.extensions.get("structured_output")
        return hook if hook is not None and hook.active else None

    def before_schedule(self, running: list["Sequence"]) -> None:
        """Drafts (`seq.spec_token_ids`) for the running sequences that decode this step. A guided sequence
        drafts under its grammar, and its drafts are cut at the first token the grammar refuses."""
        structured = self._structured()
        if structured is not None:
            manager = structured.manager
            with manager.draft_guide() as guide:
                self.decoder.propose(running, guide)
            manager.truncate_drafts(running)
        else:
            self.decoder.propose(running)

    def after_forward(self, batch: "ScheduledBatch") -> None:
        """After the forward, before the scheduler's `finish_step`: a verified row counts one computed token
        until its accepted drafts are known (so no block holding a rejected draft is named)."""
        self.decoder.verified(batch)

    def on_row(self, seq: "Sequence", num_appended: int) -> None:
        """`num_appended` tokens of `seq`'s verified row were appended: count the accepted drafts, make them
        computed and give back the blocks of the rejected ones."""
        if seq.spec_token_ids:
            self.decoder.accept(seq, num_appended, len(seq.spec_token_ids))

    def end_step(self, batch: "ScheduledBatch") -> None:
        """No draft outlives its step."""
        self.decoder.clear(batch.seqs)

    def release(self, seq_ids: list[int]) -> None:
        self.decoder.release(seq_ids)

    def stats(self) -> dict:
        m = self.decoder.metrics
        return dict(spec_decode_num_drafts=m.num_drafts, spec_decode_num_draft_tokens=m.num_draft_tokens,
                    spec_decode_num_accepted_tokens=m.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=tuple(m.num_accepted_tokens_per_pos))


def build_spec_decoder(engine: "LLMEngine"):
    """The proposer of the engine's `speculative_config` (chapter 7b), in a `SpecDecoder`. A draft model gets
    a worker and a KV pool of its own with as many token slots as the target's.

    Raises:
        ValueError: see `SpecDecodeHook`.
    """
    from minfer.block_manager import BlockManager
    from minfer.model.gguf import gguf_cache_path
    from minfer.spec_decode.decoder import SpecDecoder
    from minfer.spec_decode.draft_model import DraftModelProposer
    from minfer.spec_decode.ngram import NgramProposer
    from minfer.tokenizer import load_tokenizer
    from minfer.worker import Worker

    args = engine.args
    num_blocks = engine.block_manager.num_total_blocks
    spec = args.speculative_config
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        proposer = NgramProposer(k, spec.prompt_lookup_max, spec.prompt_lookup_min)
    else:
        # The draft's quantization is its own (speculative_config's), not the target's.
        draft = Worker(dataclasses.replace(args, model=spec.model, tokenizer=None, speculative_config=None,
                                           max_model_len=engine.max_model_len, quantization=spec.quantization,
                                           quantization_config=spec.quantization_config))
        target_cfg = engine.model_config.config
        if draft.config.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"the draft {spec.model!r} has a vocabulary of {draft.config.vocab_size} tokens, "
                             f"the target {target_cfg.vocab_size}: a draft must share the target's tokenizer")
        try:
            draft_tok = load_tokenizer(draft.source, draft.eos_token_ids,
                                       cache_dir=gguf_cache_path(draft.source.path) / "tokenizer"
                                       if draft.source.kind == "gguf" else None)
        except (OSError, ValueError):
            draft_tok = None  # a draft without tokenizer files: the vocabulary size was checked
        if draft_tok is not None and draft_tok.hf.get_vocab() != engine.tokenizer.hf.get_vocab():
            raise ValueError(f"the draft {spec.model!r} has another tokenizer than the target (same size, "
                             "different tokens): a draft must share the target's tokenizer")
        if draft.config.max_position_embeddings < engine.max_model_len:
            raise ValueError(f"the draft {spec.model!r} handles {draft.config.max_position_embeddings} "
                             f"positions, fewer than max_model_len={engine.max_model_len}")
        draft.init_kv_cache(num_blocks, 0)
        proposer = DraftModelProposer(draft, BlockManager(num_blocks, args.block_size), k)
    return SpecDecoder(spec.method, proposer, engine.block_manager, k, args.max_num_seqs)
