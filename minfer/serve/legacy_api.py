"""vLLM's legacy `POST /generate` (`vllm.entrypoints.api_server`, the server the article's §16 command starts).

    POST /generate {"prompt": "Hello", "max_tokens": 16, "temperature": 0, "stream": false, ...}
    -> {"text": ["Hello, world..."]}          one entry per completion (n), each the prompt + its text

The body is the prompt, `stream`, and `SamplingParams`' own fields by their names (n, temperature, top_p,
top_k, max_tokens (default 16, as vLLM's SamplingParams), stop, seed, ignore_eos, ...); a field
SamplingParams does not have, or a bad value, is a 400 in OpenAI's error shape (vLLM's server would answer
500). With `"stream": true` the answer is a sequence of such JSON objects, each the whole text so far,
each followed by a NUL byte (`\\0`), as vLLM's api_server streams them. The server's limits and fallbacks
apply as on the OpenAI routes (`truncate_prompt_tokens`, `request_timeout`, the waiting-requests limit).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from minfer.sampling_params import SamplingParams
from minfer.serve.fallbacks import (
    Deadline,
    GatedGroup,
    events_until,
    request_timeout_setting,
    timed_out_snapshots,
    truncate_prompt_tokens_setting,
    truncate_prompts,
)
from minfer.serve.guided import check as check_guided
from minfer.serve.limits import check_fan_out, check_prompt_chars, read_json_body
from minfer.serve.protocol import APIError, check_stop_token_ids, check_utf8, echo, fit_max_tokens, param_of
from minfer.serve.serving import _collect_unless_disconnected, _SSEResponse

router = APIRouter()

LEGACY_DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default
_NOT_SAMPLING = {"prompt", "stream", "truncate_prompt_tokens", "request_timeout", "model"}
# What a client may set: SamplingParams' public fields. The engine's own (`_eos_token_ids`, filled in from the
# tokenizer) are not a client's to choose.
PUBLIC_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)
                                   if f.init and not f.name.startswith("_"))


def legacy_sampling_params(body: dict) -> SamplingParams:
    """The body's fields other than prompt/stream as `SamplingParams(**fields)`; APIError(400) naming the
    field when one is unknown, private (`_eos_token_ids`) or invalid."""
    fields = {k: v for k, v in body.items() if k not in _NOT_SAMPLING}
    unknown = sorted(k for k in fields if k not in PUBLIC_SAMPLING_FIELDS)
    if unknown:
        raise APIError(400, f"not a sampling parameter: {echo(unknown[0])}", param=echo(unknown[0], 64))
    try:
        return SamplingParams(**fields)
    except TypeError as exc:  # an unknown keyword
        raise APIError(400, f"not a sampling parameter: {exc}", param=None) from None
    except ValueError as exc:
        raise APIError(400, str(exc).replace("SamplingParams.", ""), param=param_of(exc)) from None


@router.post("/generate")
async def generate(request: Request):
    serving = request.app.state.serving
    body = await read_json_body(request, serving.limits)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, f"prompt must be a non-empty string, got {echo(prompt)}", param="prompt")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean, got {echo(stream)}", param="stream")
    if "model" in body and body["model"] not in (None, *serving.served_model_names):
        raise APIError(404, f"The model `{echo(body['model'])}` does not exist", param="model",
                       code="model_not_found")
    params = legacy_sampling_params(body)
    if params.guided_decoding is not None:  # compiled here so that a bad schema/regex names its field, not "prompt"
        check_guided(params.guided_decoding, "guided_decoding")
    check_fan_out(1, params.n, serving.limits)
    check_prompt_chars([prompt], serving.limits, serving.max_model_len)
    check_utf8(prompt, "prompt")  # echoed in the answer, and the tokenizer's own message names its internals
    check_stop_token_ids(params, serving.vocab_size)
    try:
        ids = await run_in_threadpool(serving.engine.tokenizer.encode, prompt)
    except Exception as exc:  # noqa: BLE001 - the tokenizer's message names its internals: not for the client
        raise APIError(400, f"the prompt could not be tokenized ({type(exc).__name__})", param="prompt") from None
    keep = truncate_prompt_tokens_setting(body, serving.max_model_len)
    timeout = request_timeout_setting(body, serving.fallbacks)
    if keep is not None and len(ids) > keep and serving.engine_loop.metrics is not None:
        serving.engine_loop.metrics.count_fallback("truncate_prompt_tokens")
    [ids] = truncate_prompts([ids], keep)
    params = fit_max_tokens(params, len(ids), serving.max_model_len, LEGACY_DEFAULT_MAX_TOKENS)
    arrival = time.perf_counter()
    serving.gate.admit(1)
    group = GatedGroup(serving.engine_loop, f"generate-{uuid.uuid4().hex}", 1, serving.gate)
    await group.submit([ids], [params], arrival)
    deadline = Deadline(arrival, timeout)

    def answer(snap) -> bytes:
        return json.dumps({"text": [prompt + o.text for o in snap.outputs]}, ensure_ascii=False).encode()

    if stream:
        async def results():
            try:
                async for snap in events_until(group, deadline):
                    yield answer(snap) + b"\0"
                if deadline.expired:
                    group.abort()
            finally:
                group.abort()

        return _SSEResponse(results(), media_type="application/json")
    final = await _collect_unless_disconnected(request, group, group.rids[0], deadline)
    if final is None:
        return Response(status_code=499)
    snap = (timed_out_snapshots(group, final, [ids], params.n)[0] if deadline.expired else final[group.rids[0]])
    return Response(answer(snap), media_type="application/json")
