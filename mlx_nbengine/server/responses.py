"""OpenAI's Responses API (``POST /v1/responses``), what Codex speaks.

A request is checked into the shared chat form (`responses_shapes.check_responses`),
admitted like every other call (`_App.admit`), and the model's output, split by
`agentio.OutputSplitter` into text, reasoning and tool calls, comes back as output items:
a ``message``, a ``reasoning`` item, a ``function_call`` (or a ``custom_tool_call`` for a
freeform tool such as Codex's ``apply_patch``).

- Stateless: the client sends the whole conversation each turn. The last `KEEP_RESPONSES`
  responses' items (their input and output) are also kept in memory, so that a request
  may name one as ``previous_response_id`` instead; an id not held is a 400.
- Streamed (``stream: true``): ``response.created`` and ``response.in_progress`` go out as
  soon as the call is admitted, SSE comments keep the stream alive while a long prompt is
  read, then each output item's events in the order the SDK parses them, and last
  ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` ended it,
  ``response.failed`` when the engine failed). Every event has ``event: <type>`` and a
  ``sequence_number``.
- A prompt over the context: streamed, ``response.failed`` with ``error.code``
  ``context_length_exceeded`` (what Codex recovers from); otherwise a 400 with that code.
- Fields this server does not use (``store``, ``include``, ``service_tier``...) are taken
  and ignored; ``prompt_cache_key`` is kept on the journal entry (``conversation_key``).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from mlx_nbengine.server import agentio
from mlx_nbengine.server.openai_shapes import APIError, Call, error_body
from mlx_nbengine.server.responses_shapes import (
    CONTEXT_EXCEEDED,
    ResponsesRequest,
    check_responses,
    new_item_id,
    response_object,
    response_usage,
)
from mlx_nbengine.server.transport import IDLE, KEEPALIVE_S, EventStream, sse

__all__ = ["KEEP_RESPONSES", "ResponseStore", "routes"]

KEEP_RESPONSES = 64
"""How many recent responses ``previous_response_id`` can name."""

KEEPALIVE = b": keep-alive\n\n"


class ResponseStore:
    """The items (input and output) of the last `keep` responses, by response id."""

    def __init__(self, keep: int = KEEP_RESPONSES) -> None:
        self.keep = keep
        self._items: OrderedDict[str, list[dict]] = OrderedDict()

    def put(self, id_: str, items: list[dict]) -> None:
        self._items[id_] = items
        self._items.move_to_end(id_)
        while len(self._items) > self.keep:
            self._items.popitem(last=False)

    def get(self, id_: str) -> list[dict] | None:
        return self._items.get(id_)


def routes(app: Any) -> list[Route]:
    """The routes of this API over the server's handlers `app` (`app._App`)."""
    handler = _Responses(app, ResponseStore())
    app.responses_api = handler  # for tests and the agent view: its store, its keep-alive
    return [Route("/v1/responses", handler.create, methods=["POST"])]


def _message_item(id_: str) -> dict:
    return {
        "id": id_,
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }


