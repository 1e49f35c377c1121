"""The scheduler: which sequence does what next. No thread of its own; `tick` is one turn.

- *admission*: waiting sequences become *admitting*, oldest first, while slots are free
  (decoding members plus admitting sequences stay within `parallel`), so a burst is
  admitted together. Each restores its prefix, prefills the rest of its prompt but the
  last token, and *joins* the batch: the next decode step feeds that token and samples
  the first generated one (a one-token prompt is computed and sampled alone; so is the
  final step of a sequence alone when it is at most `ALONE_FINAL_STEP` tokens).
- *restore*: the best of two sources, ``memory`` (the `HotCache`) and ``disk`` (the
  block store, planned, loaded and rebuilt on the cache-I/O thread, with a *cut* into the
  next block on a token-exact engine; see `cache.planner`). Then every block left to
  compute gets its *reason* (`reasons`).
- *prefill steps* (`steps`): model calls that end on block boundaries, so a checkpoint
  exists at every boundary: one block at a time while others decode (a long step would
  stall them) and on recurrent models whose states cannot be taken inside a step, up to
  `max_prefill_step` tokens otherwise (a hybrid whose recurrent layers are on our kernels
  gives its states at the boundaries inside a step: `Runner.taps_states`).
- *group*: sequences whose final steps (each inside one block) are due together are
  prefilled in one call and join together; the padding a group may add is bounded by
  `GROUP_PAD_TOKENS` per extra member. A ready sequence waits for others still restoring
  (at most `DEFER_LIMIT_S`) so that a burst forms one group.
- *turn* (`tick`): admit, then one prefill step of each ready sequence (or one group
  step), then one decode step. An exception while serving one sequence fails that
  request only; one inside a decode step fails that step's members.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mlx_nbengine.engine.checkpoints import Checkpoints
from mlx_nbengine.engine.decoding import Decoder, Ended
from mlx_nbengine.engine.hot import HotCache
from mlx_nbengine.engine.restores import Restores, Start
from mlx_nbengine.engine.runner import Runner
from mlx_nbengine.engine.sampling import RequestSampler
from mlx_nbengine.engine.sequence import Phase, Sequence
from mlx_nbengine.engine.steps import final_step_group, next_step

__all__ = ["DEFER_LIMIT_S", "Scheduler", "Start"]

# The longest a sequence ready to prefill waits for others still restoring (to form a group).
DEFER_LIMIT_S = 0.05


class Scheduler:
    """Admission, restores, prefill steps, groups and joins (see the module docstring)."""

    def __init__(
        self,
        runner: Runner,
        *,
        parallel: int,
        block_size: int,
        max_prefill_step: int,
        checkpoints: Checkpoints | None = None,
        on_restored: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.runner = runner
        self.parallel = parallel
        self.block_size = block_size
        self.max_prefill_step = max_prefill_step
        self.checkpoints = checkpoints  # None: no block store
        # Told (on the cache-I/O thread) when a sequence's restore is done; then `restored`.
        self._on_restored = on_restored
        self.decoder = Decoder(runner, block_size=block_size, checkpoints=checkpoints)
        self.waiting: deque[Sequence] = deque()
        self.admitting: list[Sequence] = []
        self.restores = Restores(runner, block_size=block_size, checkpoints=checkpoints)
        self.failures = 0
        self.group_prefills = 0  # prefill steps that served several sequences at once

    @property
    def hot(self) -> HotCache | None:
        """The hot cache: the last finished sequence's cache, in memory (`restores`)."""
        return self.restores.hot

    @hot.setter
    def hot(self, hot: HotCache | None) -> None:
        self.restores.hot = hot

    @property
    def active(self) -> int:
        return len(self.decoder) + len(self.admitting)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def submit(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def wait_s(self) -> float | None:
        """How long the caller may wait before the next `tick`: 0 with work to do, None
        when idle (until something arrives)."""
        if len(self.decoder) or (self.waiting and self._free_slots() > 0):
            return 0
        if not any(a.phase is Phase.PREFILLING for a in self.admitting):
            return None
        deferred = self._deferred_until()
        return 0 if deferred is None else max(0.0, deferred - time.perf_counter())

    def tick(self) -> None:
        """One turn: admit, one prefill step (or group step) of each ready sequence, one
        decode step."""
        while self.waiting and self._free_slots() > 0:
            seq = self.waiting.popleft()
            self.admitting.append(seq)
            self._guard([seq], self._admit, seq)
        ready = self._prefill_ready()
        group = []
        if self.runner.vision is None:  # vision prefills run alone
            group = final_step_group(ready, self.next_step, block_size=self.block_size)
        if group:
            self._guard(group, self._prefill_group, group)
        for seq in ready:
            if seq not in group:
                self._guard([seq], self._prefill_step, seq)
        if len(self.decoder):
            try:
                self._finish_ended(self.decoder.step())
            except Exception as exc:
                self._fail(self.decoder.clear(), exc)

    def _guard(self, seqs: list[Sequence], fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)`; an exception fails `seqs` only."""
        try:
            fn(*args)
        except Exception as exc:
            for seq in seqs:
                self._drop_admitting(seq)
            self._fail(seqs, exc)

    # --- admission and restore --------------------------------------------------------------

    def _admit(self, seq: Sequence) -> None:
        seq.phase = Phase.RESTORING
        if not seq.greedy:
            seq.sampler = RequestSampler(**seq.sampling)  # its MLX key is made here
        if self.checkpoints is None:
            self.restores.start(seq, None, 0.0)
            return
        seq.restore_started = time.perf_counter()
        fut = self.checkpoints.restore(
            seq,
            other_source_tokens=self.restores.hot_tokens(seq),
            make_cache=self.runner.lm.make_cache,
        )
        seq.restore_future = fut
        if self._on_restored is not None:
            fut.add_done_callback(lambda _: self._on_restored(seq))

    def restored(self, seq: Sequence) -> None:
        """Take `seq`'s finished restore (its future is done) and make it ready to prefill."""
        if seq not in self.admitting or seq.phase is not Phase.RESTORING:
            return  # cancelled while the I/O thread worked
        fut: Future = seq.restore_future
        seq.restore_future = None
        try:
            result = fut.result()
        except Exception:
            result = None  # a restore that fails is a miss: the prompt is computed instead
        seconds = time.perf_counter() - seq.restore_started
        self._guard([seq], self.restores.start, seq, result, seconds)

    def _deferred_until(self) -> float | None:
        """Until when ready sequences wait for others still restoring (None: no wait)."""
        if not any(a.phase is Phase.RESTORING for a in self.admitting):
            return None
        ready = [a.ready_at for a in self.admitting if a.phase is Phase.PREFILLING]
        until = min(ready) + DEFER_LIMIT_S if ready else None
        return until if until is not None and until > time.perf_counter() else None

    def _prefill_ready(self) -> list[Sequence]:
        if self._deferred_until() is not None:
            return []
        return [a for a in self.admitting if a.phase is Phase.PREFILLING]

    def _free_slots(self) -> int:
        return self.parallel - len(self.decoder) - len(self.admitting)

    def _drop_admitting(self, seq: Sequence) -> None:
        if seq in self.admitting:
            self.admitting.remove(seq)

    # --- prefill ----------------------------------------------------------------------------

    def next_step(self, seq: Sequence) -> tuple[int, int]:
        """The prompt tokens ``start:end`` of `seq`'s next prefill step."""
        checkpoints = self.checkpoints
        # Recurrent models need a state checkpoint at every boundary (a step ends there,
        # unless the runner takes the states inside a step: `taps_states`); others take
        # bigger steps unless sequences are decoding, which a long step would stall, or
        # someone watches the blocks arrive (`live_blocks`).
        recurrent = checkpoints is not None and checkpoints.recurrent
        boundaries = recurrent and not self.runner.taps_states  # a step ends at each one
        one_block = len(self.decoder) > 0 or seq.live_blocks or boundaries
        return next_step(
            seq,
            block_size=self.block_size,
            max_step=self.block_size if one_block else self.max_prefill_step,
            bidirectional=self.runner.bidirectional,
            image_ends=checkpoints is not None and checkpoints.image_ends,
            alone=not len(self.decoder) and self.admitting == [seq],
            across=not boundaries and not seq.live_blocks,
        )

    def _prefill_step(self, seq: Sequence) -> None:
        if len(seq.prompt) > 1 and len(seq.cache_tokens) == len(seq.prompt) - 1:
            self._join(seq, seq.prompt[-1])  # restored up to the last token: nothing to do
            return
        start, end = self.next_step(seq)
        t = time.perf_counter()
        token = self.runner.prefill(seq, start, end, block_size=self.block_size)
        seq.cache_tokens.extend(seq.prompt[start:end])
        seq.report_computed(start, end, time.perf_counter() - t)
        reason = None
        if token is not None:
            # The first token reaches the caller before this step's blocks are extracted
            # and queued for saving (megabytes of copies on a real model).
            self._drop_admitting(seq)
            seq.embedded = None
            reason = seq.accept(token, context_length=self.runner.lm.context_length)
        if self.checkpoints is not None:
            self.checkpoints.after_prefill(seq, start, end)
        if end == len(seq.prompt) - 1:
            self._join(seq, seq.prompt[-1])
        elif token is not None and reason is not None:
            self._finish(seq, (list(seq.cache_tokens), seq.cache), reason)
        elif token is not None:
            self._join(seq, seq.generated[-1])

    def _prefill_group(self, group: list[Sequence]) -> None:
        """Prefill each member's rest of the prompt but the last token in one model call,
        then let the members join the batch together."""
        t = time.perf_counter()
        spans = [(len(s.cache_tokens), len(s.prompt) - 1) for s in group]
        caches = self.runner.prefill_group(group, spans)
        seconds = time.perf_counter() - t
        self.group_prefills += 1
        total = sum(end - start for start, end in spans)
        for seq, (start, end) in zip(group, spans, strict=True):
            seq.cache_tokens.extend(seq.prompt[start:end])
            seq.report_computed(start, end, seconds * (end - start) / total)
        for seq in group:
            self._drop_admitting(seq)
        self._settle_before_join()
        self.decoder.join_group(group, caches)

    def _join(self, seq: Sequence, next_token: int) -> None:
        """Move a prefilled `seq` into the batch; the next decode step feeds `next_token`."""
        self._drop_admitting(seq)
        self._settle_before_join()
        self.decoder.join(seq, next_token)

    def _settle_before_join(self) -> None:
        """Settle the step in flight; if it fails, that is the batch's fault, not the
        joining sequences': its members fail and the joiners start a new batch."""
        try:
            self._finish_ended(self.decoder.settle())
        except Exception as exc:
            self._fail(self.decoder.clear(), exc)

    # --- ends -------------------------------------------------------------------------------

    def _finish_ended(self, ended: list[Ended]) -> None:
        for e in ended:
            self._finish(e.seq, e.hot, e.reason)

    def _finish(self, seq: Sequence, hot: tuple[list[int], list[Any]] | None, reason: str) -> None:
        """End `seq`; `hot` (the tokens a cache holds, the cache) becomes the hot cache,
        and its partial last block is stored."""
        if hot is not None:
            # The only cache kept once its sequence ends; older ones leave RAM here.
            self.hot = HotCache(*hot, images=seq.images)
            self.runner.kept_hot(*hot)
            if self.checkpoints is not None:
                # Queued before the caller sees the result, so a caller that then waits
                # for the saves finds it stored.
                self.checkpoints.partial(*hot, images=seq.images)
        if seq.error is not None:  # its grammar failed (`Sequence.accept`)
            self._fail([seq], seq.error)
            return
        seq.finish(reason)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        self.failures += 1
        for seq in seqs:
            seq.fail(exc)

    def cancel(self, request: Any) -> None:
        """End `request`'s sequence, wherever it is, with ``"cancelled"``."""
        for seq in self.waiting:
            if seq.request is request:
                self.waiting.remove(seq)
                seq.finish("cancelled")
                return
        for seq in self.admitting:
            if seq.request is request:
                self._drop_admitting(seq)
                prefilling = seq.phase is Phase.PREFILLING
                hot = (list(seq.cache_tokens), seq.cache) if prefilling else None
                self._finish(seq, hot, "cancelled")
                return
        for seq in self.decoder.members:
            if seq.request is request:
                self.decoder.remove(seq)
                seq.finish("cancelled")
                return

    def fail_in_flight(self, exc: Exception) -> None:
        """Fail every admitted and decoding sequence (a fault of no one sequence)."""
        seqs = self.decoder.clear() + self.admitting
        self.admitting = []
        self._fail(seqs, exc)

    def shutdown(self) -> None:
        """Cancel every sequence held and drop the hot cache."""
        seqs = list(self.waiting) + self.decoder.clear() + self.admitting
        self.waiting.clear()
        self.admitting = []
        self.hot = None
        for seq in seqs:
            seq.finish("cancelled")

    def drop_hot_cache(self) -> None:
        """Forget the hot cache and the image features."""
        self.hot = None
        if self.runner.vision is not None:
            self.runner.vision.memo.clear()
