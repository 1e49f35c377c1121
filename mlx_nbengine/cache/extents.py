"""Where blobs lie in one file: the offset table and the free list, with no I/O of its own.

Terms:

- *extent*: a byte range `[offset, offset + length)` of the file.
- *table*: key -> `Entry(offset, length, checksum)`.
- *free list*: the extents inside the file that no blob uses, sorted by offset, never adjacent
  (neighbours are coalesced when space is returned) and never touching the end of the file
  (free space that reaches the end is cut off by the owner's `truncate`).
- *reserved*: the first bytes of the file (a named file's header), never allocated.

Invariant (`problems`): the table's extents and the free list tile `[reserved, size)`
exactly, without overlap. `BlobFile` holds one `Extents` and does the reads and writes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

__all__ = ["Entry", "Extents"]


@dataclass(frozen=True)
class Entry:
    """Where one blob lives in the scratch file and the checksum of its bytes."""

    offset: int
    length: int
    checksum: int


class Extents:
    """The table and the first-fit free list of one file (see the module docstring).

    `truncate(size)` cuts the real file to `size` bytes; it may raise `OSError`, and the
    space is then kept as ordinary free space. Not thread-safe: the owner locks.
    """

    def __init__(self, *, reserved: int, size: int, truncate: Callable[[int], None]) -> None:
        self.reserved = reserved
        self.table: dict[Hashable, Entry] = {}
        self.free: list[tuple[int, int]] = []  # (offset, length), sorted by offset
        self.size = max(reserved, size)  # the file's size as the table knows it
        self.held = 0  # bytes of live blobs
        self._truncate = truncate
        if self.size > reserved:
            self.free = [(reserved, self.size - reserved)]  # nothing adopted yet

    def reset(self) -> None:
        """Forget every blob: the file is its reserved header only (the owner cut it)."""
        self.table.clear()
        self.free.clear()
        self.size = self.reserved
        self.held = 0

    def allocate(self, length: int) -> int:
        """The offset of `length` free bytes: the first free extent that fits, else the end
        of the file (which the write then grows)."""
        for i, (offset, size) in enumerate(self.free):
            if size >= length:  # first fit: lowest offset, keeps the tail free to truncate
                if size == length:
                    del self.free[i]
                else:
                    self.free[i] = (offset + length, size - length)
                return offset
        offset = self.size
        self.size += length  # reserved now; the write itself grows the real file
        return offset

    def add(self, key: Hashable, entry: Entry) -> None:
        """Record the blob written at `entry` (its extent came from `allocate`)."""
        self.table[key] = entry
        self.held += entry.length

    def drop(self, key: Hashable) -> None:
        """Forget the blob under `key` and return its space."""
        entry = self.table.pop(key)
        self.held -= entry.length
        self.release(entry.offset, entry.length)

    def release(self, offset: int, length: int) -> None:
        """Return an extent to the free list, coalesced; truncated where it ends the file."""
        i = bisect.bisect_left(self.free, (offset,))
        if i < len(self.free) and self.free[i][0] == offset + length:
            length += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == offset:
            i -= 1
            prev_offset, prev_length = self.free.pop(i)
            offset, length = prev_offset, prev_length + length
        if offset + length >= self.size:
            try:
                self._truncate(offset)
                self.size = offset
                return
            except OSError:
                pass  # could not shrink: keep the tail as ordinary free space
        self.free.insert(i, (offset, length))

    def adopt(self, entries: Iterable[tuple[Hashable, Entry]], *, real: int) -> list[Hashable]:
        """Take `entries` as the table of a file of `real` bytes; return the keys refused
        (see `BlobFile.adopt`). Every byte no adopted blob uses becomes free space; free
        space at the end of the file is truncated."""
        if self.table:
            raise ValueError("adopt needs an empty table")
        taken: list[tuple[int, int]] = []  # sorted (offset, end) of adopted extents
        refused: list[Hashable] = []
        for key, entry in entries:
            start, end = entry.offset, entry.offset + entry.length
            i = bisect.bisect_left(taken, (start, end))
            overlaps = (i > 0 and taken[i - 1][1] > start) or (i < len(taken) and taken[i][0] < end)
            bad = entry.length <= 0 or start < self.reserved or end > real
            if bad or overlaps or key in self.table:
                refused.append(key)
                continue
            taken.insert(i, (start, end))
            self.add(key, entry)
        self.free = []
        position = self.reserved
        for start, end in taken:
            if start > position:
                self.free.append((position, start - position))
            position = end
        self.size = position
        if real > position:
            try:
                self._truncate(position)
            except OSError:
                self.size = real
                self.free.append((position, real - position))
        return refused

    def problems(self, real: int | None) -> list[str]:
        """What breaks the invariant (`real`: the file's real size, None when closed)."""
        problems = []
        if real is not None and real != self.size:
            problems.append(f"file is {real} bytes, table says {self.size}")
        extents = sorted(
            [(e.offset, e.length, "blob") for e in self.table.values()]
            + [(o, n, "free") for o, n in self.free]
        )
        position = self.reserved
        for offset, length, what in extents:
            if length <= 0:
                problems.append(f"{what} extent at {offset} has length {length}")
            if offset != position:
                problems.append(f"{what} extent at {offset}, expected {position}")
            position = offset + length
        if position != self.size:
            problems.append(f"extents end at {position}, file size is {self.size}")
        for (a, n), (b, _) in zip(self.free, self.free[1:], strict=False):
            if a + n >= b:
                problems.append(f"free extents at {a} and {b} overlap or were not coalesced")
        if self.free and sum(self.free[-1]) >= self.size:
            problems.append("free space reaches the end of the file but was not truncated")
        if self.held != sum(e.length for e in self.table.values()):
            problems.append("bytes_held disagrees with the table")
        return problems
