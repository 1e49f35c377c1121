"""Decode steps of the batch, pipelined.

A *decode step* computes one token for every member of the `DecodeBatch`. Steps are
*pipelined*: step n+1's graph is built from step n's sampled tokens before they are read
(`mx.async_eval`), so MLX computes while the generation thread streams text. The pipeline
is *settled* (step n read, nothing in flight) before a member joins, and a step after
which a member's cache reaches a block boundary launches nothing until that block's
checkpoint is taken (a window may rotate, a state moves on). On the CPU, sampled
(temperature > 0) rows are drawn in numpy when their step is read (`HostDraw`), so such
steps are not pipelined. Generation thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mlx_nbengine.engine.checkpoints import Checkpoints
from mlx_nbengine.engine.runner import Runner
from mlx_nbengine.engine.sequence import Phase, Sequence


@dataclass
class Ended:
    """A member that finished with a step: why, and (for the last of a step) the tokens
    its cache holds and that cache, which becomes the hot cache."""

    seq: Sequence
    reason: str
    hot: tuple[list[int], list[Any]] | None = None


class Decoder:
    """The decode batch and its pipeline (see the module docstring)."""

    def __init__(
        self, runner: Runner, *, block_size: int, checkpoints: Checkpoints | None = None
    ) -> None:
        self.runner = runner
        self.block_size = block_size
        self.checkpoints = checkpoints
        self.batch = runner.new_batch()
        self._launched_at = 0.0

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def members(self) -> list[Sequence]:
        return list(self.batch.members)

    def join(self, seq: Sequence, next_token: int) -> None:
        """Let prefilled `seq` join with its cache; the next step feeds `next_token`.
        Settle first (`settle`)."""
        seq.phase = Phase.DECODING
        seq.embedded = None  # the prompt's embeddings are not needed any more
        seq.next_token = next_token
        cache, seq.cache = seq.cache, None
        self.batch.add(seq, cache)

    def join_group(self, group: list[Sequence], caches: list[Any]) -> None:
        """Let members prefilled together join with their batched `caches`; the next step
        feeds each one's last prompt token. Settle first."""
        for seq in group:
            seq.phase = Phase.DECODING
            seq.next_token = seq.prompt[-1]
        self.batch.add_group(group, caches)

    def remove(self, seq: Sequence) -> bool:
        """Drop `seq` from the batch (a cancel); False when it is not a member."""
        members = self.batch.members
        if seq not in members:
            return False
        self.batch.remove([members.index(seq)])
        return True

    def clear(self) -> list[Sequence]:
        """Empty the batch; its members (for the caller to fail or finish)."""
        members = self.members
        self.batch.clear()
        return members

    def step(self) -> list[Ended]:
        """Run one decode step (launched now, or already in flight); the members it ended."""
        batch = self.batch
        if batch.pending is None:
            batch.pending = self._launch([m.next_token for m in batch.members])
        bs = self.block_size
        # No pipelining when a member's cache reaches a block boundary with this step: its
        # checkpoint must see the cache exactly there.
        boundary = self.checkpoints is not None and any(
            (len(m.cache_tokens) + 1) % bs == 0 for m in batch.members
        )
        # Nor when every member reaches its length limit with this step: nothing would
        # use the next one.
        context = self.runner.lm.context_length
        all_end = all(_ends_by_length(m, context) for m in batch.members)
        return self._complete(pipeline=not (boundary or all_end))

    def settle(self) -> list[Ended]:
        """Read and apply the step in flight, launching none (the batch may change after);
        the members it ended."""
        if self.batch.pending is None:
            return []
        return self._complete(pipeline=False)

    def _launch(self, inputs: Any) -> Any:
        tokens = self.runner.launch(self.batch, inputs)
        self._launched_at = time.perf_counter()
        return tokens

    def _complete(self, *, pipeline: bool) -> list[Ended]:
        batch = self.batch
        members = list(batch.members)
        sampled, launched_at = batch.pending, self._launched_at
        batch.pending = self._launch(sampled) if pipeline else None
        tokens = sampled.tolist()
        context = self.runner.lm.context_length
        ended: list[Ended] = []
        for i, seq in enumerate(members):
            seq.cache_tokens.append(seq.next_token)
            if len(seq.cache_tokens) == len(seq.prompt):  # it fed its prompt's last token
                n = len(seq.prompt)
                seq.report_computed(n - 1, n, time.perf_counter() - launched_at)
            if self.checkpoints is not None and len(seq.cache_tokens) % self.block_size == 0:
                self.checkpoints.after_decode(seq, batch.single_cache(i))
            reason = seq.accept(tokens[i], context_length=context)
            if reason is None:
                seq.next_token = tokens[i]
            else:
                ended.append(Ended(seq, reason))
        if ended:
            last = members.index(ended[-1].seq)
            hot_tokens = list(members[last].cache_tokens)
            if pipeline:
                # The step in flight already fed its last token into its cache.
                hot_tokens.append(tokens[last])
            ended[-1].hot = (hot_tokens, batch.single_cache(last))
            batch.remove([members.index(e.seq) for e in ended])
        return ended


def _ends_by_length(seq: Sequence, context: int | None) -> bool:
    n = len(seq.generated) + 1  # after this step's token
    return n >= seq.max_tokens or (context is not None and len(seq.prompt) + n >= context)
