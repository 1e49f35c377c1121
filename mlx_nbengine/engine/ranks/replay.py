"""`Replay`: a worker's state and the step plans it replays (see `worker`, `mirror`).

It holds the same caches rank 0 holds, under the same refs: sequences' caches, group
prefills' batched caches, single copies of batch rows, the `DecodeBatch` (same rows, same
order) and the hot cache; a disk restore rebuilt on its cache-I/O thread waits in
`restored` until rank 0 starts the sequence from it. Each model call evaluates what rank
0's same call evaluates, so both run the same collectives in the same order.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import mlx.core as mx

from mlx_nbengine.engine.batch import DecodeBatch
from mlx_nbengine.engine.blockstore import open_prefix_cache, store_figures
from mlx_nbengine.engine.cacheio import SAVE, CacheIO, rebuild_cache
from mlx_nbengine.engine.checkpoints import Checkpoints
from mlx_nbengine.engine.config import EngineConfig
from mlx_nbengine.engine.hot import HotCache
from mlx_nbengine.engine.ledger import CacheLedger
from mlx_nbengine.engine.memory import collectives_formed, give_back_memory
from mlx_nbengine.engine.ranks import plans
from mlx_nbengine.engine.ranks.channel import Link
from mlx_nbengine.engine.ranks.shard import shard_fn
from mlx_nbengine.engine.runner import Runner

AFTER_SAVES = SAVE + 1  # a store question waits for the saves sent before it
# Restores rebuilt for requests rank 0 has not started yet; older ones were cancelled.
MAX_PENDING_RESTORES = 64


class _Row:
    """What `Runner.prefill_group` reads of a sequence: its tokens and its cache."""

    def __init__(self, prompt: list[int], cache: list[Any]) -> None:
        self.prompt = prompt
        self.cache = cache


class Replay:
    """One worker's caches, store and step plans (see the module docstring)."""

    def __init__(self, link: Link, rank: int) -> None:
        self.link = link
        self.rank = rank
        self.group: Any = None
        self.config: EngineConfig | None = None  # with `plans.Load`
        self.lm: Any = None
        self.runner: Runner | None = None
        self.io: CacheIO | None = None
        self.checkpoints: Checkpoints | None = None
        self.held: dict[tuple[str, int], list[Any]] = {}
        self.restored: dict[int, Future] = {}
        self.batch = DecodeBatch()
        self.hot: HotCache | None = None
        self.stopped = False
        self.restores = 0  # disk restores this rank rebuilt (rank 0 ordered each)

    def run(self) -> None:
        while not self.stopped:
            plan = self.link.receive(timeout=None)
            handler = HANDLERS.get(type(plan))
            if handler is None:
                raise ValueError(f"unknown step plan {plan!r}")
            handler(self, **vars(plan))

    def answer(self, ask: int, value: Any) -> None:
        self.link.send(plans.Answer(ask=ask, value=value))

    def close(self) -> None:
        if self.io is not None:
            self.io.close()
            self.io = None

    # --- start ------------------------------------------------------------------------------

    def on_init(self) -> None:
        fd, path = tempfile.mkstemp(prefix="mlx-nbengine-ring-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(os.environ["MLX_NBENGINE_RING_HOSTS"])
            os.environ["MLX_HOSTFILE"] = path
            collectives_formed()
            self.group = mx.distributed.init(backend="ring", strict=True)
        finally:
            os.unlink(path)

    def on_load(self, *, model: str, config: EngineConfig, shard: str) -> None:
        from mlx_nbengine.models import load  # lazy: the worker's first MLX work

        self.config = config
        self.lm = load(model, dtype=config.dtype, shard=shard_fn(shard, self.group))
        self.runner = Runner(self.lm, split=False)

    def on_open(self, *, fingerprint: str) -> None:
        """Rank 0's fingerprint (the block keys), and this rank's own block store."""
        self.lm = lm = replace(self.lm, fingerprint=fingerprint)
        self.runner.lm = lm
        if not self.config.store:
            return
        store = self.config.store_options()
        self.io = CacheIO(name=f"mlx-nbengine-cache-io-rank{self.rank}")
        self.io.open(lambda: open_prefix_cache(lm, ledger=CacheLedger(), **store))
        prefix = self.io.prefix
        self.checkpoints = Checkpoints(
            self.io,
            fingerprint=fingerprint,
            block_size=store["block_size"],
            to_token=self.config.restore == "token",
            uncuttable_kind=prefix.uncuttable_kind,
            recurrent="state" in [str(k) for k in prefix.kinds],
            store_off=prefix.store.budget_bytes == 0,
            vision=False,
            bidirectional=False,
        )

    def on_loaded(self, ask: int) -> None:
        self.answer(ask, {"rank": self.rank, "pid": os.getpid()})

    def on_idle(self) -> None:
        give_back_memory(between_steps=True)  # rank 0 is idle: no step is in flight

    def on_probe(self) -> None:
        records = self.runner.probe_records()
        if self.io is not None:
            prefix = self.io.prefix
            self.io.call(lambda: prefix.learn(records)).result()

    def on_clear_nothing(self) -> None:
        """A step plan that does nothing (`ShardedModel.measure_comm` times sending one)."""

    def on_stop(self) -> None:
        self.stopped = True

    # --- caches -----------------------------------------------------------------------------

    def on_start(self, *, ref: Any, cid: int, source: str | None, tokens: int) -> None:
        pending = self.restored.pop(cid, None)
        if source == "disk":
            cache = pending.result() if pending is not None else None
            if cache is None:
                raise RuntimeError(
                    f"rank 0 restored request {cid} from disk; this rank has no restore"
                )
        elif source == "memory":
            cache, self.hot = self.hot.take(tokens), None
        else:
            cache = self.lm.make_cache()
        self.held[ref] = cache

    def on_hot(self, *, ref: Any, tokens: list[int]) -> None:
        self.hot = HotCache(tokens, self.held[ref])

    def on_free(self, *, ref: Any) -> None:
        self.held.pop(ref, None)

    def on_add(self, *, ref: Any) -> None:
        self.batch.add(ref, self.held.pop(ref))

    def on_add_group(self, *, ref: Any, n: int) -> None:
        self.batch.add_group([ref] * n, self.held.pop(ref))

    def on_remove(self, *, indices: list[int]) -> None:
        self.batch.pending = None
        self.batch.remove(indices)

    def on_clear(self) -> None:
        self.batch.clear()

    def on_single(self, *, index: int, ref: Any) -> None:
        self.held[ref] = self.batch.single_cache(index)

    # --- model calls ------------------------------------------------------------------------

    def on_prefill(self, *, ref: Any, tokens: list[int], last: bool) -> None:
        cache = self.held[ref]
        with self.runner.thread_policy.prefill(len(tokens)):
            logits = self.lm.model(mx.array(tokens, dtype=mx.uint32)[None], cache=cache)
            logits = getattr(logits, "logits", logits)
            # What rank 0's same step evaluates: its last row's token (and the cache).
            mx.eval(
                [mx.argmax(logits[:, -1, :], axis=-1)] if last else [], [c.state for c in cache]
            )

    def on_group(self, *, refs: list[Any], rows: list[list[int]], ref: Any) -> None:
        members = [_Row(row, self.held.pop(r)) for r, row in zip(refs, rows, strict=True)]
        spans = [(0, len(row)) for row in rows]
        self.held[ref] = self.runner.prefill_group(members, spans)

    def on_decode(self, *, tokens: list[int]) -> None:
        logits = self.batch.forward(self.lm.model, tokens)
        mx.eval(mx.argmax(logits, axis=-1))

    def on_comm(self, *, nbytes: int, repeats: int) -> None:
        """Rank 0's `ShardedModel.measure_comm`: the same all_sums, in the same order."""
        x = mx.ones((max(1, nbytes // 4),), dtype=mx.float32)
        for _ in range(repeats):
            mx.eval(mx.distributed.all_sum(x, stream=mx.cpu))

    # --- the store --------------------------------------------------------------------------

    def cache_of(self, ref: Any) -> list[Any]:
        return self.held[ref]

    def on_save(
        self, *, ref: Any, keys: list[str], tokens: list[int], block: int, chain: list[str] | None
    ) -> None:
        if self.checkpoints is not None:
            self.checkpoints._save_block(keys, tokens, self.cache_of(ref), block, chain=chain)

    def on_partial(self, *, ref: Any, tokens: list[int]) -> None:
        if self.checkpoints is not None:
            self.checkpoints.partial(tokens, self.cache_of(ref))

    def on_holds(self, *, ask: int, plan: Any) -> None:
        def job() -> dict[str, Any]:
            prefix = self.io.prefix
            has = prefix.store.has
            n = plan.n_blocks
            while n and not all(has(k, kind) for k, kind in prefix.needed(plan.keys, n)):
                n -= 1
            cut = plan.cut is not None and all(has(k, kind) for k, kind in plan.cut.needed)
            held = [any(has(k, kind) for kind in prefix.kinds) for k in plan.keys]
            return {"blocks": n, "cut": cut, "held": held}

        self._ask_store(ask, job, {"blocks": 0, "cut": False, "held": [False] * len(plan.keys)})

    def on_restore(self, *, ask: int, cid: int, plan: Any) -> None:
        make_cache = self.lm.make_cache
        served: Future = Future()

        def job() -> int:
            rebuilt = None
            try:
                prefix = self.io.prefix
                got, records = prefix.load(plan, mapped=True)
                if got.tokens == plan.tokens:
                    rebuilt = rebuild_cache(prefix, got, records, make_cache)
                    self.restores += rebuilt is not None
                del records  # views of the scratch file: used up in this job
            finally:
                served.set_result(rebuilt.cache if rebuilt is not None else None)
            return plan.tokens if rebuilt is not None else 0

        self.restored[cid] = served
        while len(self.restored) > MAX_PENDING_RESTORES:  # never started (cancelled)
            self.restored.pop(next(iter(self.restored)))
        self._ask_store(ask, job, 0)

    def on_clear_store(self, *, ask: int) -> None:
        """Empty this rank's store (rank 0's `Engine.clear_cache`)."""

        def job() -> bool:
            self.io.prefix.store.clear()
            return True

        self._ask_store(ask, job, False)

    def on_store(self, *, ask: int) -> None:
        def job() -> dict[str, Any]:
            figures = store_figures(self.io.prefix.store if self.io.prefix is not None else None)
            return {**figures, "restores": self.restores}

        self._ask_store(ask, job, store_figures(None))

    def _ask_store(self, ask: int, job: Any, empty: Any) -> None:
        """Run `job` on the cache-I/O thread after the saves sent before it; answer."""
        if self.io is None:
            self.answer(ask, empty)
            return
        fut = self.io.call(job, priority=AFTER_SAVES)
        fut.add_done_callback(
            lambda f: self.answer(ask, f.result() if not f.exception() else empty)
        )


# Each step plan's handler, by the plan's type.
HANDLERS: dict[type, Any] = {
    plans.Init: Replay.on_init,
    plans.Load: Replay.on_load,
    plans.Open: Replay.on_open,
    plans.Loaded: Replay.on_loaded,
    plans.Idle: Replay.on_idle,
    plans.Probe: Replay.on_probe,
    plans.ClearNothing: Replay.on_clear_nothing,
    plans.Stop: Replay.on_stop,
    plans.Start: Replay.on_start,
    plans.Hot: Replay.on_hot,
    plans.Free: Replay.on_free,
    plans.Add: Replay.on_add,
    plans.AddGroup: Replay.on_add_group,
    plans.Remove: Replay.on_remove,
    plans.Clear: Replay.on_clear,
    plans.Single: Replay.on_single,
    plans.Prefill: Replay.on_prefill,
    plans.Group: Replay.on_group,
    plans.Decode: Replay.on_decode,
    plans.Comm: Replay.on_comm,
    plans.Save: Replay.on_save,
    plans.Partial: Replay.on_partial,
    plans.Holds: Replay.on_holds,
    plans.Restore: Replay.on_restore,
    plans.ClearStore: Replay.on_clear_store,
    plans.Store: Replay.on_store,
}
