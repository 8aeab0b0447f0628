"""Where one request's time goes, end to end (chapter 00): tokenize, admit, schedule, build the batch, the
forward by op type, sampling, detokenize, and (against a running server) HTTP.

    python -m minfer.bench profile [--model M] [--max-tokens 32] [--base-url http://127.0.0.1:8000]

Nothing in the engine is changed to measure it: `profile_request` wraps the methods of one loaded `LLM`'s
parts (its tokenizer, scheduler, worker, sampler, output processor and every `Linear`, norm, rotary and
attention call of the model, by forward hooks) with wall-clock timers for the duration of one request, and
removes them afterwards. The timers cost a few microseconds per call, which the table includes; the chapter
says how large that is against a step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from minfer.sampling_params import SamplingParams


@dataclass
class RequestProfile:
    """Seconds per phase of one request, and the forward's seconds per op type.

    phases: ordered {name: seconds}; "forward" is the model's whole forward (its split is `forward_ops`).
    forward_ops: {op type: seconds}, summing to phases["forward"] ("other" is what no hook covers: the
        embedding, residual adds, reshapes, the activation).
    """

    prompt_tokens: int
    output_tokens: int
    steps: int
    total_s: float
    phases: dict[str, float] = field(default_factory=dict)
    forward_ops: dict[str, float] = field(default_factory=dict)
    http_s: float | None = None  # client-measured wall time of the same request through a server

    def table(self) -> str:
        rows = [f"one request: {self.prompt_tokens} prompt tokens, {self.output_tokens} output tokens, "
                f"{self.steps} engine steps, {self.total_s * 1e3:.1f} ms in all"]
        for name, s in self.phases.items():
            rows.append(f"  {name:28s} {s * 1e3:9.2f} ms  {s / self.total_s:6.1%}")
        rows.append("  the forward, by op type:")
        fwd = self.phases.get("forward", 0.0) or 1e-12
        for name, s in sorted(self.forward_ops.items(), key=lambda kv: -kv[1]):
            rows.append(f"    {name:26s} {s * 1e3:9.2f} ms  {s / fwd:6.1%} of the forward")
        if self.http_s is not None:
            rows.append(f"  through the server (HTTP, JSON, queueing): {self.http_s * 1e3:.1f} ms, "
                        f"{(self.http_s - self.total_s) * 1e3:+.1f} ms against this profiled offline request")
        return "\n".join(rows)


@contextlib.contextmanager
def _timing_method(obj, attr: str, acc: dict, name: str):
    """Replace `obj.attr` (a bound method) by a timed wrapper on the instance; restore it afterwards."""
    original = getattr(obj, attr)
    had_own = attr in vars(obj)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0

    setattr(obj, attr, timed)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)


class _TimedCallable:
    """A callable object (the sampler) timed on `__call__`, every other attribute passed through."""

    def __init__(self, inner, acc: dict, name: str):
        self._inner, self._acc, self._name = inner, acc, name

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._acc[self._name] += time.perf_counter() - t0

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


@contextlib.contextmanager
def _timing_callable(obj, attr: str, acc: dict, name: str):
    inner = getattr(obj, attr)
    setattr(obj, attr, _TimedCallable(inner, acc, name))
    try:
        yield
    finally:
        setattr(obj, attr, inner)


def _op_type(module_name: str, module: torch.nn.Module) -> str | None:
    """The op type a module's forward is counted under, or None for containers."""
    from minfer.model.layers import Linear  # noqa: PLC0415 - the parallel linears (chapter 12) are Linears too

    kind = type(module).__name__
    leaf = module_name.rsplit(".", 1)[-1]
    if isinstance(module, Linear):
        if leaf in ("qkv_proj", "q_proj", "k_proj", "v_proj", "c_attn", "query_key_value"):
            return "linear: QKV projection"
        if leaf in ("o_proj", "dense", "c_proj") and ".mlp" not in module_name:
            return "linear: attention output"
        if leaf == "lm_head":
            return "linear: LM head"
        return "linear: MLP"
    if "Norm" in kind:
        return "norms"
    if kind == "RotaryEmbedding":
        return "rotary (RoPE)"
    if kind == "Attention":
        return "attention (KV store + read)"
    return None


