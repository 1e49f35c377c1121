"""`Engine`: the plain-Python face of mlx_nbengine (the magics call it; so can anyone).

An engine is one loaded model served by two daemon threads (see `generation` and
`cacheio`): the generation thread, which owns the model, and the cache-I/O thread, which
owns the prefix cache's block store (one scratch file). The caller's thread only checks
and tokenizes prompts, hands them over and reads results; it never runs the model.

Lifecycle: `Engine.load` starts both threads and returns once the model is loaded on the
generation thread (a load error is raised in the caller). `close()` cancels what is in
flight, joins both threads and closes the store, which deletes its scratch file; it is
idempotent and also runs from an `atexit` hook, so a process that exits without calling
it leaves no file behind.

`Engine.load(..., restore="token")` (the default) restores an edited prompt up to its
first changed token where the model's layers can be cut there; ``restore="block"`` keeps
whole blocks from disk (see `scheduler`). `Engine.load(..., store=False)` runs without a
block store (no scratch file; every whole
prompt block is computed, with reason ``"store_off"``). `Engine.load(..., persist_dir=DIR)`
keeps the store in DIR for the next process that loads the same model (see
`cache/persist.py`); `close()` then leaves DIR consistent and releases its lock, and
`store_note` says in one line when DIR was not used as asked (another process holds it,
an incompatible store was set aside). `cache_view()` is what the store
view draws: the store's figures now plus the engine's `CacheLedger` (counts over all
finished requests, history, recent evictions).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any, TypeVar

from mlx_nbengine.engine.blockstore import open_prefix_cache, store_figures
from mlx_nbengine.engine.cacheio import CacheIO
from mlx_nbengine.engine.generation import GenerationThread
from mlx_nbengine.engine.internals import EngineInternals
from mlx_nbengine.engine.ledger import CacheLedger
from mlx_nbengine.engine.memory import keep_large_buffers_mapped
from mlx_nbengine.engine.prompts import prompt_tokens, stop_strings
from mlx_nbengine.engine.request import (
    EngineClosedError,
    InvalidRequestError,
    Request,
)
from mlx_nbengine.engine.sampling import validate
from mlx_nbengine.engine.sequence import Sequence
from mlx_nbengine.engine.text import TextStream
from mlx_nbengine.models import load as load_model

T = TypeVar("T")

RESTORE_MODES = ("token", "block")
"""`Engine.load(restore=...)`: to the first changed token, or whole blocks only."""

# How long close() lets a persistent store write the saves still queued.
PERSIST_DRAIN_S = 10.0

# Strong references: an engine's threads run until it is closed, dropped or not.
_open_engines: set[Engine] = set()


@atexit.register
def _close_all() -> None:
    # Daemon threads die with the interpreter; closing first releases the scratch file.
    for engine in list(_open_engines):
        engine.close()


class Engine:
    """A loaded model with continuous batching and a block-level prefix cache.

    Use `Engine.load(...)`; see `submit` for requests, `stats`, `close`. Also a context
    manager (closes on exit).
    """

    # Over 300 lines: this is the public face, and about a third of it is the API's
    # documentation; the work is done by the parts it wires (`generation`, `cacheio`).

    def __init__(
        self,
        loader: Any,
        *,
        parallel: int = 4,
        block_size: int = 256,
        disk_budget: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        max_prefill_step: int = 1024,
        name: str = "model",
        store: bool = True,
        restore: str = "token",
        persist_dir: str | os.PathLike | None = None,
    ) -> None:
        _check_options(
            restore=restore,
            parallel=parallel,
            block_size=block_size,
            cache_dir=cache_dir,
            persist_dir=persist_dir,
            store=store,
            disk_budget=disk_budget,
        )
        if persist_dir is not None:
            persist_dir = os.path.expanduser(os.fspath(persist_dir))
        self.persist_dir = persist_dir
        self.parallel = parallel
        self.block_size = block_size
        self.restore = restore
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        keep_large_buffers_mapped()
        self._io = CacheIO()
        self._ledger = CacheLedger()
        self._saving_warned = False

        prefix_factory = functools.partial(  # called on the cache-I/O thread
            open_prefix_cache,
            ledger=self._ledger,
            block_size=block_size,
            disk_budget=disk_budget,
            cache_dir=cache_dir,
            persist_dir=persist_dir,
        )
        self._gen = GenerationThread(
            loader=loader,
            io=self._io,
            prefix_factory=prefix_factory if store else None,
            parallel=parallel,
            block_size=block_size,
            max_prefill_step=max_prefill_step,
            restore=restore,
        )
        self.internals = EngineInternals(self._gen, self._io, closed=lambda: self._closed)
        try:
            self.model = self._gen.start()
        except BaseException:
            self._closed = True
            self._io.close()
            raise
        self.model_name = name
        self._ledger.start_clock()
        _open_engines.add(self)

    @classmethod
    def load(
        cls,
        model: str | os.PathLike = "default",
        *,
        parallel: int = 4,
        block_size: int = 256,
        disk_budget: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        dtype: str | None = None,
        max_prefill_step: int = 1024,
        progress: Callable[[int, int], None] | None = None,
        store: bool = True,
        restore: str = "token",
        revision: str | None = None,
        persist_dir: str | os.PathLike | None = None,
    ) -> Engine:
        """Load `model` and start serving.

        `model` is "default", a model directory, a .gguf file, or a model id ``ORG/NAME``
        found in the Hugging Face hub cache or LM Studio's models folder, else downloaded
        from the hub (see `mlx_nbengine.models.sources`); `revision` picks a branch, tag or
        commit of a Hugging Face id.

        `parallel` requests decode together; prompts are cached in blocks of `block_size`
        tokens. `disk_budget` caps the scratch file's live bytes (None: a default from the
        free disk space; 0: keep the records in memory instead). `cache_dir` is where the
        scratch file lives (default: the system temp folder). `dtype` casts the weights.
        `max_prefill_step` bounds the tokens of one prefill call when nothing else runs.
        `progress(done, total)`, when given, is called on the generation thread while a model
        is downloaded (bytes fetched so far, of `total`) and while a GGUF file is converted
        (tensor bytes written so far, of `total`; counting from 0 again after a download); a
        model already here that needs no conversion reports nothing. `store=False` runs
        without a block store: no scratch file, nothing restored from disk, every whole
        prompt block computed (reason ``"store_off"``). `restore="token"` (the default)
        restores an edited prompt up to its first changed token where the model's layers
        allow it (see `scheduler`); ``"block"`` restores whole blocks from disk only,
        bit-identical to a cold run of the same steps. `persist_dir` keeps the block store
        in that directory (created, or made, 0700; a data file, an index and a lock) so that a later
        process loading the same model, dtype and block size restores its blocks from disk;
        when another process holds it, the engine runs with a temporary store and
        `store_note` says so (an incompatible store found there is set aside, also noted).
        Raises a `ModelError` if the model cannot be loaded.
        """

        def loader() -> Any:
            return load_model(model, dtype=dtype, progress=progress, revision=revision)

        name = os.path.basename(os.fspath(model).rstrip("/\\")) or os.fspath(model)
        return cls(
            loader,
            parallel=parallel,
            block_size=block_size,
            disk_budget=disk_budget,
            cache_dir=cache_dir,
            max_prefill_step=max_prefill_step,
            name=name,
            store=store,
            restore=restore,
            persist_dir=persist_dir,
        )

    # --- requests ---------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | SequenceABC[int] | SequenceABC[dict],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | SequenceABC[str] | None = None,
        images: Any = None,
        template_kwargs: dict[str, Any] | None = None,
        live_blocks: bool = False,
    ) -> Request:
        """Queue a prompt and return its `Request` handle at once.

        `prompt` is text (tokenized with BOS), token ids (used as they are) or chat
        messages (``[{"role": ..., "content": ...}, ...]``, rendered by the model's chat
        template with `template_kwargs`, e.g. ``{"enable_thinking": False}``). Generation
        stops at EOS, at any `stop` string (cut from the text), after `max_tokens`, or
        at the context limit. `temperature` 0 is greedy; otherwise `top_p` and `seed`
        apply. Raises `InvalidRequestError` for bad values, `PromptTooLongError` when the
        prompt does not fit the context, `EngineClosedError` after `close()`.

        `images` (a vision model only): file paths, PIL images, numpy arrays (H x W x 3
        uint8) or bytes of encoded images, in the order of their places in the prompt.
        Chat messages without image parts get them before the last user message's text;
        a string without the model's image placeholder gets the placeholders first.
        Raises `ImageError` (an `InvalidRequestError`) naming the image that cannot be
        read, and for images given to a text-only model or more images than places.

        `live_blocks` prefills one block per step, so that each block's event comes as it is
        computed (for a person watching them arrive); longer steps are faster.
        """
        if self._closed:
            raise EngineClosedError("this engine is closed; load a new one with Engine.load")
        problem = validate(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        if problem:
            raise InvalidRequestError(problem)
        stops = stop_strings(stop)
        lm = self.model
        tokens, vision = prompt_tokens(
            lm, prompt, images=images, template_kwargs=template_kwargs, model_name=self.model_name
        )
        request = Request(next(self._ids), tokens, self._gen.cancel)
        seq = Sequence(
            request=request,
            prompt=tokens,
            max_tokens=max_tokens,
            sampling={"temperature": temperature, "top_p": top_p, "seed": seed},
            greedy=temperature == 0,
            text=TextStream(lm.tokenizer.detokenizer, stops),
            eos=frozenset(lm.eos_token_ids),
            block_size=self.block_size,
            submitted_at=time.perf_counter(),
            ledger=self._ledger,
            images=vision.spans if vision is not None else (),
            vision=vision,
            live_blocks=live_blocks,
        )
        with self._lock:
            if self._closed:
                raise EngineClosedError("this engine is closed; load a new one with Engine.load")
            self._gen.submit(seq)
        return request

    # --- state ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The store's stats plus active/queued requests, the model name and `parallel`.

        ``group_prefills`` counts prefill steps shared by requests that arrived together.
        ``persistent`` (the store lives in `persist_dir`), ``saving`` (False once a write
        failed for lack of space or an I/O error; ``saving_error`` says why) and
        ``store_note`` (`store_note`, "" when none) come with a store.
        """
        out: dict[str, Any] = {}
        if not self._closed and self._gen.has_store:
            fut = self._io.call(lambda: self._io.prefix.store.stats().as_dict())
            try:
                out.update(fut.result(timeout=10))
            except Exception:  # stats must never break the caller (e.g. a closing engine)
                pass
            else:
                out["store_note"] = out.pop("note", "")
        out.update(
            model=self.model_name,
            parallel=self.parallel,
            block_size=self.block_size,
            restore=self.restore,
            active=self._gen.active,
            queued=self._gen.queued,
            save_errors=self._io.save_errors,
            closed=self._closed,
            **self._gen.counts(),
        )
        return out

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
        lm = self.model
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

    def drop_hot_cache(self) -> None:
        """Forget the hot in-memory cache and the image features, keeping the block store
        (the next restore comes from disk). A no-op on a closed engine."""
        if not self._closed:
            self._gen.call(lambda: self._gen.scheduler.drop_hot_cache())

    # --- for tools and tests ----------------------------------------------------------------

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The record kind of each layer of the model's cache: "kv" (full attention),
        "window" (sliding window) or "state" (recurrent)."""
        return self._gen.layer_kinds

    def on_model_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the generation thread, the owner of the model and of every MLX
        array it makes, between two steps; return its result (or raise its error)."""
        return self._gen.call(fn)

    def wait_for_saves(self, timeout: float | None = None) -> None:
        """Wait until every block save queued so far is in the store (at most `timeout`
        seconds, None: for ever)."""
        self._io.drain(timeout=timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Cancel in-flight requests, stop both threads, delete the scratch file (a
        persistent store: write its index and release its directory). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._gen.stop()
        # A persistent store keeps the saves still queued (bounded: closing must not hang).
        self._io.close(drain_s=PERSIST_DRAIN_S if self.persist_dir is not None else 0.0)
        self.model = None
        _open_engines.discard(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"parallel={self.parallel}"
        return f"<Engine {self.model_name} {state}>"


def _check_options(
    *,
    restore: str,
    parallel: Any,
    block_size: Any,
    cache_dir: Any,
    persist_dir: Any,
    store: bool,
    disk_budget: int | None,
) -> None:
    """Raise `InvalidRequestError`, saying what to pass, for options `Engine` cannot use."""
    if restore not in RESTORE_MODES:
        raise InvalidRequestError(
            f"restore must be one of {', '.join(map(repr, RESTORE_MODES))}, got {restore!r}"
        )
    if not isinstance(parallel, int) or parallel < 1:
        raise InvalidRequestError(f"parallel must be an integer >= 1, got {parallel!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise InvalidRequestError(f"block_size must be an integer >= 1, got {block_size!r}")
    if cache_dir is not None and not os.path.isdir(cache_dir):
        raise InvalidRequestError(
            f"cache_dir {os.fspath(cache_dir)!r} is not a directory; create it or pass None "
            "for the system temp folder"
        )
    if persist_dir is not None and (not store or disk_budget == 0):
        raise InvalidRequestError(
            "persist_dir keeps the block store on disk; it needs store=True and a disk "
            "budget other than 0"
        )
