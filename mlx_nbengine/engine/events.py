"""What a request's stream yields, in order.

An *event* is a small frozen dataclass put on the request's queue by the generation
thread and read by whoever iterates `Request.stream()` (usually the kernel's main
thread). The stream of one request is:

- zero or more `BlockEvent`: one per prompt block, as soon as its source is known
  (restored from memory or disk, or computed by a prefill step);
- zero or more `Progress`: prefill progress after every step (``phase="prefill"``)
  and the restore (``phase="restore"``; ``done`` 0 when nothing was restored: it says
  the request left the queue);
- zero or more `TextDelta`: newly decoded text, never cut inside a stop string;
- exactly one `Finished` last (unless the request failed: then the stream raises).

Block sources are the names the report and widgets use: ``"memory"`` (the hot cache
of the previous request was reused), ``"disk"`` (records restored from the store),
``"computed"`` (prefilled now).

Every block also carries a *reason*, named here and nowhere else:

- source memory: ``"hot"``;
- source disk: the *record kinds* read for the block joined with "+" in the order kv,
  window, state (``"kv"``, ``"kv+window"``, ``"kv+state"``...; ``"none"`` when none
  was read for it, e.g. a window-only model's block outside the window);
- source computed: one of `ComputedReason`, decided when the request is admitted
  (see `reasons`): ``"new"`` never seen; ``"edited"`` a stored block followed the same
  prefix but its tokens differ (`edit_at` is the first changed position); ``"evicted"``
  this very block was stored once and its records are gone; ``"store_off"`` the engine
  has no block store; ``"after_miss"`` an earlier block was computed, so this one's
  chain broke; ``"tail"`` the partial last block, or the block holding the prompt's last
  token (always computed: its logits start generation); ``"window"`` the block's own
  records are held but the window/state records needed to stop at its end were dropped.

Every block also says how many of its tokens were *restored*: all of them for a memory
or disk block, none for a computed one, except the block where a token-exact restore
ended inside it (a *cut*, see `generation`): it is computed (its last tokens were
prefilled, with the reason above, e.g. ``"edited"`` at the changed token) and its
`restored` counts the unchanged tokens before. When the restore kept to a block boundary
although a stored continuation shared more tokens, the report's `kept_boundary` says
why, one of `KEPT_BOUNDARY`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mlx_nbengine.engine.results import BlockReport, BlockSource, Finished

__all__ = [
    "KEPT_BOUNDARY",
    "REASONS",
    "BlockEvent",
    "BlockSource",
    "Event",
    "Finished",
    "Progress",
    "TextDelta",
    "disk_reason",
]

BlockEvent = BlockReport
"""A block's event is its report: the stream yields the `BlockReport` the report keeps."""
ComputedReason = Literal["new", "edited", "evicted", "store_off", "after_miss", "tail", "window"]
RECORD_ORDER = ("kv", "window", "state")

REASONS: dict[str, str] = {
    "hot": "kept in memory from the previous request",
    "new": "never seen",
    "edited": "edited",  # the caller adds where: "edited at token 1,234" (from edit_at)
    "evicted": "evicted from the store",
    "store_off": "no block store",
    "after_miss": "after a computed block",
    "tail": "last tokens, computed to start the answer",
    "window": "window or state records dropped",
    "none": "nothing to read",
}
"""A short human phrase per computed reason (and ``"hot"``, ``"none"``): the only copy."""


KEPT_BOUNDARY: dict[str, str] = {
    "state": "recurrent layers resume only where a state was stored",
    "window": "the stored block's window records lack its first tokens",
    "block": "the engine restores whole blocks only (restore='block')",
    "evicted": "the stored continuation's records were evicted",
}
"""Why a restore stopped at a block boundary short of the first changed token: the only copy."""


def disk_reason(records: tuple[str, ...]) -> str:
    """The reason of a block restored from disk: its record kinds read, joined by "+"."""
    return "+".join(k for k in RECORD_ORDER if k in records) or "none"


@dataclass(frozen=True)
class TextDelta:
    """Text decoded since the previous delta."""

    text: str


@dataclass(frozen=True)
class Progress:
    """`done` of `total` prompt tokens are in the cache after the named phase."""

    phase: Literal["restore", "prefill"]
    done: int
    total: int


Event = TextDelta | BlockEvent | Progress | Finished
