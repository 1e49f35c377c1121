"""Giving freed memory back to the system, so RAM follows the live caches.

*Freed* memory is not yet *returned*: MLX keeps freed buffers in a reuse pool, and
glibc keeps freed heap pages in per-thread arenas. Both make a process's RSS stay at
the high-water mark of its largest prefill long after nothing holds those buffers.
`give_back_memory` empties both. An engine's generation thread calls it once it has been
idle a while, and again a while after the cache-I/O thread's queue of saves empties
(`CacheIO.on_drained`), never between back-to-back requests; a sharded model's workers call it
from their own threads.

glibc also raises its mmap threshold each time a large block is freed, so later large
buffers land in the arenas, where fragmentation can keep them resident even after
`malloc_trim`. `keep_large_buffers_mapped` pins the threshold (process-wide, once) at
`_MMAP_THRESHOLD_BYTES`, glibc's largest: a buffer of that size or more (a long prompt's
cache slices, attention scores) is its own mapping and leaves RSS when freed, and the
smaller ones a step allocates and frees (activations, our kernels' scratch) come from the
arenas, whose pages the next step reuses (the trim threshold, pinned with it at twice that
as glibc's own adjustment would set it, keeps a free heap top of that size mapped while
work goes on; `malloc_trim` returns it once idle). Pinned at glibc's initial 128 KiB
instead, every such buffer was a mapping faulted in page by page and unmapped again at
each step: a 430-token prefill step after 5,503 tokens on the default model took 206,000
page faults and 0.73 s where it takes none and 0.57 s now (Intel Xeon, 2 threads), with
about the same RSS once idle (`bench/bench_engine.py --only b`, four prompts of 1,024 or
4,096 tokens: extra RAM within 2 MB of none, once 24 MB, against 150-410 MB for a store kept
in RAM). Since the cache-I/O thread leaves giving back to the idle generation thread outside
a prompt's reading (`GenerationThread.io_drained`), the 1,024-token figure is higher: +10 and +27 MB
in two runs (against 164-175 MB kept in RAM), where giving back at every drained save queue,
also in the middle of a burst of prompts, gave -21 and -27 MB, and 50,000 page faults an
agent's turn.
Any thread may call either function.

Once this process formed an MLX distributed group (any rank of a sharded model), MLX's pool
is emptied only between steps (`between_steps`: the generation thread gone idle, or a
worker told so by rank 0). Measured:
`mx.clear_cache()` waits for a ring collective in flight, holding the GIL, so called from
the store's thread while a stopped rank stalled a step it froze every Python thread, the
rank group's watchdog included, and the hang it exists to catch was never caught.
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
_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX (4 MiB per byte of a long): the most mallopt accepts.
_MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
_pinned = False
_collectives = False  # this process formed an MLX distributed group (for its whole life)


def keep_large_buffers_mapped() -> None:
    """Pin glibc's mmap and trim thresholds (see the module docstring); later calls do
    nothing."""
    global _pinned
    if _MALLOPT is not None and not _pinned:
        _MALLOPT(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        _MALLOPT(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_BYTES)
        _pinned = True


def collectives_formed() -> None:
    """This process formed an MLX distributed group: from now on MLX's pool is emptied
    only between steps (see the module docstring)."""
    global _collectives
    _collectives = True


def give_back_memory(*, between_steps: bool = False) -> None:
    """Empty MLX's buffer pool, then trim the C heap (Linux/glibc). `between_steps`:
    no step of this process is in flight (the generation thread, idle); without it the
    pool is left alone once collectives may be in flight (`collectives_formed`)."""
    if between_steps or not _collectives:
        mx.clear_cache()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
