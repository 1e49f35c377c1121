"""The caller's side of a request: the handle.

A *request* is one prompt submitted to the engine. `Engine.submit` returns its
`Request` handle at once; the generation thread fills it in. The handle is shared by
two threads and keeps one rule: the generation thread only *puts* (events, the final
outcome); the caller only *reads* (stream, result) and asks to cancel.

What it ends with (`Completion`, its `Report`) is in `results`.

- `InvalidRequestError`, `PromptTooLongError`, `EngineClosedError` (defined in
  `mlx_nbengine.errors`, re-exported here): raised in the caller by `submit` for
  problems the caller can fix.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from mlx_nbengine.engine.events import Event
from mlx_nbengine.engine.results import Completion, Finished
from mlx_nbengine.errors import EngineClosedError, InvalidRequestError, PromptTooLongError

__all__ = ["EngineClosedError", "InvalidRequestError", "PromptTooLongError", "Request"]


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
