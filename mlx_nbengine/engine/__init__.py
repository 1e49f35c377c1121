"""The engine layer: continuous batching, streaming and the prefix cache wired together.

Modules, one concept each: `engine` (the `Engine` face), `request` (the caller's handle,
`Completion`, `Report`), `events` (what a stream yields; block sources and reasons),
`reasons` (why a block was computed), `generation` (the generation thread), `batch` (the
decode batch's caches), `sequence` (one request on the generation thread), `sampling`,
`text` (detokenizing and stop strings), `cacheio` (the cache-I/O thread), `ledger` (what
the store view shows over time), `memory` (giving freed memory back). Knows nothing of
IPython.
"""

from mlx_nbengine._blas import ensure_fast_blas

# Before the modules below import MLX: its matmuls bind to a BLAS on first import.
ensure_fast_blas()

from mlx_nbengine.engine.engine import Engine  # noqa: E402
from mlx_nbengine.engine.events import (  # noqa: E402
    KEPT_BOUNDARY,
    REASONS,
    BlockEvent,
    Event,
    Finished,
    Progress,
    TextDelta,
)
from mlx_nbengine.engine.request import (  # noqa: E402
    BlockReport,
    Completion,
    EngineClosedError,
    InvalidRequestError,
    PromptTooLongError,
    Report,
    Request,
)

__all__ = [
    "KEPT_BOUNDARY",
    "REASONS",
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
