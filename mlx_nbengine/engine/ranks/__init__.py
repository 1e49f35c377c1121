"""A model sharded over MLX distributed ranks, driven by one engine (rank 0, this process).

`ShardedModel` is what `Engine.load(model, ranks=N | hosts=[...], shard=...)` builds: the
loader the generation thread runs (start the workers, form the ring, load rank 0's shard,
have every worker load its own and open its own block store) and the factories of the
engine parts that mirror every step to the workers (`mirror`). The rest of the engine
(scheduler, decoder, restores, checkpoints, its cache-I/O thread) is the single-process
engine's, unchanged: rank 0 decides everything and tells the workers.

Modules: `shard` (which families, which mode), `launch` (starting and killing worker
processes, the ring's hostfile), `channel` (the control channel: framed pickles of step
plans, never tensors), `group` (rank 0's side: the workers, their heartbeats, faults),
`mirror` (rank 0's engine parts), `worker` + `replay` (a worker process).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Any

from mlx_nbengine._blas import ThreadPolicy
from mlx_nbengine.engine.config import EngineConfig
from mlx_nbengine.engine.ranks import plans
from mlx_nbengine.engine.ranks.group import (
    HANG_TIMEOUT_S,
    RankGroup,
    RankLostError,
    RingUsedError,
)
from mlx_nbengine.engine.ranks.launch import places_for, ring_hosts
from mlx_nbengine.engine.ranks.mirror import RankCheckpoints, RankRunner
from mlx_nbengine.engine.ranks.shard import NotShardableError, choose_mode, shard_fn

LOAD_TIMEOUT_S = 1800.0  # a worker reading its shard of a large model

__all__ = [
    "NotShardableError",
    "RankLostError",
    "RingUsedError",
    "ShardedModel",
]


class ShardedModel:
    """One model over ranks: its loader, its engine parts, its status and its end."""

    def __init__(self, config: EngineConfig, *, hang_timeout_s: float | None = None) -> None:
        """`config` is validated (`EngineConfig`): its ranks or hosts, shard, dtype, revision
        and block store options; each worker is sent it with its `plans.Load`."""
        ranks, hosts = config.ranks, list(config.hosts) if config.hosts is not None else None
        self.config = config
        self.model = config.model
        self.hosts = hosts
        self.asked = config.shard
        try:
            self.places = places_for(ranks=ranks, hosts=hosts)
        except OSError as exc:
            raise RankLostError(str(exc)) from None
        if hang_timeout_s is None:
            hang_timeout_s = float(os.environ.get("MLX_NBENGINE_RANK_TIMEOUT_S", HANG_TIMEOUT_S))
        self.group = RankGroup(self.places, hang_timeout_s=hang_timeout_s)
        self.mode: str | None = None

    # --- on the generation thread -----------------------------------------------------------

    def load(self) -> Any:
        """Start the workers, form the ring, load every rank's shard; rank 0's model."""
        from mlx_nbengine.models import load, sources  # lazy: as Engine.load's loader

        path = sources.locate(self.model, revision=self.config.revision)
        config = json.loads((path / "config.json").read_text())
        self.mode = choose_mode(config.get("model_type", "?"), self.asked)
        hostfile = ring_hosts(self.places)
        try:
            self.group.start({"MLX_NBENGINE_RING_HOSTS": hostfile})
            mx_group = self.group.init_ring(hostfile)
            remote = self.hosts is not None
            # This machine's folder is not theirs: remote workers use their temp folder.
            sent = replace(self.config, cache_dir=None) if remote else self.config
            model = self.model if remote else str(path)
            self.group.send(plans.Load(model=model, config=sent, shard=self.mode))
            lm = load(path, dtype=self.config.dtype, shard=shard_fn(self.mode, mx_group))
            # Every worker loaded (an answer on the control channel, never a collective: a
            # worker that fails to load must not leave this rank waiting in MLX).
            self.group.ask(plans.Loaded(), timeout=LOAD_TIMEOUT_S)
            self.group.send(plans.Open(fingerprint=lm.fingerprint))
            self.group.ask(plans.Loaded())
            self.group.loaded()
        except BaseException as exc:
            error = self.group.error or _wait_error(self.group, exc)
            self.group.close()
            if error is not None:
                raise error from exc
            raise
        return lm

    def runner(self, lm: Any, *, thread_policy: ThreadPolicy | None = None) -> RankRunner:
        return RankRunner(lm, self.group, thread_policy=thread_policy)

    def checkpoints(self, *args: Any, **kwargs: Any) -> RankCheckpoints:
        return RankCheckpoints(self.group, *args, **kwargs)

    def measure_comm(self, nbytes: int, *, repeats: int = 50) -> dict[str, float]:
        """Seconds of one all_sum of `nbytes` over the ring (median and best of `repeats`,
        every rank taking part), and of sending one step plan; run it on the generation
        thread (`Engine.on_model_thread`), between steps."""
        import statistics

        import mlx.core as mx  # lazy: as in `load`

        self.group.send(plans.Comm(nbytes=nbytes, repeats=repeats))
        x = mx.ones((max(1, nbytes // 4),), dtype=mx.float32)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, stream=mx.cpu))
            times.append(time.perf_counter() - start)
        sends = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.group.send(plans.ClearNothing())
            sends.append(time.perf_counter() - start)
        return {
            "all_sum_s": statistics.median(times[1:] or times),
            "all_sum_best_s": min(times),
            "plan_send_s": statistics.median(sends),
        }

    def clear_stores(self) -> None:
        """Empty every worker's block store (`Engine.clear_cache` empties rank 0's)."""
        self.group.ask(plans.ClearStore())

    # --- any thread -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Ranks, hosts, shard, and each worker's process and store."""
        return {
            "ranks": self.group.size,
            "hosts": [p.host for p in self.places],
            "shard": self.mode,
            "workers": self.group.status(),
            "error": str(self.group.error) if self.group.error is not None else None,
        }

    def close(self) -> None:
        self.group.close()


def _wait_error(group: RankGroup, exc: BaseException) -> RankLostError | None:
    """The group's error for `exc`, when a lost worker caused it (named within 2 s)."""
    if not (isinstance(exc, RuntimeError) and "[ring]" in str(exc)):
        return None
    for _ in range(40):
        if group.error is not None:
            return group.error
        time.sleep(0.05)
    return RankLostError(f"the rank group failed while loading: {exc}")
