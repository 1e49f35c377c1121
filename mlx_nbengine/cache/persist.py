"""The persistent block store's files: a data file, a durable index log and a lock, in DIR.

`BlockStore(persist_dir=DIR)` keeps its records here, so a kernel restarted with the same
model finds them again. Files (directory mode 0700, files 0600, opened without following
symlinks):

- ``DIR/blocks.dat`` -- the *data file*: a 4096-byte header, then record blobs at extents
  managed like the scratch file's (`BlobFile` with ``reserved=4096``: table, first-fit free
  list, tail truncation). Header: ``b"MNBDATA1"``, u32 format version, the 16-byte *store
  id*, u32 CRC-32 of those 28 bytes, zeros up to 4096.
- ``DIR/index.log`` -- the *index* (`indexlog`: its format and its file): a header, then
  an append-only log of entries. Header: ``b"MNBINDEX"``, u32 format version, u32 length
  *n*, *n* bytes of JSON ``{"format", "store_id", "identity", "checksum", "created"}``,
  u32 CRC-32 of the JSON.
  `identity` says whose records these are (the engine puts the model fingerprint, block
  size, key format, layer layout, GGUF converter version and the record format there:
  `kinds.RECORD_FORMAT`, the blob layout and each record kind's version, so a change of
  what one kind keeps sets older stores aside; and under `SOFTWARE`, ``{name: version}``
  of what computes the numbers: MLX, mlx-lm, mlx-vlm, the kernels, the BLAS core);
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

Durability (a put): write the blob, append its ``P`` entry, and return; a thread of the
store's own (`_Syncer`) then ``fdatasync``s the data file and the index, once for however
many puts came while it was busy. So no put, and no read queued behind one on the cache-I/O
thread, waits for the disk (on a VM disk an ``fdatasync`` takes 25 ms; two per record made a
restore wait up to 100 ms behind the save before it). A put survives the process's death at
once (its bytes are in the page cache) and power loss once synced, a moment later. Until
then the kernel may write the index's pages before the data's, so a ``P`` entry can outlive
its bytes: the blob checksum, checked on every read, makes such a record a miss, never a
wrong answer, and so it does for a record whose space a put reused before the delete that
freed it was durable. A failed sync is raised by the next put (its `OSError`), which turns
saving off as a failed write does; `flush` syncs at once, and `close` syncs before it compacts.
Deletes and follower entries are appended the same way, without a sync of their own.

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
line (for other software: "it was written by mlx-lm 0.32.1, this process runs mlx-lm
0.32.2"), and nothing of it is read. Nothing in these files is unpickled or executed:
entries are fixed binary layouts, the header is JSON, records are safetensors blobs
(`records.record_from_buffer`).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

import numpy as np

from mlx_nbengine.cache.blobfile import CHECKSUM, BlobFile, Entry
from mlx_nbengine.cache.indexlog import (
    DEFAULT_FOLLOWERS,
    FORMAT_VERSION,
    INDEX_FILE,
    INDEX_MAGIC,
    TEMP_SUFFIX,
    Delete,
    Follower,
    IndexLog,
    Item,
    LogEntry,
    Put,
    Replay,
    StoreFormatError,
    decode_header,
    encode_entry,
    encode_header,
    pwrite_all,
    read_index,
    sync_dir,
)
from mlx_nbengine.errors import CacheError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no persistence, the store says so
    fcntl = None

__all__ = [
    "DATA_FILE",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "INDEX_MAGIC",
    "LOCK_FILE",
    "SOFTWARE",
    "Delete",
    "Follower",
    "PersistentBlobs",
    "Put",
    "StoreBusyError",
    "StoreFormatError",
    "decode_header",
    "encode_entry",
    "encode_header",
    "read_index",
]

DATA_FILE = "blocks.dat"
# The identity's key for what computes the records' numbers ({name: version}, named by the
# engine): a store written under other versions is set aside with a line naming them.
SOFTWARE = "software"
LOCK_FILE = "lock"
SET_ASIDE_PREFIX = "set-aside-"
DATA_MAGIC = b"MNBDATA1"
DATA_HEADER_BYTES = 4096

_DATA_HEAD = struct.Struct("<8sI16s")


class StoreBusyError(CacheError):
    """Another process holds the store directory's lock."""


