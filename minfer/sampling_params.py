"""`SamplingParams`: how one request is decoded (article §7, §13).

Names and meanings follow vLLM's `SamplingParams`
(https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html), so code written for vLLM's offline API
reads the same here. Every field is validated on construction: a bad value raises `ValueError` naming the
field and its allowed range, before any request reaches the engine.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_N = 128  # completions per request, as OpenAI's API allows (each is a sequence with its own KV)
MAX_LOGPROBS = 20  # top logprobs per token, vLLM's default max_logprobs
# Stop strings are checked on the engine thread for every running sequence at every step, so what one request
# may ask for is bounded. OpenAI's API takes 4 stop strings; 64 leaves room for the longest lists tools send
# (role and turn markers of several chat templates), and 256 characters is longer than any such marker or
# code delimiter. The whole set is then <= 16,384 characters, which `minfer.detokenizer.StopMatcher` turns
# into its automaton once per request in a few milliseconds.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
# Token-id lists are bounded for the same reason: the sampler writes a request's stop ids (under min_tokens)
# and its logit_bias into the logits at every step. 1,024 is more than every special token of any supported
# vocabulary (Llama 3 reserves 256); 1.9 M stop ids held 66 MB per sequence before these caps.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_TOKENS = 1024
# The smallest normal float32 (torch.finfo(torch.float32).tiny): the sampler runs in float32, where a top_p
# below this is a subnormal or 0, and 0 would mask every token.
FLOAT32_TINY = 1.1754943508222875e-38


@dataclass
class SamplingParams:
    """Decoding options for one request.

    Args:
        n: number of independent completions per prompt, 1..128.
        temperature: softmax temperature (>= 0); 0 means exact greedy (argmax).
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p; in (0, 1], and not below
            float32's smallest normal number (1.18e-38).
        min_p: drop tokens whose probability is below min_p x the top token's; in [0, 1].
        seed: per-request random seed; the same seed gives the same tokens whatever the batch.
        max_tokens: most new tokens to generate (>= 1); None means "up to max_model_len".
        stop: strings that end generation; the matched string is cut from the returned text. At most
            MAX_STOP_STRINGS (64) strings of at most MAX_STOP_STRING_CHARS (256) characters each.
        stop_token_ids: token ids that end generation (besides the model's EOS ids); at most
            MAX_STOP_TOKEN_IDS (1,024).
        ignore_eos: keep generating past EOS (benchmarks use it for fixed output lengths).
        logprobs: return the log-probabilities of this many top tokens per step (0..20, plus the chosen
            one); None returns none.
        include_stop_str_in_output: keep the matched stop string in the text.
        presence_penalty: subtracted once from the logit of every token already generated (OpenAI/vLLM);
            in [-2, 2]; > 0 favours new tokens.
        frequency_penalty: subtracted from a token's logit once per time it was generated; in [-2, 2].
        repetition_penalty: HF/CTRL's multiplicative penalty (Keskar et al., 2019) on every token of the
            prompt and the output: a positive logit is divided by it, a negative one multiplied; > 0, 1 = off.
        min_tokens: the stop token ids (and EOS unless `ignore_eos`) are masked, and stop strings not
            checked, until this many tokens were generated; 0 <= min_tokens <= max_tokens.
        logit_bias: {token id: bias} added to the logits before sampling (OpenAI's), biases in [-100, 100];
            at most MAX_LOGIT_BIAS_TOKENS (1,024) tokens.
        prompt_logprobs: return, for every prompt token after the first, the log-probability the model gave
            it plus this many top alternatives (0..20), as vLLM's `RequestOutput.prompt_logprobs` (the first
            entry is None). A request asking for them is not served from the prefix cache: every prompt
            position must be computed to have logits.
        guided_decoding: a `GuidedDecodingParams` (structured output, vLLM's name): the output is constrained
            to a JSON schema, a regex, a choice of strings, a grammar, or any JSON object, by a token mask
            applied in the sampler at every step (`minfer.structured_output`). Not served with beam search;
            speculative decoding skips such requests (they decode one token a step).

    Numbers may be any `numbers.Integral` / `numbers.Real` but a bool (NumPy's scalars too); they are stored
    as plain Python ints and floats.

    Raises:
        ValueError: a field is outside its allowed range (the message names the field and the range).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    guided_decoding: "GuidedDecodingParams | None" = None
    # Filled in by the engine: the model's EOS ids (generation_config.json may list several).
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._verify()

    def _verify(self) -> None:
        # Each check stores the plain Python number: NumPy scalars are accepted as prompts' token ids are,
        # and what reaches the sampler, the JSON answers and the hash of a seed is then always an int/float.
        self.n = self._number("n", _as_int, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]")
        self.temperature = self._number("temperature", _as_float, lambda v: 0 <= v < float("inf"),
                                        "a finite number >= 0 (0 means greedy)")
        self.top_k = self._number("top_k", _as_int, lambda v: v >= 1 or v == -1, "-1 (disabled) or an integer >= 1")
        self.top_p = self._number("top_p", _as_float, lambda v: FLOAT32_TINY <= v <= 1,
                                  f"in (0, 1] and at least {FLOAT32_TINY:.4g} (the smallest normal float32: the "
                                  "sampler runs in float32, where a smaller top_p is 0 and masks every token)")
        self.min_p = self._number("min_p", _as_float, lambda v: 0 <= v <= 1, "in [0, 1]")
        self.seed = self._number("seed", _as_int, lambda v: -2 ** 63 <= v < 2 ** 64,
                                 "an integer in [-2**63, 2**64) or None (torch.Generator's range)", optional=True)
        self.max_tokens = self._number("max_tokens", _as_int, lambda v: v >= 1, "an integer >= 1 or None",
                                       optional=True)
        self.logprobs = self._number("logprobs", _as_int, lambda v: 0 <= v <= MAX_LOGPROBS,
                                     f"an integer in [0, {MAX_LOGPROBS}] or None", optional=True)
        self.presence_penalty = self._number("presence_penalty", _as_float, lambda v: -2 <= v <= 2, "in [-2, 2]")
        self.frequency_penalty = self._number("frequency_penalty", _as_float, lambda v: -2 <= v <= 2, "in [-2, 2]")
        # Bounded so that the penalty and its inverse stay normal float32 numbers: the sampler divides and
        # multiplies float32 logits by it, and 1e-39 would be 0 there (logits of seen tokens become inf).
        self.repetition_penalty = self._number(
            "repetition_penalty", _as_float, lambda v: 1e-30 <= v <= 1e30, "a number in [1e-30, 1e30] (1 means off)")
        self.min_tokens = self._number("min_tokens", _as_int, lambda v: v >= 0, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be at most max_tokens "
                             f"({self.max_tokens})")
        self.prompt_logprobs = self._number("prompt_logprobs", _as_int, lambda v: 0 <= v <= MAX_LOGPROBS,
                                            f"an integer in [0, {MAX_LOGPROBS}] or None", optional=True)
        if self.guided_decoding is not None:
            if isinstance(self.guided_decoding, dict):
                self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
            elif not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise ValueError("SamplingParams.guided_decoding must be a GuidedDecodingParams (or a dict of its "
                                 f"fields), got {type(self.guided_decoding).__name__}")
        self._verify_logit_bias()
        self._verify_stop()
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} token ids, "
                             f"got {len(self.stop_token_ids)}")
        ids = [_as_int(t) for t in self.stop_token_ids]
        if any(t is None or t < 0 for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of non-negative integers, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            setattr(self, name, _as_bool(getattr(self, name), f"SamplingParams.{name}"))

    def _number(self, name: str, convert, ok, allowed: str, optional: bool = False):
        """Field `name` as a plain int or float (`convert`: `_as_int` / `_as_float`), or None if `optional`.

        Raises:
            ValueError: "SamplingParams.<name> must be <allowed>, got <value>" when it is not a number of that
                kind or `ok(value)` is false.
        """
        value = getattr(self, name)
        if value is None and optional:
            return None
        number = convert(value)
        if number is None or not ok(number):
            raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")
        return number

    def _verify_stop(self) -> None:
        """Stop strings: at most MAX_STOP_STRINGS, each non-empty and at most MAX_STOP_STRING_CHARS long.

        The messages name the count or one bad string (shortened), never the whole list, which may be large.
        """
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"SamplingParams.stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or s == "":
                raise ValueError("SamplingParams.stop must be a non-empty string or a list of non-empty strings, "
                                 f"got {s!r:.80} at stop[{i}]")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"SamplingParams.stop strings may be at most {MAX_STOP_STRING_CHARS} characters "
                                 f"each, got {len(s)} at stop[{i}]")

    def _verify_logit_bias(self) -> None:
        """`logit_bias` as {int token id >= 0: float bias in [-100, 100]} (JSON sends the ids as strings)."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r:.80}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"SamplingParams.logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                             f"got {len(self.logit_bias)}")
        out = {}
        for k, v in self.logit_bias.items():
            # ASCII digits only: str.isdigit() also takes "²" and "٤٢", which int() refuses or reads silently.
            tid = _as_int(k) if not isinstance(k, str) else (int(k) if re.fullmatch(r"[0-9]+", k.strip()) else None)
            bias = _as_float(v)
            if tid is None or tid < 0:
                raise ValueError(f"SamplingParams.logit_bias keys must be token ids (integers >= 0), got {k!r:.40}")
            if bias is None or not -100 <= bias <= 100:
                raise ValueError(f"SamplingParams.logit_bias values must be numbers in [-100, 100], got {v!r:.40} "
                                 f"for token {tid}")
            if tid in out:
                raise ValueError(f"SamplingParams.logit_bias names token {tid} twice ({k!r:.40})")
            out[tid] = bias
        self.logit_bias = out or None

    @property
    def needs_logits_processing(self) -> bool:
        """True when the sampler must change the logits before choosing (penalties, min_tokens, logit_bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias)

    @property
    def extensions(self) -> tuple[str, ...]:
        """The engine extensions this request needs (`minfer.extensions`): "structured_output" when guided."""
        return ("structured_output",) if self.guided_decoding is not None else ()

    @property
    def greedy(self) -> bool:
        """True when decoding is an exact argmax (temperature 0)."""
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Token ids that finish the request: explicit ones, plus EOS unless `ignore_eos`.

        Built once per params object and shared: a request's n sequences hold the same set, not n copies.
        """
        key = (tuple(self.stop_token_ids), self.ignore_eos, tuple(self._eos_token_ids))
        cached = self.__dict__.get("_stop_set")
        if cached is None or cached[0] != key:
            ids = set(self.stop_token_ids)
            if not self.ignore_eos:
                ids.update(self._eos_token_ids)
            cached = (key, frozenset(ids))
            self.__dict__["_stop_set"] = cached
        return cached[1]

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        from dataclasses import fields

        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        kwargs.update(changes)
        return SamplingParams(**kwargs)


def _as_int(value) -> int | None:
    """`value` as a Python int if it is an integer (int, NumPy's integers: any `numbers.Integral`) but not a
    bool, else None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def _as_float(value) -> float | None:
    """`value` as a Python float if it is a real number (int, float, NumPy's: any `numbers.Real`) but not a
    bool, else None (also when it is too large for a float)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return None
    return None


def _as_bool(value, name: str) -> bool:
    """`value` as a plain bool when it is a real boolean (Python's or NumPy's), else ValueError naming `name`.

    Checked, not coerced: the string "no" is truthy (`"ignore_eos": "no"` would silently ignore EOS), and
    a non-bool that reached the detokenizer raised there, failing every request of the engine step."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{name} must be a boolean (True or False), got {value!r:.80}")


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
