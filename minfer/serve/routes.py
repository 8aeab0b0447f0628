"""The server's HTTP routes and `build_app`, the FastAPI app that holds them (article §9: what `vllm serve` runs).

| route | answers |
| --- | --- |
| GET /health | `{"status": "ok"}`, restarting the engine loop's thread if it is not running; 503 once the engine process died |
| GET /v1/models | the served model names, as OpenAI's model list |
| POST /v1/completions | OpenAI's completions: a prompt (or several, or token ids) in, text out |
| POST /v1/chat/completions | OpenAI's chat completions: messages in, rendered with the model's chat template |
| GET /v1/stats | engine statistics as JSON, for the demo page |
| GET /metrics | the Prometheus metrics (`metrics.py`) |
| GET / | the demo page (`static/index.html`), with a Content-Security-Policy that allows only its own code |
| GET /v1/models/{id}, POST /tokenize, /detokenize, GET /version, /ping | `ops_routes.py` (vLLM's and OpenAI's extra routes) |
| POST /generate | vLLM's legacy api_server route (`legacy_api.py`) |
| POST /v1/responses, GET/DELETE /v1/responses/{id}, GET .../input_items, POST .../cancel | OpenAI's Responses API (`responses.py`) |

Each GET route also answers HEAD (the same headers, no body). Each handler only parses (with `protocol`, after
the admission checks of `limits`) and hands over (to `serving.OpenAIServing`). They find what they share in
`request.app.state`, as the handlers of vLLM's `vllm/entrypoints/openai/api_server.py` do, so they are plain
module-level functions on one `APIRouter`. Every error, the framework's own 404 and 405 (with its `Allow`
header) included, is answered with OpenAI's error body and counted in the metrics.

With an API key every route needs `Authorization: Bearer <key>` except `PUBLIC_PATHS`: /health and /metrics
(open in vLLM too: a load balancer and Prometheus read them) and the demo page, which holds no data and asks
for the key itself. The OpenAPI schema is off unless asked for, and then behind the key; the interactive docs
(/docs, /redoc) are never served, since FastAPI's load Swagger UI and ReDoc from a CDN. No route sends CORS
headers: a page from another origin cannot read an answer, nor post JSON without a preflight.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import secrets
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from minfer.sampling_params import SamplingParams
from minfer.serve.beam_search import beam_search_params, beam_search_requested, serve_beam_search
from minfer.serve.engine_loop import EngineLoop
from minfer.serve.fallbacks import FallbackConfig, truncate_prompt_tokens_setting
from minfer.serve.legacy_api import router as legacy_router
from minfer.serve.limits import (
    FramingMiddleware,
    ServerLimits,
    check_fan_out,
    check_message_chars,
    check_prompt_chars,
    check_rendered_chars,
    check_tool_chars,
    read_json_body,
)
from minfer.serve.metrics import ServerMetrics
from minfer.serve.ops_routes import router as ops_router
from minfer.serve.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    chat_template_options,
    check_utf8,
    context_overflow,
    echo,
    echo_setting,
    normalize_messages,
    parse_prompts,
    resolve_model,
    sampling_params,
)
from minfer.serve.responses import router as responses_router
from minfer.serve.serving import OpenAIServing

logger = logging.getLogger("minfer.serve")

STATIC_DIR = Path(__file__).parent / "static"
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/", "/ping"})  # open even with --api-key

router = APIRouter()


def _get(path: str):
    """A GET route that answers HEAD too (FastAPI's routes do not add HEAD: it would be a 405).

    HEAD is a route of its own, left out of the OpenAPI schema, which allows one operation id per function.
    """
    def register(endpoint):
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
        return router.get(path)(endpoint)
    return register


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


# ----------------------------------------------------------------------------------------------------------
# Routes
# ----------------------------------------------------------------------------------------------------------
@_get("/health")
async def health(request: Request):
    engine_loop = _serving(request).engine_loop
    if not engine_loop.alive and not getattr(engine_loop, "exit_reason", None):
        engine_loop.start()  # an in-process loop's thread is restarted; a dead engine process is not
    if not engine_loop.alive:
        raise APIError(503, getattr(engine_loop, "exit_reason", None) or "the engine is not running")
    return {"status": "ok"}


@_get("/v1/models")
async def models(request: Request):
    serving = _serving(request)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": int(serving.started), "owned_by": "minfer",
         "root": getattr(serving.engine, "model_name", name), "parent": None,
         "max_model_len": serving.max_model_len}
        for name in serving.served_model_names]}


async def _read(request: Request) -> tuple[OpenAIServing, dict, str]:
    """What both generation routes read first, in this order: the body (declared JSON, within the size and
    time limits), the model."""
    serving = _serving(request)
    body = await read_json_body(request, serving.limits)  # a large body is parsed in a worker thread
    return serving, body, resolve_model(body, serving.served_model_names)


async def _off_loop(body: dict, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` (the sampling-params check: long id lists, grammars compiled without the tokenizer)
    in a worker thread when the request is large (an approximation: the body had many items), else inline."""
    if _large(body):
        return await run_in_threadpool(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _large(body: dict) -> bool:
    return any(isinstance(v, (list, dict, str)) and len(v) > 1000 for v in body.values())


async def _parse(request: Request, *, chat: bool) -> tuple[OpenAIServing, dict, str, SamplingParams]:
    """`_read`, then the sampling parameters."""
    serving, body, model = await _read(request)
    return serving, body, model, await _off_loop(body, sampling_params, body, chat=chat,
                                                 defaults=serving.default_sampling_params)


@router.post("/v1/completions")
async def completions(request: Request):
    serving, body, model = await _read(request)
    beam = beam_search_requested(body)
    # Beam search reads its own fields (`serve.beam_search`); sampling's parser would refuse best_of != n.
    params = (await _off_loop(body, beam_search_params, body))[0] if beam else await _off_loop(
        body, sampling_params, body, chat=False, defaults=serving.default_sampling_params)
    prompts = parse_prompts(body)
    width = params.beam_width if beam else params.n
    check_fan_out(len(prompts), width, serving.limits)  # before tokenizing: these cost nothing yet
    check_prompt_chars(prompts, serving.limits, serving.max_model_len)

    truncating = truncate_prompt_tokens_setting(body, serving.max_model_len) is not None

    def tokenize() -> list:
        # One prompt at a time, each refused as soon as it cannot fit (unless it is to be truncated): what is
        # held is at most max_model_len ids per prompt, not every prompt's whole tokenization.
        out = []
        for i, p in enumerate(prompts):
            ids = serving.engine.tokenizer.encode(p) if isinstance(p, str) else p
            if not truncating and len(ids) >= serving.max_model_len:
                raise context_overflow(f"{'the prompt' if len(prompts) == 1 else f'prompt[{i}]'} has {len(ids)} "
                                       f"tokens, but max_model_len is {serving.max_model_len}: that leaves no room "
                                       "for output. Shorten the prompt or raise max_model_len.",
                                       serving.max_model_len)
            out.append(ids)
        return out

    texts = list(prompts)
    check_utf8(prompts, "prompt")  # before the tokenizer, whose own message names its internals
    try:  # off the engine thread: a megabyte of prompt text must not stall everyone's decoding
        prompts = await run_in_threadpool(tokenize)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizer's message names its internals: not for the client
        logger.info("prompt not tokenized: %s", exc)
        raise APIError(400, f"the prompt could not be tokenized ({type(exc).__name__})", param="prompt") from None
    if beam:
        return await serve_beam_search(serving, request, body, prompts, model,
                                       serving.default_sampling_params.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS))
    echo_on, score_only = echo_setting(body)
    echo_prompts = None
    if echo_on:  # a prompt given as token ids is echoed as their text

        def echo_texts():  # in a worker thread: millions of ids to check and decode must not hold the loop
            vocab = serving.engine.model_config.vocab_size
            for ids in prompts:  # checked before decoding: the tokenizer overflows on ids outside [0, 2**32)
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise APIError(400, f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}",
                                   param="prompt")
            return [t if isinstance(t, str) else serving.engine.tokenizer.decode(ids, skip_special_tokens=False)
                    for t, ids in zip(texts, prompts)]

        echo_prompts = await run_in_threadpool(echo_texts)
    return await serving.generate(request, body, prompts, params, chat=False, model=model, id_prefix="cmpl",
                                  default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS, echo_prompts=echo_prompts,
                                  score_only=score_only)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    serving, body, model = await _read(request)
    if beam_search_requested(body):
        return await _chat_beam_search(request, serving, body, model)
    params = await _off_loop(body, sampling_params, body, chat=True, defaults=serving.default_sampling_params)
    check_fan_out(1, params.n, serving.limits)
    return await serve_chat(request, serving, body, model, params)


