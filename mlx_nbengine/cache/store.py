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
- *default budget*: `min(25% of the free space of the directory, 8 GiB)`: a quarter leaves the
  user's disk usable while other programs grow, and 8 GiB holds ~800 blocks of Gemma 3 270M
  (~10 MB each), far more than one notebook's prompts need.
- *memory only*: `budget_bytes=0` turns the disk off; blobs then live in a dict under
  `memory_budget_bytes` (default 512 MiB), so the cache still works where no disk is wanted.
- *miss*: `get` of an absent or damaged item. A `put` that cannot store (blob larger than
  the budget, disk full, any write error) returns False and is counted as `rejected`.
- *events*: `on_event(name, key, kind, nbytes)` is called with "stored" after each stored
  blob and "evicted" whenever a record leaves the store other than by `close()` (budget,
  damage, `delete`, `clear`), after the store's state is updated and outside its lock.

Keys name content (the block key hashes the model, the tokens and all earlier blocks), so a
`put` of an item already present only refreshes its recency and writes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlx_nbengine.cache.blobfile import BlobFile, CorruptBlobError
from mlx_nbengine.errors import CacheError

__all__ = ["BlockStore", "StoreStats", "default_budget_bytes"]

Item = tuple[str, str]
EventCallback = Callable[[str, str, str, int], None]

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_DISK_FRACTION = 0.25
DEFAULT_DISK_CAP = 8 * GiB
DEFAULT_MEMORY_BUDGET = 512 * MiB


def default_budget_bytes(directory: str | os.PathLike[str] | None = None) -> int:
    """`min(25% of the free space where the scratch file lives, 8 GiB)`."""
    free = shutil.disk_usage(directory or tempfile.gettempdir()).free
    return min(int(free * DEFAULT_DISK_FRACTION), DEFAULT_DISK_CAP)


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

    def as_dict(self) -> dict[str, int | str]:
        return dataclasses.asdict(self)


class _MemoryBlobs:
    """The memory-only backend: BlobFile's interface over a dict (no file, no checksum)."""

    file_size = 0
    free_bytes = 0

    def __init__(self) -> None:
        self._blobs: dict[Item, bytes] = {}
        self.closed = False

    def write(self, key: Item, data: bytes | bytearray | memoryview) -> None:
        if len(data) == 0:
            raise ValueError("cannot store an empty blob")
        self._blobs[key] = bytes(data)

    def read(self, key: Item) -> bytes:
        return self._blobs[key]

    def delete(self, key: Item) -> bool:
        return self._blobs.pop(key, None) is not None

    def clear(self) -> None:
        self._blobs.clear()

    def close(self) -> None:
        self._blobs.clear()
        self.closed = True


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
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise CacheError(
                f"budget_bytes={budget_bytes} is negative; pass a size in bytes, 0 for memory "
                "only, or None for the default"
            )
        if memory_budget_bytes < 0:
            raise CacheError(f"memory_budget_bytes={memory_budget_bytes} must be >= 0")
        if budget_bytes is None:
            budget_bytes = default_budget_bytes(directory)
        self._lock = threading.RLock()
        self._on_event = on_event
        self._blobs: BlobFile | _MemoryBlobs
        if budget_bytes == 0:
            self._blobs = _MemoryBlobs()
            self._budget = memory_budget_bytes
            self._description = f"memory only, budget {_human(memory_budget_bytes)}"
        else:
            self._blobs = BlobFile(directory=directory)
            self._budget = budget_bytes
            where = "a chosen folder" if directory is not None else "the system temp folder"
            self._description = f"scratch file in {where}, budget {_human(budget_bytes)}"
        self._recency: OrderedDict[Item, int] = OrderedDict()  # item -> nbytes, oldest first
        self._held = 0
        self._hits = self._misses = self._stored = self._evicted = self._rejected = 0

    # -- the owner's API ----------------------------------------------------------------

    def put(self, key: str, kind: str, data: bytes | bytearray | memoryview) -> bool:
        """Store a blob; True if it is now held, False if it could not be (a miss, not an error).

        Evicts least recently used items until the blob fits the budget.
        """
        item = (key, kind)
        nbytes = memoryview(data).nbytes
        if nbytes == 0:
            raise ValueError(f"empty blob for {item!r}; records are never empty")
        events: list[tuple[str, str, str, int]] = []
        try:
            with self._lock:
                self._check_open()
                if item in self._recency:
                    self._recency.move_to_end(item)
                    return True
                if nbytes > self._budget:
                    self._rejected += 1
                    return False
                while self._held + nbytes > self._budget:
                    oldest = next(iter(self._recency))
                    self._remove(oldest, events)
                try:
                    self._blobs.write(item, data)
                except OSError:
                    # Disk full or file too large: the backend already returned the space.
                    self._rejected += 1
                    return False
                self._recency[item] = nbytes
                self._held += nbytes
                self._stored += 1
                events.append(("stored", key, kind, nbytes))
                return True
        finally:
            self._emit(events)

    def get(self, key: str, kind: str) -> bytes | None:
        """The blob, or None on a miss; a damaged blob is evicted and reported as a miss."""
        item = (key, kind)
        events: list[tuple[str, str, str, int]] = []
        try:
            with self._lock:
                self._check_open()
                if item not in self._recency:
                    self._misses += 1
                    return None
                try:
                    data = self._blobs.read(item)
                except (CorruptBlobError, OSError):
                    self._remove(item, events)
                    self._misses += 1
                    return None
                self._recency.move_to_end(item)
                self._hits += 1
                return data
        finally:
            self._emit(events)

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
        events: list[tuple[str, str, str, int]] = []
        try:
            with self._lock:
                self._check_open()
                if (key, kind) not in self._recency:
                    return False
                self._remove((key, kind), events)
                return True
        finally:
            self._emit(events)

    def clear(self) -> None:
        """Remove every item (each an "evicted" event) and shrink the scratch file to zero."""
        events: list[tuple[str, str, str, int]] = []
        try:
            with self._lock:
                self._check_open()
                for (key, kind), nbytes in self._recency.items():
                    events.append(("evicted", key, kind, nbytes))
                self._evicted += len(self._recency)
                self._recency.clear()
                self._held = 0
                self._blobs.clear()
        finally:
            self._emit(events)

    def close(self) -> None:
        """Close and delete the scratch file; no events. Calling it again does nothing."""
        with self._lock:
            self._recency.clear()
            self._held = 0
            self._blobs.close()

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
            )

    @property
    def budget_bytes(self) -> int:
        """The budget in force (the memory budget when the disk is off)."""
        return self._budget

    @property
    def blobfile(self) -> BlobFile | None:
        """The scratch file, None when memory only; for diagnostics and tests."""
        return self._blobs if isinstance(self._blobs, BlobFile) else None

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

    def _remove(self, item: Item, events: list[tuple[str, str, str, int]]) -> None:
        nbytes = self._recency.pop(item)
        self._held -= nbytes
        self._blobs.delete(item)
        self._evicted += 1
        events.append(("evicted", item[0], item[1], nbytes))

    def _emit(self, events: list[tuple[str, str, str, int]]) -> None:
        if self._on_event is not None:
            for name, key, kind, nbytes in events:
                self._on_event(name, key, kind, nbytes)


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"
