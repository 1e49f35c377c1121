"""The block store: an LRU of cache records, under a byte budget, in one scratch file.

Terms:

- *item*: `(block_key, kind)`, the name of one record blob (`kind` is "kv", "window" or
  "state"; the store treats both as opaque strings).
- *recency*: the LRU order. `put` and a successful `get` make an item the most recent;
  `touch(items)` makes each present item more recent than the ones before it, so callers
  touch a chain suffix-first (last block first, first block last) and the suffix evicts first.
- *budget*: the most bytes of live blobs the store keeps. Before storing, the least recently
  used items are evicted until the new blob fits. The scratch file can be larger than the
  budget by its interior free space (`free_bytes`), which later writes reuse first.
- *default budget*: `min(25% of the free space of the directory, 8 GiB)` (`backends`, which
  also opens the blobs' home: memory, a scratch file or a persistent directory).
- *memory only*: `budget_bytes=0` turns the disk off; blobs then live in a dict under
  `memory_budget_bytes` (default 512 MiB), so the cache still works where no disk is wanted.
- *miss*: `get` of an absent or damaged item. A `put` that cannot store (blob larger than
  the budget, disk full, any write error) returns False and is counted as `rejected`.
- *events*: `on_event(name, key, kind, nbytes)` is called with "stored" after each stored
  blob and "evicted" whenever a record leaves the store other than by `close()` (budget,
  damage, `delete`, `clear`), after the store's state is updated and outside its lock.

Keys name content (the block key hashes the model, the tokens and all earlier blocks), so a
`put` of an item already present only refreshes its recency and writes nothing.

- *persistent*: `persist_dir=DIR` keeps the records in DIR (a data file and a durable index,
  see `cache/persist.py`) instead of an unlinked scratch file, for the next process with
  the same `identity` (the engine's model fingerprint, block size, formats). The records
  found there are held at once, oldest first as they were left, trimmed to the budget
  (without events). When DIR cannot be used -- another process holds its lock, it is not
  writable -- the store falls back to a scratch file in `directory` and `note` says so in
  one line; an incompatible store found in DIR is set aside (`note` too). The default
  budget counts the space the store already holds as free.
- *saving off*: the first write that fails for lack of space or an I/O error (ENOSPC,
  EDQUOT, EFBIG, EIO, EROFS) turns saving off: later puts are refused at once (counted
  `rejected`), gets keep serving the records held, `saving_error` says why in one line.
  `clear()` or `resume_saving()` turns it back on. Other write errors only reject the put.
- *followers*: `remember(key, parent, ids)` writes a block's follower metadata into a
  persistent store's index; `remembered()` gives it back after a restart (a no-op and an
  empty list without persistence).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlx_nbengine.cache.backends import (
    DEFAULT_MEMORY_BUDGET,
    default_budget_bytes,
    open_backend,
    saving_off_reason,
)
from mlx_nbengine.cache.blobfile import BlobFile, CorruptBlobError
from mlx_nbengine.cache.persist import PersistentBlobs

__all__ = ["BlockStore", "StoreStats", "default_budget_bytes"]

Item = tuple[str, str]
EventCallback = Callable[[str, str, str, int], None]


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store; `description` names the backend without any path."""

    records: int
    bytes_held: int
    file_size: int
    free_bytes: int
    hits: int
    misses: int
    stored: int
    evicted: int
    rejected: int
    budget_bytes: int
    description: str
    persistent: bool = False
    saving: bool = True
    saving_error: str = ""
    note: str = ""
    records_at_open: int = 0

    def as_dict(self) -> dict[str, int | str]:
        return dataclasses.asdict(self)


