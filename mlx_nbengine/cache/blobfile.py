"""One scratch file holding many blobs, with an in-memory offset table and a free list.

Terms:

- *blob*: a non-empty byte string stored under a hashable *key* (the store uses
  `(block_key, kind)`).
- *extent*: a byte range `[offset, offset + length)` of the scratch file.
- *table* and *free list*: where each blob lies and which extents are free (`extents`:
  first fit, neighbours coalesced, free space at the end given back with `os.ftruncate`),
  kept in memory only; a scratch file has no header and no index, so nothing on disk
  outlives the process (a named file's owner keeps its index elsewhere, see below).
- *checksum*: a 64-bit XXH3 of the blob (`xxhash`, installed with mlx-vlm), checked on every
  read; `zlib.crc32` where xxhash is missing. XXH3 is the one that keeps a read near
  page-cache bandwidth (bench/bench_blobfile.py measures them). The checksum guards
  against torn or stray writes, not against an attacker (the file is private: mode 0600,
  and unlinked).

Invariant (`check_invariants`): the table's extents and the free list tile
`[reserved, file_size)` exactly (`reserved` is 0 for a scratch file), without overlap, and
`file_size` is the file's real size (a named file: once `adopt` has run).

The scratch file is `tempfile.TemporaryFile`: on POSIX it is created unlinked (Linux:
`O_TMPFILE`), so a crash, a missed `close()` or garbage collection leaves nothing behind;
where unlinking an open file is impossible (Windows) Python falls back to delete-on-close.
Writes use `os.pwrite`, reads `os.pread` of exactly one blob (seek+read under the lock where
those are missing); nothing reads the whole file.

*Named file* (`path=`, used by the persistent store, `cache/persist.py`): the same table and
free list over a file that outlives the process. It is opened without following a symlink,
mode 0600, and its first `reserved` bytes (the owner's file header) are never allocated, so
the invariant tiles `[reserved, file_size)`. The table starts empty: the owner replays its
index and hands the extents it found to `adopt`, which drops those that overlap or run past
the end of the file and frees every gap. `sync()` makes the written blobs durable
(`fdatasync`). Closing a named file keeps it.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import zlib
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path

import numpy as np

from mlx_nbengine.cache.extents import Entry, Extents
from mlx_nbengine.errors import CacheError

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash comes with mlx-vlm's dependencies
    xxhash = None

__all__ = ["CHECKSUM", "BlobFile", "CorruptBlobError", "Entry", "checksum"]

CHECKSUM = "xxh3_64" if xxhash is not None else "crc32"


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum `BlobFile` keeps for each blob (named by `CHECKSUM`)."""
    if xxhash is not None:
        return xxhash.xxh3_64_intdigest(data)
    return zlib.crc32(data)


class CorruptBlobError(CacheError):
    """A blob read back differs from what was written (checksum mismatch or short read)."""


def _seek_write(fd: int, data: memoryview, offset: int) -> int:
    os.lseek(fd, offset, os.SEEK_SET)
    return os.write(fd, data)


def _seek_read(fd: int, length: int, offset: int) -> bytes:
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, length)


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    # Looked up per call so tests can patch os.pwrite; Windows lacks it (BlobFile holds its
    # lock around every I/O, so seek-then-write is safe there).
    return os.pwrite(fd, data, offset) if hasattr(os, "pwrite") else _seek_write(fd, data, offset)


