"""The persistent block store's files: a data file, a durable index log and a lock, in DIR.

`BlockStore(persist_dir=DIR)` keeps its records here, so a kernel restarted with the same
model finds them again. Files (directory mode 0700, files 0600, opened without following
symlinks):

- ``DIR/blocks.dat`` -- the *data file*: a 4096-byte header, then record blobs at extents
  managed like the scratch file's (`BlobFile` with ``reserved=4096``: table, first-fit free
  list, tail truncation). Header: ``b"MNBDATA1"``, u32 format version, the 16-byte *store
  id*, u32 CRC-32 of those 28 bytes, zeros up to 4096.
- ``DIR/index.log`` -- the *index*: a header, then an append-only log of entries.
  Header: ``b"MNBINDEX"``, u32 format version, u32 length *n*, *n* bytes of JSON
  ``{"format", "store_id", "identity", "checksum", "created"}``, u32 CRC-32 of the JSON.
  `identity` says whose records these are (the engine puts the model fingerprint, block
  size, key format, layer layout, GGUF converter version and the record format there:
  `kinds.RECORD_FORMAT`, the blob layout and each record kind's version, so a change of
  what one kind keeps sets older stores aside);
  `checksum` names the checksum of the entries and blobs (`blobfile.CHECKSUM`).
  Entry: a frame ``u32 payload length, u64 checksum of the payload``, then the payload, one
  type byte first (all integers little-endian; strings UTF-8 with a u16 length):

  ======== ========================================================================
  ``P`` 1  put: u64 offset, u64 length, u64 blob checksum, key, kind
  ``D`` 2  delete (an eviction, a damaged record, `delete`): key, kind
  ``F`` 3  follower: key, parent key, u32 count, count x i64 token ids (the follower
           index's metadata: which block followed which prefix, with what tokens)
  ======== ========================================================================

- ``DIR/lock`` -- `fcntl.flock`'d (exclusive, non-blocking) by the process that has the
  store open; it holds that process's pid, for the message a second process gets.
- ``DIR/index.log.tmp`` -- a compaction in progress (removed on open).
- ``DIR/set-aside-<time>/`` -- an incompatible or damaged store's files, moved out of the
  way whole (never migrated in place; delete the folder to free its space).

Durability (a put): write the blob, ``fdatasync`` the data file, append its ``P`` entry,
``fdatasync`` the index. So every durable ``P`` entry describes durable bytes, and a
``kill -9`` (or power loss) at any instant leaves a log whose complete, checksummed
entries all hold. Deletes and follower entries are appended without a sync of their own:
the next put's sync (or `close`) makes them durable, and as the log is append-only, a
durable put implies every entry before it is durable too -- in particular the delete of
the record whose space it reuses.

Opening replays the log up to its first damaged or truncated entry (the rest is cut off),
drops puts whose extent overlaps a later one, starts in the header or runs past the end of
the data file, and frees every byte no record uses (a half-written record's space comes
back here; free space at the end is truncated). Blob checksums are checked on every read,
not on open (so opening reads the index only): a record whose bytes were damaged
is a miss, evicted when first read. A log grown to more than twice the live entries (at
least `compact_min` entries) is *compacted*: the live entries, oldest first, are written
to ``index.log.tmp``, synced and renamed over the log (atomic: either log is whole). Close
compacts too, which also keeps the LRU order for the next process.

An index or data file that is not a store's (bad magic, damaged header, another store's
data file, a symlink, absurd sizes) or was written for another identity or format is
*set aside* and an empty store started; `PersistentBlobs.note` says what happened in one
line. Nothing in these files is unpickled or executed: entries are fixed binary layouts,
the header is JSON, records are safetensors blobs (`records.record_from_buffer`).
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
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_nbengine.cache.blobfile import CHECKSUM, BlobFile, Entry, checksum
from mlx_nbengine.errors import CacheError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no persistence, the store says so
    fcntl = None

__all__ = [
    "DATA_FILE",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "LOCK_FILE",
    "Delete",
    "Follower",
    "PersistentBlobs",
    "Put",
    "StoreBusyError",
    "StoreFormatError",
    "read_index",
]

FORMAT_VERSION = 1
INDEX_FILE = "index.log"
DATA_FILE = "blocks.dat"
LOCK_FILE = "lock"
TEMP_SUFFIX = ".tmp"
SET_ASIDE_PREFIX = "set-aside-"
INDEX_MAGIC = b"MNBINDEX"
DATA_MAGIC = b"MNBDATA1"
DATA_HEADER_BYTES = 4096
MAX_HEADER_JSON = 1 << 16
MAX_ENTRY_BYTES = 1 << 24  # a follower entry of a 2M-token block; anything larger is damage
MAX_INDEX_BYTES = 1 << 28  # a log this large is not ours (ours compacts to ~10 MB at most)
DEFAULT_FOLLOWERS = 4096  # as FollowerIndex's default capacity

_FRAME = struct.Struct("<IQ")
_PUT = struct.Struct("<BQQQ")
_DATA_HEAD = struct.Struct("<8sI16s")
_PUT_T, _DELETE_T, _FOLLOWER_T = 1, 2, 3

Item = tuple[str, str]


class StoreFormatError(CacheError):
    """A store file is not one this version can read (foreign, damaged or incompatible)."""


class StoreBusyError(CacheError):
    """Another process holds the store directory's lock."""


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