# -- the data file's header ----------------------------------------------------------------


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
    sync_dir(path)
    return target


def _check_compatible(header: dict, identity: dict, data: Path) -> None:
    """`StoreFormatError` unless the index `header` is this version's and `identity`'s, and
    the data file (where there is one) belongs to the same store."""
    if header.get("checksum") != CHECKSUM:
        raise StoreFormatError(f"checksum {header.get('checksum')}, this version uses {CHECKSUM}")
    old = header["identity"]
    if old != identity:
        software = _describe_software(old.get(SOFTWARE), identity.get(SOFTWARE))
        rest = _describe_mismatch(
            {k: v for k, v in old.items() if k != SOFTWARE},
            {k: v for k, v in identity.items() if k != SOFTWARE},
        )
        if software is None:
            raise StoreFormatError(f"written for another model or format ({rest})")
        raise StoreFormatError(software + (f" (also: {rest})" if rest else ""))
    if os.path.lexists(data):
        check_data_header(_read_head(data, DATA_HEADER_BYTES), header["store_id"])


def _describe_software(old: object, new: object) -> str | None:
    """What differs between two identities' `SOFTWARE` (name -> version), in words; None
    where nothing does."""
    if old == new:
        return None
    if not isinstance(old, dict) or not isinstance(new, dict):
        return "it was written by a version of mlx_nbengine that recorded no software versions"
    names = [k for k in new if old.get(k) != new[k]] + [k for k in old if k not in new]
    there = ", ".join(f"{k} {old.get(k, 'none')}" for k in names)
    now = ", ".join(f"{k} {new.get(k, 'none')}" for k in names)
    return f"it was written by {there}, this process runs {now}"