def _pread(fd: int, length: int, offset: int) -> bytes:
    return os.pread(fd, length, offset) if hasattr(os, "pread") else _seek_read(fd, length, offset)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    # pwrite may write less than asked (a full disk often does so before failing with ENOSPC).
    done = 0
    while done < len(data):
        written = _pwrite(fd, data[done:], offset + done)
        if written <= 0:
            raise OSError(f"pwrite wrote {written} bytes at offset {offset + done}")
        done += written


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    data = _pread(fd, length, offset)
    if len(data) == length:
        return data
    parts = [data]
    got = len(data)
    while got < length:
        more = _pread(fd, length - got, offset + got)
        if not more:
            break  # the file is shorter than the table says; the caller reports corruption
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset`; the bytes read (fewer where the file ends first)."""
    got = 0
    while got < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf[got:]], offset + got)
        else:  # Windows: a read into bytes, then a copy
            more = _pread(fd, len(buf) - got, offset + got)
            buf[got : got + len(more)] = more
            n = len(more)
        if n <= 0:
            break
        got += n
    return got


def _open_named(path: str | os.PathLike[str]):
    """A named file (the persistent store's data): never through a symlink, mode 0600."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, "r+b", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _open_scratch(directory: str | os.PathLike[str] | None):
    """An unlinked scratch file in `directory` (None: the system temp folder)."""
    if directory is not None and not Path(directory).is_dir():
        raise CacheError(
            f"cache directory {os.fspath(directory)!r} does not exist or is not a "
            "folder; create it, or pass directory=None to use the system temp folder"
        )
    try:
        return tempfile.TemporaryFile("w+b", buffering=0, dir=directory)
    except OSError as exc:
        where = os.fspath(directory or tempfile.gettempdir())
        raise CacheError(
            f"cannot create a scratch file in {where!r} ({exc.strerror}); pass a "
            "writable directory, or budget_bytes=0 for memory only"
        ) from exc


class BlobFile:
    """Blobs in one unlinked scratch file: offset table, first-fit free list, tail truncation.

    Meant to be owned by one thread (the engine's cache-I/O thread); a lock still makes
    every method safe to call from another thread, so sizes can be read for statistics.
    A failed write raises `OSError` after returning its space, leaving no table entry.
    The bookkeeping (table, free list, sizes) is `extents.Extents`; this class does the I/O.
    """

    def __init__(
        self,
        *,
        directory: str | os.PathLike[str] | None = None,
        path: str | os.PathLike[str] | None = None,
        reserved: int = 0,
    ) -> None:
        if reserved < 0:
            raise ValueError(f"reserved={reserved} must be >= 0")
        self.path = None if path is None else Path(path)
        self._file = _open_scratch(directory) if path is None else _open_named(path)
        self._fd = self._file.fileno()
        self._lock = threading.Lock()
        size = os.fstat(self._fd).st_size if path is not None else reserved
        self._extents = Extents(
            reserved=reserved, size=size, truncate=lambda n: os.ftruncate(self._fd, n)
        )

    # -- public API ---------------------------------------------------------------------

    def write(self, key: Hashable, data: bytes | bytearray | memoryview) -> tuple[int, int]:
        """Store `data` under `key` (replacing any blob there); return `(offset, length)`.

        Raises `OSError` when the write fails (disk full, file too large); the file and the
        table are then as if the write had never been tried, except that an old blob under
        `key` is gone.
        """
        view = memoryview(data).cast("B")
        length = len(view)
        if length == 0:
            raise ValueError("BlobFile cannot store an empty blob")
        with self._lock:
            self._check_open()
            extents = self._extents
            if key in extents.table:
                extents.drop(key)
            offset = extents.allocate(length)
            try:
                _pwrite_all(self._fd, view, offset)
            except BaseException:
                extents.release(offset, length)
                raise
            extents.add(key, Entry(offset, length, checksum(view)))
            return offset, length

    def read(self, key: Hashable) -> bytes:
        """Return the blob under `key`; `KeyError` if absent, `CorruptBlobError` if damaged."""
        with self._lock:
            self._check_open()
            entry = self._extents.table[key]
            data = _pread_all(self._fd, entry.length, entry.offset)
        _verify(key, entry, data, len(data))
        return data

    def read_buffer(self, key: Hashable, into: np.ndarray | None = None) -> np.ndarray:
        """`read` into a uint8 array, with no copy on the way: `into`'s first bytes (one
        slice of a buffer the caller reads many blobs into) when it is large enough, else a
        new array (numpy backs large arrays with huge pages where the system allows: fewer
        page faults than a new bytes object's pages)."""
        with self._lock:
            self._check_open()
            entry = self._extents.table[key]
            if into is not None and into.dtype == np.uint8 and into.size >= entry.length:
                data = into[: entry.length]
            else:
                data = np.empty(entry.length, dtype=np.uint8)
            got = _pread_into(self._fd, memoryview(data), entry.offset)
        _verify(key, entry, data, got)
        return data

    @property
    def mappable(self) -> bool:
        """Whether `read_mapped` maps blobs: a scratch file on a system with `mmap`
        (nothing outside this process can shrink an unlinked file under a mapping)."""
        return self.path is None and hasattr(mmap, "MAP_SHARED") and os.name == "posix"

    def read_mapped(self, key: Hashable) -> np.ndarray:
        """The blob under `key` as a read-only uint8 view of the file's pages, checksum
        verified: no copy at all (no new memory, so no page faults either). Only for the
        file's owner thread, and
        only until its next write, `delete` or `clear` (space the blob leaves may be
        rewritten or cut off the file: a view of it then reads other bytes or faults).
        `KeyError` if absent, `CorruptBlobError` if damaged; `read_buffer` where
        `mappable` is False."""
        if not self.mappable:
            return self.read_buffer(key)
        with self._lock:
            self._check_open()
            entry = self._extents.table[key]
            # The file's real size: touching a mapping past its end would fault (SIGBUS).
            if entry.offset + entry.length > os.fstat(self._fd).st_size:
                raise CorruptBlobError(f"blob {key!r} is short: the file ends before it")
            start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(
                self._fd,
                entry.offset + entry.length - start,
                flags=flags,
                prot=mmap.PROT_READ,
                offset=start,
            )
        data = np.frombuffer(mapping, dtype=np.uint8, offset=entry.offset - start)
        _verify(key, entry, data, entry.length)
        return data

    def delete(self, key: Hashable) -> bool:
        """Forget the blob under `key` and return its space; False if there was none."""
        with self._lock:
            self._check_open()
            if key not in self._extents.table:
                return False
            self._extents.drop(key)
            return True

    def clear(self) -> None:
        """Forget every blob and shrink the file to its reserved header (zero bytes)."""
        with self._lock:
            self._check_open()
            os.ftruncate(self._fd, self._extents.reserved)
            self._extents.reset()

    def close(self) -> None:
        """Close the file (a scratch file is deleted, a named one kept); idempotent."""
        with self._lock:
            if self._file.closed:
                return
            self._file.close()
            self._extents.reset()

    def adopt(self, entries: Iterable[tuple[Hashable, Entry]]) -> list[Hashable]:
        """Take `entries` (found in an index) as the table of a named file; return the keys
        refused: an extent that is empty, starts inside the reserved header, runs past the
        end of the file or overlaps one adopted before it (in the order given), or a key
        given twice. Every byte no adopted blob uses becomes free space; free space at the
        end of the file is truncated. Only on a file whose table is still empty.
        """
        with self._lock:
            self._check_open()
            real = max(self._extents.reserved, os.fstat(self._fd).st_size)
            return self._extents.adopt(entries, real=real)

    def sync(self) -> None:
        """Make every blob written so far durable (`fdatasync`, `fsync` where missing)."""
        with self._lock:
            self._check_open()
            (getattr(os, "fdatasync", None) or os.fsync)(self._fd)

    @property
    def reserved(self) -> int:
        """Bytes at the start of the file that hold no blob (a named file's header)."""
        return self._extents.reserved

    @property
    def closed(self) -> bool:
        return self._file.closed

    def entry(self, key: Hashable) -> Entry | None:
        """Where the blob under `key` lives, or None; for diagnostics and tests."""
        with self._lock:
            return self._extents.table.get(key)

    def fileno(self) -> int:
        """The scratch file's descriptor; for tests that damage blobs on purpose."""
        return self._fd

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._extents.table

    def __len__(self) -> int:
        with self._lock:
            return len(self._extents.table)

    def keys(self) -> Iterator[Hashable]:
        with self._lock:
            return iter(list(self._extents.table))

    @property
    def file_size(self) -> int:
        """Bytes in the file: held bytes plus interior free space (plus the reserved header)."""
        with self._lock:
            return self._extents.size

    @property
    def bytes_held(self) -> int:
        """Bytes of live blobs."""
        with self._lock:
            return self._extents.held

    @property
    def free_bytes(self) -> int:
        """Bytes of free extents inside the file, waiting for reuse."""
        with self._lock:
            extents = self._extents
            return extents.size - extents.reserved - extents.held

    def free_extents(self) -> list[tuple[int, int]]:
        """The free list as `(offset, length)` pairs, sorted by offset."""
        with self._lock:
            return list(self._extents.free)

    def check_invariants(self) -> None:
        """Raise `AssertionError` unless table and free list tile the file exactly, and the
        file's real size is the table's."""
        with self._lock:
            real = None if self._file.closed else os.fstat(self._fd).st_size
            problems = self._extents.problems(real)
        if problems:
            raise AssertionError("BlobFile invariants broken: " + "; ".join(problems))

    def _check_open(self) -> None:
        if self._file.closed:
            raise ValueError("BlobFile is closed")


def _verify(key: Hashable, entry: Entry, data: bytes | np.ndarray, got: int) -> None:
    """`CorruptBlobError` unless `got` (the bytes read) is the blob's length and `data`
    matches its checksum."""
    if got != entry.length:
        raise CorruptBlobError(f"blob {key!r} is short: {got} of {entry.length} bytes")
    if checksum(data) != entry.checksum:
        raise CorruptBlobError(f"blob {key!r} failed its checksum")
