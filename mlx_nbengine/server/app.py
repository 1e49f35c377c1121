"""The ASGI app (Starlette): OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` on one `Engine`, through its public `submit` API only.

Chat answers are split with `agentio.OutputSplitter` (`_App.splitter`, which every API that
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
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from mlx_nbengine.engine import (
    BlockReport,
    EngineClosedError,
    Finished,
    InvalidRequestError,
    PromptTooLongError,
    TextDelta,
)
from mlx_nbengine.errors import EngineError
from mlx_nbengine.server import messages, responses, transport
from mlx_nbengine.server.agentio import OutputSplitter, Reasoning, Text, ToolCall, template_messages
from mlx_nbengine.server.anthropic_shapes import error_body as anthropic_error_body
from mlx_nbengine.server.conversations import client_name, reader_of, request_facts
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

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): text only as half of a pair.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


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
        self.loopback_only = loopback_only
        self.api_key = api_key
        self.limits = limits
        self.journal = journal
        self.log_prompts = log_prompts
        self.max_pending = max_pending
        self.model_name = model_name
        self.created = int(time.time())
        self.in_flight = 0

    # -- helpers ---------------------------------------------------------------------------

    def check_key(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise APIError(
                "a wrong or missing API key; send 'Authorization: Bearer KEY' (or "
                "'x-api-key: KEY') with the key %llm_serve was started with",
                status=401,
                code="invalid_api_key",
            )

    def check_host(self, request: HTTPRequest) -> None:
        """On loopback, the Host header must name this machine (a web page that rebinds
        its own name to 127.0.0.1 cannot reach the server)."""
        if not self.loopback_only:
            return
        host = request.headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        if name.strip("[]") not in LOOPBACK_NAMES:
            raise APIError(
                f"the Host header {host!r} is not this machine; this server answers "
                "127.0.0.1, localhost and ::1 only",
                status=403,
                type="permission_error",
            )

    def check_json(self, request: HTTPRequest) -> None:
        """POST bodies must say they are JSON: a web page's form post (which browsers send
        to any address without asking) is refused."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise APIError(
                f"send the body as JSON with 'Content-Type: application/json' (got "
                f"{kind or 'none'!r})",
                status=415,
            )

    async def read_body(self, request: HTTPRequest) -> dict:
        limit = self.limits.max_body_bytes
        too_big = APIError(
            f"the request body is over this server's limit of {limit:,} bytes",
            status=413,
            code="request_too_large",
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:  # journalled as a client gone; nobody reads the answer
            raise APIError("the client disconnected before its body was sent", status=499) from None
        raw = b"".join(chunks)
        try:
            # UTF-8 only (a BOM taken), strictly: json.loads of bytes would let encoded
            # surrogates through, which tokenizers refuse.
            body = json.loads(raw.decode("utf-8-sig"))
        except (ValueError, UnicodeDecodeError):
            raise APIError("the request body is not valid JSON") from None
        except RecursionError:
            raise APIError("the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        if SURROGATE_ESCAPE.search(raw):  # a lone surrogate is no text: tokenizers refuse it
            try:
                json.dumps(body, ensure_ascii=False).encode()
            except (UnicodeEncodeError, RecursionError):
                raise APIError(
                    "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                    "without its pair); send valid Unicode text"
                ) from None
        return body

    def template_kwargs(self, call: Call) -> dict[str, Any] | None:
        """What the chat template is given beside the messages: the call's own values
        (``reasoning_effort``, ``chat_template_kwargs``), ``tools`` for a template that reads
        them (others never see them; none with ``tool_choice: "none"``), and
        ``enable_thinking: False`` for a forced call (its grammar starts at the first
        token, so a template that can should not open a reasoning block)."""
        out = dict(call.template_kwargs)
        tools = call.offered_tools
        if tools:
            lm = self.engine.model
            template = getattr(getattr(lm, "text_tokenizer", None), "chat_template", None)
            if isinstance(template, dict):  # named templates: the default one renders chats
                template = template.get("default") or template.get("tool_use") or ""
            if isinstance(template, str) and "tools" in template:
                out["tools"] = tools
        if call.forced:
            out.setdefault("enable_thinking", False)
        return out or None

    def tool_grammar(self, call: Call) -> str | None:
        """The grammar a forced call is decoded under (`toolgrammar.tool_call_grammar` for
        the model's tokenizer); None where the call is not forced."""
        if not call.forced:
            return None
        from mlx_nbengine.server import toolgrammar  # noqa: PLC0415 - only forced calls need it

        return toolgrammar.tool_call_grammar(
            self.engine.model.tokenizer,
            call.tools,
            call.tool_choice,
            parallel=call.parallel_tool_calls,
        )

    def splitter(self, call: Call, handle: Any) -> OutputSplitter:
        """The split of a chat call's answer (`handle`: its `Request`): reasoning, text and
        calls of the tools the model was offered, with the model's own markers and parser."""
        return OutputSplitter(
            getattr(self.engine, "model", None),
            call.offered_tools,
            prompt=getattr(handle, "prompt_tokens", None),
        )

    def prompt_of(self, call: Call) -> Any:
        """The prompt `Engine.submit` takes for `call`: chat messages as templates read them
        (`agentio.template_messages`), or plain lines for a model without a template."""
        prompt = call.prompt
        if _is_chat(prompt):
            prompt = template_messages(prompt)
            if not getattr(self.engine.model, "has_chat_template", True):
                # A base model: no template to render them (the tools as a line of JSON).
                prompt = plain_chat(prompt, call.offered_tools)
        return prompt

    def submit(self, call: Call) -> Any:
        """`Engine.submit` (on a worker thread: it tokenizes); OpenAI errors for its own."""
        prompt = self.prompt_of(call)
        try:
            grammar = self.tool_grammar(call)
            extra = {"grammar": grammar} if grammar is not None else {}
            return self.engine.submit(
                prompt,
                max_tokens=call.max_tokens,
                temperature=call.temperature,
                top_p=call.top_p,
                seed=call.seed,
                stop=call.stop or None,
                images=call.images or None,
                template_kwargs=self.template_kwargs(call),
                **extra,
            )
        except PromptTooLongError as exc:
            raise APIError(str(exc), param="messages", code="context_length_exceeded") from None
        except InvalidRequestError as exc:
            raise APIError(str(exc)) from None
        except EngineClosedError:
            raise APIError(
                "the model was unloaded; load it again and restart the server",
                status=503,
                type="server_error",
            ) from None
        except EngineError as exc:  # e.g. a model without a chat template
            raise APIError(str(exc)) from None

    # -- endpoints ---------------------------------------------------------------------------

    async def models(self, request: HTTPRequest) -> JSONResponse:
        try:
            self.check_host(request)
            self.check_key(request)
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
            self.check_host(request)
            self.check_key(request)
            self.check_json(request)
            body = await self.read_body(request)
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
                handle = await run_in_threadpool(self.submit, call)
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
            splitter = self.splitter(admitted.call, admitted.handle)
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
        splitter = self.splitter(call, admitted.handle)
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


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def plain_chat(messages: list[dict], tools: list[dict] | None = None) -> str:
    """Chat messages as plain text for a model without a chat template (a base model):
    a ``tools:`` line with the offered tools' JSON first (never dropped unseen), one
    ``role: content`` line each, an assistant's calls in the JSON ``<tool_call>`` form the
    answer's splitter reads, then ``assistant:`` for the answer to follow."""
    lines = []
    if tools:
        lines.append("tools: " + json.dumps(tools, separators=(",", ":"), ensure_ascii=False))
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # parts (images are refused for text models)
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        for called in m.get("tool_calls") or ():
            function = called.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):  # JSON text, as the chat form holds it
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            call = {"name": function.get("name"), "arguments": arguments}
            content += "<tool_call>" + json.dumps(call, ensure_ascii=False) + "</tool_call>"
        lines.append(f"{m.get('role', 'user')}: {content}")
    return "\n".join([*lines, "assistant:"])


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