class Persistence:
    """What a persistent store adds to the LRU: its note, and the follower metadata in its
    index and flushing it. A part `BlockStore` holds and delegates to, given the backend's
    blobs, the store's lock and the `note` opening the backend wrote: one line on what
    opening `persist_dir` found or why it was not used ("" if all went as asked)."""

    def __init__(self, blobs: Any, lock: Any, note: str) -> None:
        self._blobs = blobs
        self._lock = lock
        self.note = note

    def _open(self) -> bool:
        return isinstance(self._blobs, PersistentBlobs) and not self._blobs.closed

    @property
    def persistent(self) -> bool:
        """Whether the records outlive this process (`persist_dir` opened)."""
        return isinstance(self._blobs, PersistentBlobs)

    def remember(self, key: str, parent: str, ids: Iterable[int]) -> None:
        """Keep block `key`'s follower metadata (its parent key, its token ids as
        `blocks.match_ids`) in a persistent store's index; a no-op otherwise."""
        with self._lock:
            if self._open():
                packed = np.asarray(list(ids), dtype="<i8").tobytes()
                self._blobs.note_follower(key, parent, packed)

    def remembered(self) -> list[tuple[str, str, list[int]]]:
        """``(key, parent, ids)`` kept by `remember`, oldest first (this process's and the
        earlier ones'); empty without persistence."""
        with self._lock:
            if not self._open():
                return []
            return [
                (key, parent, np.frombuffer(ids, dtype="<i8").tolist())
                for key, parent, ids in self._blobs.followers()
            ]

    def flush(self) -> None:
        """Make what a persistent store wrote durable now (its syncer does so after each put,
        on a thread of its own; a failure here is its next put's)."""
        with self._lock:
            if self._open():
                try:
                    self._blobs.flush()
                except OSError:
                    pass