def encode_data_header(store_id: str) -> bytes:
    head = _DATA_HEAD.pack(DATA_MAGIC, FORMAT_VERSION, bytes.fromhex(store_id))
    head += struct.pack("<I", zlib.crc32(head))
    return head + bytes(DATA_HEADER_BYTES - len(head))


def _is_data_header(data: bytes) -> bool:
    size = _DATA_HEAD.size
    if len(data) < size + 4 or not data.startswith(DATA_MAGIC):
        return False
    (crc,) = struct.unpack_from("<I", data, size)
    return zlib.crc32(data[:size]) == crc


def check_data_header(data: bytes, store_id: str) -> None:
    """`StoreFormatError` unless `data` is the header of store `store_id`'s data file."""
    size = _DATA_HEAD.size
    if len(data) < size + 4 or not data.startswith(DATA_MAGIC):
        raise StoreFormatError("the data file is not a block store's (no MNBDATA1 header)")
    (crc,) = struct.unpack_from("<I", data, size)
    if zlib.crc32(data[:size]) != crc:
        raise StoreFormatError("the data file's header fails its checksum")
    _, version, sid = _DATA_HEAD.unpack_from(data)
    if version != FORMAT_VERSION:
        raise StoreFormatError(f"data file format {version}, this version reads {FORMAT_VERSION}")
    if sid.hex() != store_id:
        raise StoreFormatError("the data file belongs to another store than the index")


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


# -- the directory -------------------------------------------------------------------------


def prepare_dir(directory: str | os.PathLike[str]) -> Path:
    """Create `directory` (mode 0700) if needed; make it 0700; refuse one not ours."""
    path = Path(directory).expanduser()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{os.fspath(path)!r} is not a directory")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise CacheError(f"{os.fspath(path)!r} belongs to another user; use a folder of yours")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _sync_dir(path: Path) -> None:
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


