"""An engine's block-store face: its note, the saving warning, the store view's figures
(`Engine.cache_view`), and emptying the store and the hot cache.

`StoreFace` is a part the `Engine` holds (and delegates to), given what it reads: the
engine's internals, generation and cache-I/O threads, ledger, model name, block size, and
two callables for the engine's model and whether it is closed.
The views are cheap and safe from any thread: they read the store's own locked snapshots
and the `CacheLedger`; clearing runs on the threads that own the store and the hot cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mlx_nbengine.engine.blockstore import store_figures
from mlx_nbengine.engine.cacheio import CacheIO
from mlx_nbengine.engine.generation import GenerationThread
from mlx_nbengine.engine.internals import EngineInternals
from mlx_nbengine.engine.ledger import CacheLedger

__all__ = ["StoreFace"]


class StoreFace:
    """The store's note, the one-time saving warning, the store view, clearing (see the
    module)."""

    def __init__(
        self,
        internals: EngineInternals,
        gen: GenerationThread,
        io: CacheIO,
        ledger: CacheLedger,
        *,
        model_name: str,
        block_size: int,
        model: Callable[[], Any],
        closed: Callable[[], bool],
        sharded: Any = None,
    ) -> None:
        self.internals = internals
        self.model_name = model_name
        self.block_size = block_size
        self.sharded = sharded
        self._gen = gen
        self._io = io
        self._ledger = ledger
        self._model = model
        self._is_closed = closed
        self._lock = threading.Lock()
        self._saving_warned = False

    @property
    def _closed(self) -> bool:
        return self._is_closed()

    def _block_store(self) -> Any:
        prefix = self.internals.prefix_cache
        return None if prefix is None else prefix.store

    @property
    def store_note(self) -> str | None:
        """One line when the block store is not what `persist_dir` asked for (another
        process holds the directory, an incompatible store was set aside, records were
        dropped on open); None otherwise. Safe from any thread."""
        store = self._block_store()
        return (getattr(store, "note", "") or None) if store is not None else None

    def store_stats(self) -> dict[str, Any]:
        """The block store's own stats (`BlockStore.stats`, its ``note`` as ``store_note``);
        empty without a store or on a closed engine. Never raises."""
        out: dict[str, Any] = {}
        if not self._closed and self._gen.has_store:
            fut = self._io.call(lambda: self._io.prefix.store.stats().as_dict())
            try:
                out.update(fut.result(timeout=10))
            except Exception:  # stats must never break the caller (e.g. a closing engine)
                pass
            else:
                out["store_note"] = out.pop("note", "")
        return out

    def store_warning(self) -> str | None:
        """The one-line warning that saving to the block store is off (a full disk, an I/O
        error), the first time it is asked after that happened; None otherwise."""
        store = self._block_store()
        error = getattr(store, "saving_error", None) if store is not None else None
        with self._lock:
            if error is None:
                self._saving_warned = False  # on again (cleared): warn again next time
                return None
            if self._saving_warned:
                return None
            self._saving_warned = True
        return error

    def cache_view(self) -> dict[str, Any]:
        """What the store view draws, JSON-ready; cheap and safe from any thread.

        The store now: ``blocks_held`` (distinct block keys with a record), ``records``,
        ``bytes_held``, ``budget_bytes``, ``file_size``, ``free_bytes``, ``backend`` (the
        store's description; ``"off"`` without a store, whose figures are then zeros),
        ``by_kind`` (``{"kv"|"window"|"state": {"records", "bytes"}}``). Over all finished
        requests: ``blocks_restored``, ``blocks_computed``, ``tokens_restored``,
        ``tokens_computed``, ``requests``; over the store's life: ``blocks_evicted``
        (blocks that lost their last record), ``records_evicted``. ``history``: one point
        per finished request and per eviction burst, ``{"t", "restored", "computed",
        "evicted"}`` (cumulative blocks, ``t`` in seconds since the engine loaded), at most
        200. ``recent_evictions``: ``{"t", "kind", "bytes", "text"}``, newest first, at
        most 10, ``text`` the first words of the evicted block ("" if unknown).
        """
        view: dict[str, Any] = {"model": self.model_name, "block_size": self.block_size}
        view.update(store_figures(self._block_store()))
        ledger = self._ledger.snapshot()
        evictions = ledger.pop("recent_evictions")
        view.update(ledger)
        view["recent_evictions"] = [
            {"t": e["t"], "kind": e["kind"], "bytes": e["bytes"], "text": self._words(e["tokens"])}
            for e in evictions
        ]
        return view

    def _words(self, tokens: list[int] | None, *, words: int = 8) -> str:
        """The first `words` words of `tokens` decoded ("" when unknown or not decodable)."""
        lm = self._model()
        if not tokens or lm is None:
            return ""
        try:
            text = lm.decode(tokens, skip_special_tokens=True)
        except Exception:  # a view must never fail on a tokenizer's quirk
            return ""
        return " ".join(text.split()[:words])

    def clear_cache(self) -> None:
        """Empty the block store and drop the hot in-memory cache.

        Safe while requests run: the store is cleared on the cache-I/O thread (its owner),
        saves still queued are dropped, and the hot cache is dropped on the generation
        thread between steps. Running requests keep their own caches; their later
        checkpoints store again. A no-op on a closed engine.
        """
        if self._closed:
            return
        self.drop_hot_cache()
        if self._gen.has_store:
            self._io.clear().result(timeout=60)
            if self.sharded is not None:
                self.sharded.clear_stores()  # every worker's own store too

    def drop_hot_cache(self) -> None:
        """Forget the hot in-memory cache and the image features, keeping the block store
        (the next restore comes from disk). A no-op on a closed engine."""
        if not self._closed:
            self._gen.call(lambda: self._gen.scheduler.drop_hot_cache())
