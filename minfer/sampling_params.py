"""`SamplingParams`: how one request is decoded (article §7, §13).

Names and meanings follow vLLM's `SamplingParams`
(https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html), so code written for vLLM's offline API
reads the same here. Every field is validated on construction: a bad value raises `ValueError` naming the
field and its allowed range, before any request reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_N = 128  # completions per request, as OpenAI's API allows (each is a sequence with its own KV)
MAX_LOGPROBS = 20  # top logprobs per token, vLLM's default max_logprobs


@dataclass
class SamplingParams:
    """Decoding options for one request.

    Args:
        n: number of independent completions per prompt, 1..128.
        temperature: softmax temperature (>= 0); 0 means exact greedy (argmax).
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p; in (0, 1].
        min_p: drop tokens whose probability is below min_p x the top token's; in [0, 1].
        seed: per-request random seed; the same seed gives the same tokens whatever the batch.
        max_tokens: most new tokens to generate (>= 1); None means "up to max_model_len".
        stop: strings that end generation; the matched string is cut from the returned text.
        stop_token_ids: token ids that end generation (besides the model's EOS ids).
        ignore_eos: keep generating past EOS (benchmarks use it for fixed output lengths).
        logprobs: return the log-probabilities of this many top tokens per step (0..20, plus the chosen
            one); None returns none.
        include_stop_str_in_output: keep the matched stop string in the text.

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
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not 0 <= self.temperature < float("inf")):
            raise bad("temperature", "a finite number >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "-1 (disabled) or an integer >= 1")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2 ** 63 <= self.seed < 2 ** 64):
            raise bad("seed", "an integer in [-2**63, 2**64) or None (torch.Generator's range)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when decoding is an exact argmax (temperature 0)."""
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that finish the request: explicit ones, plus EOS unless `ignore_eos`."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self._eos_token_ids)
        return ids

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        from dataclasses import fields

        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        kwargs.update(changes)
        return SamplingParams(**kwargs)