def _text_part(text: str = "") -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Output:
    """Turns the splitter's pieces into output items and their stream events (dicts
    without ``sequence_number``), in order. One item is open at a time (a message or a
    reasoning item); a tool call is whole when the splitter gives it."""

    def __init__(self, splitter: Any, req: ResponsesRequest) -> None:
        self.splitter = splitter
        self.req = req
        self.items: list[dict] = []
        self.open: dict | None = None  # the open message or reasoning item
        self.open_text = ""
        self.pending = ""  # whitespace held until text follows it (dropped at the end)
        self.reasoning = ""  # all reasoning text, for the usage's reasoning tokens
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        return self._pieces(self.splitter.feed(text))

    def close(self, status: str = "completed") -> list[dict]:
        events = self._pieces(self.splitter.close())
        return events + self._close_open(status)

    def _pieces(self, pieces: list[Any]) -> list[dict]:
        events: list[dict] = []
        for piece in pieces:
            if isinstance(piece, agentio.ToolCall):
                events += self._call(piece)
            elif isinstance(piece, agentio.Reasoning):
                events += self._text(piece.text, "reasoning")
            elif isinstance(piece, agentio.Text):
                events += self._text(piece.text, "message")
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _text(self, text: str, kind: str) -> list[dict]:
        if self.open is not None and self.open["type"] == kind:
            return [self._delta(text)] if text else []
        text = self.pending + text
        if not text.strip():
            self.pending = text
            return []
        self.pending = ""
        events = self._close_open("completed")
        if kind == "message":
            item = _message_item(new_item_id("msg"))
            part = _text_part()
        else:
            item = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.open, self.open_text = item, ""
        self.items.append(item)
        events.append(
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": dict(item, content=[]),
            }
        )
        events.append(
            {
                "type": "response.content_part.added",
                **self._where(),
                "content_index": 0,
                "part": part,
            }
        )
        events.append(self._delta(text.lstrip()))
        return events

    def _delta(self, text: str) -> dict:
        self.open_text += text
        if self.open["type"] == "message":
            return {
                "type": "response.output_text.delta",
                **self._where(),
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        self.reasoning += text
        return {
            "type": "response.reasoning_text.delta",
            **self._where(),
            "content_index": 0,
            "delta": text,
        }

    def _close_open(self, status: str) -> list[dict]:
        item, text = self.open, self.open_text
        if item is None:
            return []
        where = self._where()
        self.open, self.open_text = None, ""
        if item["type"] == "message":
            part = _text_part(text)
            done = {
                "type": "response.output_text.done",
                **where,
                "content_index": 0,
                "text": text,
                "logprobs": [],
            }
            item.update(status=status, content=[part])
        else:
            part = {"type": "reasoning_text", "text": text}
            done = {
                "type": "response.reasoning_text.done",
                **where,
                "content_index": 0,
                "text": text,
            }
            item.update(content=[part], encrypted_content=None)
        return [
            done,
            {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": item,
            },
        ]

    def _call(self, call: Any) -> list[dict]:
        if self.calls and not self.req.parallel_tool_calls:
            return []  # one call per response was asked for
        self.calls += 1
        self.pending = ""
        events = self._close_open("completed")
        index = len(self.items)
        if call.name in self.req.custom_tools:
            text = _custom_input(call.arguments)
            item = {
                "id": new_item_id("ctc"),
                "type": "custom_tool_call",
                "status": "in_progress",
                "call_id": call.id,
                "name": call.name,
                "input": "",
            }
            kinds = ("response.custom_tool_call_input", "input")
        else:
            text = call.arguments
            item = {
                "id": new_item_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
            }
            if call.name in self.req.namespaces:  # a tool of a namespace (Codex's agents)
                item["namespace"] = self.req.namespaces[call.name]
            kinds = ("response.function_call_arguments", "arguments")
        prefix, field = kinds
        where = {"item_id": item["id"], "output_index": index}
        events.append(
            {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
        )
        events.append({"type": f"{prefix}.delta", **where, "delta": text})
        events.append({"type": f"{prefix}.done", **where, field: text})
        item.update({field: text, "status": "completed"})
        self.items.append(item)
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return events


def _custom_input(arguments: str) -> str:
    """A freeform tool's raw input from the arguments of the function it was shown as."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    if isinstance(value, dict) and len(value) == 1:
        (only,) = value.values()
        return only if isinstance(only, str) else json.dumps(only)
    return arguments


class _Responses:
    def __init__(self, app: Any, store: ResponseStore) -> None:
        self.app = app
        self.store = store
        self.keepalive_s = KEEPALIVE_S  # silence before a keep-alive comment

    # -- the request ----------------------------------------------------------------------------

    def _previous(self, body: dict) -> list[dict] | None:
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        if not isinstance(previous, str):
            raise APIError("'previous_response_id' must be a string", param="previous_response_id")
        items = self.store.get(previous)
        if items is None:
            raise APIError(
                f"Previous response with id {previous!r} not found: this server keeps the "
                f"last {self.store.keep} responses in memory only; send the whole "
                "conversation as 'input' instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return items

    @staticmethod
    def _call(req: ResponsesRequest) -> Call:
        """The call to admit: the chat form, ``reasoning.effort`` for templates that read
        it (``"none"`` also turns thinking off, as chat completions do)."""
        template: dict[str, Any] = {}
        if req.effort is not None:
            template["reasoning_effort"] = req.effort
            if req.effort == "none":
                template["enable_thinking"] = False
        return Call(
            prompt=req.messages,
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stream=req.stream,
            images=req.images,
            tools=req.tools,
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            template_kwargs=template,
        )

    async def create(self, request: HTTPRequest) -> Any:
        app = self.app
        entry = app.journal.open("/v1/responses")
        vision = getattr(app.engine.model, "modality", "text") == "vision"
        checked: list[ResponsesRequest] = []

        def check(body: dict) -> Call:
            key = body.get("prompt_cache_key")
            entry.conversation_key = key if isinstance(key, str) else None
            previous = self._previous(body)
            req = check_responses(body, app.limits, vision=vision, previous=previous)
            checked.append(req)
            return self._call(req)

        try:
            admitted = await app.admit(request, entry, check)
        except APIError as err:
            if err.code == CONTEXT_EXCEEDED:
                err.param = "input"  # this API's name for what the chat's 'messages' are
                if checked and checked[0].stream:
                    return EventStream(self._too_long(checked[0], err), lambda: None)
            return JSONResponse(err.body(), status_code=err.status)
        req = checked[0]
        id_ = new_item_id("resp")
        entry.response_id = id_  # a later previous_response_id names this entry's conversation
        if req.stream:
            return EventStream(self._stream(admitted, req, id_), admitted.release)
        try:
            return await self._whole(request, admitted, req, id_)
        finally:
            admitted.release()

    # -- answers ---------------------------------------------------------------------------------

    def _finish(self, entry: Any, req: ResponsesRequest, id_: str, out: _Output, reason: str):
        """The finished response's status, incomplete reason and usage; it is stored."""
        status, incomplete = "completed", None
        if reason == "length":
            status, incomplete = "incomplete", "max_output_tokens"
        reasoning_tokens = 0
        if out.reasoning:
            try:
                reasoning_tokens = len(
                    self.app.engine.model.encode(out.reasoning, add_special_tokens=False)
                )
            except Exception:  # a model without a tokenizer to count with
                reasoning_tokens = 0
        reasoning_tokens = min(reasoning_tokens, entry.completion_tokens)
        use = response_usage(
            entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens, reasoning_tokens
        )
        self.store.put(id_, [*req.items, *out.items])
        return status, incomplete, use

    async def _whole(
        self, request: HTTPRequest, admitted: Any, req: ResponsesRequest, id_: str
    ) -> JSONResponse:
        app, entry = self.app, admitted.entry
        try:
            completion = await app.completion(request, admitted)
        except Exception as exc:
            message = app.failed(entry, exc)
            return JSONResponse(error_body(message, type="server_error"), status_code=500)
        if completion is None:
            return JSONResponse(error_body("the client disconnected"), status_code=499)
        app._log_answer(entry, completion.text)
        out = _Output(self.app.calls.splitter(admitted.call, admitted.handle), req)
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        out.feed(completion.text)
        out.close(status)
        status, incomplete, use = self._finish(entry, req, id_, out, completion.finish_reason)
        body = response_object(
            id_,
            entry.started,
            app.model_name,
            req,
            status=status,
            output=out.items,
            usage=use,
            incomplete=incomplete,
        )
        return JSONResponse(body)

    async def _stream(self, admitted: Any, req: ResponsesRequest, id_: str) -> AsyncIterator[bytes]:
        app, entry = self.app, admitted.entry
        model, started = app.model_name, entry.started
        events = _Sequence()
        head = response_object(id_, started, model, req, status="in_progress")
        yield events.sse({"type": "response.created", "response": head})
        yield events.sse({"type": "response.in_progress", "response": head})
        try:
            out = _Output(self.app.calls.splitter(admitted.call, admitted.handle), req)
            async for item in app.answer_events(admitted, self.keepalive_s):
                if item is IDLE:  # a long prompt is read: an SSE comment keeps it alive
                    yield KEEPALIVE
                elif isinstance(item, str):
                    for payload in out.feed(item):
                        yield events.sse(payload)
                else:
                    completion = item
                    length = completion.finish_reason == "length"
                    for payload in out.close("incomplete" if length else "completed"):
                        yield events.sse(payload)
                    status, incomplete, use = self._finish(
                        entry, req, id_, out, completion.finish_reason
                    )
                    body = response_object(
                        id_,
                        started,
                        model,
                        req,
                        status=status,
                        output=out.items,
                        usage=use,
                        incomplete=incomplete,
                    )
                    kind = "response.completed" if status == "completed" else "response.incomplete"
                    yield events.sse({"type": kind, "response": body})
        except Exception as exc:
            message = app.failed(entry, exc)
            error = {"code": "server_error", "message": message}
            body = response_object(id_, started, model, req, status="failed", error=error)
            yield events.sse({"type": "response.failed", "response": body})

    async def _too_long(self, req: ResponsesRequest, err: APIError) -> AsyncIterator[bytes]:
        """A prompt over the context, streamed: created, then failed with the code."""
        events = _Sequence()
        id_ = new_item_id("resp")
        model, started = self.app.model_name, time.time()
        head = response_object(id_, started, model, req, status="in_progress")
        yield events.sse({"type": "response.created", "response": head})
        error = {"code": CONTEXT_EXCEEDED, "message": err.message}
        body = response_object(id_, started, model, req, status="failed", error=error)
        yield events.sse({"type": "response.failed", "response": body})


class _Sequence:
    """Numbers a stream's events (``sequence_number``, from 0) and writes them as SSE."""

    def __init__(self) -> None:
        self.number = 0

    def sse(self, payload: dict) -> bytes:
        payload = {**payload, "sequence_number": self.number}
        self.number += 1
        return sse(payload, event=payload["type"])
