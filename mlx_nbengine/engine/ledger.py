"""The cache ledger: what the store view shows of the prefix cache over time.

Two threads write it and any thread reads it, so every method holds one lock and does
little under it:

- the cache-I/O thread reports each record the store evicts (`store_event`, wired to the
  store's ``on_event``), with the block's token ids when the follower index still
  remembers them, and whether the block lost its last record (then it counts as an
  evicted *block*);
- the generation thread reports each finished request's `Report` (`request_finished`):
  blocks and tokens restored or computed.

*History* is one point per finished request and one per *eviction burst* (evictions
with no request finishing in between share one point, updated in place), each with the
cumulative block counts and ``t``, seconds since `start_clock` (the engine calls it
once its model is loaded); at most
`HISTORY_POINTS`, the oldest dropped. *Recent evictions* are the last `RECENT_EVICTIONS`
evicted records, newest first; their text is decoded by the reader (`snapshot` returns
token ids), on the reader's thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

HISTORY_POINTS = 200
RECENT_EVICTIONS = 10

# key, kind -> (the block's token ids or None, whether the block still has a record)
Lookup = Callable[[str, str], tuple[list[int] | None, bool]]


class CacheLedger:
    """Counts, history and recent evictions of one engine (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._lookup: Lookup | None = None
        self._counts = dict.fromkeys(
            (
                "blocks_restored",
                "blocks_computed",
                "tokens_restored",
                "tokens_computed",
                "blocks_evicted",
                "records_evicted",
                "requests",
            ),
            0,
        )
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._evictions: deque[dict[str, Any]] = deque(maxlen=RECENT_EVICTIONS)
        self._burst = False  # the last history point is an eviction burst still open

    def start_clock(self) -> None:
        """Count ``t`` from now."""
        with self._lock:
            self._t0 = time.monotonic()

    def attach(self, lookup: Lookup) -> None:
        """How `store_event` learns an evicted block's tokens and whether it is gone."""
        self._lookup = lookup

    def _now(self) -> float:
        return round(time.monotonic() - self._t0, 3)

    def _point(self) -> dict[str, Any]:
        c = self._counts
        return {
            "t": self._now(),
            "restored": c["blocks_restored"],
            "computed": c["blocks_computed"],
            "evicted": c["blocks_evicted"],
        }

    def store_event(self, name: str, key: str, kind: str, nbytes: int) -> None:
        """The store's ``on_event`` (cache-I/O thread): count evictions."""
        if name != "evicted":
            return
        tokens, held = (None, True) if self._lookup is None else self._lookup(key, kind)
        with self._lock:
            self._counts["records_evicted"] += 1
            if not held:
                self._counts["blocks_evicted"] += 1
            self._evictions.appendleft(
                {"t": self._now(), "kind": kind, "bytes": nbytes, "tokens": tokens}
            )
            if self._burst:
                self._history[-1] = self._point()
            else:
                self._history.append(self._point())
                self._burst = True

    def request_finished(self, report: Any) -> None:
        """A request's `Report` (generation thread): count its blocks and tokens."""
        computed = sum(1 for b in report.blocks if b.source == "computed")
        with self._lock:
            c = self._counts
            c["requests"] += 1
            c["blocks_restored"] += len(report.blocks) - computed
            c["blocks_computed"] += computed
            c["tokens_restored"] += report.restored_tokens
            c["tokens_computed"] += report.computed_tokens
            self._history.append(self._point())
            self._burst = False

    def snapshot(self) -> dict[str, Any]:
        """The counts, ``history`` and ``recent_evictions`` (with ``tokens``, not text)."""
        with self._lock:
            return {
                **self._counts,
                "history": [dict(p) for p in self._history],
                "recent_evictions": [dict(e) for e in self._evictions],
            }
