"""The caller's side of a request: the handle, its result and its report.

A *request* is one prompt submitted to the engine. `Engine.submit` returns its
`Request` handle at once; the generation thread fills it in. The handle is shared by
two threads and keeps one rule: the generation thread only *puts* (events, the final
outcome); the caller only *reads* (stream, result) and asks to cancel.

- `Completion`: the outcome of a request that ended normally or was cancelled.
- `Report`: where every prompt block came from, why, and what it cost (`BlockReport`
  each; the reasons are named in `events`), where the prompt first leaves a stored
  continuation (`edit_at`), plus time to first token and decode speed.
- `InvalidRequestError`, `PromptTooLongError`, `EngineClosedError` (defined in
  `mlx_nbengine.errors`, re-exported here): raised in the caller by `submit` for
  problems the caller can fix.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from mlx_nbengine.engine.events import BlockSource, Event, Finished
from mlx_nbengine.errors import EngineClosedError, InvalidRequestError, PromptTooLongError

__all__ = [
    "BlockReport",
    "Completion",
    "EngineClosedError",
    "InvalidRequestError",
    "PromptTooLongError",
    "Report",
    "Request",
]

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class BlockReport:
    """Prompt block `index` covers tokens ``start:end`` and came from `source` in `seconds`.

    Blocks are `block_size` tokens; the last one may be shorter (the prompt's tail).
    A block only partly restored (the restore ended inside it, a cut) counts as computed
    and its `restored` says how many of its tokens were restored. `reason`, `records`,
    `edit_at`, `restored` and `images` are those of its `BlockEvent`.
    """

    index: int
    start: int
    end: int
    source: BlockSource
    seconds: float
    reason: str
    records: tuple[str, ...] = ()
    edit_at: int | None = None
    restored: int = 0
    images: tuple[int, ...] = ()


@dataclass
class Report:
    """How the prompt reached the cache and how fast the answer came.

    `restored_tokens` came from memory or disk, `computed_tokens` were prefilled
    (their sum is the prompt length); `ttft_s` runs from submit to the first token;
    `tokens_per_s` is the decode speed after the first token (0.0 for one token).
    `restored_bytes` is the size of the records read from disk (or of the hot cache
    reused from memory); `restore_source` names where the restored prefix came from.
    `edit_at` is the absolute position of the first prompt token that differs from a
    stored continuation of its prefix (also when it falls in the tail), else None.
    `kept_boundary` says why the restore stopped at a block boundary although a stored
    continuation shared more tokens (one of `events.KEPT_BOUNDARY`: ``"state"``,
    ``"window"``, ``"block"``, ``"evicted"``), else None. `images` are the request's
    image spans (token range and content digest), in order.
    """

    blocks: list[BlockReport] = field(default_factory=list)
    restored_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float = 0.0
    restore_source: BlockSource | None = None
    restored_bytes: int = 0
    edit_at: int | None = None
    kept_boundary: str | None = None
    images: list[Any] = field(default_factory=list)


@dataclass
class Completion:
    """A finished request: generated `text` and `tokens`, the `prompt_tokens` ids.

    `stop_reason` says what stopped a ``finish_reason == "stop"`` request: ``"eos"``
    (an end-of-text token) or the stop string that matched; None for other endings.
    """

    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    finish_reason: FinishReason
    report: Report
    stop_reason: str | None = None


class Request:
    """Handle of one submitted prompt; see the module docstring for who does what.

    `stream()` yields `events` in order and ends after `Finished` (or raises the
    request's error); it may be iterated once. `result()` waits for the end without
    consuming the stream. `cancel()` frees the request's slot at once; the tokens
    produced so far stay in the result with ``finish_reason == "cancelled"``.
    """

    def __init__(self, request_id: int, prompt_tokens: list[int], on_cancel: Callable) -> None:
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._on_cancel = on_cancel
        self.cancelled = False

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return f"<Request {self.id} {state}, {len(self.prompt_tokens)} prompt tokens>"

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def stream(self, *, timeout: float | None = None) -> Iterator[Event]:
        """Yield events until `Finished`; raise the request's error if it failed.

        `timeout` bounds the wait for each event (TimeoutError when it runs out).
        """
        while True:
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event from request {self.id} in {timeout} s") from None
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finished):
                return

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the request to end and return its `Completion` (or raise its error)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish in {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    def cancel(self) -> None:
        """Stop generating; the result keeps the tokens produced so far."""
        if self.done or self.cancelled:
            return
        self.cancelled = True
        self._on_cancel(self)

    # Called on the generation thread only.

    def _put(self, event: Event) -> None:
        self._events.put(event)

    def _finish(self, completion: Completion) -> None:
        if self.done:
            return
        self._completion = completion
        self._events.put(Finished(completion))
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        if self.done:
            return
        self._error = error
        self._events.put(error)
        self._done.set()
