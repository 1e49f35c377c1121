"""What a request's stream yields, in order.

An *event* is a small frozen dataclass put on the request's queue by the generation
thread and read by whoever iterates `Request.stream()` (usually the kernel's main
thread). The stream of one request is:

- zero or more `BlockEvent`: one per prompt block, as soon as its source is known
  (restored from memory or disk, or computed by a prefill step);
- zero or more `Progress`: prefill progress after every step (``phase="prefill"``)
  and the restore (``phase="restore"``);
- zero or more `TextDelta`: newly decoded text, never cut inside a stop string;
- exactly one `Finished` last (unless the request failed: then the stream raises).

Block sources are the names the report and widgets use: ``"memory"`` (the hot cache
of the previous request was reused), ``"disk"`` (records restored from the store),
``"computed"`` (prefilled now).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from mlx_nbengine.engine.request import Completion

BlockSource = Literal["memory", "disk", "computed"]


@dataclass(frozen=True)
class TextDelta:
    """Text decoded since the previous delta."""

    text: str


@dataclass(frozen=True)
class BlockEvent:
    """Prompt block `index` (tokens ``start:end``) came from `source` in `seconds`."""

    index: int
    start: int
    end: int
    source: BlockSource
    seconds: float


@dataclass(frozen=True)
class Progress:
    """`done` of `total` prompt tokens are in the cache after the named phase."""

    phase: Literal["restore", "prefill"]
    done: int
    total: int


@dataclass(frozen=True)
class Finished:
    """The request ended; `completion` is what `Request.result()` returns."""

    completion: Completion


Event = TextDelta | BlockEvent | Progress | Finished
