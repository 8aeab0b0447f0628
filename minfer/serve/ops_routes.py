"""The routes clients and operators call beside generation (article §15): vLLM's and OpenAI's, so that their
tools find them.

| route | answers |
| --- | --- |
| GET /v1/models/{model} | one served model, as OpenAI's model object (the openai client's `models.retrieve`); 404 in OpenAI's error shape for an unknown id |
| POST /tokenize | vLLM's: `{"prompt"}` or `{"messages"}` (+ `add_special_tokens`, `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`, `return_token_strs`) -> `{"count", "max_model_len", "tokens", "token_strs"}` |
| POST /detokenize | vLLM's: `{"tokens": [ids]}` -> `{"prompt": text}` |
| GET /tokenizer_info | vLLM's: the tokenizer's class, special tokens (as text), chat template and `model_max_length`, which lm-eval's `tokenizer_backend=remote` reads (with /tokenize and /detokenize) instead of downloading a tokenizer |
| GET /version | `{"version": minfer.__version__}` |
| GET, POST /ping | as /health (vLLM's and SageMaker's liveness route); open without the API key |

`vllm bench serve` calls /tokenize-style routes and /v1/models; a load balancer calls /ping.
"""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from minfer.serve.limits import check_message_chars, check_prompt_chars, read_json_body
from minfer.serve.protocol import APIError, _get_bool, chat_template_options, echo, normalize_messages, resolve_model

router = APIRouter()
OPEN_PATHS = frozenset({"/ping"})  # open even with --api-key, as /health


def _serving(request: Request):
    return request.app.state.serving


def model_card(serving, name: str) -> dict:
    """OpenAI's model object for one served name."""
    return {"id": name, "object": "model", "created": int(serving.started), "owned_by": "minfer",
            "root": getattr(serving.engine, "model_name", name), "parent": None,
            "max_model_len": serving.max_model_len}


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str):
    serving = _serving(request)
    if model not in serving.served_model_names:
        raise APIError(404, f"The model `{echo(model)}` does not exist. Served: {', '.join(serving.served_model_names)}",
                       param="model", code="model_not_found", type="invalid_request_error")
    return model_card(serving, model)


def _token_text(token) -> str | None:
    """A special token as its text (transformers may hold an `AddedToken`)."""
    return None if token is None else str(getattr(token, "content", token))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does, by calling /tokenize and
    /detokenize for the ids. lm-eval's `RemoteTokenizer` (`lm_eval/utils.py`) reads `eos_token`, `bos_token`,
    `pad_token` (strings it sends to /tokenize) and `chat_template` (rendered with Jinja on its side)."""
    serving = _serving(request)
    tok = serving.engine.tokenizer
    hf = getattr(tok, "hf", tok)
    return {"tokenizer_class": type(hf).__name__, "model_max_length": serving.max_model_len,
            "vocab_size": getattr(tok, "vocab_size", None),
            **{name: _token_text(getattr(hf, name, None)) for name in ("eos_token", "bos_token", "pad_token",
                                                                       "unk_token")},
            "eos_token_ids": list(getattr(tok, "eos_token_ids", ()) or ()),
            "chat_template": getattr(hf, "chat_template", None)}


@router.get("/version")
async def version():
    from minfer import __version__

    return {"version": __version__}


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request):
    from minfer.serve.routes import health

    return await health(request)


@router.post("/tokenize")
async def tokenize(request: Request):
    """vLLM's /tokenize: a prompt (special tokens added unless `add_special_tokens: false`) or chat messages
    (rendered with the chat template; `add_special_tokens` defaults to false there, as in vLLM)."""
    serving = _serving(request)
    body = await read_json_body(request, serving.limits)
    resolve_model(body, serving.served_model_names)
    tok = serving.engine.tokenizer
    strs = _get_bool(body, "return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "give exactly one of 'prompt' (a string) and 'messages' (a chat)", param="prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise APIError(400, f"prompt must be a string, got {echo(prompt)}", param="prompt")
        check_prompt_chars([prompt], serving.limits, serving.max_model_len)
        special = _get_bool(body, "add_special_tokens", True)
        fn = functools.partial(tok.encode, prompt, add_special_tokens=special)
    else:
        check_message_chars(body["messages"], serving.limits, serving.max_model_len)
        messages = normalize_messages(body["messages"])
        options = chat_template_options(body)  # as /v1/chat/completions renders them
        special = _get_bool(body, "add_special_tokens", False)

        def fn():
            text = tok.apply_chat_template(messages, **options)
            return tok.encode(text, add_special_tokens=special)
    def answer():  # in a worker thread, the answer's JSON too: a million token strings must not hold the loop
        try:
            ids = fn()
        except (ValueError, TypeError, KeyError) as exc:
            raise APIError(400, f"could not tokenize: {exc}",
                           param="prompt" if "prompt" in body else "messages") from None
        out = {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": list(ids)}
        if strs:
            out["token_strs"] = [serving.tok_text(t) for t in ids]
        return JSONResponse(out)

    return await run_in_threadpool(answer)


@router.post("/detokenize")
async def detokenize(request: Request):
    """vLLM's /detokenize: token ids -> text (special tokens kept, as vLLM's default)."""
    serving = _serving(request)
    body = await read_json_body(request, serving.limits)
    resolve_model(body, serving.served_model_names)
    ids = body.get("tokens")
    vocab = getattr(serving.engine.model_config, "vocab_size", None) or getattr(serving.engine.tokenizer,
                                                                                "vocab_size", None)

    def answer():  # in a worker thread: millions of ids to check and decode must not hold the event loop
        if (not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids)
                or (vocab is not None and any(not 0 <= t < vocab for t in ids))):
            raise APIError(400, f"tokens must be a list of token ids (integers in [0, {vocab})), got {echo(ids)}",
                           param="tokens")
        try:
            text = serving.engine.tokenizer.decode(ids, skip_special_tokens=False)
        except (ValueError, TypeError, OverflowError) as exc:
            raise APIError(400, f"could not detokenize: {exc}", param="tokens") from None
        return {"prompt": text}

    return await run_in_threadpool(answer)
