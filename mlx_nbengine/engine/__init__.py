"""The engine layer: continuous batching, streaming and the prefix cache wired together.

Modules, one concept each. The face: `engine` (`Engine`), `storeface` (its block-store part:
note, warning, store view, clearing), `request` (the caller's handle), `results`
(`Completion`, `Report`, `BlockReport`, `Finished`), `events` (what a stream yields; block
reasons), `prompts` (prompts to token ids), `internals` (what tests and tools reach). The
parts the generation thread owns: `scheduler` (admission, groups, joins; no thread),
`restores` (hot cache or disk: where a prefill starts), `steps` (where prefill steps end),
`runner` (the model calls), `decoding` (pipelined decode steps), `batch` (the decode batch's
caches), `checkpoints` (saves to the store), `hot` (the hot cache), `sequence` (one
request), `sampling`, `text` (detokenizing, stop strings), `reasons` (why a block was
computed), `vision`. The threads: `generation` (the inbox and loop around the scheduler),
`cacheio` (the block store's thread), with `blockstore` (opening the store, its identity and
figures), `ledger` (what the store view shows over time) and `memory` (giving freed memory
back). Knows nothing of IPython.
"""

from mlx_nbengine._blas import ensure_fast_blas

# Before the modules below import MLX: its matmuls bind to a BLAS on first import.
ensure_fast_blas()

from mlx_nbengine.engine.config import EngineConfig  # noqa: E402
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
    EngineClosedError,
    InvalidRequestError,
    PromptTooLongError,
    Request,
)
from mlx_nbengine.engine.results import BlockReport, Completion, Report  # noqa: E402

__all__ = [
    "KEPT_BOUNDARY",
    "REASONS",
    "BlockEvent",
    "BlockReport",
    "Completion",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "Event",
    "Finished",
    "InvalidRequestError",
    "Progress",
    "PromptTooLongError",
    "Report",
    "Request",
    "TextDelta",
]