class BlockStore:
    """LRU of record blobs `(block_key, kind) -> bytes` under a byte budget.

    Owned by one thread: the engine's cache-I/O thread is the only caller of `put`, `get`,
    `touch`, `delete`, `clear` and `close`. A lock guards every method anyway, so `stats()`
    (and `has`, `census`) can be read from any thread, e.g. by the notebook face.
    Invariant: the recency order, the sizes and the backend hold exactly the same items, and
    `bytes_held <= budget_bytes` after every call.
    """

    def __init__(
        self,
        *,
        budget_bytes: int | None = None,
        directory: str | os.PathLike[str] | None = None,
        on_event: EventCallback | None = None,
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET,
        persist_dir: str | os.PathLike[str] | None = None,
        identity: dict | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self._on_event = on_event
        self._recency: OrderedDict[Item, int] = OrderedDict()  # item -> nbytes, oldest first
        self._held = 0
        self._hits = self._misses = self._stored = self._evicted = self._rejected = 0
        self._saving_error: str | None = None
        backend = open_backend(
            budget_bytes=budget_bytes,
            directory=directory,
            memory_budget_bytes=memory_budget_bytes,
            persist_dir=persist_dir,
            identity=identity,
        )
        self._blobs = backend.blobs
        self._budget = backend.budget
        self._description = backend.description
        self._persist = Persistence(self._blobs, self._lock, backend.note)
        self._at_open = 0
        if isinstance(self._blobs, PersistentBlobs):
            for item, nbytes in self._blobs.items():
                self._recency[item] = nbytes
                self._held += nbytes
            self._blobs.recency = lambda: list(self._recency)
            while self._held > self._budget:  # a smaller budget than last time
                self._remove(next(iter(self._recency)), [], count=False)
            self._at_open = len(self._recency)

    # -- the owner's API ----------------------------------------------------------------

    persistent = property(lambda self: self._persist.persistent, doc="See `Persistence`.")
    note = property(lambda self: self._persist.note, doc="See `Persistence.note`.")

    def remember(self, key: str, parent: str, ids: Iterable[int]) -> None:
        """`Persistence.remember`."""
        self._persist.remember(key, parent, ids)

    def remembered(self) -> list[tuple[str, str, list[int]]]:
        """`Persistence.remembered`."""
        return self._persist.remembered()

    def flush(self) -> None:
        """`Persistence.flush`."""
        self._persist.flush()

    @property
    def saving(self) -> bool:
        """False once a write failed for lack of space or an I/O error (see the module)."""
        return self._saving_error is None

    @property
    def saving_error(self) -> str | None:
        """Why saving is off, in one line; None while it is on."""
        return self._saving_error

    def resume_saving(self) -> None:
        """Try saving again (e.g. after space was freed elsewhere)."""
        with self._lock:
            self._saving_error = None

    def put(self, key: str, kind: str, data: bytes | bytearray | memoryview) -> bool:
        """Store a blob; True if it is now held, False if it could not be (a miss, not an error).

        Evicts least recently used items until the blob fits the budget.
        """
        item = (key, kind)
        nbytes = memoryview(data).nbytes
        if nbytes == 0:
            raise ValueError(f"empty blob for {item!r}; records are never empty")
        with self._changing() as events:
            if item in self._recency:
                self._recency.move_to_end(item)
                return True
            if nbytes > self._budget or self._saving_error is not None:
                self._rejected += 1
                return False
            while self._held + nbytes > self._budget:
                oldest = next(iter(self._recency))
                self._remove(oldest, events)
            try:
                self._blobs.write(item, data)
            except OSError as exc:
                # Disk full or file too large: the backend already returned the space.
                self._rejected += 1
                self._saving_error = saving_off_reason(exc) or self._saving_error
                return False
            self._recency[item] = nbytes
            self._held += nbytes
            self._stored += 1
            events.append(("stored", key, kind, nbytes))
            return True

    def get(self, key: str, kind: str) -> bytes | None:
        """The blob, or None on a miss; a damaged blob is evicted and reported as a miss."""
        return self._get(key, kind, buffer=None)

    def get_buffer(
        self, key: str, kind: str, into: np.ndarray | None = None, *, mapped: bool = False
    ) -> np.ndarray | None:
        """`get` as a uint8 array, read straight into it (the restore path's one copy of
        the blob): a slice of `into` when it is large enough (`BlobFile.read_buffer`).
        With `mapped`, a view of the scratch file's pages where it can be mapped
        (`BlobFile.read_mapped`: no copy, valid only until the store's next change, for
        the store's owner thread). Treat it as read-only."""
        return self._get(key, kind, buffer="mapped" if mapped else "read", into=into)

    @property
    def mappable(self) -> bool:
        """Whether `get_buffer(..., mapped=True)` maps blobs (a scratch file) rather than
        reading them."""
        return isinstance(self._blobs, BlobFile) and self._blobs.mappable

    def size(self, key: str, kind: str) -> int | None:
        """The item's blob size in bytes, None if absent; changes neither recency nor
        statistics."""
        with self._lock:
            return self._recency.get((key, kind))

    def _get(
        self, key: str, kind: str, *, buffer: str | None, into: np.ndarray | None = None
    ) -> Any:
        item = (key, kind)
        with self._changing() as events:
            if item not in self._recency:
                self._misses += 1
                return None
            try:
                if buffer == "mapped" and isinstance(self._blobs, BlobFile):
                    data = self._blobs.read_mapped(item)
                elif buffer is not None:
                    data = self._blobs.read_buffer(item, into)
                else:
                    data = self._blobs.read(item)
            except (CorruptBlobError, OSError):
                self._remove(item, events)
                self._misses += 1
                return None
            self._recency.move_to_end(item)
            self._hits += 1
            return data

    def has(self, key: str, kind: str) -> bool:
        """Whether the item is held; changes neither recency nor statistics."""
        with self._lock:
            return (key, kind) in self._recency

    def touch(self, items: Iterable[Item]) -> None:
        """Make the held items most recent, each later one more recent than the earlier."""
        with self._lock:
            self._check_open()
            for item in items:
                item = tuple(item)
                if item in self._recency:
                    self._recency.move_to_end(item)

    def delete(self, key: str, kind: str) -> bool:
        """Remove the item (an "evicted" event); False if it was not held."""
        with self._changing() as events:
            if (key, kind) not in self._recency:
                return False
            self._remove((key, kind), events)
            return True

    def clear(self) -> None:
        """Remove every item (each an "evicted" event) and shrink the scratch file to zero."""
        with self._changing() as events:
            for (key, kind), nbytes in self._recency.items():
                events.append(("evicted", key, kind, nbytes))
            self._evicted += len(self._recency)
            self._recency.clear()
            self._held = 0
            self._blobs.clear()
            self._saving_error = None  # the space is back: try again

    def close(self) -> None:
        """Close and delete the scratch file (a persistent store: compact its index, keeping
        the LRU order, close its files, release its directory); no events. Idempotent."""
        with self._lock:
            self._blobs.close()  # first: a persistent store writes the recency order
            self._recency.clear()
            self._held = 0

    @property
    def closed(self) -> bool:
        return self._blobs.closed

    def stats(self) -> StoreStats:
        """A consistent snapshot; safe from any thread."""
        with self._lock:
            return StoreStats(
                records=len(self._recency),
                bytes_held=self._held,
                file_size=self._blobs.file_size,
                free_bytes=self._blobs.free_bytes,
                hits=self._hits,
                misses=self._misses,
                stored=self._stored,
                evicted=self._evicted,
                rejected=self._rejected,
                budget_bytes=self._budget,
                description=self._description,
                persistent=isinstance(self._blobs, PersistentBlobs),
                saving=self._saving_error is None,
                saving_error=self._saving_error or "",
                note=self._persist.note,
                records_at_open=self._at_open,
            )

    @property
    def budget_bytes(self) -> int:
        """The budget in force (the memory budget when the disk is off)."""
        return self._budget

    @property
    def blobfile(self) -> BlobFile | None:
        """The scratch (or persistent data) file, None when memory only; for diagnostics
        and tests."""
        if isinstance(self._blobs, PersistentBlobs):
            return self._blobs.blobs
        return self._blobs if isinstance(self._blobs, BlobFile) else None

    @property
    def persistence(self) -> PersistentBlobs | None:
        """The persistent backend (data file, index log, lock), None without one."""
        return self._blobs if isinstance(self._blobs, PersistentBlobs) else None

    def census(self) -> tuple[int, dict[str, tuple[int, int]]]:
        """Distinct block keys held, and per kind ``(records, bytes)``; safe from any thread."""
        with self._lock:
            keys = set()
            by_kind: dict[str, tuple[int, int]] = {}
            for (key, kind), nbytes in self._recency.items():
                keys.add(key)
                count, total = by_kind.get(kind, (0, 0))
                by_kind[kind] = (count + 1, total + nbytes)
            return len(keys), by_kind

    def items(self) -> list[Item]:
        """Held items, least recently used first."""
        with self._lock:
            return list(self._recency)

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._blobs.closed:
            raise ValueError("BlockStore is closed")

    @contextlib.contextmanager
    def _changing(self) -> Iterator[list[tuple[str, str, str, int]]]:
        """The lock held on an open store, and a list for the change's events, which are
        emitted once the lock is released (even when the change raises)."""
        events: list[tuple[str, str, str, int]] = []
        try:
            with self._lock:
                self._check_open()
                yield events
        finally:
            self._emit(events)

    def _remove(
        self, item: Item, events: list[tuple[str, str, str, int]], *, count: bool = True
    ) -> None:
        nbytes = self._recency.pop(item)
        self._held -= nbytes
        self._blobs.delete(item)
        if count:
            self._evicted += 1
            events.append(("evicted", item[0], item[1], nbytes))

    def _emit(self, events: list[tuple[str, str, str, int]]) -> None:
        if self._on_event is not None:
            for name, key, kind, nbytes in events:
                self._on_event(name, key, kind, nbytes)
