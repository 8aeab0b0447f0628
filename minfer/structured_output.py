"""Structured output (article §7): a grammar turned into a mask over the vocabulary, one step at a time.

    GuidedDecodingParams ─► compile_grammar ─► LLMatcher per sequence ─► bitmask [B, ceil(V/32)] int32
       (json / regex /        (llguidance:        (advanced with every      ─► Sampler: masked_fill(-inf)
        choice / grammar)      a Lark grammar)      accepted token)              before temperature, top-k/p

A JSON schema, a regex or a choice is a context-free grammar; the grammar library (llguidance,
https://github.com/guidance-ai/llguidance) keeps a parser state per sequence and answers, for that state,
which of the V tokens may come next, as one bit per token packed in int32 words (bit j of word w is token
32 w + j). The engine asks for the mask of every guided row of a step in one call, the sampler applies all
rows at once with tensor ops (`minfer.sampling.apply_token_bitmask`), and the sampled token advances the
row's parser. When the grammar is complete the matcher allows only EOS; the engine then finishes the
sequence ("stop"), EOS or not.

What minfer writes is the plumbing (which rows, when to advance, preemption, errors); the parser over the
tokenizer's byte strings is llguidance's (Rust, one wheel with no dependencies). Preemption keeps a matcher
as it is: recompute re-runs the prompt and the output already generated, and the matcher has consumed exactly
those output tokens.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import torch

from minfer.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

_TOKENIZERS: dict[int, object] = {}
_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:  # the optional dependency (pip install llguidance)
        raise ValueError("structured output needs llguidance: pip install llguidance "
                         "(or minfer's 'structured' extra)") from exc
    return llguidance


def grammar_text(guided: GuidedDecodingParams) -> str:
    """The llguidance grammar (a JSON string) of `guided`. Not checked yet: see `validate_grammar`.

    Raises:
        ValueError: a `json` that is not JSON text or an object.
    """
    ll = _llguidance()
    kind = guided.kind
    if kind in ("json", "json_object"):
        schema = guided.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"guided_decoding json is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("guided_decoding json must be a JSON schema object")
        # A compact layout ("," and ": "), and no whitespace between tokens: a small model given the freedom
        # of JSON's whitespace can spend every token on newlines.
        return ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(guided.regex)
    if kind == "choice":
        return ll.grammar_from("choice", json.dumps(list(guided.choice)))
    return ll.grammar_from("grammar", guided.grammar)


def one_line(message: str, limit: int = 300) -> str:
    """The grammar library's message as one line for a client: its first line, without a Rust panic's
    backtrace ("assertion failed: grammar.symbols.len() < u16::MAX ... stack backtrace: ..."), at most
    `limit` characters."""
    text = str(message).split("stack backtrace:")[0].split("note: run with `RUST_BACKTRACE")[0]
    line = next((x.strip() for x in text.splitlines() if x.strip()), "") or "the grammar library failed"
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _guarded(kind: str, fn, *args, **kwargs):
    """`fn(*args)` with a panic inside the grammar library (pyo3's PanicException, a BaseException) turned
    into the ValueError a bad grammar gets: a request must not take the process down or echo a backtrace."""
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - only the library's panic is caught, everything else re-raised
        if type(exc).__name__ != "PanicException":
            raise
        raise ValueError(f"invalid guided_decoding {kind}: the grammar library refused it: {one_line(exc)}") from None


def validate_grammar(guided: GuidedDecodingParams) -> str:
    """Compile `guided` without a tokenizer (what the server checks before admission); returns the grammar.

    Raises:
        ValueError: "invalid guided_decoding <kind>: <the library's message>".
    """
    ll = _llguidance()
    try:
        text = grammar_text(guided)
    except ValueError as exc:
        raise ValueError(f"invalid guided_decoding {guided.kind}: {exc}") from None
    error = _guarded(guided.kind, ll.LLMatcher.validate_grammar, text)
    if error:
        raise ValueError(f"invalid guided_decoding {guided.kind}: {one_line(error)}")
    return text


def llg_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: tuple):
    """llguidance's view of a Hugging Face fast tokenizer (about 0.5 s to build: cached per tokenizer)."""
    ll = _llguidance()
    key = id(hf_tokenizer)
    with _LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            eos = list(eos_token_ids) or None
            try:
                llt = ll.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
            except ValueError as exc:  # e.g. a word-level tokenizer: "can't determine decoder type: None"
                # "SamplingParams.guided_decoding" so the server's 400 names the field (protocol.param_of)
                raise ValueError(f"this model's tokenizer is not supported for structured output "
                                 f"(SamplingParams.guided_decoding needs a byte-level or SentencePiece tokenizer; "
                                 f"llguidance: {exc})") from None
            tok = _TOKENIZERS[key] = (hf_tokenizer, llt)
    return tok[1]


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: ceil(V / 32)."""
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """The engine's matchers: one `llguidance.LLMatcher` per guided sequence, keyed by `seq_id` (so a
    `Sequence` stays plain data).

    Args:
        hf_tokenizer: the engine's Hugging Face fast tokenizer. vocab_size: the model's logits width V.
        eos_token_ids: the model's EOS ids (the token a complete grammar allows).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple):
        self.hf, self.vocab_size, self.eos = hf_tokenizer, vocab_size, tuple(eos_token_ids)
        self.matchers: dict[int, object] = {}
        self.mask_time_s = 0.0  # seconds spent computing masks (the cost a guided step adds)
        self._ready: dict[int, tuple] = {}  # id(guided) -> (guided, matcher or ValueError): `precompile`'s
        self._ready_lock = threading.Lock()

    def precompile(self, guided: GuidedDecodingParams) -> None:
        """Compile `guided` now and keep the matcher (or the ValueError) for the `compile(guided)` that follows,
        for the same object. Safe to call from another thread: the engine process compiles a request's grammar
        in a worker thread (llguidance releases the GIL while it compiles), off the engine step, and adds the
        request once it is ready (`serve.engine_core.EngineCore`)."""
        try:
            result = self._compile(guided)
        except ValueError as exc:
            result = exc
        with self._ready_lock:
            self._ready[id(guided)] = (guided, result)

    def discard(self, guided: GuidedDecodingParams) -> None:
        """Forget what `precompile(guided)` made (its request was aborted before it was added)."""
        with self._ready_lock:
            self._ready.pop(id(guided), None)

    def compile(self, guided: GuidedDecodingParams):
        """A fresh matcher for `guided` (the one `precompile(guided)` made, if it did).

        Raises:
            ValueError: the grammar is invalid (with the library's message).
        """
        with self._ready_lock:
            entry = self._ready.pop(id(guided), None)
        if entry is not None and entry[0] is guided:
            if isinstance(entry[1], ValueError):
                raise entry[1]
            return entry[1]
        return self._compile(guided)

    def _compile(self, guided: GuidedDecodingParams):
        ll = _llguidance()
        text = validate_grammar(guided)
        m = _guarded(guided.kind, ll.LLMatcher, llg_tokenizer(self.hf, self.vocab_size, self.eos), text, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid guided_decoding {guided.kind}: {one_line(m.get_error())}")
        # A grammar whose language is empty ("start: start", {"$ref": "#"}, a regex of an empty class) compiles,
        # and the matcher only goes into error on the first mask: compute that mask now (scratch memory; it does
        # not advance the matcher) so the request is refused before admission instead of ending "" with "stop".
        scratch = torch.zeros(bitmask_width(self.vocab_size), dtype=torch.int32)
        m.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
        if m.is_error():
            # "SamplingParams.guided_decoding" so the server's 400 names the field (protocol.param_of)
            raise ValueError(f"invalid SamplingParams.guided_decoding {guided.kind}: the grammar matches no "
                             f"output ({m.get_error().splitlines()[0][:200]})")
        return m

    def add(self, seq_ids: list[int], guided: GuidedDecodingParams) -> None:
        """Give each of `seq_ids` (the n sequences of one request) its own matcher; raises as `compile`."""
        first = self.compile(guided)
        for i, sid in enumerate(seq_ids):
            self.matchers[sid] = first if i == 0 else first.deep_copy()

    def bitmask(self, seqs: list) -> torch.Tensor | None:
        """The token bitmask of a step: int32 `[len(seqs), ceil(V/32)]`, all ones (-1) for unguided rows, or
        None when no row of `seqs` is guided."""
        guided = [(j, self.matchers[s.seq_id]) for j, s in enumerate(seqs) if s.seq_id in self.matchers]
        if not guided:
            return None
        t0 = time.perf_counter()
        mask = torch.full((len(seqs), bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        row_bytes = mask.shape[1] * 4
        for j, m in guided:  # one call per guided row, into the tensor's own memory (no copy)
            m.unsafe_compute_mask_ptr(mask[j].data_ptr(), row_bytes)
        self.mask_time_s += time.perf_counter() - t0
        return mask

    def draft_guide(self) -> "DraftGuide":
        """A context manager for one proposal of a draft model: masks for the draft positions of guided
        sequences; on exit every matcher is rolled back to where it was."""
        return DraftGuide(self)

    def truncate_drafts(self, seqs: list) -> None:
        """Cut each guided sequence's speculative drafts (`seq.spec_token_ids`) at the first token its grammar
        refuses (`LLMatcher.validate_tokens`; the matcher does not move), so no forward is spent on positions
        that cannot be accepted.

        Only where that keeps the output distribution: greedy requests (a refused draft never equals the
        masked argmax) and deterministic proposers (n-gram: `spec_token_probs` is None; the cut drafts are
        still a function of the context). A sampled draft model's drafts are left whole: cutting them on a
        property of the drawn draft would bias Leviathan et al.'s acceptance rule; a refused draft has p = 0
        under the mask and is rejected there."""
        for s in seqs:
            m = self.matchers.get(s.seq_id)
            if m is None or not s.spec_token_ids or not (s.params.greedy or s.spec_token_probs is None):
                continue
            n = 0 if m.is_error() else m.validate_tokens(s.spec_token_ids)
            if n < len(s.spec_token_ids):
                s.spec_token_ids = s.spec_token_ids[:n]
                if s.spec_token_probs is not None:
                    s.spec_token_probs = s.spec_token_probs[:n] if n else None

    def spec_bitmasks(self, seqs: list) -> dict[int, torch.Tensor]:
        """The masks a speculating guided sequence is verified under: for batch row j with k drafts, int32
        `[k + 1, ceil(V/32)]`, row i the grammar's mask after the drafts d_1..d_i (row 0: its current state).

        The matcher consumes the drafts that the grammar allows and is rolled back (`LLMatcher.rollback`), so
        it ends where it started; the engine then advances it by the tokens verification emits. Rows after the
        first refused draft are never read (that draft has p = 0 and is rejected) and repeat the last mask."""
        out: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        for j, s in enumerate(seqs):
            m = self.matchers.get(s.seq_id)
            if m is None or not s.spec_token_ids:
                continue
            drafts = s.spec_token_ids
            masks = torch.full((len(drafts) + 1, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
            row_bytes = masks.shape[1] * 4
            if m.is_error():
                out[j] = masks  # accept() aborts the sequence on its next token
                continue
            m.unsafe_compute_mask_ptr(masks[0].data_ptr(), row_bytes)
            consumed = 0
            for i in range(m.validate_tokens(drafts)):
                # EOS ends the sequence, so nothing after it is read; and llguidance does not count a consumed
                # EOS in what `rollback` undoes, so it is never consumed here.
                if drafts[i] in self.eos or not m.consume_token(drafts[i]) or m.is_error():
                    break
                consumed += 1
                m.unsafe_compute_mask_ptr(masks[i + 1].data_ptr(), row_bytes)
            if consumed:
                m.rollback(consumed)
            masks[consumed + 1:] = masks[consumed]
            out[j] = masks
        self.mask_time_s += time.perf_counter() - t0
        return out

    def accept(self, seq, token: int) -> bool:
        """Advance `seq`'s matcher by its sampled `token`; True when the grammar is now complete (the
        sequence should finish). An unguided sequence: False.

        A token the mask allowed is always accepted; EOS at the end of a complete grammar is accepted too.
        A matcher in error (the grammar can no longer be completed, e.g. a required recursive property) finishes
        the sequence with "abort", not "stop": its output is not in the grammar's language.
        """
        m = self.matchers.get(seq.seq_id)
        if m is None:
            return False
        if not m.is_error():
            if token in self.eos and m.is_accepting():
                return True
            m.consume_token(token)
            if not m.is_error():
                return m.is_stopped()
        logger.warning("guided decoding of request %s aborted: the grammar cannot be completed (%s)",
                       seq.request_id, m.get_error().splitlines()[0][:200])
        seq.finish_reason, seq.stop_reason = "abort", None  # overrides a "stop"/"length" by the same token
        return True

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self.matchers.pop(sid, None)


class DraftGuide:
    """The grammar masks a draft model drafts under (`DraftModelProposer.propose`), one draft step at a time.

    Each call advances the guided sequences' matchers by the token each drafted since the last call and
    returns the masks of the next position; `__exit__` rolls every matcher back by what it consumed (llguidance's
    `rollback`), so verification and the real acceptance start from the true state.
    """

    def __init__(self, manager: StructuredOutputManager):
        self.manager = manager
        self.consumed: dict[int, int] = {}  # seq_id -> draft tokens its matcher has consumed

    def __enter__(self) -> "DraftGuide":
        return self

    def masks(self, seqs: list, drafted: list[list[int]]) -> torch.Tensor | None:
        """int32 `[len(seqs), ceil(V/32)]` masks for the next draft position of `seqs` (`drafted[r]`: the
        tokens row r has drafted so far), all ones for unguided rows; None when no row is guided."""
        matchers = self.manager.matchers
        if not any(s.seq_id in matchers for s in seqs):
            return None
        t0 = time.perf_counter()
        mask = torch.full((len(seqs), bitmask_width(self.manager.vocab_size)), -1, dtype=torch.int32)
        for r, (s, d) in enumerate(zip(seqs, drafted)):
            m = matchers.get(s.seq_id)
            if m is None or m.is_error():
                continue
            done = self.consumed.get(s.seq_id, 0)
            if any(t in self.manager.eos for t in d):
                continue  # the sequence ends at its drafted EOS: later drafts are never read (and EOS is never
                # consumed: llguidance's rollback does not count it)
            for t in d[done:]:
                if not m.consume_token(t):
                    break
                done += 1
            self.consumed[s.seq_id] = done
            if not m.is_error():
                m.unsafe_compute_mask_ptr(mask[r].data_ptr(), mask.shape[1] * 4)
        self.manager.mask_time_s += time.perf_counter() - t0
        return mask

    def __exit__(self, *exc) -> None:
        for sid, n in self.consumed.items():
            m = self.manager.matchers.get(sid)
            if m is not None and n:
                m.rollback(n)
        self.consumed.clear()
