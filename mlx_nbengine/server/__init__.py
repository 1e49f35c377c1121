"""The server layer: the kernel's engine as an OpenAI-compatible HTTP endpoint.

Modules: `openai_shapes` (OpenAI's request fields checked into a `Call`; its response,
chunk and error shapes), `app` (the Starlette app: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models`` over `Engine.submit`), `journal` (one entry of figures
per request, for the agent view), `serve` (`ApiServer`: uvicorn on a daemon thread, with
start, stop and a watcher that stops it when the engine closes). Sits above the engine,
beside the notebook face (whose `%llm_serve` starts it); knows nothing of IPython.
"""

from mlx_nbengine.server.journal import Entry, Journal
from mlx_nbengine.server.openai_shapes import APIError, Limits
from mlx_nbengine.server.serve import DEFAULT_PORT, ApiServer, ServeError, is_loopback

__all__ = [
    "DEFAULT_PORT",
    "APIError",
    "ApiServer",
    "Entry",
    "Journal",
    "Limits",
    "ServeError",
    "is_loopback",
]