@contextlib.contextmanager
def _timing_modules(model: torch.nn.Module, acc: dict):
    """Forward hooks that add each leaf op's wall time to `acc[op type]`."""
    handles, starts = [], {}
    for name, module in model.named_modules():
        kind = _op_type(name, module)
        if kind is None:
            continue

        def pre(mod, args, key=id(module)):
            starts[key] = time.perf_counter()

        def post(mod, args, out, key=id(module), kind=kind):
            acc[kind] += time.perf_counter() - starts.pop(key)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def profile_request(llm, messages: list[dict], params: SamplingParams | None = None) -> RequestProfile:
    """Run one chat request through `llm`'s engine with timers on every part (see the module docstring).

    Args:
        llm: a loaded `minfer.LLM` with no requests in flight.
        messages: one conversation, [{"role": ..., "content": ...}].
        params: sampling parameters (default: greedy, 32 tokens).

    Returns:
        RequestProfile. Raises ValueError for a bad request (as `LLM.chat` does).
    """
    params = params or SamplingParams(temperature=0, max_tokens=32)
    engine = llm.llm_engine
    worker = engine.worker
    phases: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    t_start = time.perf_counter()
    ids = llm.tokenizer.encode_chat(messages)
    phases["tokenize (chat template)"] = time.perf_counter() - t_start
    with contextlib.ExitStack() as stack:
        stack.enter_context(_timing_method(engine, "add_request", phases, "admit (validate, reserve)"))
        stack.enter_context(_timing_method(engine.scheduler, "schedule", phases, "schedule"))
        stack.enter_context(_timing_method(engine.scheduler, "finish_step", phases, "schedule"))
        stack.enter_context(_timing_method(worker, "prepare_inputs", phases, "build batch (block tables)"))
        stack.enter_context(_timing_method(worker.model, "forward", phases, "forward"))
        stack.enter_context(_timing_method(worker.model, "compute_logits", phases, "LM head (logits)"))
        stack.enter_context(_timing_callable(worker, "sampler", phases, "sampling"))
        stack.enter_context(_timing_method(engine.output_processor, "process", phases, "detokenize + stop check"))
        stack.enter_context(_timing_modules(worker.model, ops))
        steps0 = engine.stats().num_steps
        rid = engine.add_request(None, ids, params)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    out = o
        steps = engine.stats().num_steps - steps0
    total = time.perf_counter() - t_start
    # The LM head runs outside model.forward (compute_logits); count it as a phase, not a forward op.
    head = ops.pop("linear: LM head", 0.0)
    phases["LM head (logits)"] = max(phases.get("LM head (logits)", 0.0), head)
    ops["other (embedding, residuals, activation)"] = max(0.0, phases["forward"] - sum(ops.values()))
    phases["engine bookkeeping"] = max(0.0, total - sum(phases.values()))
    order = ["tokenize (chat template)", "admit (validate, reserve)", "schedule", "build batch (block tables)",
             "forward", "LM head (logits)", "sampling", "detokenize + stop check", "engine bookkeeping"]
    return RequestProfile(prompt_tokens=len(ids), output_tokens=len(out.outputs[0].token_ids), steps=steps,
                          total_s=total, phases={k: phases[k] for k in order if k in phases},
                          forward_ops=dict(ops))


def time_http_request(base_url: str, model: str, messages: list[dict], max_tokens: int, timeout: float = 120) -> float:
    """Client wall time (s) of one non-streaming greedy chat completion through an OpenAI-compatible server."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
    return time.perf_counter() - t0


def plot(profile: RequestProfile, ax=None):
    """A horizontal stacked bar of the phases, the forward split by op type (matplotlib)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 2.8))
    left = 0.0
    segments = []
    for name, s in profile.phases.items():
        if name == "forward":
            for op, t in sorted(profile.forward_ops.items(), key=lambda kv: -kv[1]):
                segments.append((f"forward: {op}", t))
        else:
            segments.append((name, s))
    for i, (name, s) in enumerate(segments):
        ms = s * 1e3
        ax.barh(0, ms, left=left, color=plt.cm.tab20(i % 20), label=f"{name} ({ms:.0f} ms)")
        left += ms
    ax.set_yticks([])
    ax.set_xlabel("milliseconds, in request order (the forward expanded by op type)")
    ax.set_title(f"one request: {profile.prompt_tokens} prompt + {profile.output_tokens} output tokens, "
                 f"{profile.total_s * 1e3:.0f} ms")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False)
    return ax


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.bench profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model to load (default: the embedded SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens (default 32)")
    ap.add_argument("--prompt", default="Explain the KV cache in two sentences.")
    ap.add_argument("--base-url", default=None, help="also time the request through this running server")
    ap.add_argument("--served-model-name", default="smollm2-135m-instruct")
    args = ap.parse_args(argv)
    from minfer import LLM

    llm = LLM(**({"model": args.model} if args.model else {}), max_model_len=2048)
    messages = [{"role": "user", "content": args.prompt}]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    profile_request(llm, messages, SamplingParams(temperature=0, max_tokens=2))  # warm-up
    prof = profile_request(llm, messages, params)
    if args.base_url:
        prof.http_s = time_http_request(args.base_url, args.served_model_name, messages, args.max_tokens)
    print(prof.table())
    return 0