async def serve_chat(request: Request, serving: OpenAIServing, body: dict, model: str, params: SamplingParams):
    """A chat body whose sampling parameters are read: render its messages (with its tools and template
    controls), then generate. Also what /v1/responses runs, on the chat body it translates to."""
    tools, messages, options = check_chat(serving, body)
    params = tools_params(tools, params)
    prompt = await _render_chat(serving, messages, tools, options)
    return await serving.generate(request, body, [prompt], params, chat=True, model=model, id_prefix="chatcmpl",
                                  default_max_tokens=None, tools=tools)


def check_chat(serving: OpenAIServing, body: dict):
    """What the chat route and /tokenize check of a chat body before rendering it, in this order: its messages
    and tools within the size limits, every string in them valid Unicode, each `tool` message with its
    `tool_call_id` (OpenAI requires it), the template controls, the tools. Returns (the
    `serve.tools.ToolRequest` or None, the messages to render, the template options).

    Raises:
        APIError(400) naming the field.
    """
    check_message_chars(body.get("messages"), serving.limits, serving.max_model_len)
    if body.get("tools"):  # counted even when tool_choice is "none": they are checked, if not shown
        check_tool_chars(body.get("messages"), body.get("tools"), serving.limits, serving.max_model_len)
    check_utf8(body.get("messages"), "messages")
    check_utf8(body.get("tools"), "tools")
    check_tool_messages(body.get("messages"))
    if body.get("chat_template") is not None:
        raise APIError(400, "a request's own chat_template is not supported by minfer: the server renders with the "
                            "model's template", param="chat_template")
    options = chat_template_options(body)
    from minfer.serve.tools import parse_tools

    tools = parse_tools(body)
    messages = body.get("messages") if tools is not None else normalize_messages(body.get("messages"))
    return tools, messages, options


