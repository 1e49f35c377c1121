"""The engine layer: continuous batching, streaming and the prefix cache wired together.

Modules, one concept each: `engine` (the `Engine` face), `request` (the caller's handle,
`Completion`, `Report`), `events` (what a stream yields), `generation` (the generation
thread), `batch` (the decode batch's caches), `sequence` (one request on the generation
thread), `sampling`, `text` (detokenizing and stop strings), `cacheio` (the cache-I/O
thread). Knows nothing of IPython.
"""

from mlx_nbengine.engine.engine import Engine
from mlx_nbengine.engine.events import BlockEvent, Event, Finished, Progress, TextDelta
from mlx_nbengine.engine.request import (
    BlockReport,
    Completion,
    EngineClosedError,
    InvalidRequestError,
    PromptTooLongError,
    Report,
    Request,
)

__all__ = [
    "BlockEvent",
    "BlockReport",
    "Completion",
    "Engine",
    "EngineClosedError",
    "Event",
    "Finished",
    "InvalidRequestError",
    "Progress",
    "PromptTooLongError",
    "Report",
    "Request",
    "TextDelta",
]
