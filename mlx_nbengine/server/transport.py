"""How an engine call's events reach an HTTP response, for every API the server speaks.

- `Pump`: moves one `Request`'s events from its blocking stream to the event loop (a
  daemon thread per call).
- `EventStream`: a streaming response that runs a cleanup once it ends, however it ends.
- `sse`: one server-sent event (``data: ...``, with an ``event:`` line where the API names
  its events, as Anthropic's and the Responses API do).
- `keepalive`: while a long prompt is read no token comes; an iterator of events that
  yields a keep-alive payload every `every` seconds of silence, so that clients and
  proxies with read time-outs do not drop the stream.
- `disconnected`: returns when the client has gone (the body was read already).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from mlx_nbengine.engine import Finished

__all__ = [
    "IDLE",
    "KEEPALIVE_S",
    "STREAM_HEADERS",
    "EventStream",
    "Pump",
    "disconnected",
    "keepalive",
    "sse",
]

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE_S = 5.0  # a stream with no event for this long gets a keep-alive


class Idle:
    """What `keepalive` yields after `every` seconds without an event."""


IDLE = Idle()


class Pump:
    """Moves one `Request`'s events from its stream (a blocking queue) to the event loop."""

    def __init__(self, handle: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = handle
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=self._run, daemon=True, name=f"mnb-api-{handle.id}").start()

    def _run(self) -> None:
        try:
            for event in self.handle.stream():
                self._put(event)
        except BaseException as exc:  # the request's error: raised again on the loop
            self._put(exc)

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped
            pass

    async def events(self, idle_every: float | None = None) -> AsyncIterator[Any]:
        """The call's events up to its `Finished`; with `idle_every`, `IDLE` after each
        `idle_every` seconds without one (see `keepalive`)."""
        while True:
            if idle_every is None:
                item = await self._queue.get()
            else:
                try:
                    item = await asyncio.wait_for(self._queue.get(), idle_every)
                except TimeoutError:
                    yield IDLE
                    continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finished):
                return


def keepalive(pump: Pump, every: float = KEEPALIVE_S) -> AsyncIterator[Any]:
    """`pump`'s events, with `IDLE` after each `every` seconds of silence."""
    return pump.events(idle_every=every)


class EventStream(StreamingResponse):
    """A streaming response that runs `cleanup()` once it ends, however it ends (sent
    whole, the client gone mid-stream, or cancelled before the first byte)."""

    def __init__(self, content: Any, cleanup: Callable[[], None], **kwargs: Any) -> None:
        kwargs.setdefault("media_type", "text/event-stream")
        kwargs.setdefault("headers", STREAM_HEADERS)
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


def sse(payload: dict, event: str | None = None) -> bytes:
    """One server-sent event carrying `payload` as compact JSON."""
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


async def disconnected(request: HTTPRequest) -> None:
    """Return when the client disconnects (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
