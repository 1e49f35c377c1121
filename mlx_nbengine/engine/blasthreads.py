"""How many BLAS threads a model call gets: many for prefill, one for decode.

On Linux CPU, MLX's matmuls run in OpenBLAS (see `mlx_nbengine._blas`), whose worker
threads spin-wait for each other at every call. For a *prefill* call (hundreds of rows)
the work per call dwarfs that; for a *decode* call (one row per sequence) it does not,
and on a small or busy machine the waiting dominates: a Gemma 3 270M decode step took
1.5 s with two threads and 0.25 s with one on the 2-core machine the benchmarks ran on.
`BlasThreads.use` sets the count before each call; it is a no-op where OpenBLAS is not
what MLX calls (macOS, the reference BLAS). Owned by the generation thread, the only
thread that runs model calls.
"""

from __future__ import annotations

import ctypes
import sys

# Rows (tokens x sequences) from which a call counts as a prefill and gets every thread.
MANY_ROWS = 32


def _openblas(name: str):
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)  # found only if loaded globally (_blas)
    except (OSError, AttributeError):
        return None


class BlasThreads:
    """Switches OpenBLAS between its default thread count and one (see module docstring)."""

    def __init__(self) -> None:
        self._set = _openblas("openblas_set_num_threads")
        get = _openblas("openblas_get_num_threads")
        self.many = int(get()) if get is not None else 1
        self.current = self.many

    def use(self, rows: int) -> None:
        """Pick the thread count for a model call over `rows` rows."""
        n = self.many if rows >= MANY_ROWS else 1
        if self._set is not None and n != self.current:
            self._set(n)
            self.current = n
