"""A fake `LLMEngine` with the real engine's interface, for fast unit tests of the server.

It "generates" deterministic words (a function of the prompt, the completion index, the step and the seed),
keeps a toy paged KV pool (one block per `block_size` tokens) so that tests can check blocks are freed, and
validates requests the way the real engine does (an empty prompt, a prompt longer than `max_model_len` or one
whose `max_tokens` does not fit after it, bad token ids raise `ValueError` before anything is queued).
Use `FakeEngine(step_delay=...)` to slow steps down.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minfer.sampling_params import SamplingParams

_WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
          "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon"]


class FakeTokenizer:
    """Word-level tokenizer: id 0 is EOS, ids 1..len(_WORDS) are words, larger ids are `<t{id}>`.

    A word longer than `max_token_chars` is split into pieces of that length, so that no token stands for more
    characters (the server's prompt-length bound, `minfer.serve.limits.prompt_char_limit`, reads it).
    """

    eos_token_id = 0
    vocab_size = 50000
    max_token_chars = 16

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for word in text.split():
            for w in (word[i:i + self.max_token_chars] for i in range(0, len(word), self.max_token_chars)):
                ids.append(_WORDS.index(w) + 1 if w in _WORDS else 100 + (sum(map(ord, w)) % 800))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i == 0:
                continue
            out.append(" " + (_WORDS[i - 1] if 1 <= i <= len(_WORDS) else f"<t{i}>"))
        return "".join(out)

    def encode_chat(self, messages, add_generation_prompt: bool = True, **options) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **options))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template_kwargs=None, tools=None, normalize: bool = True) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        parts = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a 'role' and a string 'content'")
            parts.append(f"{m['role']}: {m['content']}")
        if add_generation_prompt:
            parts.append("assistant:")
        return "\n".join(parts)


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    fragmentation: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_evicted_blocks: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int


@dataclass
class _ModelConfig:
    max_model_len: int


class _Req:
    def __init__(self, rid, prompt, prompt_ids, params, arrival):
        self.rid, self.prompt, self.prompt_ids, self.params = rid, prompt, prompt_ids, params
        self.outs = [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                     for i in range(params.n)]
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.blocks = 0
        self.step = 0


class FakeEngine:
    def __init__(self, max_model_len: int = 256, num_blocks: int = 64, block_size: int = 16,
                 max_num_seqs: int = 8, step_delay: float = 0.0, model_name: str = "fake-model"):
        self.tokenizer = FakeTokenizer()
        self.model_config = _ModelConfig(max_model_len)
        self.model_name = model_name
        self.block_size, self.num_blocks, self.max_num_seqs = block_size, num_blocks, max_num_seqs
        self.step_delay = step_delay
        self.free_blocks = num_blocks
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.num_prompt_tokens = 0
        self.num_gen_tokens = 0
        self.num_steps = 0
        self.last_step_num_tokens = 0

    def add_request(self, request_id, prompt, sampling_params: SamplingParams, arrival_time=None):
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or t < 0 or t >= self.tokenizer.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.tokenizer.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.model_config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is "
                             f"{self.model_config.max_model_len}: that leaves no room for output")
        max_tokens = sampling_params.max_tokens
        if max_tokens is not None and len(ids) + max_tokens > self.model_config.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len ({self.model_config.max_model_len})")
        if any(r.rid == request_id for r in self.waiting + self.running):
            raise ValueError(f"request id {request_id!r} already exists")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.waiting.append(_Req(request_id, prompt if isinstance(prompt, str) else None, ids,
                                 sampling_params, arrival))

    def abort_request(self, request_id):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for r in list(self.waiting) + list(self.running):
            if r.rid in ids:
                self._free(r)

    def _free(self, r: _Req):
        self.free_blocks += r.blocks
        r.blocks = 0
        if r in self.waiting:
            self.waiting.remove(r)
        if r in self.running:
            self.running.remove(r)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _token(self, r: _Req, idx: int) -> int:
        seed = r.params.seed if r.params.seed is not None else 0
        h = (sum(r.prompt_ids) * 31 + idx * 7 + r.step * 3 + (seed if r.params.temperature > 0 else 0)) % 23
        if h == 22 and not r.params.ignore_eos:
            return 0
        return 1 + h % len(_WORDS)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        # admit waiting requests when blocks and seats allow
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            need = math.ceil((len(r.prompt_ids) + 1) / self.block_size) * r.params.n
            if need > self.free_blocks:
                break
            self.waiting.pop(0)
            r.blocks = need
            self.free_blocks -= need
            r.metrics.first_scheduled_time = time.perf_counter()
            self.num_prompt_tokens += len(r.prompt_ids)
            self.running.append(r)
        outputs = []
        now = time.perf_counter()
        step_tokens = sum(len(r.prompt_ids) for r in self.running if r.step == 0)
        for r in list(self.running):
            max_tokens = r.params.max_tokens or (self.model_config.max_model_len - len(r.prompt_ids))
            for o in r.outs:
                if o.finish_reason is not None:
                    continue
                tok = self._token(r, o.index)
                o.token_ids.append(tok)
                self.num_gen_tokens += 1
                step_tokens += 1
                if o.logprobs is not None:
                    others = [t for t in range(1, len(_WORDS) + 1) if t != tok][: r.params.logprobs]
                    o.logprobs.append({tok: -0.5, **{t: -1.0 - 0.5 * j for j, t in enumerate(others)}})
                    o.cumulative_logprob -= 0.5
                o.text = self.tokenizer.decode(o.token_ids)
                if tok in r.params.all_stop_token_ids or tok == 0 and not r.params.ignore_eos:
                    o.finish_reason, o.stop_reason = "stop", tok
                for s in r.params.stop:
                    pos = o.text.find(s)
                    if pos >= 0:
                        o.text = o.text[:pos]
                        o.finish_reason, o.stop_reason = "stop", s
                        break
                if o.finish_reason is None and (len(o.token_ids) >= max_tokens or
                                                len(r.prompt_ids) + len(o.token_ids) >= self.model_config.max_model_len):
                    o.finish_reason = "length"
            r.step += 1
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.token_times.append(now)
            r.metrics.last_token_time = now
            done = all(o.finish_reason is not None for o in r.outs)
            if done:
                r.metrics.finished_time = now
                self._free(r)
            outputs.append(RequestOutput(request_id=r.rid, prompt=r.prompt, prompt_token_ids=r.prompt_ids,
                                         outputs=r.outs, finished=done, metrics=r.metrics))
        self.last_step_num_tokens = step_tokens
        return outputs

    def stats(self) -> FakeStats:
        used = self.num_blocks - self.free_blocks
        return FakeStats(num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=0,
                         num_free_blocks=self.free_blocks, num_total_blocks=self.num_blocks,
                         kv_cache_usage=used / self.num_blocks, fragmentation=0.0, prefix_cache_queries=0,
                         prefix_cache_hits=0, prefix_cache_hit_rate=0.0, num_preemptions=0, num_evicted_blocks=0,
                         num_prompt_tokens_total=self.num_prompt_tokens,
                         num_generation_tokens_total=self.num_gen_tokens)

    def kv_pool_info(self) -> dict:
        return dict(num_blocks=self.num_blocks, block_size=self.block_size,
                    num_tokens=self.num_blocks * self.block_size, bytes=self.num_blocks * self.block_size * 1024)


if __name__ == "__main__":  # python tests/fake_engine.py PORT: serve the fake engine (for manual checks)
    import sys

    import uvicorn

    from minfer.serve.connection import uvicorn_options
    from minfer.serve.limits import ServerLimits
    from minfer.serve.routes import build_app

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    name = sys.argv[2] if len(sys.argv) > 2 else "fake-model"
    max_len = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    uvicorn.run(build_app(FakeEngine(max_model_len=max_len, step_delay=0.02, max_num_seqs=64, num_blocks=256),
                          served_model_names=[name]), host="127.0.0.1", port=port, log_level="warning",
                **uvicorn_options(ServerLimits()))
