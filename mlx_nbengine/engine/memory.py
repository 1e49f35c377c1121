"""Giving freed memory back to the system, so RAM follows the live caches.

*Freed* memory is not yet *returned*: MLX keeps freed buffers in a reuse pool, and
glibc keeps freed heap pages in per-thread arenas. Both make a process's RSS stay at
the high-water mark of its largest prefill long after nothing holds those buffers.
`give_back_memory` empties both; the engine's threads call it when they go idle.

glibc also raises its mmap threshold each time a large block is freed, so later large
buffers (cache slices, attention scores) land in the arenas, where fragmentation keeps
them resident even after `malloc_trim`. `keep_large_buffers_mapped` pins the threshold
(process-wide, once) so every large buffer is its own mapping and leaves RSS when freed.
Any thread may call either function.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

import mlx.core as mx


def _glibc(name: str) -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)  # glibc; absent on musl
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _glibc("malloc_trim")
_MALLOPT = _glibc("mallopt")
_M_MMAP_THRESHOLD = -3  # from glibc's malloc.h
_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own initial value
_pinned = False


def keep_large_buffers_mapped() -> None:
    """Pin glibc's mmap threshold (see the module docstring); later calls do nothing."""
    global _pinned
    if _MALLOPT is not None and not _pinned:
        _MALLOPT(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        _pinned = True


def give_back_memory() -> None:
    """Empty MLX's buffer pool, then trim the C heap (Linux/glibc)."""
    mx.clear_cache()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
