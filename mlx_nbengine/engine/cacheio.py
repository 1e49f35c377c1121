"""The cache-I/O thread: the only thread that touches the block store.

A *job* is a function run on this thread with its result delivered through a
`concurrent.futures.Future`. Jobs come in three priorities, served in this order:
control (open the store, stats), *restores* (plan and load the records of a prompt's
prefix, which a waiting request needs now), then *saves* (serialize a finished block's
records into the scratch file, which nobody waits for). Within a priority, jobs run in
the order they were given.

Threading rules kept here: the `PrefixCache` (and its `BlockStore`) is created, used
and closed on this thread only; records handed to `save` were evaluated on the
generation thread before crossing; `restore` rebuilds the cache here, from records it
reads as views of the scratch file's pages (no copy), in the same job (no save can
change the file under them), and evaluates it before it crosses back. A failed save is
counted and dropped (a missing record is a cache miss, never a wrong answer); a failed
restore fails that future.

Restores jump the queue, yet must not miss blocks whose saves are still queued (a
prompt run twice in a row): a restore first stores the queued records of its own
chain (and of the blocks that followed its prefixes), then plans. A restore also
returns the `BlockFacts` of the blocks its plan does not cover, read from the store at
that moment, from which the generation thread says why each computed block was
computed. A save names the block's parent and tokens, so the prefix cache's follower
index learns what followed each prefix; a persistent store keeps that too
(`BlockStore.remember`), so the next process can cut edited blocks at once.

After a step's blocks are stored, their chain is *touched* suffix-first (see
`PrefixCache.touch`) so that, under pressure, suffixes evict first.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_nbengine.cache.followers import ROOT
from mlx_nbengine.cache.records import RecordError
from mlx_nbengine.engine.events import RECORD_ORDER
from mlx_nbengine.engine.memory import give_back_memory

CONTROL, RESTORE, SAVE = 0, 1, 2


@dataclass
class Restored:
    """A cache rebuilt from a plan's records on the cache-I/O thread (evaluated), the bytes
    of the records read for it, and the record kinds read for each whole block."""

    cache: list
    nbytes: int
    kinds: dict[int, tuple[str, ...]]


@dataclass(frozen=True)
class RestoreResult:
    """What a restore job found: the `plan` served (None without a store), the cache
    rebuilt from its records (None when another source serves more, or on a miss), and
    the `BlockFacts` of every block from the plan's last whole block on (None without a
    store)."""

    plan: Any = None
    restored: Restored | None = None
    facts: dict[int, Any] | None = None


def rebuild_cache(prefix: Any, plan: Any, records: dict, make_cache: Callable[[], list]) -> Any:
    """`Restored` from `records`, or None (a miss, never a failed request) when they do
    not fit the model after all."""
    try:
        cache = prefix.assemble(
            records,
            n_blocks=plan.n_blocks,
            template_cache=make_cache(),
            cut_tokens=plan.cut.tokens if plan.cut is not None else 0,
        )
        mx.eval([c.state for c in cache])
    except (RecordError, ValueError):
        return None
    return Restored(
        cache,
        # Whole blobs are read, also the cut's (of which only its first tokens are used).
        nbytes=sum(r.nbytes for recs in records.values() for r in recs.values()),
        kinds={
            block: tuple(k for k in RECORD_ORDER if k in recs)
            for block, recs in records.items()
            if block < plan.n_blocks
        },
    )


class CacheIO:
    """Runs store jobs on its own daemon thread; see the module docstring."""

    def __init__(self, *, name: str = "mlx-nbengine-cache-io") -> None:
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._closing = False
        self.prefix: Any = None  # PrefixCache, set by `open` on this thread
        self.save_errors = 0
        # Called on this thread each time its queue empties after a job: freed blobs and
        # decoded arrays are garbage then. At once by default; an engine hands it to its
        # generation thread (`GenerationThread.io_drained`), which gives memory back once
        # it has been idle a while: emptied from here at once, MLX's pool and the heap's
        # free pages were gone for the next request (50,000 page faults an agent's turn).
        self.on_drained: Callable[[], None] = give_back_memory
        self._queued_saves: dict[str, tuple] = {}  # key -> (records, parent, tokens)
        self._queued_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any], *, priority: int = CONTROL) -> Future:
        """Run `fn()` on the I/O thread; its result or exception lands in the future."""
        fut: Future = Future()
        if self._closing:
            fut.set_exception(RuntimeError("the cache-I/O thread is closed"))
            return fut
        self._jobs.put((priority, next(self._order), fn, fut))
        return fut

    def open(self, factory: Callable[[], Any]) -> None:
        """Create the prefix cache on the I/O thread (it owns the store's file)."""

        def build():
            self.prefix = factory()

        self.call(build).result()

    def restore(
        self,
        tokens: list[int],
        *,
        other_source_tokens: int,
        make_cache: Callable[[], list],
        to_token: bool = False,
        images: tuple = (),
        bidirectional_images: bool = False,
        agree: Any = None,
    ) -> Future:
        """Plan the longest restorable prefix of `tokens`; if it beats `other_source_tokens`
        (what another source, the hot cache, serves), load its records and rebuild the cache
        from them here, in `make_cache()` (a fresh cache list: Python objects only, so any
        thread may make it).

        With `to_token` the plan may end inside a block (a cut, see `planner`). The
        future's result is a `RestoreResult`: `restored` is a `Restored` (the
        cache, evaluated, and what was read), None when the plan restores no more than
        `other_source_tokens` tokens (the caller has a better source) or its records do not
        fit the model after all (a miss); `facts` maps each block from the plan's last whole
        block to the prompt's last to its `BlockFacts`. `images` are the prompt's
        `ImageSpan`s (in the keys); with `bidirectional_images` no restore ends inside one.

        The records are views of the scratch file's pages (`PrefixCache.load` with
        `mapped`): they are used up in this job, before any save can change the file.

        `agree` (a sharded model's engine, `ranks.mirror.Agreement`) holds the plan to what
        every rank's store holds (``agree.plan(prefix, plan)``), has every rank rebuild
        the plan served (``agree.rebuilt(plan)``, False: a miss on all of them), and marks
        the blocks a rank does not hold as not held (``agree.facts(facts)``).
        """

        def job():
            prefix = self.prefix
            if prefix is None:
                return RestoreResult()
            self._flush_saves_of(prefix.keys(tokens, images))
            plan = prefix.plan(
                tokens, images, bidirectional_images=bidirectional_images, to_token=to_token
            )
            if agree is not None:
                plan = agree.plan(prefix, plan)
            restored = None
            if plan.tokens > other_source_tokens:
                plan, records = prefix.load(plan, mapped=True)
                if plan.tokens > other_source_tokens:
                    restored = rebuild_cache(prefix, plan, records, make_cache)
                del records  # views of the file: none may outlive this job
            if restored is not None and agree is not None and not agree.rebuilt(plan):
                restored = None
            # After the load: a record found damaged there is gone now.
            facts = prefix.block_facts(tokens, plan.keys, first=plan.n_blocks, images=images)
            if agree is not None:
                facts = agree.facts(facts)
            return RestoreResult(plan, restored, {f.index: f for f in facts})

        return self.call(job, priority=RESTORE)

    def _flush_saves_of(self, keys: list[str]) -> None:
        """Write the queued saves of a prompt's blocks `keys` now, and of the queued blocks
        that followed its prefixes: the facts compare the prompt with them and a cut
        restores from them (an edit of a prompt that just ran). On this thread."""
        for key in keys:
            self._flush_save(key)
        parents = {ROOT, *keys}
        with self._queued_lock:
            followers = [k for k, q in self._queued_saves.items() if q[1] in parents]
        for key in followers:
            self._flush_save(key)

    def save(
        self,
        key: str,
        records: dict,
        *,
        chain: list[str] | None = None,
        parent: str | None = None,
        tokens: list[int] | None = None,
    ) -> None:
        """Queue one block's (already evaluated) records for the store.

        `chain`, when given, is the block keys from the first block to this one; it is
        touched after the save. `parent` (the previous block's key, `ROOT` for block 0)
        and the block's `tokens` go to the follower index.
        """
        with self._queued_lock:
            self._queued_saves[key] = (records, parent, tokens)

        def job():
            self._flush_save(key)
            if chain and self.prefix is not None:
                self.prefix.touch(chain)

        self.call(job, priority=SAVE)

    def _flush_save(self, key: str) -> bool:
        """Store the save queued under `key` now, if it is still queued (saves run in
        order, but a restore stores the blocks it may read first)."""
        with self._queued_lock:
            queued = self._queued_saves.pop(key, None)
        if queued is None or self.prefix is None:
            return False
        records, parent, tokens = queued
        try:
            saved = self.prefix.save(key, records, parent=parent, tokens=tokens)
            if parent is not None and tokens is not None and key in self.prefix.followers:
                # A persistent store keeps it for the next process (a no-op otherwise).
                remember = getattr(self.prefix.store, "remember", None)
                if remember is not None:
                    remember(key, parent, tokens)
            return saved
        except Exception:
            # A lost checkpoint is a future cache miss, not a reason to fail anyone.
            self.save_errors += 1
            return False

    def clear(self) -> Future:
        """Drop the saves still queued and empty the store (a control job: runs first)."""

        def job():
            with self._queued_lock:
                self._queued_saves.clear()
            if self.prefix is not None:
                self.prefix.store.clear()

        return self.call(job)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every job queued so far (saves included) has run."""
        self.call(lambda: None, priority=SAVE + 1).result(timeout)

    def close(self, *, drain_s: float = 0.0) -> None:
        """Drop queued saves, close the store on its thread, join. Idempotent.

        `drain_s` > 0 first lets the queued jobs run for up to that many seconds (a
        persistent store keeps the blocks of the last request; a scratch store loses
        them anyway)."""
        if self._closing:
            return
        if drain_s > 0 and self._thread.is_alive():
            try:
                self.drain(timeout=drain_s)
            except Exception:  # noqa: BLE001 - timed out or the thread failed: close anyway
                pass
        self._closing = True
        # Priority -1 jumps every queued save: closing must not wait for the disk.
        self._jobs.put((-1, next(self._order), None, None))
        self._thread.join()

    def _run(self) -> None:
        while True:
            _, _, fn, fut = self._jobs.get()
            if fn is None:
                break
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # delivered to whoever waits on the future
                    fut.set_exception(exc)
            if self._jobs.empty():
                self.on_drained()
        while True:  # the jobs left behind are dropped; tell any waiter
            try:
                _, _, fn, fut = self._jobs.get_nowait()
            except queue.Empty:
                break
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the cache-I/O thread closed"))
        if self.prefix is not None:
            self.prefix.store.close()
            self.prefix = None
        # This thread's MLX stream must not outlive it (see `generation._release_streams`).
        mx.synchronize()
        mx.clear_streams()
