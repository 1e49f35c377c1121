"""The checks every request of the agents' endpoint passes before its body is read as an
API call: its API key, its Host header (a loopback server), its content type, and its body
(size, JSON, valid Unicode). Each refusal is an `APIError` in OpenAI's shape (the Messages
API turns it into Anthropic's)."""

from __future__ import annotations

import hmac
import json
import re

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from mlx_nbengine.server.openai_shapes import APIError, Limits

__all__ = ["LOOPBACK_NAMES", "Gate"]

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): text only as half of a pair.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class Gate:
    """A server's request checks, with its key, limits and whether it serves loopback
    only."""

    def __init__(self, *, api_key: str | None, limits: Limits, loopback_only: bool) -> None:
        self.api_key = api_key
        self.limits = limits
        self.loopback_only = loopback_only

    async def body(self, request: HTTPRequest) -> dict:
        """Host, key and content type checked, the body read (`read_body`)."""
        self.check_host(request)
        self.check_key(request)
        self.check_json(request)
        return await self.read_body(request)

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
