"""`minfer.serve`: an OpenAI-compatible HTTP server around `LLMEngine` (article §9, §15, §16).

- `python -m minfer.serve [flags]`: the command line (`minfer/serve/__main__.py`), flags named as vLLM's.
- `build_app(engine, ...)`: the FastAPI app (`minfer/serve/api.py`), usable in-process.
- `ServerMetrics`: the Prometheus metrics (`minfer/serve/metrics.py`).
"""

from minfer.serve.api import APIError, EngineLoop, build_app
from minfer.serve.metrics import ServerMetrics

__all__ = ["APIError", "EngineLoop", "ServerMetrics", "build_app"]
