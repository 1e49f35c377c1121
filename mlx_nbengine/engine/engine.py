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

from mlx_nbengine import _blas
from mlx_nbengine._blas import ThreadPolicy
from mlx_nbengine.engine.blockstore import open_prefix_cache
from mlx_nbengine.engine.cacheio import CacheIO
from mlx_nbengine.engine.config import EngineConfig
from mlx_nbengine.engine.constraint import Constraint, GrammarTokenizer, compile_constraint
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
from mlx_nbengine.engine.storeface import StoreFace
from mlx_nbengine.engine.text import TextStream
from mlx_nbengine.models import load as load_model

T = TypeVar("T")

# How long close() lets a persistent store write the saves still queued.
PERSIST_DRAIN_S = 10.0

# How long close() waits for a sharded engine's generation thread to end its step.
SHARDED_STOP_S = 15.0

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

    def __init__(self, loader: Any, config: EngineConfig, *, sharded: Any = None) -> None:
        """Start an engine on `loader` (called on the generation thread, returns the model)
        with `config`; `sharded` is a `ranks.ShardedModel` (its loader is used), or None.
        Use `Engine.load`."""
        self.config = config
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        keep_large_buffers_mapped()
        self._io = CacheIO()
        self._ledger = CacheLedger()
        self._grammar_tokenizer: GrammarTokenizer | None = None  # at the first grammar
        self.sharded = sharded  # a `ranks.ShardedModel`, or None: one process
        if sharded is not None:
            loader = sharded.load
            sharded.group.on_fault = self._rank_fault
        self._gen = _generation_thread(loader, self._io, self._ledger, config, sharded)
        self._io.on_drained = self._gen.io_drained
        self.internals = EngineInternals(self._gen, self._io, closed=lambda: self._closed)
        try:
            self.model = self._gen.start()
        except BaseException:
            self._closed = True
            self._io.close()
            if sharded is not None:
                sharded.close()
            raise
        self.model_name = config.name
        self._store = StoreFace(
            self.internals,
            self._gen,
            self._io,
            self._ledger,
            model_name=config.name,
            block_size=config.block_size,
            model=lambda: self.model,
            closed=lambda: self._closed,
            sharded=sharded,
        )
        self._ledger.start_clock()
        _open_engines.add(self)

    # The options as attributes (read by the faces and tests).
    parallel = property(lambda self: self.config.parallel)
    block_size = property(lambda self: self.config.block_size)
    restore = property(lambda self: self.config.restore)
    persist_dir = property(lambda self: self.config.persist_dir)

    # The block store's face (`StoreFace`): its note and warning, the store view, clearing.
    store_note = property(lambda self: self._store.store_note, doc=StoreFace.store_note.__doc__)

    def store_warning(self) -> str | None:
        return self._store.store_warning()

    def cache_view(self) -> dict[str, Any]:
        return self._store.cache_view()

    def clear_cache(self) -> None:
        self._store.clear_cache()

    def drop_hot_cache(self) -> None:
        self._store.drop_hot_cache()

    store_warning.__doc__ = StoreFace.store_warning.__doc__
    cache_view.__doc__ = StoreFace.cache_view.__doc__
    clear_cache.__doc__ = StoreFace.clear_cache.__doc__
    drop_hot_cache.__doc__ = StoreFace.drop_hot_cache.__doc__

    @classmethod
    def load(
        cls,
        model: str | os.PathLike = "default",
        *,
        progress: Callable[[int, int], None] | None = None,
        **options: Any,
    ) -> Engine:
        """Load `model` and start serving; `options` are `EngineConfig`'s fields (what
        each does is said there), checked before anything loads (`InvalidRequestError`).

        `progress(done, total)`, when given, is called on the generation thread while a model
        is downloaded (bytes fetched so far, of `total`) and while a GGUF file is converted
        (tensor bytes written so far, of `total`; counting from 0 again after a download); a
        model already here that needs no conversion reports nothing.
        Raises a `ModelError` if the model cannot be loaded (`NotShardableError`: a family
        mlx-lm cannot shard). On a CPU whose MLX was imported before mlx_nbengine (its
        matmuls on the reference BLAS, about 40x slower) one line on stderr says so and how
        to fix it, once per process.
        """
        config = EngineConfig.of(model, **options)
        _blas.say_reference_blas()

        def loader() -> Any:
            return load_model(
                config.model, dtype=config.dtype, progress=progress, revision=config.revision
            )

        return cls(loader, config, sharded=_sharded(config) if config.sharded else None)

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
        grammar: str | None = None,
    ) -> Request:
        """Queue a prompt and return its `Request` handle at once.

        `prompt` is text (tokenized with BOS), token ids (used as they are) or chat
        messages (``[{"role": ..., "content": ...}, ...]``, rendered by the model's chat
        template with `template_kwargs`, e.g. ``{"enable_thinking": False}``). Generation
        stops at EOS, at any `stop` string (cut from the text), after `max_tokens`, or
        at the context limit. `temperature` 0 is greedy; otherwise `top_p` and `seed`
        apply. Raises `InvalidRequestError` for bad values, `PromptTooLongError` when the
        prompt does not fit the context, `EngineClosedError` after `close()`.
        `images` (a vision model only): the prompt's images, as `prompts.prompt_tokens`
        reads them (paths, PIL images, arrays, bytes); an unreadable one is an `ImageError`.
        `live_blocks` prefills one block per step, so that each block's event comes as it is
        computed (for a person watching them arrive); longer steps are faster. `grammar`
        holds every generated token to an llguidance grammar (Lark, or e.g.
        ``llguidance.LLMatcher.grammar_from_json_schema(schema)``); the request stops once
        it is complete (``stop_reason == "grammar"``), see `constraint` for the rest. One
        llguidance cannot build, or a sharded engine, raises `InvalidRequestError`.
        """
        self._refuse_if_closed()
        sampling = {"temperature": temperature, "top_p": top_p, "seed": seed}
        if problem := validate(max_tokens=max_tokens, **sampling):
            raise InvalidRequestError(problem)
        tokens, vision = prompt_tokens(
            self.model,
            prompt,
            images=images,
            template_kwargs=template_kwargs,
            model_name=self.model_name,
        )
        request = Request(next(self._ids), tokens, self._gen.cancel)
        seq = _sequence(
            request,
            vision,
            self.model,
            self.block_size,
            self._ledger,
            max_tokens=max_tokens,
            sampling=sampling,
            stops=stop_strings(stop),
            live_blocks=live_blocks,
        )
        seq.constraint = None if grammar is None else self._constraint(grammar)
        with self._lock:
            self._refuse_if_closed()
            self._gen.submit(seq)
        return request

    def _constraint(self, grammar: Any) -> Constraint:
        """The `Constraint` of a request's `grammar` (checked here, on the caller's thread)."""
        if self.sharded is not None:
            raise InvalidRequestError(
                "grammar is not supported on a sharded engine (ranks or hosts); load the "
                "model in one process for constrained decoding"
            )
        lm = self.model
        with self._lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = GrammarTokenizer(lm)
        return compile_constraint(grammar, self._grammar_tokenizer, frozenset(lm.eos_token_ids))

    # --- state ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The store's stats plus active/queued requests, the model name and `parallel`.

        ``group_prefills`` counts prefill steps shared by requests that arrived together.
        ``persistent`` (the store lives in `persist_dir`), ``saving`` (False once a write
        failed for lack of space or an I/O error; ``saving_error`` says why) and
        ``store_note`` (`store_note`, "" when none) come with a store.
        """
        out = self._store.store_stats()
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
        if self.sharded is not None:
            view = self.cache_view()
            out["sharded"] = self.sharded.status()
            out["sharded"]["rank0_store"] = {
                k: view[k] for k in ("blocks_held", "records", "bytes_held", "backend")
            }
        return out

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
        self._close_now()

    def _close_now(self) -> None:
        # A sharded step waits for its workers: bounded, a lost worker must not hang close.
        self._gen.stop(timeout=SHARDED_STOP_S if self.sharded is not None else None)
        # A persistent store keeps the saves still queued (bounded: closing must not hang).
        self._io.close(drain_s=PERSIST_DRAIN_S if self.persist_dir is not None else 0.0)
        if self.sharded is not None:
            self.sharded.close()  # every worker stops; each deletes its scratch file
        model, self.model = self.model, None
        if model is not None:  # mx.fast and the library's classes are the user's again
            model.release_routes()
        _open_engines.discard(self)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise EngineClosedError(self._closed_line())

    def _closed_line(self) -> str:
        lost = self.sharded.group.error if self.sharded is not None else None
        if lost is not None:  # why a sharded engine closed: its lost worker, named
            return f"this engine is closed: {lost}"
        return "this engine is closed; load a new one with Engine.load"

    def _rank_fault(self, error: Exception) -> None:
        """A worker rank is lost (on the group's fault thread): refuse new requests, fail
        every request held with `error`, then close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._gen.fail_everything(error)
        self._close_now()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"parallel={self.parallel}"
        return f"<Engine {self.model_name} {state}>"


def _sequence(
    request: Request,
    vision: Any,
    lm: Any,
    block_size: int,
    ledger: CacheLedger,
    *,
    max_tokens: int,
    sampling: dict[str, Any],
    stops: list[str],
    live_blocks: bool,
) -> Sequence:
    """The scheduler's record of `request` (its prompt already tokenized)."""
    return Sequence(
        request=request,
        prompt=request.prompt_tokens,
        max_tokens=max_tokens,
        sampling=sampling,
        greedy=sampling["temperature"] == 0,
        text=TextStream(lm.tokenizer.detokenizer, stops),
        eos=frozenset(lm.eos_token_ids),
        block_size=block_size,
        submitted_at=time.perf_counter(),
        ledger=ledger,
        images=vision.spans if vision is not None else (),
        vision=vision,
        live_blocks=live_blocks,
    )


def _generation_thread(
    loader: Any, io: CacheIO, ledger: CacheLedger, config: EngineConfig, sharded: Any
) -> GenerationThread:
    """An engine's generation thread, not started; with a store, its prefix factory (run
    on the cache-I/O thread `io`) opens the block store."""
    prefix_factory = functools.partial(open_prefix_cache, ledger=ledger, **config.store_options())
    factories = {}
    if sharded is not None:
        factories = {"runner_factory": sharded.runner, "checkpoints_factory": sharded.checkpoints}
    return GenerationThread(
        loader=loader,
        io=io,
        prefix_factory=prefix_factory if config.store else None,
        config=config,
        thread_policy=ThreadPolicy(),
        **factories,
    )


def _sharded(config: EngineConfig) -> Any:
    """The `ranks.ShardedModel` of `Engine.load(ranks=..., hosts=...)`."""
    from mlx_nbengine.engine.ranks import ShardedModel  # lazy: sharded engines only

    return ShardedModel(config)
