"""Anthropic's Messages API, what Claude Code speaks: ``POST /v1/messages`` (streamed or
whole) and ``POST /v1/messages/count_tokens``, on the app's one admission path.

A request (``?beta=true`` and any ``anthropic-beta`` / ``anthropic-version`` headers taken;
the key as ``x-api-key`` or ``Authorization: Bearer``) is checked into a `Call` over the
chat-format conversation (`anthropic_shapes.check_messages`) and submitted like every other
API's (`_App.admit`). The answer's text goes through `agentio.OutputSplitter` (the model's
own tool-call and thinking markup) into content blocks (`anthropic_shapes.Blocks`):

- whole: ``{"id": "msg_...", "type": "message", "role": "assistant", "model", "content",
  "stop_reason", "stop_sequence", "usage"}``;
- streamed: ``event: <type>`` server-sent events: ``message_start`` at once, ``ping`` while
  the prompt is read (and every few seconds of silence), then per block
  ``content_block_start``, ``content_block_delta`` (``text_delta``, ``thinking_delta`` and
  a ``signature_delta`` before a thinking block closes, one ``input_json_delta`` per tool
  call), ``content_block_stop``; last ``message_delta`` (``stop_reason``, ``stop_sequence``,
  the whole ``usage``) and ``message_stop``. A failure mid-stream is an ``error`` event.

``usage``: ``input_tokens`` the prompt tokens computed now, ``cache_read_input_tokens``
those restored from the cache, ``cache_creation_input_tokens`` 0, ``output_tokens``.
``stop_reason``: ``tool_use`` where the answer made a call, ``max_tokens``,
``stop_sequence`` (with the sequence), else ``end_turn``.

Errors are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the
status the app gives (400 invalid_request_error, 401 authentication_error, 403, 413, 415,
429 rate_limit_error, 500 / 503 api_error); a prompt over the context is a 400 saying
"prompt is too long: N tokens > M maximum".
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from mlx_nbengine.engine import (
    InvalidRequestError,
    PromptTooLongError,
)
from mlx_nbengine.engine.prompts import prompt_tokens
from mlx_nbengine.errors import EngineError
from mlx_nbengine.server.anthropic_shapes import (
    Blocks,
    check_messages,
    error_body,
    message_response,
    new_message_id,
    stop_reason,
    too_long,
    usage,
)
from mlx_nbengine.server.openai_shapes import APIError, Call, check_model
from mlx_nbengine.server.transport import IDLE, EventStream, sse

__all__ = ["routes"]


PING = sse({"type": "ping"}, event="ping")


def routes(app: Any) -> list[Route]:
    """The routes of this API over the server's handlers `app` (`app._App`)."""
    api = MessagesAPI(app)
    return [
        Route("/v1/messages", api.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
    ]


def _error(err: APIError) -> JSONResponse:
    """`err` in Anthropic's shape; the engine's prompt-too-long line as Anthropic words it."""
    message = err.message
    if err.code == "context_length_exceeded" and (sizes := too_long(message)):
        message = "prompt is too long: {} tokens > {} maximum".format(*sizes)
    return JSONResponse(error_body(message, err.status), status_code=err.status)


class MessagesAPI:
    """The Messages API's handlers over the app's (`_App`)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @property
    def vision(self) -> bool:
        return getattr(self.app.engine.model, "modality", "text") == "vision"

    def check(self, body: dict) -> Call:
        return check_messages(body, self.app.limits, vision=self.vision)

    # -- POST /v1/messages ---------------------------------------------------------------------

    async def create(self, request: HTTPRequest) -> Any:
        app = self.app
        entry = app.journal.open("/v1/messages")
        try:
            admitted = await app.admit(request, entry, self.check)
        except APIError as err:
            return _error(err)
        if admitted.call.stream:
            return EventStream(self.stream(admitted), admitted.release)
        try:
            return await self.whole(request, admitted)
        finally:
            admitted.release()

    async def whole(self, request: HTTPRequest, admitted: Any) -> JSONResponse:
        """The answer as one message; a client that leaves cancels the call."""
        app, entry, call = self.app, admitted.entry, admitted.call
        try:
            completion = await app.completion(request, admitted)
            if completion is None:
                return JSONResponse(error_body("the client disconnected", 499), status_code=499)
            splitter = app.calls.splitter(call, admitted.handle)
            blocks = Blocks()
            blocks.feed(splitter.feed(completion.text))
            blocks.feed(splitter.close())
            blocks.close()
        except Exception as exc:
            message = app.failed(entry, exc)
            return JSONResponse(error_body(message, 500), status_code=500)
        reason, sequence = stop_reason(completion, blocks.tool_calls, call.stop)
        use = usage(entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens)
        body = message_response(
            new_message_id(), app.model_name, blocks.content, reason, sequence, use
        )
        return JSONResponse(body)

    async def stream(self, admitted: Any) -> Any:
        """The answer as Anthropic's stream events. A client that goes away cancels this
        iterator; `EventStream`'s cleanup then cancels the call."""
        app, entry, call = self.app, admitted.entry, admitted.call
        start = message_response(
            new_message_id(), app.model_name, [], None, None, usage(entry.prompt_tokens, 0, 0)
        )
        yield sse({"type": "message_start", "message": start}, event="message_start")
        yield PING
        try:
            splitter = app.calls.splitter(call, admitted.handle)
            blocks = Blocks()
            async for item in app.answer_events(admitted):
                if item is IDLE:  # a long prompt is read
                    yield PING
                elif isinstance(item, str):
                    for name, payload in blocks.feed(splitter.feed(item)):
                        yield sse(payload, event=name)
                else:
                    completion = item
                    for name, payload in [*blocks.feed(splitter.close()), *blocks.close()]:
                        yield sse(payload, event=name)
                    reason, sequence = stop_reason(completion, blocks.tool_calls, call.stop)
                    use = usage(entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens)
                    delta = {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": use,
                    }
                    yield sse(delta, event="message_delta")
                    yield sse({"type": "message_stop"}, event="message_stop")
        except Exception as exc:
            yield sse(error_body(app.failed(entry, exc), 500), event="error")

    # -- POST /v1/messages/count_tokens -----------------------------------------------------

    async def count_tokens(self, request: HTTPRequest) -> JSONResponse:
        """The prompt's token count as the request would render it; nothing is generated."""
        app = self.app
        try:
            body = await app.gate.body(request)
            check_model(body)
            call = self.check(body)
            count = await run_in_threadpool(self.count, call)
        except APIError as err:
            return _error(err)
        return JSONResponse({"input_tokens": count})

    def count(self, call: Call) -> int:
        """`call`'s prompt tokens, rendered as `_App.submit` renders it (on a worker thread:
        it tokenizes)."""
        app = self.app
        if app.engine.closed:
            raise APIError(
                "the model was unloaded; load it again and restart the server",
                status=503,
                type="server_error",
            )
        try:
            tokens, _ = prompt_tokens(
                app.engine.model,
                app.calls.prompt_of(call),
                images=call.images or None,
                template_kwargs=app.calls.template_kwargs(call),
                model_name=app.model_name,
            )
        except PromptTooLongError as exc:
            sizes = too_long(str(exc))
            if sizes is None:
                raise APIError(str(exc)) from None
            return sizes[0]  # counted all the same: the count says how much to cut
        except (InvalidRequestError, EngineError) as exc:
            raise APIError(str(exc)) from None
        return len(tokens)
