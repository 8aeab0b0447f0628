"""Beam search on /v1/completions: vLLM's `use_beam_search: true` (article §7; `minfer.beam_search`).

The request's beam width is `best_of` if given, else `n`; the answer's `choices` are the `n` best beams of each
prompt, best score first (choice `i * n + j` is beam `j` of prompt `i`, as OpenAI numbers completions). The
fields beam search reads: `n`, `best_of`, `max_tokens` (default 16, capped to what max_model_len leaves, as
for sampling), `temperature`, `length_penalty`, `early_stopping`, `ignore_eos`, `include_stop_str_in_output`,
and of the fallbacks (`serve.fallbacks`) `truncate_prompt_tokens` and the KV-pressure cap; `request_timeout`
is a 400 (the search cannot stop at a deadline).
A sampling-only field set to anything but its default (`top_p`, `stop`, `logprobs`, ...) is refused with a
400 naming it, rather than ignored. `/v1/chat/completions` takes `use_beam_search` too (the conversation
rendered with the chat template; the beams are assistant messages), and `stream: true` sends each finished
beam whole in one chunk.

`LLM.beam_search` steps the executor itself, outside the scheduler, so it needs an idle engine: the search
is a job the engine runs between two steps once no request is unfinished (`EngineLoop.run_when_idle` in
process; with the engine in its own process, `MPEngineClient.run_when_idle` sends the job there and
`EngineCore` runs it); requests that arrive meanwhile wait behind it. Nothing else of the serving path knows about beam search.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minfer.beam_search import run_beam_search
from minfer.sampling_params import BeamSearchParams, SamplingParams
from minfer.sequence import validate_prompt
from minfer.serve.fallbacks import request_timeout_setting, truncate_prompt_tokens_setting, truncate_prompts
from minfer.serve.protocol import SSE_DONE, APIError, echo, engine_error, sse, usage

# Fields that only sampling reads, with the values that mean "not used" (JSON null always means not given).
_SAMPLING_ONLY = {"top_p": (1, 1.0), "top_k": (-1, 0), "min_p": (0, 0.0), "stop": ([], ""), "stop_token_ids": ([],),
                  "logprobs": (), "echo": (False,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
                  "repetition_penalty": (1, 1.0), "min_tokens": (0,), "logit_bias": ({},), "suffix": ("",),
                  "stream_options": ()}


def beam_search_requested(body: dict) -> bool:
    """`use_beam_search` as a JSON boolean (APIError(400) for anything else)."""
    value = body.get("use_beam_search")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"use_beam_search must be a boolean (true or false), got {echo(value)}",
                       param="use_beam_search")
    return value


def _int_field(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise APIError(400, f"{name} must be an integer >= 1, got {echo(value)}", param=name)
    return value


def beam_search_params(body: dict) -> tuple[BeamSearchParams, int, int | None]:
    """The body's beam search fields -> (params, n beams to return, max_tokens as given or None).

    `params.max_tokens` is a placeholder (1) when max_tokens was omitted: its default depends on each prompt's
    length (`run`). Raises APIError(400) naming the field: stream, a sampling-only field, best_of < n, or a
    value `BeamSearchParams` refuses.
    """
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise APIError(400, f"stream must be a boolean (true or false), got {echo(body.get('stream'))}",
                       param="stream")
    for name, unused in _SAMPLING_ONLY.items():
        value = body.get(name)
        if value is not None and not any(value == u and type(value) is type(u) for u in unused):
            raise APIError(400, f"{name}={echo(value)} is not supported with use_beam_search (beam search keeps "
                                "the most likely beams; it does not sample)", param=name)
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs"):
        value = body.get(name)
        if value is not None and not (name == "response_format" and isinstance(value, dict)
                                      and value.get("type") == "text"):
            raise APIError(400, f"{name} (structured output) is not supported with use_beam_search: a grammar "
                                "masks one sequence's tokens, and beams are scored without it", param=name)
    n = _int_field(body, "n", 1)
    width = _int_field(body, "best_of", n)
    if width < n:
        raise APIError(400, f"best_of={width} (the beam width) must be >= n={n} (the beams returned)",
                       param="best_of")
    max_tokens = body.get("max_tokens")
    try:
        params = BeamSearchParams(
            beam_width=width, max_tokens=1 if max_tokens is None else max_tokens,
            ignore_eos=_bool_field(body, "ignore_eos"),
            temperature=0.0 if body.get("temperature") is None else body["temperature"],
            length_penalty=1.0 if body.get("length_penalty") is None else body["length_penalty"],
            early_stopping=False if body.get("early_stopping") is None else body["early_stopping"],
            include_stop_str_in_output=_bool_field(body, "include_stop_str_in_output"))
    except (ValueError, TypeError) as exc:
        m = re.search(r"BeamSearchParams\.(\w+)", str(exc))
        param = m.group(1) if m else None
        if param == "beam_width":
            param = "best_of" if body.get("best_of") is not None else "n"
        raise APIError(400, str(exc).replace("BeamSearchParams.", ""), param=param) from None
    return params, n, max_tokens


def _bool_field(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean (true or false), got {echo(value)}", param=name)
    return value


def _per_prompt(engine, prompts: list[list[int]], params: BeamSearchParams, max_tokens: int | None,
                default_max_tokens: int) -> list[BeamSearchParams]:
    """Each prompt's params, an omitted max_tokens filled in as `protocol.fit_max_tokens` does; APIError(400)
    for a prompt the engine would refuse (checked here, before queueing: the answer needs no engine)."""
    out = []
    max_model_len, vocab = engine.model_config.max_model_len, engine.model_config.vocab_size
    for ids in prompts:
        room = max_model_len - len(ids)
        p = params if max_tokens is not None else dataclasses.replace(
            params, max_tokens=max(1, min(default_max_tokens, room)))
        try:
            validate_prompt(ids, SamplingParams(max_tokens=p.max_tokens), max_model_len, vocab)
        except ValueError as exc:
            raise engine_error(exc) from None
        out.append(p)
    return out


async def _wait(request: Request, q: asyncio.Queue):
    """The job's event, or None if the client disconnected first."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    get, gone = asyncio.ensure_future(q.get()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (get, gone):
            if not t.done():
                t.cancel()
    return get.result() if get in done else None


