"""What tests, benchmarks and tools reach through an engine (`Engine.internals`).

The engine's two threads own its state: the generation thread the model, the runner and
the hot cache; the cache-I/O thread the block store (`PrefixCache`). These accessors
name each thing and the thread to touch it on, so no caller reaches into private
attributes. Applications need none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from mlx_nbengine.cache import PrefixCache
from mlx_nbengine.engine.cacheio import CacheIO
from mlx_nbengine.engine.generation import GenerationThread
from mlx_nbengine.engine.hot import HotCache
from mlx_nbengine.engine.request import EngineClosedError

T = TypeVar("T")


class EngineInternals:
    """One engine's threads and what they own (see the module docstring)."""

    def __init__(self, gen: GenerationThread, io: CacheIO, *, closed: Callable[[], bool]) -> None:
        self._gen = gen
        self._io = io
        self._closed = closed

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The block store's `PrefixCache` (None without a store, or once closed). It
        belongs to the cache-I/O thread: call its pure parts (`keys`, `layer_kinds`)
        anywhere, and what touches the store through `on_store_thread`."""
        return self._io.prefix if self._gen.has_store and not self._closed() else None

    def on_store_thread(self, fn: Callable[[PrefixCache], T], *, timeout: float = 60) -> T:
        """Run `fn(prefix_cache)` on the cache-I/O thread, the store's owner, and return
        its result (or raise its error); `EngineClosedError` without a store."""
        prefix = self.prefix_cache
        if prefix is None:
            raise EngineClosedError("this engine has no open block store")
        return self._io.call(lambda: fn(prefix)).result(timeout=timeout)

    @property
    def hot_cache(self) -> HotCache | None:
        """The hot cache (the last finished request's tokens and layer caches), or None.
        Its arrays belong to the generation thread: read them in `Engine.on_model_thread`."""
        scheduler = self._gen.scheduler
        return None if scheduler is None else scheduler.hot

    @property
    def splits_head(self) -> bool:
        """Whether a final prefill step computes the output head for its last row only
        (`models.head`: found and checked exactly at load)."""
        runner = self._gen.runner
        return runner is not None and runner.split is not None

    @property
    def takes_states_inside_steps(self) -> bool:
        """Whether a recurrent model's prefill steps may span block boundaries, its states
        there taken inside the step (`Runner.taps_states`)."""
        runner = self._gen.runner
        return runner is not None and runner.taps_states

    @property
    def host_sampling(self) -> bool:
        """Whether sampled rows are drawn in numpy when a step is read (the CPU's default)
        rather than in the MLX graph (see `sampling`). Settable."""
        runner = self._gen.runner
        return runner is not None and runner.host_sampling

    @host_sampling.setter
    def host_sampling(self, value: bool) -> None:
        self._gen.call(lambda: setattr(self._gen.runner, "host_sampling", bool(value)))

    def watch_logits(self, fn: Callable[[Any], None] | None) -> None:
        """Call `fn(logits)` (an MLX array, one row per sequence) on the generation thread
        with every set of logits a token is sampled from, host-drawn rows aside; None
        stops. `fn` may evaluate them, at the cost of that step's pipelining."""
        self._gen.call(lambda: setattr(self._gen.runner, "logit_watcher", fn))