def _describe_mismatch(old: dict, new: dict) -> str:
    """The first three keys whose values differ, in words; "variant" first (it says why a
    fingerprint differs), and of its parts (joined by "+") only those that differ."""
    parts = []
    for key in sorted(set(old) | set(new), key=lambda k: (k != "variant", k)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if key == "variant" and isinstance(a, str) and isinstance(b, str):
            pa, pb = a.split("+"), b.split("+")
            shown = [
                "+".join(p for p in x if p not in y) or "none" for x, y in ((pa, pb), (pb, pa))
            ]
        else:
            shown = [str(v)[:12] + ("..." if len(str(v)) > 12 else "") for v in (a, b)]
        parts.append(f"{key} {shown[0]} there, {shown[1]} now")
    return "; ".join(parts[:3])


# -- the syncer ----------------------------------------------------------------------------


class _Syncer:
    """Runs `sync` on a thread of its own (started at the first `kick`) after each `kick`;
    kicks that come while a sync runs make one more sync, not one each. The first `OSError`
    a sync raised stays in `error` until taken."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._wake = threading.Condition()
        self._pending = False
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: OSError | None = None

    def kick(self) -> None:
        with self._wake:
            self._pending = True
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(
                    target=self._run, name="mlx-nbengine-store-sync", daemon=True
                )
                self._thread.start()
            self._wake.notify_all()

    def take_error(self) -> OSError | None:
        """The first failure since the last take (None: none)."""
        with self._wake:
            error, self.error = self.error, None
        return error

    def now(self) -> None:
        """Sync on this thread, now (an `OSError` is kept in `error` too, and raised)."""
        try:
            self._sync()
        except OSError as exc:
            with self._wake:
                if self.error is None:
                    self.error = exc
            raise

    def wait(self) -> None:
        """Until every sync asked for so far has run."""
        with self._wake:
            while (self._pending or self._busy) and self._thread is not None:
                self._wake.wait()

    def stop(self) -> None:
        """Let a sync asked for run, then end the thread; idempotent."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._pending or self._stopping):
                    self._wake.wait()
                if not self._pending:
                    return
                self._pending, self._busy = False, True
            try:
                self.now()
            except OSError:
                pass  # kept in `error`: the next put raises it
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()


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
        self.recency = None  # callable -> items oldest first (the owner's LRU order)
        self.closed = False
        self._lock_fd = _lock(self.path)
        # Held while the files are synced, and while the index's descriptor changes.
        self._sync_lock = threading.Lock()
        self._syncer = _Syncer(self._sync)
        self._log: IndexLog | None = None
        self.blobs: BlobFile | None = None
        try:
            self._open()
        except BaseException:
            if self.blobs is not None:
                self.blobs.close()
            if self._log is not None:
                self._log.close()
            self._release_lock()
            raise

    @property
    def broken(self) -> str | None:
        """Why the index can no longer be written (None while it can)."""
        return self._log.broken if self._log is not None else None

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
                _check_compatible(state.header, self.identity, data)
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
        self._log = IndexLog(self.path, store_id=store_id, identity=self.identity)
        self._log.attach(state)
        notes = []
        if fresh_data and self.dropped:
            notes.append(f"its data file was missing ({self.dropped} record(s) dropped)")
        elif self.dropped:
            notes.append(f"{self.dropped} record(s) the index named were incomplete or damaged")
        if state.end < state.size:
            notes.append("a torn index tail was cut off")
        if notes:
            self.note = f"block store in {self.path}: " + "; ".join(notes) + " (space reclaimed)"
        if state.end < state.size or refused or self._needs_compaction():
            try:
                self.compact()
            except OSError as exc:
                if refused:
                    # The refused entries stay in the log; a later write could land where
                    # one points. Write nothing more: serve what is held.
                    self._log.broken = exc.strerror or str(exc)

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
        self._log = IndexLog(self.path, store_id=self.store_id, identity=self.identity)
        self._log.rewrite([])

    def _write_data_header(self, data: Path, store_id: str) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(data, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            pwrite_all(fd, encode_data_header(store_id), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        sync_dir(self.path)

    # -- the log -------------------------------------------------------------------------

    def _needs_compaction(self) -> bool:
        live = len(self._items) + len(self._followers)
        return self._log.entries > max(self.compact_min, 2 * live)

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
        """Rewrite the log with the live entries only (data synced first; temp file, sync,
        rename)."""
        if self.broken is None:
            with self._sync_lock:
                self.blobs.sync()
                self._log.rewrite(self._live_entries())

    def _sync(self) -> None:
        """Make the blobs and entries written so far durable: the data file, then the log."""
        with self._sync_lock:
            if self.blobs.closed:
                return
            (getattr(os, "fdatasync", None) or os.fsync)(self.blobs.fileno())
            self._log.flush()

    # -- BlobFile's interface ------------------------------------------------------------

    def items(self) -> list[tuple[Item, int]]:
        """The held records, oldest first, with their sizes."""
        return [(item, entry.length) for item, entry in self._items.items()]

    def write(self, key: Hashable, data: bytes | bytearray | memoryview) -> None:
        item = _item(key)
        encode_entry(Put(item[0], item[1], 0, 0, 0))  # a key the index cannot hold: now
        if self.broken is not None:
            raise OSError(errno.EIO, f"the store's index cannot be written ({self.broken})")
        failed = self._syncer.take_error()
        if failed is not None:
            raise OSError(failed.errno or errno.EIO, failed.strerror or str(failed))
        if item in self._items:
            self.delete(item)
        self.blobs.write(item, data)
        entry = self.blobs.entry(item)
        try:
            self._log.append([Put(item[0], item[1], entry.offset, entry.length, entry.checksum)])
        except BaseException:
            self.blobs.delete(item)
            raise
        self._items[item] = entry
        self._syncer.kick()
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
                self._log.append([Delete(*item)])
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
        with self._sync_lock:
            self._log.clear()
            self.blobs.clear()

    def flush(self) -> None:
        """Make every blob and entry written so far durable, now (`OSError` if it fails; the
        next put fails too)."""
        self._syncer.now()

    def synced(self) -> None:
        """Wait until the syncs that the puts so far asked for have run (for tests)."""
        self._syncer.wait()

    def close(self) -> None:
        """Compact the log (keeping the LRU order), close the files, release the lock."""
        if self.closed:
            return
        self.closed = True
        self._syncer.stop()
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
            self._log.close()
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
        return self._log.end

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
                self._log.append([Follower(key, parent, ids)])
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