def beam_search_job(engine, prompts: list[list[int]], per_prompt: list[BeamSearchParams]) -> list:
    """The search on an idle `engine`: one `BeamSearchOutput` per prompt (run where the engine lives)."""
    decode = engine.tokenizer.decode
    return [run_beam_search(engine, [ids], p, decode)[0] for ids, p in zip(prompts, per_prompt)]


async def serve_beam_search(serving, request: Request, body: dict, prompts: list[list[int]], model: str,
                            default_max_tokens: int, chat: bool = False) -> dict | Response:
    """Answer a `use_beam_search` request for token-id `prompts`: OpenAI's `text_completion` object, or with
    `chat` (one rendered conversation) a `chat.completion` whose choices are the beams as assistant messages.
    With `stream: true` the same choices come as server-sent events, each beam whole in one chunk (the beams
    are known only when the search ends), then `[DONE]`.

    Raises:
        APIError(400): a bad field or prompt, or beams that cannot fit in the KV pool.
        APIError(503): the search could not run (the engine was not idle: retry), or the engine died (a dead
            parallel worker: as on the sampling path, /health says so too).
        APIError(500): the search failed.
    """
    params, n, max_tokens = beam_search_params(body)
    # The fallbacks as on the sampling path (`serve.fallbacks`): truncate_prompt_tokens validated and applied;
    # the KV-pressure cap applied below. A time limit is refused instead: the search is one engine job
    # (`run_when_idle`) that cannot be cut at a deadline and answer its beams so far, so the body's
    # `request_timeout` is a 400 here, and the server's `--request-timeout` does not apply to beam search.
    if body.get("request_timeout") is not None:
        request_timeout_setting(body, serving.fallbacks)  # a bad value gets the same 400 as without beams
        raise APIError(400, "request_timeout is not supported with use_beam_search (the search runs as one "
                            "engine job and cannot stop at a deadline)", param="request_timeout")
    prompts = truncate_prompts(prompts, truncate_prompt_tokens_setting(body, serving.max_model_len))
    per_prompt = _per_prompt(serving.engine, prompts, params, max_tokens, default_max_tokens)
    per_prompt, fallback = _cap_under_kv_pressure(serving, per_prompt)
    # A module-level function and plain data: the in-process loop calls it, and the engine-core process
    # receives it pickled (`MPEngineClient.run_when_idle`) and calls it on its own engine.
    job = functools.partial(beam_search_job, prompts=prompts, per_prompt=per_prompt)
    req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    q: asyncio.Queue = asyncio.Queue()
    serving.engine_loop.run_when_idle(req_id, job, q)
    event = await _wait(request, q)
    if event is None:
        serving.engine_loop.cancel_job(req_id)
        return Response(status_code=499)
    _, kind, payload = event
    if kind == "error":
        if isinstance(payload, APIError):  # 503: the engine died (a dead worker), as on the sampling path
            raise payload
        if isinstance(payload, ValueError):
            raise APIError(400, str(payload), param="max_tokens" if "KV blocks" in str(payload) else None)
        if isinstance(payload, RuntimeError) and "idle engine" in str(payload):
            raise APIError(503, f"beam search could not run now ({payload}); retry the request")
        raise APIError(500, f"beam search failed: {type(payload).__name__}: {payload}")
    choices, completion_tokens = [], 0
    for i, out in enumerate(payload):
        for j, beam in enumerate(out.sequences[:n]):
            completion_tokens += len(beam.output_token_ids)
            content = ({"message": {"role": "assistant", "content": beam.text}} if chat else {"text": beam.text})
            choices.append({"index": i * n + j, **content, "logprobs": None, "finish_reason": beam.finish_reason})
    created, total = int(time.time()), usage(sum(len(p) for p in prompts), completion_tokens)
    headers = {} if fallback is None else {"X-Max-Tokens-Capped": str(fallback["max_tokens_capped"]["granted"])}
    if body.get("stream"):
        return StreamingResponse(_beam_events(req_id, created, model, choices, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    answer = {"id": req_id, "object": "chat.completion" if chat else "text_completion", "created": created,
              "model": model, "choices": choices, "usage": total}
    if fallback is not None:
        answer["fallback"] = fallback
        return JSONResponse(answer, headers=headers)
    return answer


def _cap_under_kv_pressure(serving, per_prompt: list[BeamSearchParams]) -> tuple[list[BeamSearchParams], dict | None]:
    """`fallbacks.cap_under_kv_pressure` for beams: max_tokens lowered to `--kv-pressure-max-tokens` while the
    KV usage is at `--kv-pressure-threshold`, decided at arrival as for sampling; (params, what to report)."""
    config = serving.fallbacks
    cap, threshold = config.kv_pressure_max_tokens, config.kv_pressure_threshold
    usage_now = serving.engine_loop.latest_stats.get("kv_cache_usage")
    if cap is None or usage_now is None or usage_now < threshold or all(p.max_tokens <= cap for p in per_prompt):
        return per_prompt, None
    requested = [p.max_tokens for p in per_prompt]
    out = [p if p.max_tokens <= cap else dataclasses.replace(p, max_tokens=cap) for p in per_prompt]
    return out, {"max_tokens_capped": {"requested": requested, "granted": cap,
                                       "kv_cache_usage": round(float(usage_now), 4), "threshold": threshold}}


async def _beam_events(req_id: str, created: int, model: str, choices: list[dict], chat: bool):
    """The SSE chunks of finished beams: (chat: a role chunk,) one chunk per beam, [DONE]."""
    head = {"id": req_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}
    if chat:
        yield sse({**head, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None} for c in choices]})
    for c in choices:
        part = {"delta": {"content": c["message"]["content"]}} if chat else {"text": c["text"]}
        yield sse({**head, "choices": [{"index": c["index"], **part, "logprobs": None,
                                        "finish_reason": c["finish_reason"]}]})
    yield SSE_DONE