def check_tool_messages(messages) -> None:
    """APIError(400, param="messages") for a `tool` message without a string `tool_call_id` (OpenAI's API
    requires it: it says which call the result answers)."""
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(m, dict) and m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"messages[{i}]: a tool message needs its tool_call_id (the id of the call it "
                                    f"answers), got {echo(call_id)}", param=f"messages[{i}].tool_call_id")


async def _chat_beam_search(request: Request, serving: OpenAIServing, body: dict, model: str):
    """`use_beam_search` on chat: the conversation rendered, then `serve.beam_search` (an omitted max_tokens:
    the server's generation-config default, else up to max_model_len, as chat sampling)."""
    if body.get("tools"):
        raise APIError(400, "tools are not supported with use_beam_search", param="tools")
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}  # chat's newer name for it
    params = beam_search_params(body)[0]
    check_fan_out(1, params.beam_width, serving.limits)
    check_message_chars(body.get("messages"), serving.limits, serving.max_model_len)
    check_utf8(body.get("messages"), "messages")
    messages = normalize_messages(body.get("messages"))
    prompt = await _render_chat(serving, messages, None, chat_template_options(body))
    return await serve_beam_search(serving, request, body, [prompt], model,
                                   serving.default_sampling_params.get("max_tokens", serving.max_model_len), chat=True)


