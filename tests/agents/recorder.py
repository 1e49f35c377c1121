"""A recording stand-in for the server: what an agent CLI sends, kept whole.

`Recorder(path)` serves on 127.0.0.1 at a free port (`url`) from a daemon thread and appends
one JSON line per request to `path`: method, path, query, headers, body (parsed JSON where
it is JSON). It answers just enough for a CLI to go on:

- ``POST .../responses``: OpenAI's Responses API as server-sent events (created, one
  message item with its text, completed with usage), what Codex reads;
- ``POST .../messages``: Anthropic's Messages API, as events when ``stream`` is true, else
  one JSON message; ``POST .../messages/count_tokens``: a count;
- ``GET .../models``: one model, in both APIs' list shapes;
- anything else: 404 with an error body (what a CLI does next says whether it needed it).

Standard library only, no dependence on the project: `capture.py` uses it to write the
first-request fixtures, and it is what tests/agents/README.md's facts were read from.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ANSWER = "OK"
MODEL = "recorded-model"


class Recorder:
    def __init__(self, path: Path | str, answer: str = ANSWER) -> None:
        self.path = Path(path)
        self.answer = answer
        self.lock = threading.Lock()
        self.count = 0
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _read(self) -> bytes:
                length = int(self.headers.get("content-length") or 0)
                return self.rfile.read(length) if length else b""

            def _any(self) -> None:
                raw = self._read()
                recorder.record(self, raw)
                recorder.answer_request(self, raw)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- recording ----------------------------------------------------------------------------

    def record(self, handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        path, _, query = handler.path.partition("?")
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        with self.lock:
            self.count += 1
            entry = {
                "n": self.count,
                "time": time.time(),
                "method": handler.command,
                "path": path,
                "query": query,
                "headers": [[k.lower(), v] for k, v in handler.headers.items()],
                "body_bytes": len(raw),
                "body": body,
            }
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    def requests(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    # -- answers ------------------------------------------------------------------------------

    def answer_request(self, h: BaseHTTPRequestHandler, raw: bytes) -> None:
        path = h.path.partition("?")[0].rstrip("/")
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if h.command == "GET" and path.endswith("/models"):
            model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "recorder"}
            model.update(type="model", display_name=MODEL, created_at="1970-01-01T00:00:00Z")
            return _json(h, 200, {"object": "list", "data": [model], "has_more": False})
        if h.command == "POST" and path.endswith("/responses"):
            return _sse(h, responses_events(body.get("model", MODEL), self.answer))
        if h.command == "POST" and path.endswith("/messages/count_tokens"):
            return _json(h, 200, {"input_tokens": len(raw) // 4})
        if h.command == "POST" and path.endswith("/messages"):
            if body.get("stream"):
                return _sse(h, messages_events(body.get("model", MODEL), self.answer))
            return _json(h, 200, message(body.get("model", MODEL), self.answer))
        if h.command == "HEAD":
            h.send_response(200)
            h.send_header("content-length", "0")
            h.end_headers()
            return None
        return _json(h, 404, {"error": {"type": "not_found", "message": f"no {h.path}"}})


def _json(h: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    h.send_response(status)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def _sse(h: BaseHTTPRequestHandler, events: list[tuple[str, dict]]) -> None:
    h.send_response(200)
    h.send_header("content-type", "text/event-stream")
    h.send_header("cache-control", "no-cache")
    h.send_header("connection", "close")
    h.end_headers()
    for name, data in events:
        h.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        h.wfile.flush()
    h.close_connection = True


def responses_events(model: str, text: str) -> list[tuple[str, dict]]:
    """One text answer in the Responses API's stream events."""
    rid, mid, now = "resp_rec1", "msg_rec1", int(time.time())
    base = {"id": rid, "object": "response", "created_at": now, "model": model}
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"id": mid, "type": "message", "role": "assistant", "status": "completed"}
    done_item = {**item, "content": [part]}
    usage = {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 11,
    }
    events = [
        ("response.created", {"response": {**base, "status": "in_progress", "output": []}}),
        (
            "response.output_item.added",
            {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}},
        ),
        (
            "response.content_part.added",
            {"item_id": mid, "output_index": 0, "content_index": 0, "part": {**part, "text": ""}},
        ),
        (
            "response.output_text.delta",
            {"item_id": mid, "output_index": 0, "content_index": 0, "delta": text},
        ),
        (
            "response.output_text.done",
            {"item_id": mid, "output_index": 0, "content_index": 0, "text": text},
        ),
        (
            "response.content_part.done",
            {"item_id": mid, "output_index": 0, "content_index": 0, "part": part},
        ),
        ("response.output_item.done", {"output_index": 0, "item": done_item}),
        (
            "response.completed",
            {"response": {**base, "status": "completed", "output": [done_item], "usage": usage}},
        ),
    ]
    return [
        (name, {"type": name, "sequence_number": i, **data})
        for i, (name, data) in enumerate(events)
    ]


def message(model: str, text: str) -> dict:
    return {
        "id": "msg_rec1",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1},
    }


def messages_events(model: str, text: str) -> list[tuple[str, dict]]:
    """One text answer in the Messages API's stream events."""
    start = {**message(model, ""), "content": [], "stop_reason": None}
    start["usage"] = {"input_tokens": 10, "output_tokens": 0}
    events = [
        ("message_start", {"message": start}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}),
        ("content_block_stop", {"index": 0}),
        (
            "message_delta",
            {
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 1},
            },
        ),
        ("message_stop", {}),
    ]
    return [(name, {"type": name, **data}) for name, data in events]
