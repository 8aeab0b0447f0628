"""Settings of the request features that attach from outside the core: `GuidedDecodingParams` (structured
output, chapter 7 §7.5) and `BeamSearchParams` (beam search, chapter 7). Both are also importable from
`minfer.sampling_params` and `minfer`, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from minfer.sampling_params import MAX_N, _as_bool, _as_float, _as_int


@dataclass
class GuidedDecodingParams:
    """What the output must match (vLLM's `GuidedDecodingParams`); exactly one field is set.

    Args:
        json: a JSON schema (a dict, or its JSON text) the output must validate against.
        regex: a regular expression the whole output must match (Rust `regex` syntax, as llguidance reads it).
        choice: a list of strings; the output is exactly one of them.
        grammar: a context-free grammar in Lark syntax (llguidance's) or GBNF (llama.cpp's).
        json_object: True: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).

    The grammar itself is compiled and checked against the tokenizer when the engine admits the request
    (`minfer.structured_output.compile_grammar`): a bad schema or regex raises ValueError there, before the
    request is queued.

    Raises:
        ValueError: none or more than one field set, or a field of the wrong type.
    """

    json: "dict | str | None" = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("SamplingParams.guided_decoding must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"SamplingParams.guided_decoding json must be a JSON schema (a dict or its text), "
                             f"got {type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("SamplingParams.guided_decoding regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("SamplingParams.guided_decoding grammar must be a string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("SamplingParams.guided_decoding choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise ValueError("SamplingParams.guided_decoding json_object must be a boolean")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, n) not in (None, False))


@dataclass
class BeamSearchParams:
    """Beam search options (vLLM's `BeamSearchParams`; scores as Hugging Face transformers' beam search).

    Args:
        beam_width: beams kept per prompt, and sequences returned (1..MAX_N).
        max_tokens: most new tokens per beam (>= 1).
        ignore_eos: EOS does not end a beam (every beam runs to max_tokens).
        temperature: 0 (default) scores with the model's log-probabilities; a value > 0 divides the logits
            by it before the log_softmax. Beam search stays deterministic either way.
        length_penalty: a finished beam's score is sum(logprobs) / len ** length_penalty, len counting its
            generated tokens (EOS included), as in transformers; > 0 favours longer outputs.
        early_stopping: transformers' rule: False (its default heuristic), True (stop as soon as beam_width
            beams finished) or "never".
        include_stop_str_in_output: kept for vLLM's signature; beams end on EOS ids only.

    Raises:
        ValueError: a field outside its range (the message names it).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        w = _as_int(self.beam_width)
        if w is None or not 1 <= w <= MAX_N:
            raise ValueError(f"BeamSearchParams.beam_width must be an integer in [1, {MAX_N}], got {self.beam_width!r}")
        m = _as_int(self.max_tokens)
        if m is None or m < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        t = _as_float(self.temperature)
        if t is None or not 0 <= t < float("inf"):
            raise ValueError(f"BeamSearchParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        lp = _as_float(self.length_penalty)
        # |length_penalty| <= 10 keeps len ** length_penalty a finite float64 for any length a model allows.
        if lp is None or lp != lp or abs(lp) > 10:
            raise ValueError(f"BeamSearchParams.length_penalty must be a number in [-10, 10], got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError("BeamSearchParams.early_stopping must be True, False or 'never', "
                             f"got {self.early_stopping!r}")
        self.beam_width, self.max_tokens, self.temperature, self.length_penalty = w, m, t, lp
        self.ignore_eos = _as_bool(self.ignore_eos, "BeamSearchParams.ignore_eos")
        self.include_stop_str_in_output = _as_bool(self.include_stop_str_in_output,
                                                   "BeamSearchParams.include_stop_str_in_output")