async def _render_chat(serving: OpenAIServing, messages, tools, options: dict,
                       add_special_tokens: bool = False) -> list[int]:
    """The chat prompt's token ids: rendered with the template (and `tools`, a `serve.tools.ToolRequest`,
    shown as the server's `tool_prompt` mode says: `serve.tools.render_text`), its length checked
    (`limits.check_rendered_chars`), then tokenized; all off the event loop. `options`: the chat-template
    controls (`protocol.chat_template_options`).

    Under `--tool-prompt minfer`, an "auto" request whose tool prompt is over `serving.tool_prompt_max_tokens`
    tokens is rendered as under `template` (no tool prompt), with a warning in the log: a chat that tools
    ride along with (Open WebUI's 36) is served at the size of its messages rather than refused.

    Token ids, not text: the template already holds any BOS, and the engine would add another when it
    tokenized a string.
    """
    tokenizer = serving.engine.tokenizer

    def render(mode: str) -> tuple[str, str | None]:
        if tools is not None:
            from minfer.serve.tools import render_text

            return render_text(tokenizer, messages, tools, options, mode)
        return tokenizer.apply_chat_template(messages, **options), None

    try:
        text, tool_text = await run_in_threadpool(render, serving.tool_prompt)
    except (ValueError, TypeError, KeyError) as exc:
        raise APIError(400, f"messages could not be rendered with the chat template: {exc}",
                       param="messages") from None
    check_rendered_chars(text, serving.limits, serving.max_model_len, "tools" if tools is not None else "messages")
    try:
        if tool_text is not None and not tools.constrained:
            spent = await run_in_threadpool(lambda: len(tokenizer.encode(tool_text, add_special_tokens=False)))
            if spent > serving.tool_prompt_max_tokens:
                logger.warning("tool_choice \"auto\" with %d tools: minfer's tool prompt would add %d tokens, "
                               "over --tool-prompt-max-tokens %d; the tools are not shown to the model",
                               len(tools.functions), spent, serving.tool_prompt_max_tokens)
                text, _ = await run_in_threadpool(render, "template")
        return await run_in_threadpool(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as exc:  # noqa: BLE001 - the tokenizer's message names its internals: not for the client
        logger.info("chat prompt not tokenized: %s", exc)
        raise APIError(400, f"the prompt could not be tokenized ({type(exc).__name__})", param="messages") from None


def tools_params(tools, params: SamplingParams) -> SamplingParams:
    """`params` with the call's grammar for a "required" or named tool_choice of `tools` (a
    `serve.tools.ToolRequest` or None). APIError(400) for a forced call together with a response_format."""
    from minfer.serve.tools import guided

    g = guided(tools) if tools is not None else None
    if g is not None:
        if params.guided_decoding is not None:
            raise APIError(400, "tool_choice \"required\" or a named function already constrains the output; "
                                "leave out response_format / guided_*", param="tool_choice")
        params = params.clone(guided_decoding=g)
    return params


@_get("/v1/stats")
async def stats(request: Request):
    serving = _serving(request)
    engine_loop = serving.engine_loop
    ttfts = list(engine_loop.recent_ttfts)
    recent = [t for _, t in ttfts[-16:]]
    return {"model": serving.model_id, "time": time.time(), "uptime_s": time.time() - serving.started,
            "max_model_len": serving.max_model_len, "stats": engine_loop.latest_stats,
            "kv_pool": engine_loop.kv_pool_info,
            "recent_ttfts": [{"time": t, "ttft_s": v} for t, v in ttfts],
            "ttft_recent_mean_s": sum(recent) / len(recent) if recent else None,
            "num_requests_total": engine_loop.num_requests_added, "num_steps": engine_loop.num_steps,
            "num_step_errors": engine_loop.num_step_errors, "engine_loop_alive": engine_loop.alive,
            "api_server_pid": os.getpid(), "engine_pid": getattr(engine_loop, "engine_pid", None) or os.getpid(),
            "limits": serving.limits.as_dict()}


@_get("/metrics")
async def prometheus_metrics(request: Request):
    body, content_type = request.app.state.metrics.render()
    return Response(body, headers={"Content-Type": content_type})


@_get("/")
async def index(request: Request):
    page, headers = request.app.state.page
    return Response(page, media_type="text/html", headers=headers)


def page_with_headers(html: str) -> tuple[bytes, dict[str, str]]:
    """The demo page and its security headers: a CSP that lets it run only its own code, and no framing.

    The page's one inline `<script>` and one `<style>` are allowed by their SHA-256 (CSP level 2), so no
    'unsafe-inline' is needed and an injected script or style would not run; it may fetch only its own origin
    and load nothing else (`default-src 'none'`; the favicon is a `data:` URL). It writes model text with
    `textContent`, never as markup. `frame-ancestors 'none'` and `X-Frame-Options` (for older browsers) keep
    other sites from framing it to trick a click.
    """
    code = re.sub(r"<!--.*?-->", "", html, flags=re.S)  # a comment may name the tags too

    def sources(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", code, re.S)
        return " ".join("'sha256-%s'" % base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()
                        for b in blocks) or "'none'"

    policy = (f"default-src 'none'; script-src {sources('script')}; style-src {sources('style')}; "
              "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode(), {"Content-Security-Policy": policy, "X-Frame-Options": "DENY",
                           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


# ----------------------------------------------------------------------------------------------------------
# Errors and auth
# ----------------------------------------------------------------------------------------------------------
def error_response(metrics: ServerMetrics, err: APIError) -> JSONResponse:
    metrics.count_error(err.status)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _api_error(request: Request, exc: APIError):
    return error_response(request.app.state.metrics, exc)


async def _http_error(request: Request, exc: StarletteHTTPException):
    """The framework's own errors (no such route, wrong method) in OpenAI's shape, with their headers; a 405
    names every method the path takes in `Allow`, which HTTP requires."""
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = _allowed_methods(request.scope)
    return error_response(request.app.state.metrics, APIError(
        exc.status_code, str(exc.detail), type="not_found_error" if exc.status_code == 404 else None,
        headers=headers))


def _allowed_methods(scope) -> str:
    """The methods of every route at this path (Starlette's own 405 names only the first route's)."""
    methods = set()
    for route in [*router.routes, *ops_router.routes, *legacy_router.routes, *responses_router.routes]:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


async def _internal(request: Request, exc: Exception):
    logger.exception("internal error")
    return error_response(request.app.state.metrics, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


_EXCEPTION_HANDLERS = {APIError: _api_error, StarletteHTTPException: _http_error, Exception: _internal}


class _AuthMiddleware:
    """401 for every path but `PUBLIC_PATHS` without `Authorization: Bearer <api_key>`.

    A list of what is open rather than of what is closed: a route added later (or FastAPI's /openapi.json)
    is behind the key until someone decides otherwise. A plain ASGI middleware: Starlette's
    `BaseHTTPMiddleware` would get in the way of streaming.
    """

    def __init__(self, app, api_key: str, metrics: ServerMetrics):
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            # compare_digest: the time taken must not tell how much of a guessed key was right
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                response = error_response(self.metrics, APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key given "
                         "to --api-key", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------------------
@asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.engine_loop.start()
    try:
        yield
    finally:
        app.state.engine_loop.stop()


def build_app(engine, served_model_names: list[str] | str | None = None, api_key: str | None = None,
              log_requests: bool = True, engine_loop: EngineLoop | None = None, limits: ServerLimits | None = None,
              enable_docs: bool = False, fallbacks: FallbackConfig | None = None, tool_prompt: str = "template",
              tool_prompt_max_tokens: int | None = None) -> FastAPI:
    """A FastAPI app serving `engine` with OpenAI's API.

    Args:
        engine: an `LLMEngine` (or a fake with its interface), owned by the app's engine-loop thread; or, with
            an `MPEngineClient` as `engine_loop`, its `EngineView` (tokenizer, model config, KV pool).
        served_model_names: names clients may put in "model" (the first one is reported); default:
            `engine.model_name`.
        api_key: when set, every route but `PUBLIC_PATHS` needs `Authorization: Bearer <api_key>`.
        log_requests: log each request's id, prompt length and sampling parameters.
        engine_loop: the engine client: an existing `EngineLoop` for `engine` or a started `MPEngineClient`
            (`engine_client.py`; default: a new `EngineLoop`, with its own metrics).
        limits: what one request may ask (default: `ServerLimits()`); a `max_prompt_chars` of None is derived
            from the engine's tokenizer here. The connection limits in it are uvicorn's to enforce
            (`connection.uvicorn_options`).
        enable_docs: serve the OpenAPI schema at /openapi.json (behind the key, if one is set).
        fallbacks: load shedding, time limit, KV-pressure cap (`fallbacks.FallbackConfig`; default: all off).
        tool_prompt: when minfer writes its own tool prompt for a template that ignores tools: "template"
            (only for a forced tool_choice, as vLLM shows "auto" tools to the template alone) or "minfer" (for
            "auto" too, within `tool_prompt_max_tokens`; default `serve.tools.DEFAULT_TOOL_PROMPT_MAX_TOKENS`).
            The model's generation-config defaults come from `engine.default_sampling_params`
            (`minfer.config.diff_sampling_param`).

    Returns:
        the app; its engine loop starts with the app (lifespan) or on the first request.
    """
    if isinstance(served_model_names, str):
        served_model_names = [served_model_names]
    names = list(served_model_names or [getattr(engine, "model_name", "minfer")])
    if engine_loop is None:
        engine_loop = EngineLoop(engine, ServerMetrics(names[0]))
    limits = (limits or ServerLimits()).resolve(engine.tokenizer, engine.model_config.max_model_len)
    app = FastAPI(title="minfer", version="0.1", lifespan=_lifespan, exception_handlers=_EXCEPTION_HANDLERS,
                  description="OpenAI-compatible server of minfer (a teaching LLM inference engine).",
                  openapi_url="/openapi.json" if enable_docs else None, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.engine_loop = engine_loop
    app.state.metrics = engine_loop.metrics or ServerMetrics(names[0])
    app.state.served_model_names = names
    app.state.page = page_with_headers((STATIC_DIR / "index.html").read_text(encoding="utf-8"))
    app.state.serving = OpenAIServing(engine, engine_loop, names, log_requests, limits, fallbacks,
                                      tool_prompt=tool_prompt, tool_prompt_max_tokens=tool_prompt_max_tokens)
    app.state.metrics.set_cache_config(cache_config_labels(engine_loop, engine))
    if api_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key, metrics=app.state.metrics)
    app.state.metrics.instrument_http(app)  # outside the key check: a 401 is counted too

    async def refuse(scope, receive, send, err: APIError) -> None:
        await error_response(app.state.metrics, err)(scope, receive, send)

    app.add_middleware(FramingMiddleware, limits=limits, respond=refuse)  # outermost: before the key is read
    app.include_router(router)
    app.include_router(ops_router)
    app.include_router(legacy_router)
    app.include_router(responses_router)
    return app


def cache_config_labels(engine_loop, engine) -> dict:
    """The labels of `cache_config_info`: the KV pool's size and the engine's cache settings (vLLM's names
    where it has them: block_size, num_gpu_blocks, num_cpu_blocks, cache_dtype, enable_prefix_caching)."""
    pool = dict(getattr(engine_loop, "kv_pool_info", None) or {})
    args = getattr(engine_loop, "engine_args", None) or getattr(engine, "args", None)
    labels = {"block_size": pool.get("block_size"), "num_gpu_blocks": pool.get("num_blocks"),
              "num_cpu_blocks": pool.get("num_cpu_blocks"), "cache_bytes": pool.get("bytes")}
    for name, field in (("cache_dtype", "kv_cache_dtype"), ("enable_prefix_caching", "enable_prefix_caching"),
                        ("swap_space", "swap_space"), ("gpu_memory_utilization", "gpu_memory_utilization")):
        labels[name] = getattr(args, field, None)
    return labels