def _lock(path: Path) -> int:
    if fcntl is None:
        raise CacheError("a persistent store needs POSIX file locks (fcntl)")
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path / LOCK_FILE, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise StoreBusyError(f"in use by another process{who}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def set_aside(path: Path, names: Iterable[str]) -> Path | None:
    """Move the files `names` of `path` into a new ``set-aside-<time>`` folder (0700)."""
    present = [n for n in names if os.path.lexists(path / n)]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path / f"{SET_ASIDE_PREFIX}{stamp}"
    n = 1
    while os.path.lexists(target):
        n += 1
        target = path / f"{SET_ASIDE_PREFIX}{stamp}-{n}"
    target.mkdir(mode=0o700)
    for name in present:
        os.rename(path / name, target / name)
    _sync_dir(path)
    return target


def _describe_mismatch(old: dict, new: dict) -> str:
    parts = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a != b:
            shown = [str(v)[:12] + ("..." if len(str(v)) > 12 else "") for v in (a, b)]
            parts.append(f"{key} {shown[0]} there, {shown[1]} now")
    return "; ".join(parts[:3]) or "another identity"


# -- the backend ---------------------------------------------------------------------------


class PersistentBlobs:
    """`BlobFile`'s interface (write, read, delete, clear, close, sizes) over DIR's data
    file and index log; holds DIR's lock from construction to `close`.

    Owned by `BlockStore` (which locks around every call). Raises `StoreBusyError` when
    another process holds DIR, `CacheError`/`OSError` when DIR cannot be used at all; sets
    an incompatible or foreign store aside (see `note`). `items()` gives the replayed
    records oldest first; `recency` (set by the owner) gives the order that compaction
    writes (oldest first); without it the table's order is written.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        identity: dict,
        compact_min: int = 4096,
        followers: int = DEFAULT_FOLLOWERS,
    ) -> None:
        self.path = prepare_dir(directory)
        self.identity = json.loads(json.dumps(identity, sort_keys=True))
        self.compact_min = compact_min
        self.follower_capacity = followers
        self.note = ""  # one line: what opening found (set aside, dropped records)
        self.dropped = 0  # records the index named that opening could not keep
        self.broken: str | None = None  # why the index can no longer be written
        self.recency = None  # callable -> items oldest first (the owner's LRU order)
        self.closed = False
        self._lock_fd = _lock(self.path)
        self._log_fd = -1
        self.blobs: BlobFile | None = None
        try:
            self._open()
        except BaseException:
            if self.blobs is not None:
                self.blobs.close()
            if self._log_fd >= 0:
                os.close(self._log_fd)
            self._release_lock()
            raise

    # -- opening -------------------------------------------------------------------------

    def _open(self) -> None:
        index, data = self.path / INDEX_FILE, self.path / DATA_FILE
        temp = self.path / (INDEX_FILE + TEMP_SUFFIX)
        if os.path.lexists(temp):
            os.unlink(temp)  # a compaction a crash interrupted; the log is whole
        state = self._replay(index, data)
        if state is None:
            self._create()
        else:
            self._adopt(state, index, data)

    def _replay(self, index: Path, data: Path) -> Replay | None:
        """The index replayed, if it is this identity's store; else None, with a foreign or
        incompatible store set aside (and an orphaned data file of ours removed)."""
        state: Replay | None = None
        if os.path.lexists(index):
            try:
                state = read_index(index, followers=self.follower_capacity)
                if state.header.get("checksum") != CHECKSUM:
                    raise StoreFormatError(
                        f"checksum {state.header.get('checksum')}, this version uses {CHECKSUM}"
                    )
                if state.header["identity"] != self.identity:
                    raise StoreFormatError(
                        "written for another model or format ("
                        + _describe_mismatch(state.header["identity"], self.identity)
                        + ")"
                    )
                if os.path.lexists(data):
                    check_data_header(_read_head(data, DATA_HEADER_BYTES), state.header["store_id"])
            except StoreFormatError as exc:
                self._set_aside(str(exc))
                state = None
        elif os.path.lexists(data):
            # A data file without its index: a crash while the store was being created
            # (ours: no record in it was ever durable, so it goes), or a stranger's.
            try:
                ours = _is_data_header(_read_head(data, DATA_HEADER_BYTES))
            except StoreFormatError:
                ours = False
            if ours:
                os.unlink(data)
            else:
                self._set_aside("a data file that is not a block store's, without an index")
        return state

    def _adopt(self, state: Replay, index: Path, data: Path) -> None:
        """Serve the replayed `state`: its extents adopted, damage noted and reclaimed."""
        store_id = state.header["store_id"]
        fresh_data = not os.path.lexists(data)
        if fresh_data:
            self._write_data_header(data, store_id)
        self.store_id = store_id
        self.blobs = BlobFile(path=data, reserved=DATA_HEADER_BYTES)
        # Newest first: where two extents overlap (only a damaged log does that) the last
        # written one is kept.
        refused = self.blobs.adopt(reversed(state.puts.items()))
        for item in refused:
            del state.puts[item]
        self._items = state.puts
        self.dropped = len(refused)
        self._followers = state.followers
        self._log_fd = _open_log(index)
        self._log_start = state.start
        self._log_end = state.end
        self._log_entries = state.entries
        notes = []
        if fresh_data and self.dropped:
            notes.append(f"its data file was missing ({self.dropped} record(s) dropped)")
        elif self.dropped:
            notes.append(f"{self.dropped} record(s) the index named were incomplete or damaged")
        if state.end < state.size:
            notes.append("a torn index tail was cut off")
        if notes:
            self.note = f"block store in {self.path}: " + "; ".join(notes) + " (space reclaimed)"
        if state.end < state.size:
            os.ftruncate(self._log_fd, state.end)  # later entries must not follow garbage
        if state.end < state.size or refused or self._needs_compaction():
            try:
                self.compact()
            except OSError as exc:
                if refused:
                    # The refused entries stay in the log; a later write could land where
                    # one points. Write nothing more: serve what is held.
                    self.broken = exc.strerror or str(exc)

    def _set_aside(self, reason: str) -> None:
        where = set_aside(self.path, [INDEX_FILE, DATA_FILE])
        self.note = (
            f"the block store in {self.path} was set aside: {reason}; its files are now in "
            f"{where} (delete that folder to free its space); starting an empty store"
        )

    def _create(self) -> None:
        self.store_id = os.urandom(16).hex()
        data = self.path / DATA_FILE
        self._write_data_header(data, self.store_id)
        self.blobs = BlobFile(path=data, reserved=DATA_HEADER_BYTES)
        self.blobs.adopt([])
        self._items: OrderedDict[Item, Entry] = OrderedDict()
        self._followers: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._rewrite([])

    def _write_data_header(self, data: Path, store_id: str) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(data, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            _pwrite_all(fd, encode_data_header(store_id), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        _sync_dir(self.path)

    # -- the log -------------------------------------------------------------------------

    def _append(self, entries: list[LogEntry], *, sync: bool) -> None:
        """Append `entries`; on failure cut the log back and raise `OSError`."""
        if self.broken is not None:
            raise OSError(errno.EIO, f"the store's index cannot be written ({self.broken})")
        frames = b"".join(encode_entry(e) for e in entries)
        try:
            _pwrite_all(self._log_fd, frames, self._log_end)
            if sync:
                (getattr(os, "fdatasync", None) or os.fsync)(self._log_fd)
        except OSError as exc:
            try:
                os.ftruncate(self._log_fd, self._log_end)
            except OSError:
                self.broken = exc.strerror or str(exc)
            raise
        self._log_end += len(frames)
        self._log_entries += len(entries)

    def _needs_compaction(self) -> bool:
        live = len(self._items) + len(self._followers)
        return self._log_entries > max(self.compact_min, 2 * live)

    def _live_entries(self) -> list[LogEntry]:
        order = list(self.recency()) if self.recency is not None else list(self._items)
        seen = set(order)
        order += [item for item in self._items if item not in seen]
        out: list[LogEntry] = [
            Follower(key, parent, ids) for key, (parent, ids) in self._followers.items()
        ]
        for item in order:
            entry = self._items.get(item)
            if entry is not None:
                out.append(Put(item[0], item[1], entry.offset, entry.length, entry.checksum))
        return out

    def compact(self) -> None:
        """Rewrite the log with the live entries only (temp file, sync, rename)."""
        if self.broken is None:
            self._rewrite(self._live_entries())

    def _rewrite(self, entries: list[LogEntry]) -> None:
        index = self.path / INDEX_FILE
        temp = self.path / (INDEX_FILE + TEMP_SUFFIX)
        header = encode_header(store_id=self.store_id, identity=self.identity)
        body = header + b"".join(encode_entry(e) for e in entries)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(temp, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            _pwrite_all(fd, body, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise
        os.close(fd)
        os.replace(temp, index)
        _sync_dir(self.path)
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._log_fd = _open_log(index)
        self._log_start = len(header)
        self._log_end = len(body)
        self._log_entries = len(entries)

    # -- BlobFile's interface ------------------------------------------------------------

    def items(self) -> list[tuple[Item, int]]:
        """The held records, oldest first, with their sizes."""
        return [(item, entry.length) for item, entry in self._items.items()]

    def write(self, key: Hashable, data: bytes | bytearray | memoryview) -> None:
        item = _item(key)
        encode_entry(Put(item[0], item[1], 0, 0, 0))  # a key the index cannot hold: now
        if self.broken is not None:
            raise OSError(errno.EIO, f"the store's index cannot be written ({self.broken})")
        if item in self._items:
            self.delete(item)
        self.blobs.write(item, data)
        entry = self.blobs.entry(item)
        try:
            self.blobs.sync()
            self._append(
                [Put(item[0], item[1], entry.offset, entry.length, entry.checksum)], sync=True
            )
        except BaseException:
            self.blobs.delete(item)
            raise
        self._items[item] = entry
        if self._needs_compaction():
            try:
                self.compact()
            except OSError:
                pass  # the log stays valid, only longer

    def read(self, key: Hashable) -> bytes:
        return self.blobs.read(_item(key))

    def read_buffer(self, key: Hashable, into: np.ndarray | None = None) -> np.ndarray:
        return self.blobs.read_buffer(_item(key), into)

    def delete(self, key: Hashable) -> bool:
        item = _item(key)
        if self._items.pop(item, None) is None:
            return False
        self.blobs.delete(item)
        if self.broken is None:
            try:
                self._append([Delete(*item)], sync=False)
            except OSError:
                # Not logged: the record may come back on the next open, where its
                # checksum decides (its space is not reused while saving is off).
                pass
        return True

    def clear(self) -> None:
        """Forget everything: cut the log back to its header (needs no free space), sync,
        then truncate the data file."""
        self._items.clear()
        self._followers.clear()
        if self.broken is None:
            try:
                os.ftruncate(self._log_fd, self._log_start)
                os.fsync(self._log_fd)
                self._log_end, self._log_entries = self._log_start, 0
            except OSError as exc:
                self.broken = exc.strerror or str(exc)
        self.blobs.clear()

    def flush(self) -> None:
        """Make every entry appended so far durable."""
        if self.broken is None and self._log_fd >= 0:
            os.fsync(self._log_fd)

    def close(self) -> None:
        """Compact the log (keeping the LRU order), close the files, release the lock."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.broken is None:
                try:
                    self.compact()
                except OSError:
                    self.flush()
        except OSError:
            pass
        finally:
            self.blobs.close()
            if self._log_fd >= 0:
                os.close(self._log_fd)
                self._log_fd = -1
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = -1

    @property
    def file_size(self) -> int:
        return self.blobs.file_size

    @property
    def free_bytes(self) -> int:
        return self.blobs.free_bytes

    @property
    def log_size(self) -> int:
        """Bytes of the index log now."""
        return self._log_end

    # -- followers -----------------------------------------------------------------------

    def note_follower(self, key: str, parent: str, ids: bytes) -> None:
        """Log that block `key` followed `parent` with token ids `ids` (packed int64)."""
        if self._followers.get(key) == (parent, ids):
            self._followers.move_to_end(key)
            return
        self._followers.pop(key, None)
        self._followers[key] = (parent, ids)
        if len(self._followers) > self.follower_capacity:
            self._followers.popitem(last=False)
        if self.broken is None:
            try:
                self._append([Follower(key, parent, ids)], sync=False)
            except OSError:
                pass  # only metadata: a cut after a restart may not find this block
            except ValueError:
                self._followers.pop(key, None)

    def followers(self) -> list[tuple[str, str, bytes]]:
        """``(key, parent, packed ids)`` of the followers known, oldest first."""
        return [(key, parent, ids) for key, (parent, ids) in self._followers.items()]


def _item(key: Hashable) -> Item:
    if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
        raise TypeError(f"the persistent store's keys are (block_key, kind) strings, not {key!r}")
    return key  # type: ignore[return-value]


def _open_log(path: Path) -> int:
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags)


def _read_head(path: Path, n: int) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreFormatError("the data file is a symlink") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreFormatError("the data file is not a regular file")
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        written = os.pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {written} bytes")
        done += written
