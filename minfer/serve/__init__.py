"""`minfer.serve`: an OpenAI-compatible HTTP server around `LLMEngine` (article §9, §15, §16).

Split as vLLM's `vllm/entrypoints/openai/`, one job a module, in the order a request meets them:

- `python -m minfer.serve [flags]`: the command line (`__main__.py`), flags named as vLLM's.
- `build_app(engine, ...)`: the FastAPI app, its routes, auth and error handlers (`routes.py`), usable in-process.
- `connection.py`: uvicorn's HTTP/1.1 protocol with deadlines on a client's headers and body.
- `limits.py`: admission control, `ServerLimits`: what one request may ask (size, type, fan-out, prompt
  length), refused before the work it would cost.
- `protocol.py`: the OpenAI API's shapes: request bodies -> `SamplingParams` and prompts, `APIError`, the JSON
  answers and streamed chunks.
- `serving.py`: one generation request end to end: submit, then a JSON answer or a server-sent-event stream.
- `fallbacks.py`: what happens when a request cannot get all it asked for (chapter 15): load shedding (503),
  the time limit, `truncate_prompt_tokens`, the max_tokens cap under KV pressure.
- `ops_routes.py`: `/v1/models/{id}`, `/tokenize`, `/detokenize`, `/version`, `/ping`; `legacy_api.py`: vLLM's
  legacy `POST /generate`.
- `EngineLoop`: the engine's own thread and its bridge to asyncio (`engine_loop.py`): the in-process client.
- `MPEngineClient`: the engine core in a process of its own, over ZMQ (`engine_client.py`; the process body is
  `engine_core.py`); what `python -m minfer.serve` uses unless `--no-engine-process`.
- `DPEngineClient`: N engine clients (replicas) behind a routing policy, with one client's interface
  (`router.py`); what `--data-parallel-size N` uses (chapter 12b).
- `ServerMetrics`: the Prometheus metrics (`metrics.py`).
"""

import minfer.envs as envs

# The process `python -m minfer.serve` started runs this before anything imports torch (`__main__` comes
# after its package): its OpenMP threads must know how to wait before torch loads libgomp.
if envs.started_as_server():
    envs.configure_process("api_server")

from minfer.serve.engine_client import EngineView, InprocClient, MPEngineClient
from minfer.serve.engine_loop import EngineLoop
from minfer.serve.limits import ServerLimits
from minfer.serve.metrics import ServerMetrics
from minfer.serve.protocol import APIError
from minfer.serve.router import DPEngineClient
from minfer.serve.routes import build_app

__all__ = ["APIError", "DPEngineClient", "EngineLoop", "EngineView", "InprocClient", "MPEngineClient", "ServerLimits", "ServerMetrics",
           "build_app"]
