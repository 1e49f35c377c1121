"""The persistent store's index: a durable, append-only log of entries, its format and its file.

The layout (header, entry frames, the ``P``/``D``/``F`` entries) is described in
`persist`'s module docstring. Terms:

- *replay*: reading a log from its header to its first damaged or truncated entry, into
  the live puts (oldest first) and followers (`Replay`, `read_index`).
- *append*: entries written at the log's end, not synced (`IndexLog.flush` syncs them), cut
  back when a write fails (`IndexLog.append`).
- *rewrite*: the live entries written whole to ``index.log.tmp``, synced and renamed over the
  log (`IndexLog.rewrite`; atomic: either log is whole). *broken*: why the log can no longer
  be written (None while it can); nothing is appended then.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mlx_nbengine.cache.blobfile import CHECKSUM, Entry, checksum
from mlx_nbengine.errors import CacheError

__all__ = [
    "FORMAT_VERSION",
    "INDEX_FILE",
    "INDEX_MAGIC",
    "Delete",
    "Follower",
    "IndexLog",
    "Put",
    "Replay",
    "StoreFormatError",
    "decode_header",
    "encode_entry",
    "encode_header",
    "read_index",
]

FORMAT_VERSION = 1
INDEX_FILE = "index.log"
TEMP_SUFFIX = ".tmp"
INDEX_MAGIC = b"MNBINDEX"
MAX_HEADER_JSON = 1 << 16
MAX_ENTRY_BYTES = 1 << 24  # a follower entry of a 2M-token block; anything larger is damage
MAX_INDEX_BYTES = 1 << 28  # a log this large is not ours (ours compacts to ~10 MB at most)
DEFAULT_FOLLOWERS = 4096  # as FollowerIndex's default capacity

_FRAME = struct.Struct("<IQ")
_PUT = struct.Struct("<BQQQ")
_PUT_T, _DELETE_T, _FOLLOWER_T = 1, 2, 3

Item = tuple[str, str]


class StoreFormatError(CacheError):
    """A store file is not one this version can read (foreign, damaged or incompatible)."""


@dataclass(frozen=True)
class Put:
    key: str
    kind: str
    offset: int
    length: int
    checksum: int


@dataclass(frozen=True)
class Delete:
    key: str
    kind: str


@dataclass(frozen=True)
class Follower:
    key: str
    parent: str
    ids: bytes  # packed little-endian int64 token ids


LogEntry = Put | Delete | Follower


# -- encoding ------------------------------------------------------------------------------


def _str(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"{text[:40]!r}... is too long for the store index (64 KiB at most)")
    return struct.pack("<H", len(raw)) + raw


def encode_entry(entry: LogEntry) -> bytes:
    """One framed log entry (see the module docstring)."""
    if isinstance(entry, Put):
        payload = _PUT.pack(_PUT_T, entry.offset, entry.length, entry.checksum)
        payload += _str(entry.key) + _str(entry.kind)
    elif isinstance(entry, Delete):
        payload = bytes([_DELETE_T]) + _str(entry.key) + _str(entry.kind)
    elif isinstance(entry, Follower):
        count = len(entry.ids) // 8
        payload = bytes([_FOLLOWER_T]) + _str(entry.key) + _str(entry.parent)
        payload += struct.pack("<I", count) + entry.ids[: count * 8]
    else:  # pragma: no cover - a programming error
        raise TypeError(f"not a log entry: {entry!r}")
    return _FRAME.pack(len(payload), checksum(payload)) + payload


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("short")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def string(self) -> str:
        (n,) = struct.unpack("<H", self.take(2))
        return self.take(n).decode("utf-8")


def decode_payload(payload: bytes) -> LogEntry:
    """The entry in one payload; ValueError if it is not a well-formed entry."""
    r = _Reader(payload)
    kind = r.take(1)[0]
    if kind == _PUT_T:
        _, offset, length, check = _PUT.unpack(payload[: _PUT.size])
        r.pos = _PUT.size
        entry: LogEntry = Put(r.string(), r.string(), offset, length, check)
    elif kind == _DELETE_T:
        entry = Delete(r.string(), r.string())
    elif kind == _FOLLOWER_T:
        key, parent = r.string(), r.string()
        (count,) = struct.unpack("<I", r.take(4))
        entry = Follower(key, parent, r.take(8 * count))
    else:
        raise ValueError(f"unknown entry type {kind}")
    if r.pos != len(payload):
        raise ValueError("trailing bytes in an entry")
    return entry


def iter_entries(data: bytes, start: int) -> Iterator[tuple[LogEntry, int]]:
    """Each complete, checksummed entry from `start` with the offset just past it; stops at
    the first entry that is truncated, fails its checksum or does not decode."""
    pos = start
    while pos + _FRAME.size <= len(data):
        length, check = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + length
        if length == 0 or length > MAX_ENTRY_BYTES or end > len(data):
            return
        payload = data[pos + _FRAME.size : end]
        if checksum(payload) != check:
            return
        try:
            entry = decode_payload(payload)
        except (ValueError, UnicodeDecodeError, struct.error):
            return
        yield entry, end
        pos = end


def encode_header(*, store_id: str, identity: dict) -> bytes:
    body = json.dumps(
        {
            "format": FORMAT_VERSION,
            "store_id": store_id,
            "identity": identity,
            "checksum": CHECKSUM,
            "created": int(time.time()),
        },
        sort_keys=True,
    ).encode()
    return (
        INDEX_MAGIC
        + struct.pack("<II", FORMAT_VERSION, len(body))
        + body
        + struct.pack("<I", zlib.crc32(body))
    )


def decode_header(data: bytes) -> tuple[dict, int]:
    """The header's JSON and the offset of the first entry; `StoreFormatError` if `data`
    does not start with a store index header."""
    if not data.startswith(INDEX_MAGIC):
        raise StoreFormatError("not a block store index (no MNBINDEX header)")
    if len(data) < 16:
        raise StoreFormatError("the index header is truncated")
    version, n = struct.unpack_from("<II", data, 8)
    if version != FORMAT_VERSION:
        raise StoreFormatError(f"store format {version}, this version reads {FORMAT_VERSION}")
    if n > MAX_HEADER_JSON or len(data) < 16 + n + 4:
        raise StoreFormatError("the index header is truncated or damaged")
    body = data[16 : 16 + n]
    (crc,) = struct.unpack_from("<I", data, 16 + n)
    if zlib.crc32(body) != crc:
        raise StoreFormatError("the index header fails its checksum")
    try:
        header = json.loads(body)
    except (ValueError, RecursionError):
        raise StoreFormatError("the index header is not JSON") from None
    if (
        not isinstance(header, dict)
        or header.get("format") != FORMAT_VERSION
        or not isinstance(header.get("identity"), dict)
        or not isinstance(header.get("store_id"), str)
        or len(header["store_id"]) != 32
    ):
        raise StoreFormatError("the index header lacks its fields")
    try:
        bytes.fromhex(header["store_id"])
    except ValueError:
        raise StoreFormatError("the index header's store id is not hex") from None
    return header, 16 + n + 4


@dataclass
class Replay:
    """What an index log says: live puts oldest first, followers, and where it ends."""

    header: dict
    start: int  # offset of the first entry (the header's length)
    puts: OrderedDict[Item, Entry]
    followers: OrderedDict[str, tuple[str, bytes]]
    entries: int  # complete entries read
    end: int  # offset just past the last complete entry
    size: int  # the file's size (end < size: a damaged or torn tail)


def read_index(path: str | os.PathLike[str], *, followers: int = DEFAULT_FOLLOWERS) -> Replay:
    """Read and replay the index at `path`; `StoreFormatError` if it is no store index."""
    data = _read_regular(Path(path), limit=MAX_INDEX_BYTES, what="index")
    header, pos = decode_header(data)
    return replay(data, header, pos, followers=followers)


def replay(data: bytes, header: dict, start: int, *, followers: int = DEFAULT_FOLLOWERS) -> Replay:
    puts: OrderedDict[Item, Entry] = OrderedDict()
    known: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
    count, end = 0, start
    for entry, end in iter_entries(data, start):  # noqa: B007 - `end` is read after
        count += 1
        if isinstance(entry, Put):
            item = (entry.key, entry.kind)
            puts.pop(item, None)
            puts[item] = Entry(entry.offset, entry.length, entry.checksum)
        elif isinstance(entry, Delete):
            puts.pop((entry.key, entry.kind), None)
        else:
            known.pop(entry.key, None)
            known[entry.key] = (entry.parent, entry.ids)
            if len(known) > followers:
                known.popitem(last=False)
    return Replay(header, start, puts, known, count, end, len(data))


def _read_regular(path: Path, *, limit: int, what: str) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreFormatError(f"the {what} file is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreFormatError(f"the {what} file is not a regular file")
        if st.st_size > limit:
            raise StoreFormatError(f"the {what} file is {st.st_size} bytes, too large for one")
        parts, got = [], 0
        while got < st.st_size:
            chunk = os.read(fd, st.st_size - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_log(path: Path) -> int:
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags)


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        written = os.pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {written} bytes")
        done += written


# -- the log file --------------------------------------------------------------------------


class IndexLog:
    """The open index log of one store in `directory` (see the module docstring).

    `rewrite` writes a new log (the first call creates it); `attach` opens the log a
    `Replay` read, cutting off a torn tail. Owned by `PersistentBlobs`.
    """

    def __init__(self, directory: Path, *, store_id: str, identity: dict) -> None:
        self.directory = directory
        self.path = directory / INDEX_FILE
        self.store_id = store_id
        self.identity = identity
        self.fd = -1
        self.start = 0  # offset of the first entry (the header's length)
        self.end = 0  # offset just past the last entry
        self.entries = 0  # entries in the log, live or not
        self.broken: str | None = None

    def attach(self, state: Replay) -> None:
        """Append after `state`'s last complete entry; a torn tail is cut off first."""
        self.fd = open_log(self.path)
        self.start, self.end, self.entries = state.start, state.end, state.entries
        if state.end < state.size:
            os.ftruncate(self.fd, state.end)  # later entries must not follow garbage

    def append(self, entries: list[LogEntry]) -> None:
        """Append `entries` (not synced: see `flush`); on failure cut the log back and raise
        `OSError`."""
        if self.broken is not None:
            raise OSError(errno.EIO, f"the store's index cannot be written ({self.broken})")
        frames = b"".join(encode_entry(e) for e in entries)
        try:
            pwrite_all(self.fd, frames, self.end)
        except OSError as exc:
            try:
                os.ftruncate(self.fd, self.end)
            except OSError:
                self.broken = exc.strerror or str(exc)
            raise
        self.end += len(frames)
        self.entries += len(entries)

    def rewrite(self, entries: list[LogEntry]) -> None:
        """Replace the log with a header and `entries` (temp file, sync, rename)."""
        temp = self.directory / (INDEX_FILE + TEMP_SUFFIX)
        header = encode_header(store_id=self.store_id, identity=self.identity)
        body = header + b"".join(encode_entry(e) for e in entries)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(temp, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            pwrite_all(fd, body, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise
        os.close(fd)
        os.replace(temp, self.path)
        sync_dir(self.directory)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = open_log(self.path)
        self.start = len(header)
        self.end = len(body)
        self.entries = len(entries)

    def clear(self) -> None:
        """Cut the log back to its header (needs no free space) and sync it; a failure
        breaks the log."""
        if self.broken is not None:
            return
        try:
            os.ftruncate(self.fd, self.start)
            os.fsync(self.fd)
            self.end, self.entries = self.start, 0
        except OSError as exc:
            self.broken = exc.strerror or str(exc)

    def flush(self) -> None:
        """Make every entry appended so far durable."""
        if self.broken is None and self.fd >= 0:
            (getattr(os, "fdatasync", None) or os.fsync)(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
