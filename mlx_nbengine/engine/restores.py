"""Restore choice: which source serves a sequence's prefix, and what its prefill starts from.

- *sources*: ``memory``, the `HotCache` (the cache of the last sequence that finished,
  servable up to the tokens it shares with the prompt), and ``disk``, the block store's
  restore (planned, loaded and rebuilt on the cache-I/O thread; a `cacheio.RestoreResult`).
  The one that restores more tokens wins; on a tie, the hot cache.
- *start* (`Start`): the cache a prefill begins from and how many prompt tokens it holds.
  Choosing one also sets the sequence's restore facts, prompt keys and block reasons.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mlx_nbengine.engine.checkpoints import Checkpoints
from mlx_nbengine.engine.hot import HotCache
from mlx_nbengine.engine.reasons import computed_reasons
from mlx_nbengine.engine.results import BlockSource
from mlx_nbengine.engine.runner import Runner
from mlx_nbengine.engine.sequence import Phase, Sequence

__all__ = ["Restores", "Start"]


@dataclass
class Start:
    """Where a sequence's prefill starts: its cache holding the first `tokens` prompt
    tokens, restored from `source` (None: a fresh cache) in `seconds`."""

    cache: list[Any]
    tokens: int = 0
    source: BlockSource | None = None
    seconds: float = 0.0
    nbytes: int = 0
    kinds: dict[int, tuple[str, ...]] | None = None  # record kinds read per block (disk)


class Restores:
    """The hot cache and the choice between it and a disk restore (see the module)."""

    def __init__(self, runner: Runner, *, block_size: int, checkpoints: Checkpoints | None) -> None:
        self.runner = runner
        self.block_size = block_size
        self.checkpoints = checkpoints  # None: no block store
        self.hot: HotCache | None = None

    def start(self, seq: Sequence, result: Any, seconds: float) -> None:
        """Give `seq` the better start of the disk restore `result` (None: none) and the
        hot cache, and make it ready to prefill."""
        self.begin(seq, self.choose(seq, result, seconds))

    def hot_tokens(self, seq: Sequence) -> int:
        """The prompt tokens of `seq` the hot cache can serve (0 without one)."""
        if self.hot is None:
            return 0
        bidirectional = seq.images if self.runner.bidirectional else ()
        return self.hot.servable_tokens(
            seq.prompt_match, block_size=self.block_size, bidirectional=bidirectional
        )

    def choose(self, seq: Sequence, result: Any, seconds: float) -> Start:
        """The better of the disk restore `result` (a `cacheio.RestoreResult` or None) and
        the hot cache; sets `seq`'s restore facts, prompt keys and reasons."""
        plan = result.plan if result is not None else None
        rebuilt = result.restored if result is not None else None
        hot_n = self.hot_tokens(seq)
        if rebuilt is not None and plan.tokens > hot_n:
            # Rebuilt on the cache-I/O thread, in the restore's own job (see `cacheio`).
            start = Start(rebuilt.cache, plan.tokens, "disk", seconds, rebuilt.nbytes)
            start.kinds = rebuilt.kinds
            seq.kept_boundary = plan.kept_boundary
        elif hot_n > 0:
            t = time.perf_counter()
            cache, self.hot = self.hot.take(hot_n), None
            nbytes = sum(c.nbytes for c in cache)
            start = Start(cache, hot_n, "memory", time.perf_counter() - t, nbytes)
        else:
            start = Start(self.runner.lm.make_cache())
            seq.kept_boundary = plan.kept_boundary if plan is not None else None
        facts = None
        if self.checkpoints is not None:
            facts = result.facts if result is not None else None
            keys = plan.keys if plan is not None else self.checkpoints.keys(seq.prompt, seq.images)
            seq.prompt_keys = list(keys)
        store_off = self.checkpoints is None or self.checkpoints.store_off
        first = start.tokens // self.block_size  # the first block not wholly restored
        seq.set_reasons(*computed_reasons(seq.n_blocks, first, facts, store_off=store_off))
        return start

    def begin(self, seq: Sequence, start: Start) -> None:
        """Give `seq` the cache of `start`, embed its images, report the restore, and make
        it ready to prefill."""
        seq.cache = self.runner.adopt(seq, start.cache, start.source, start.tokens)
        seq.cache_tokens = list(seq.prompt[: start.tokens])
        seq.restored_bytes = start.nbytes
        self.runner.embed(seq, start.tokens)
        if start.source is not None:
            seq.report_restored(start.tokens, start.source, start.seconds, records=start.kinds)
        else:
            seq.report_nothing_restored()
        seq.phase = Phase.PREFILLING
        seq.ready_at = time.perf_counter()
