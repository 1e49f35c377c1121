"""Where a `BlockStore` keeps its blobs: memory, a scratch file or a persistent directory.

Terms:

- *backend*: an object with `BlobFile`'s interface (write, read, read_buffer, delete,
  clear, close, file_size, free_bytes): `MemoryBlobs` (a dict; `budget_bytes=0`),
  `BlobFile` (an unlinked scratch file) or `PersistentBlobs` (`persist_dir=DIR`).
- *default budget*: `min(25% of the free space of the directory, 8 GiB)`: a quarter leaves
  the user's disk usable while other programs grow, and 8 GiB holds far more blocks of a
  small model than one notebook's prompts need (the README gives a block's bytes).
- *note*: one line on why DIR was not used as asked (another process holds its lock, it
  cannot be written) or what opening it found; the store then falls back to a scratch file.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np

from mlx_nbengine.cache.blobfile import BlobFile
from mlx_nbengine.cache.persist import PersistentBlobs, StoreBusyError
from mlx_nbengine.errors import CacheError

__all__ = ["Backend", "MemoryBlobs", "default_budget_bytes", "open_backend", "saving_off_reason"]

Item = tuple[str, str]

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_DISK_FRACTION = 0.25
DEFAULT_DISK_CAP = 8 * GiB
DEFAULT_MEMORY_BUDGET = 512 * MiB
# Write errors that mean "no more room" or "this disk fails": saving turns off.
SAVING_OFF_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EFBIG", "EIO", "EROFS")
    if hasattr(errno, name)
)


def default_budget_bytes(directory: str | os.PathLike[str] | None = None, *, held: int = 0) -> int:
    """`min(25% of the free space where the store lives, 8 GiB)`; `held` bytes the store
    already occupies there count as free."""
    free = shutil.disk_usage(directory or tempfile.gettempdir()).free + held
    return min(int(free * DEFAULT_DISK_FRACTION), DEFAULT_DISK_CAP)


def saving_off_reason(exc: OSError) -> str | None:
    """Why saving turns off after the failed write `exc`; None when only that put fails."""
    if exc.errno not in SAVING_OFF_ERRNOS:
        return None
    what = exc.strerror or os.strerror(exc.errno)
    return (
        f"saving to the block store is off: a write failed ({what}); "
        "the blocks already stored are still restored"
    )


class MemoryBlobs:
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

    def read_buffer(self, key: Item, into: np.ndarray | None = None) -> np.ndarray:
        return np.frombuffer(self._blobs[key], dtype=np.uint8)  # a view: nothing to read

    def delete(self, key: Item) -> bool:
        return self._blobs.pop(key, None) is not None

    def clear(self) -> None:
        self._blobs.clear()

    def close(self) -> None:
        self._blobs.clear()
        self.closed = True


@dataclass
class Backend:
    """An opened backend, the budget in force over it, its description (no path) and the
    note on `persist_dir` ("" if all went as asked)."""

    blobs: BlobFile | MemoryBlobs | PersistentBlobs
    budget: int
    description: str
    note: str = ""


def open_backend(
    *,
    budget_bytes: int | None,
    directory: str | os.PathLike[str] | None,
    memory_budget_bytes: int,
    persist_dir: str | os.PathLike[str] | None,
    identity: dict | None,
) -> Backend:
    """The backend `BlockStore`'s options ask for (see `BlockStore` and the module)."""
    if budget_bytes is not None and budget_bytes < 0:
        raise CacheError(
            f"budget_bytes={budget_bytes} is negative; pass a size in bytes, 0 for memory "
            "only, or None for the default"
        )
    if memory_budget_bytes < 0:
        raise CacheError(f"memory_budget_bytes={memory_budget_bytes} must be >= 0")
    if persist_dir is not None and budget_bytes == 0:
        raise CacheError("a persistent store keeps its records on disk; drop budget_bytes=0")
    note = ""
    if persist_dir is not None:
        persistent, note = _open_persistent(persist_dir, identity or {})
        if persistent is not None:
            if budget_bytes is None:
                budget_bytes = default_budget_bytes(persistent.path, held=persistent.file_size)
            described = f"persistent store, budget {_human(budget_bytes)}"
            return Backend(persistent, budget_bytes, described, note)
    if budget_bytes is None:
        budget_bytes = default_budget_bytes(directory)
    if budget_bytes == 0:
        described = f"memory only, budget {_human(memory_budget_bytes)}"
        return Backend(MemoryBlobs(), memory_budget_bytes, described, note)
    where = "a chosen folder" if directory is not None else "the system temp folder"
    described = f"scratch file in {where}, budget {_human(budget_bytes)}"
    return Backend(BlobFile(directory=directory), budget_bytes, described, note)


def _open_persistent(
    persist_dir: str | os.PathLike[str], identity: dict
) -> tuple[PersistentBlobs | None, str]:
    """DIR's store and its note, or None and why this process cannot have it."""
    where = os.fspath(persist_dir)
    try:
        store = PersistentBlobs(persist_dir, identity=identity)
    except StoreBusyError as exc:
        return None, (
            f"the block store in {where} is {exc}; this kernel uses a temporary store "
            "(nothing it stores is kept)"
        )
    except Exception as exc:  # noqa: BLE001 - whatever DIR holds, the kernel goes on
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return None, (
            f"cannot use the block store in {where} ({reason}); this kernel uses a "
            "temporary store (nothing it stores is kept)"
        )
    return store, store.note


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"
