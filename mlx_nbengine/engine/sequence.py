"""One request as the generation thread sees it: its tokens, cache and report.

A sequence goes through these phases (`Phase`), in order:

- ``WAITING``: queued, holds no cache;
- ``RESTORING``: the cache-I/O thread is planning/loading its prefix;
- ``PREFILLING``: owns a single-sequence cache (`cache`) and computes the rest of the
  prompt in steps that end on block boundaries;
- ``DECODING``: a member of the `DecodeBatch`, which holds its cache rows;
- ``DONE``: its request got a completion or an error.

`cache_tokens` is always exactly the token ids whose keys/values (or states) are in
the sequence's cache: the prompt prefix prefilled so far, then each generated token
once it has been fed back. Owned by the generation thread.

Each prompt block is reported once (a `BlockEvent` on the stream, a `BlockReport` in the
report) with its source and reason: restored blocks at the restore (``"hot"``, or the
record kinds read from disk), computed ones as their last token is prefilled, with the
reason `set_reasons` gave them at admission (see `reasons`). A restore that ends inside a
block (a cut) leaves that block computed, with its restored tokens counted in its
`restored` and its share of the restore time in its seconds. A finished sequence tells
the engine's `CacheLedger` (when it has one) what its blocks cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mlx_nbengine.cache.blocks import match_ids
from mlx_nbengine.engine.events import Progress, TextDelta, disk_reason
from mlx_nbengine.engine.request import Request
from mlx_nbengine.engine.results import BlockReport, BlockSource, Completion, Report
from mlx_nbengine.engine.text import TextStream
from mlx_nbengine.errors import GrammarError


class Phase(Enum):
    """Where a sequence is on its way (see the module docstring)."""

    WAITING = "waiting"
    RESTORING = "restoring"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"


@dataclass(eq=False)
class Sequence:
    """Generation-thread state of one request (see the module docstring)."""

    request: Request
    prompt: list[int]
    max_tokens: int
    sampling: dict[str, Any]  # temperature, top_p, seed: the sampler is built on admission
    greedy: bool
    text: TextStream
    eos: frozenset[int]
    block_size: int
    submitted_at: float
    phase: Phase = Phase.WAITING
    sampler: Any = None
    cache: list[Any] | None = None
    cache_tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None
    restore_future: Any = None
    restore_started: float = 0.0
    ready_at: float = 0.0  # when it became ready to prefill (its restore done)
    prompt_keys: list[str] | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    restored: int = 0
    restored_bytes: int = 0
    restore_source: BlockSource | None = None
    blocks: dict[int, BlockReport] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)  # computed blocks, set at admission
    edits: dict[int, int] = field(default_factory=dict)  # block -> first changed position
    disk_records: dict[int, tuple[str, ...]] = field(default_factory=dict)  # kinds read
    kept_boundary: str | None = None  # why the restore stopped short at a boundary
    stop_reason: str | None = None
    ledger: Any = None  # the engine's CacheLedger, told when the sequence finishes
    images: tuple[Any, ...] = ()  # ImageSpans of the prompt's images (in the block keys)
    vision: Any = None  # engine.vision.VisionInputs of an image prompt, else None
    embedded: Any = None  # engine.vision.Embedded while prefilling on a vision model
    rope_delta: int = 0  # decode position offset (Qwen2-VL after images), see engine.vision
    # Prefill one block per step, so each block is reported as it is computed (a person
    # watches the strip); else steps as long as the scheduler allows.
    live_blocks: bool = False
    # The grammar its tokens are held to (`constraint.Constraint`), else None; `error` is
    # what ended it when that failed mid-way (the scheduler fails the request with it).
    constraint: Any = None
    error: BaseException | None = None
    # The recurrent layers' states at block boundaries inside the last prefill step
    # (boundary -> layer index -> a cache), taken by the runner, read by the checkpoints.
    step_states: dict[int, dict[int, Any]] = field(default_factory=dict)
    _seconds: dict[int, float] = field(default_factory=dict)
    _partial: dict[int, int] = field(default_factory=dict)  # block -> tokens restored in it
    _prompt_match: Any = None  # `prompt_match`, once asked for

    @property
    def n_blocks(self) -> int:
        """Prompt blocks, the partial tail included."""
        return -(-len(self.prompt) // self.block_size)

    def match(self, tokens: list[int]) -> Any:
        """`tokens` (a prefix of the prompt, then generated ones) as `blocks.match_ids`."""
        return match_ids(tokens, self.images)

    @property
    def prompt_match(self) -> Any:
        """The prompt as `blocks.match_ids`, computed once (it never changes)."""
        if self._prompt_match is None:
            self._prompt_match = self.match(self.prompt)
        return self._prompt_match

    def block_images(self, index: int) -> tuple[int, ...]:
        start, end = self.block_span(index)
        return tuple(i for i, s in enumerate(self.images) if s.overlaps(start, end))

    def block_span(self, index: int) -> tuple[int, int]:
        start = index * self.block_size
        return start, min(start + self.block_size, len(self.prompt))

    def set_reasons(self, reasons: dict[int, str], edits: dict[int, int]) -> None:
        """The reasons of the blocks to compute and where the prompt leaves a stored
        continuation (see `reasons.computed_reasons`)."""
        self.reasons, self.edits = reasons, edits

    def report_restored(
        self,
        n_tokens: int,
        source: BlockSource,
        seconds: float,
        *,
        records: dict[int, tuple[str, ...]] | None = None,
    ) -> None:
        """Record that the first `n_tokens` prompt tokens came from `source`; `records`
        are the record kinds read per block (disk only)."""
        self.restored, self.restore_source = n_tokens, source
        self.disk_records = dict(records or {})
        per_token = seconds / max(1, n_tokens)
        for i in range(self.n_blocks):
            start, end = self.block_span(i)
            if end <= n_tokens:
                self._add_block(i, source, per_token * (end - start))
            elif start < n_tokens:  # a cut: the block is reported once its rest is computed
                self._partial[i] = n_tokens - start
                self._seconds[i] = per_token * (n_tokens - start)
        self.request._put(Progress("restore", n_tokens, len(self.prompt)))

    def report_nothing_restored(self) -> None:
        """The restore found nothing: say so (the stream's first event: the request left
        the queue and its prefill begins)."""
        self.request._put(Progress("restore", 0, len(self.prompt)))

    def report_computed(self, start: int, end: int, seconds: float) -> None:
        """Record that prompt tokens ``start:end`` were prefilled in `seconds`."""
        per_token = seconds / max(1, end - start)
        first, last = start // self.block_size, (end - 1) // self.block_size
        for i in range(first, last + 1):
            b0, b1 = self.block_span(i)
            share = per_token * (min(b1, end) - max(b0, start))
            self._seconds[i] = self._seconds.get(i, 0.0) + share
            if b1 <= end and i not in self.blocks:
                self._add_block(i, "computed", self._seconds.pop(i))
        self.request._put(Progress("prefill", end, len(self.prompt)))

    def _add_block(self, index: int, source: BlockSource, seconds: float) -> None:
        start, end = self.block_span(index)
        records: tuple[str, ...] = ()
        edit_at = None
        restored = end - start
        if source == "memory":
            reason = "hot"
        elif source == "disk":
            records = self.disk_records.get(index, ())
            reason = disk_reason(records)
        else:
            default = "tail" if index == self.n_blocks - 1 else "new"
            reason = self.reasons.get(index, default)
            edit_at = self.edits.get(index)
            restored = self._partial.get(index, 0)
        images = self.block_images(index)
        block = BlockReport(
            index, start, end, source, seconds, reason, records, edit_at, restored, images
        )
        self.blocks[index] = block
        self.request._put(block)

    def accept(self, token: int, *, context_length: int | None) -> str | None:
        """Take one sampled token; return the finish reason if the sequence is done
        (``"error"``: its grammar failed, `error` says how; the scheduler fails it)."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        constraint = self.constraint
        if constraint is not None:
            problem = constraint.consume(token)
            if problem is not None:
                self.error = GrammarError(f"the request's grammar failed: {problem}")
                return "error"
        if token in self.eos:
            self.stop_reason = "eos"
            return "stop"
        self.generated.append(token)
        delta = self.text.add(token)
        if delta:
            self.request._put(TextDelta(delta))
        if self.text.stopped:
            self.stop_reason = self.text.stop_matched
            return "stop"
        if constraint is not None and constraint.complete:
            self.stop_reason = "grammar"
            return "stop"
        if len(self.generated) >= self.max_tokens:
            return "length"
        if context_length is not None and len(self.prompt) + len(self.generated) >= context_length:
            return "length"
        return None

    def finish(self, reason: str) -> None:
        """Flush the text and hand the request its completion."""
        self.phase = Phase.DONE
        delta = self.text.finish()
        if delta:
            self.request._put(TextDelta(delta))
        report = Report(
            blocks=[self.blocks[i] for i in sorted(self.blocks)],
            restored_tokens=self.restored,
            computed_tokens=max(0, min(len(self.cache_tokens), len(self.prompt)) - self.restored),
            ttft_s=(
                None if self.first_token_at is None else self.first_token_at - self.submitted_at
            ),
            restore_source=self.restore_source,
            restored_bytes=self.restored_bytes,
            edit_at=min(self.edits.values(), default=None),
            kept_boundary=self.kept_boundary,
            images=list(self.images),
        )
        n = len(self.generated)
        if n > 1 and self.last_token_at > self.first_token_at:
            report.tokens_per_s = (n - 1) / (self.last_token_at - self.first_token_at)
        if self.ledger is not None:  # before the caller can see the result
            self.ledger.request_finished(report)
        self.request._finish(
            Completion(
                text=self.text.text,
                tokens=list(self.generated),
                prompt_tokens=self.prompt,
                finish_reason=reason,
                report=report,
                stop_reason=self.stop_reason if reason == "stop" else None,
            )
        )
        self.cache = None
        self.embedded = None

    def fail(self, error: BaseException) -> None:
        self.phase = Phase.DONE
        self.cache = None
        self.embedded = None
        self.request._fail(error)
