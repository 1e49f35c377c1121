"""The ASGI app (Starlette): OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` on one `Engine`, through its public `submit` API only.

Chat answers are split with `agentio.OutputSplitter` (`EngineCalls.splitter`, which every API that
answers with the model uses): the model's reasoning (``reasoning_content``), its text
(``content``) and its tool calls (``tool_calls``, ``finish_reason: "tool_calls"``). Tools
reach a chat template that reads them; a forced call (``tool_choice`` "required" or a named
function) is decoded under `toolgrammar`'s grammar, so even a small model makes a call its
parser reads.

Terms:

- *call*: one API request that reached the engine (a `Request` handle). Its events come to
  the server's event loop through a *pump*: a daemon thread that iterates
  `Request.stream()` and hands each event to the loop (`transport.Pump`).
- *in flight*: calls submitted and not yet answered; past `max_pending` a request gets 429.

Rules the app keeps:

- Every refusal is OpenAI's error shape with its status (400 a bad field, 401 a wrong or
  missing key, 403 a Host header that is not this machine on a loopback server, 404 an
  unknown model or path, 405, 413 a body over the limit, 415 a body not sent as JSON, 429,
  503 a closed engine, 500 anything unforeseen); the server keeps serving.
- A client that goes away cancels its call (the engine frees the slot): a stream's body
  iterator is cancelled by Starlette when the client disconnects; a plain request watches
  for ``http.disconnect`` while it waits.
- Nothing that holds a prompt or an answer is logged unless `log_prompts` is set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from mlx_nbengine.engine import (
    BlockReport,
    Finished,
    TextDelta,
)
from mlx_nbengine.server import messages, responses, transport
from mlx_nbengine.server.agentio import Reasoning, Text, ToolCall
from mlx_nbengine.server.anthropic_shapes import error_body as anthropic_error_body
from mlx_nbengine.server.calls import EngineCalls
from mlx_nbengine.server.conversations import client_name, reader_of, request_facts
from mlx_nbengine.server.gate import Gate
from mlx_nbengine.server.journal import Entry, Journal
from mlx_nbengine.server.openai_shapes import (
    APIError,
    Call,
    Limits,
    chat_chunk,
    chat_response,
    check_chat,
    check_completion,
    check_model,
    completion_chunk,
    completion_response,
    error_body,
    models_response,
    new_id,
    tool_call_delta,
    usage,
)
from mlx_nbengine.server.transport import IDLE, EventStream, Pump, disconnected, keepalive, sse

__all__ = ["build_app"]

log = logging.getLogger("mlx_nbengine.server")


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


@dataclass
class Admitted:
    """A call the engine took (`_App.admit`): its journal entry, the checked `Call`, the
    request's body, and the pump of its events. `release()` (once, however the answer
    ends) cancels the call if it still runs and frees its place among those in flight."""

    app: _App
    entry: Entry
    call: Call
    body: dict
    pump: Pump
    released: bool = False

    @property
    def handle(self) -> Any:
        return self.pump.handle

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.handle.cancel()  # a no-op once done; frees the slot of a client gone
        if self.entry.finish is None:
            self.app.journal.cancel(self.entry)
        self.app.in_flight -= 1


class _App:
    """The handlers, holding the engine and the server's settings."""

    def __init__(
        self,
        engine: Any,
        *,
        api_key: str | None,
        limits: Limits,
        journal: Journal,
        log_prompts: bool,
        max_pending: int,
        model_name: str,
        loopback_only: bool,
    ) -> None:
        self.engine = engine
        self.gate = Gate(api_key=api_key, limits=limits, loopback_only=loopback_only)
        self.calls = EngineCalls(engine)
        self.limits = limits
        self.journal = journal
        self.log_prompts = log_prompts
        self.max_pending = max_pending
        self.model_name = model_name
        self.created = int(time.time())
        self.in_flight = 0

    # -- endpoints ---------------------------------------------------------------------------

    async def models(self, request: HTTPRequest) -> JSONResponse:
        try:
            self.gate.check_host(request)
            self.gate.check_key(request)
        except APIError as err:
            return _error(err)
        return JSONResponse(models_response([self.model_name], self.created))

    async def chat(self, request: HTTPRequest) -> Any:
        return await self.answer(request, "chat")

    async def completions(self, request: HTTPRequest) -> Any:
        return await self.answer(request, "completions")

    async def admit(
        self, request: HTTPRequest, entry: Entry, check: Callable[[dict], Call]
    ) -> Admitted:
        """Check a POST's headers and body, turn the body into a `Call` with `check`,
        and submit it: what every endpoint that answers with the model does first.
        Raises `APIError` (the caller writes it in its API's shape, and the journal has it
        already); on success the call counts as in flight until `Admitted.release`."""
        entry.client = client_name(request.headers.get("user-agent"))
        try:
            body = await self.gate.body(request)
            check_model(body)
            call = check(body)
            if self.in_flight >= self.max_pending:
                raise APIError(
                    f"{self.in_flight} requests are in flight, this server's limit; retry later",
                    status=429,
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            if self.log_prompts:
                log.info("request %d %s prompt: %r", entry.number, entry.endpoint, call.prompt)
            self.in_flight += 1
            try:
                handle = await run_in_threadpool(self.calls.submit, call)
            except BaseException:
                self.in_flight -= 1
                raise
        except APIError as err:
            self.journal.fail(entry, err.status, err.message)
            raise
        entry.prompt_tokens = len(handle.prompt_tokens)
        entry.tokens = list(handle.prompt_tokens)
        facts = request_facts(request.headers, body, call, endpoint=entry.endpoint)
        self.journal.admitted(entry, facts, reader_of(self.engine))
        pump = Pump(handle, asyncio.get_running_loop())
        return Admitted(self, entry, call, body, pump)

    async def answer(self, request: HTTPRequest, endpoint: str) -> Any:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        entry = self.journal.open(path)
        if endpoint == "chat":
            vision = getattr(self.engine.model, "modality", "text") == "vision"

            def check(body: dict) -> Call:
                return check_chat(body, self.limits, vision=vision)

        else:

            def check(body: dict) -> Call:
                return check_completion(body, self.limits)

        try:
            admitted = await self.admit(request, entry, check)
        except APIError as err:
            return _error(err)
        if admitted.call.stream:
            if endpoint == "chat":
                body = self.chat_stream(admitted)
            else:
                body = self.completion_stream(admitted)
            return EventStream(body, admitted.release)
        try:
            return await self.whole(request, admitted, endpoint)
        finally:
            admitted.release()

    async def _collect(self, pump: Pump, entry: Entry) -> Any:
        async for event in pump.events():
            if isinstance(event, BlockReport):
                entry.blocks.append(event)
                self.journal.changed(entry)
            elif isinstance(event, Finished):
                return event.completion
        raise RuntimeError("the request's stream ended without its completion")

    async def completion(self, request: HTTPRequest, admitted: Admitted) -> Any:
        """Wait for the call's `Completion` (its journal entry filled in); None when the
        client went away first (the call is cancelled). The request's error, if it failed,
        is raised."""
        pump, entry = admitted.pump, admitted.entry
        collect = asyncio.ensure_future(self._collect(pump, entry))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not collect.done():
            pump.handle.cancel()
            collect.cancel()
            self.journal.cancel(entry)
            return None
        completion = collect.result()
        self.journal.finish(entry, completion)
        self._log_answer(entry, completion.text)
        return completion

    async def whole(self, request: HTTPRequest, admitted: Admitted, endpoint: str) -> Any:
        """The answer as one JSON response; a client that leaves cancels the call."""
        entry = admitted.entry
        try:
            completion = await self.completion(request, admitted)
        except Exception as exc:
            return self._failed(entry, exc)
        if completion is None:
            return JSONResponse(error_body("the client disconnected"), status_code=499)
        use = usage(entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens)
        finish = _finish_reason(completion.finish_reason)
        created, text = int(entry.started), completion.text
        if endpoint == "chat":
            splitter = self.calls.splitter(admitted.call, admitted.handle)
            pieces = [*splitter.feed(text), *splitter.close()]
            calls = [p for p in pieces if isinstance(p, ToolCall)]
            answer = "".join(p.text for p in pieces if isinstance(p, Text))
            reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
            body = chat_response(
                new_id("chatcmpl"),
                created,
                self.model_name,
                None if calls and not answer.strip() else answer,
                _finish_reason(completion.finish_reason, called=bool(calls)),
                use,
                reasoning=reasoning or None,
                tool_calls=calls,
            )
        else:
            body = completion_response(new_id("cmpl"), created, self.model_name, text, finish, use)
        return JSONResponse(body)

    def _failed(self, entry: Entry, exc: BaseException) -> JSONResponse:
        message = self.failed(entry, exc)
        return JSONResponse(error_body(message, type="server_error"), status_code=500)

    def failed(self, entry: Entry, exc: BaseException) -> str:
        """Journal a call that failed in the engine; its one-line message."""
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.journal.fail(entry, 500, message)
        return message

    def _log_answer(self, entry: Entry, text: str) -> None:
        if self.log_prompts:
            log.info("request %d answer: %r", entry.number, text)

    async def answer_events(
        self, admitted: Admitted, every: float | None = None
    ) -> AsyncIterator[Any]:
        """A streamed answer as every API's stream reads it: `IDLE` after each `every`
        seconds without an event (default `transport.KEEPALIVE_S`, read now: a keep-alive is
        due), each piece of text (a str), and last the `Completion`, with the journal
        filled in. Block reports go to the journal as they come."""
        entry = admitted.entry
        every = transport.KEEPALIVE_S if every is None else every
        async for event in keepalive(admitted.pump, every):
            if event is IDLE:
                yield IDLE
            elif isinstance(event, TextDelta):
                if event.text:
                    yield event.text
            elif isinstance(event, BlockReport):
                entry.blocks.append(event)
                self.journal.changed(entry)
            elif isinstance(event, Finished):
                completion = event.completion
                self.journal.finish(entry, completion)
                self._log_answer(entry, completion.text)
                yield completion

    async def chat_stream(self, admitted: Admitted) -> AsyncIterator[bytes]:
        """A chat answer as server-sent events in OpenAI's chunk format, ``data: [DONE]``
        last: ``delta.reasoning_content``, ``delta.content`` and each tool call whole as
        ``delta.tool_calls`` (with its ``index``), in the order the model wrote them. A
        client that goes away cancels this iterator; `EventStream`'s cleanup then cancels
        the call."""
        call, entry = admitted.call, admitted.entry
        id_, created, model = new_id("chatcmpl"), int(entry.started), self.model_name
        splitter = self.calls.splitter(call, admitted.handle)
        calls = 0

        def chunks(pieces: list) -> list[bytes]:
            nonlocal calls
            out = []
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    delta = tool_call_delta(piece, calls)
                    calls += 1
                elif isinstance(piece, Reasoning):
                    delta = {"reasoning_content": piece.text}
                else:
                    delta = {"content": piece.text}
                out.append(sse(chat_chunk(id_, created, model, delta)))
            return out

        yield sse(chat_chunk(id_, created, model, {"role": "assistant", "content": ""}))
        try:
            async for item in self.answer_events(admitted):
                if item is IDLE:  # a long prompt is read: an SSE comment keeps it alive
                    yield b": keep-alive\n\n"
                elif isinstance(item, str):
                    for chunk in chunks(splitter.feed(item)):
                        yield chunk
                else:
                    completion = item
                    for chunk in chunks(splitter.close()):
                        yield chunk
                    finish = _finish_reason(completion.finish_reason, called=calls > 0)
                    yield sse(chat_chunk(id_, created, model, {}, finish))
                    if call.include_usage:
                        use = usage(
                            entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens
                        )
                        yield sse(chat_chunk(id_, created, model, None, None, use))
        except Exception as exc:
            yield sse(error_body(self.failed(entry, exc), type="server_error"))
        yield b"data: [DONE]\n\n"

    async def completion_stream(self, admitted: Admitted) -> AsyncIterator[bytes]:
        """A text completion as server-sent events in OpenAI's chunk format, ``data:
        [DONE]`` last. A client that goes away cancels this iterator; `EventStream`'s
        cleanup then cancels the call."""
        call, entry = admitted.call, admitted.entry
        id_, created, model = new_id("cmpl"), int(entry.started), self.model_name
        try:
            async for item in self.answer_events(admitted):
                if item is IDLE:  # a long prompt is read: an SSE comment keeps it alive
                    yield b": keep-alive\n\n"
                elif isinstance(item, str):
                    yield sse(completion_chunk(id_, created, model, item))
                else:
                    finish = _finish_reason(item.finish_reason)
                    yield sse(completion_chunk(id_, created, model, "", finish))
                    if call.include_usage:
                        use = usage(
                            entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens
                        )
                        yield sse(completion_chunk(id_, created, model, None, None, use))
        except Exception as exc:
            yield sse(error_body(self.failed(entry, exc), type="server_error"))
        yield b"data: [DONE]\n\n"


def _finish_reason(reason: str, *, called: bool = False) -> str:
    """OpenAI's finish_reason: "length", "tool_calls" (the answer made calls) or "stop"
    (a cancelled call too)."""
    if reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def _error_body(path: str, message: str, status: int, type: str) -> dict:  # noqa: A002
    """An error in the shape of the API `path` belongs to (Anthropic's for /v1/messages)."""
    if path.startswith("/v1/messages"):
        return anthropic_error_body(message, status)
    return error_body(message, type=type)


class _Unforeseen:
    """ASGI middleware: an exception no handler caught is a 500 in the API's error shape
    (logged by its type only), and the connection stays open for the client's next request
    (Starlette's own 500 handler raises it again, and uvicorn then drops the connection
    under a client that keeps it alive). Mid-response, the connection is cut."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            path = scope.get("path", "")
            log.error("internal error on %s: %s", path, type(exc).__name__)
            message = f"internal error: {type(exc).__name__}"
            body = _error_body(path, message, 500, "server_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)


def build_app(
    engine: Any,
    *,
    api_key: str | None = None,
    limits: Limits | None = None,
    journal: Journal | None = None,
    log_prompts: bool = False,
    max_pending: int = 64,
    model_name: str | None = None,
    loopback_only: bool = True,
) -> Starlette:
    """The ASGI app serving `engine`; `model_name` (default: the engine's) is the id
    clients send as ``model``; `loopback_only` (a server on loopback) checks that the Host
    header names this machine."""
    if limits is None:
        lm = getattr(engine, "model", None)
        limits = Limits(context=getattr(lm, "context_length", None))
    if journal is None:
        journal = Journal()
    journal.log_prompts = log_prompts  # the misses' text in its entries' as_dict
    handlers = _App(
        engine,
        api_key=api_key,
        limits=limits,
        journal=journal,
        log_prompts=log_prompts,
        max_pending=max_pending,
        model_name=model_name or engine.model_name,
        loopback_only=loopback_only,
    )

    async def http_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        message = {404: f"no such path: {request.url.path}", 405: "method not allowed"}.get(
            status, getattr(exc, "detail", "error")
        )
        body = _error_body(request.url.path, message, status, "invalid_request_error")
        return JSONResponse(body, status_code=status)

    app = Starlette(
        routes=[
            Route("/v1/models", handlers.models, methods=["GET"]),
            Route("/v1/chat/completions", handlers.chat, methods=["POST"]),
            Route("/v1/completions", handlers.completions, methods=["POST"]),
            *responses.routes(handlers),
            *messages.routes(handlers),
        ],
        exception_handlers={HTTPException: http_error},
        middleware=[Middleware(_Unforeseen)],
    )
    app.state.handlers = handlers
    return app
