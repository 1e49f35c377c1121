"""Following a running request from the kernel and rendering it into its cell.

A request (``Engine.submit``) yields events from ``request.stream()`` until its
``Finished`` event carries the `Completion`. This module reads those events and
feeds them to an `AnswerView` (`mlx_nbengine.notebook.render`), which redraws one display
handle about every 100 ms (its ``interval``).

Terms and threads:

- *pump*: a daemon thread (``mlx-nbengine-stream``) per request that only iterates
  ``request.stream()`` and puts each event, then an end marker, on a queue. The
  engine's stream may block for as long as it likes; the reader never does.
- *reader*: the thread that takes events off that queue, applies them to the view
  and refreshes it, waking at least every ``view.interval`` seconds (`drive`).
- *foreground answer* (`follow`): a plain `%%llm` cell. The reader is the kernel's
  main thread, so the cell stays busy, its output lands in that cell and nbclient
  records it, and the kernel's interrupt (a `KeyboardInterrupt` raised on the main
  thread) reaches the reader: it cancels the request, marks the view interrupted and
  drains the events still in flight for up to `CANCEL_GRACE_S` seconds, so the
  partial answer and its report still show. A second interrupt stops that wait.
- *background answer* (`BackgroundAnswer`, `%%llm --bg`): the cell returns at once
  with the handle; the reader is the handle's own daemon thread
  (``mlx-nbengine-<label>``), which sets ipykernel's thread parent to the header of
  the cell that started it, so every update it sends carries that cell's parent and
  lands there. The handle's thread owns the view; other threads only read it.
  The thread also runs in a copy of the cell's context, so the widget messages it sends
  (the block strip's updates) carry that cell's parent too.
- *chat turn*: with ``--chat``, the turn the answer is recorded into
  (`mlx_nbengine.notebook.prompting.ChatTurn`). The reader finishes it with the answer (the
  partial text when interrupted) or abandons it when the request fails.
- *interrupted cell*: a foreground cell whose request the user interrupted ends with
  `GenerationInterrupted`, a `KeyboardInterrupt` (so "Run all" stops there) that IPython
  shows as one line instead of a traceback: the partial answer above is what matters.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlx_nbengine.engine.results import Finished
from mlx_nbengine.errors import EngineError
from mlx_nbengine.notebook.answerview import AnswerView
from mlx_nbengine.notebook.summary import prefill_stop_phrase, stopped_in_prefill

if TYPE_CHECKING:
    from mlx_nbengine.notebook.prompting import ChatTurn

__all__ = [
    "CANCEL_GRACE_S",
    "BackgroundAnswer",
    "GenerationInterrupted",
    "drive",
    "follow",
    "short_error",
]

# How long a cancelled request may take to deliver its final event before we stop waiting.
CANCEL_GRACE_S = 10.0


def short_error(exc: BaseException) -> str:
    """The one-line message shown for `exc` (its text, else its class name)."""
    return str(exc) or type(exc).__name__


class GenerationInterrupted(KeyboardInterrupt):
    """The user interrupted a foreground `%%llm` cell; its partial answer stays shown.

    A `KeyboardInterrupt`, so the cell ends in error and "Run all" stops there; IPython
    shows exceptions that define `_render_traceback_` with the lines it returns, so the
    cell gets one line, not the internal traceback of wherever the interrupt landed.
    """

    def __init__(self, message: str = "generation cancelled; the partial answer is kept above"):
        super().__init__(message)

    @classmethod
    def of(cls, completion: Any) -> GenerationInterrupted:
        """The interrupt of the request that ended with `completion` (None: not heard)."""
        if completion is not None and stopped_in_prefill(completion):
            return cls(prefill_stop_phrase(completion))
        return cls()

    def _render_traceback_(self) -> list[str]:
        return [f"interrupted: {self}"]


_END = object()


@dataclass
class _Failure:
    error: BaseException


def _pump(request: Any, events: queue.Queue) -> None:
    # Runs on its own thread so the reader can wake every `interval` (and see Ctrl-C)
    # whatever the engine's stream does while it waits.
    try:
        for event in request.stream():
            events.put(event)
    except BaseException as exc:  # noqa: BLE001 - handed to the reader, which decides
        events.put(_Failure(exc))
    finally:
        events.put(_END)


def _consume(events: queue.Queue, view: AnswerView, *, deadline: float | None = None) -> Any:
    """Feed events to `view` until the stream ends; return the `Completion` if one came."""
    completion = None
    while True:
        timeout = view.interval
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        try:
            item = events.get(timeout=timeout)
        except queue.Empty:
            view.refresh()
            if deadline is not None and time.monotonic() >= deadline:
                return completion
            continue
        if item is _END:
            return completion
        if isinstance(item, _Failure):
            raise item.error
        if isinstance(item, Finished):
            completion = item.completion
        view.apply(item)
        view.refresh()


def drive(request: Any, view: AnswerView) -> tuple[Any, bool]:
    """Render `request` into `view` until it ends; return (completion, interrupted).

    On the main thread a `KeyboardInterrupt` (the kernel's interrupt) cancels the request;
    the events still in flight are drained so the partial answer and its report show.
    The request's own error (an `EngineError`...) propagates.
    """
    events: queue.Queue = queue.Queue()
    threading.Thread(
        target=_pump, args=(request, events), name="mlx-nbengine-stream", daemon=True
    ).start()
    interrupted = False
    try:
        completion = _consume(events, view)
    except KeyboardInterrupt:
        interrupted = True
        request.cancel()
        view.mark_interrupted()
        view.refresh(force=True)
        try:
            completion = _consume(events, view, deadline=time.monotonic() + CANCEL_GRACE_S)
        except KeyboardInterrupt:
            completion = None  # a second interrupt: stop waiting for the engine
    if completion is None and not interrupted:
        completion = request.result()
    if completion is not None:
        view.finish(completion, interrupted=interrupted)
    elif interrupted:
        view.mark_interrupted()
    view.close()
    return completion, interrupted


def follow(request: Any, view: AnswerView, *, turn: ChatTurn | None = None) -> tuple[Any, bool]:
    """Render `request` on the calling (main) thread; return (completion, interrupted).

    The chat `turn`, if any, is finished with the answer (the partial text when
    interrupted). An `EngineError` is shown in the view, abandons the turn, and is
    re-raised for the caller to report.
    """
    try:
        completion, interrupted = drive(request, view)
    except EngineError as exc:
        view.fail(short_error(exc))
        view.close()
        if turn is not None:
            turn.abandon()
        raise
    if turn is not None:
        turn.finish(completion.text if completion is not None else view.text)
    return completion, interrupted


class BackgroundAnswer:
    """Handle of a `%%llm --bg` request, returned at once (and stored by ``-o VAR``).

    `result()` waits for the `Completion`; `cancel()` stops the request (the partial text
    stays); `text` is what has streamed so far; `done()` says whether it has finished.
    `start(shell)` runs the reader thread, which owns `view`; the handle only reads it.
    """

    def __init__(
        self,
        request: Any,
        view: AnswerView,
        *,
        label: str = "",
        turn: ChatTurn | None = None,
        after: Callable[[Any], None] | None = None,
    ) -> None:
        self.request = request
        self.view = view
        self.label = label
        self.turn = turn
        # Run on the handle's thread with the finished `Completion` (e.g. the block map).
        self.after = after
        self.completion: Any = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def text(self) -> str:
        return self.completion.text if self.completion is not None else self.view.text

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def cancel(self) -> None:
        self.request.cancel()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the reader thread (if started) to end."""
        if self._thread is not None:
            self._thread.join(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the answer and return its `Completion` (re-raises the request's error)."""
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background answer {self.label!r} is still running")
        if self.error is not None:
            raise self.error
        return self.completion

    def start(self, shell: Any) -> None:
        """Start following the request; call on the main thread, in the cell that asked."""
        # The parent header of the executing cell, so the thread's output goes there.
        parent = shell.get_parent() if hasattr(shell, "get_parent") else None
        # The kernel keeps the cell's parent for comm messages in a context variable.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run,
            args=(self._run, shell, parent),
            name=f"mlx-nbengine-{self.label}",
            daemon=True,
        )
        self._thread.start()

    def _run(self, shell: Any, parent: Any) -> None:
        tokens = None
        if parent is not None and hasattr(shell, "set_thread_parent"):
            tokens = shell.set_thread_parent(parent)
        try:
            self.completion, _ = drive(self.request, self.view)
            if self.turn is not None:
                self.turn.finish(self.text)
            if self.after is not None and self.completion is not None:
                self.after(self.completion)
        except BaseException as exc:  # noqa: BLE001 - kept for result()
            self.error = exc
            self.view.fail(short_error(exc))
            self.view.close()
            if self.turn is not None:
                self.turn.abandon()
        finally:
            if tokens is not None:
                shell.reset_thread_parent(tokens)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<BackgroundAnswer {self.label!r} {state}, {len(self.text):,} chars>"

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        # Showing the handle (e.g. after `handle.result()`) shows the answer as it stands,
        # with its block strip's picture: what a headless run records, since it misses
        # updates sent after the --bg cell.
        bundle = self.view.bundle()
        if self.view.strip is not None and "text/html" in bundle:
            bundle["text/html"] += self.view.strip.html()
        return bundle
