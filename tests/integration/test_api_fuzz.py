"""Bad input (issue 34): malformed bodies, slow clients and a thousand requests at once.

One tiny random-weight llama (a text model, 16-token blocks) is served on 127.0.0.1 at a
free port, with a 64 KiB body limit and `MAX_PENDING` requests in flight at most. Each
test sends real HTTP (httpx, or a raw socket for the slow clients) and checks:

- a malformed body (wrong JSON types per field, unknown item and block types, a tool
  result for a call never made, an image on a text model, deep nesting, a body over the
  limit, another content type, bytes that are not UTF-8 or not JSON, nothing) gets a 4xx
  in its API's error shape (OpenAI's ``{"error": {"message", "type", "param", "code"}}``,
  Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages*``)
  with a one-line message; a body that may be valid (bad JSON text in a call's
  arguments, odd text) gets a whole answer or such a 4xx, never a 5xx or a hang;
- a client that sends its body slowly is answered while others are served, and one that
  goes away mid-body is journalled as gone (499) without holding a place in flight;
- a thousand requests at once over every API each get a whole answer or a 429 in their
  API's shape, the journal agrees, and nothing stays in flight.

The fuzz is hypothesis's, derandomized (the same examples every run) and bounded by
`EXAMPLES` per test; every wait is bounded, and nothing asserts on time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mlx_nbengine.engine import Engine  # noqa: E402
from mlx_nbengine.server import ApiServer, Limits  # noqa: E402

BLOCK = 16
BODY_LIMIT = 64 * 1024
MAX_MESSAGES = 8
MAX_PENDING = 64
EXAMPLES = 80  # per fuzz test: each is one request (a few ms; an answer some 10s of ms)
AT_ONCE = 1000
TIMEOUT = 60  # seconds an HTTP request may take before the test fails (never reached)

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

CHAT, COMPLETIONS, RESPONSES = "/chat/completions", "/completions", "/responses"
MESSAGES, COUNT = "/messages", "/messages/count_tokens"
MODEL_APIS = (CHAT, RESPONSES, MESSAGES, COUNT)  # the APIs that take conversations
ALL = (CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT)
JOURNALLED = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)  # count_tokens answers without a call

USER = [{"role": "user", "content": "Hello"}]
GOOD = {
    CHAT: {"model": "any", "messages": USER, "max_tokens": 1, "temperature": 0},
    COMPLETIONS: {"model": "any", "prompt": "Hello", "max_tokens": 1, "temperature": 0},
    RESPONSES: {"model": "any", "input": "Hello", "max_output_tokens": 1, "temperature": 0},
    MESSAGES: {"model": "any", "messages": USER, "max_tokens": 1, "temperature": 0},
    COUNT: {"model": "any", "messages": USER},
}
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine.load(tiny_model_dir("llama"), block_size=BLOCK, parallel=4) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    limits = Limits(max_body_bytes=BODY_LIMIT, max_messages=MAX_MESSAGES, context=8192)
    srv = ApiServer(engine, port=0, limits=limits, max_pending=MAX_PENDING).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def in_flight(server) -> int:
    return server.app.state.handlers.in_flight


def post(client, path: str, body, headers: dict | None = None):
    """POST `body` (a dict: as JSON; bytes or an iterator of bytes: as they are)."""
    if isinstance(body, dict):
        data = json.dumps(body).encode()  # NaN and Infinity written as Python writes them
    else:
        data = body
    sent = {"content-type": "application/json"}
    sent.update(headers or {})
    sent = {k: v for k, v in sent.items() if v is not None}
    return client.post(path, content=data, headers=sent)


def error_of(response, path: str) -> dict:
    """The error of a refusal, checked against its API's shape; its message one line."""
    assert response.headers.get("content-type", "").startswith("application/json"), (
        response.status_code,
        response.text[:300],
    )
    body = response.json()
    if path.startswith(MESSAGES):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        error = body["error"]
        assert set(error) == {"type", "message"} and isinstance(error["type"], str), body
    else:
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        assert isinstance(error["type"], str), body
    message = error["message"]
    assert isinstance(message, str) and message.strip(), body
    assert "\n" not in message and "\r" not in message, message
    return error


def refused(response, path: str, statuses=None) -> dict:
    """A 4xx (one of `statuses` when given) in `path`'s API shape; its error."""
    assert 400 <= response.status_code < 500, (path, response.status_code, response.text[:500])
    if statuses is not None:
        assert response.status_code in statuses, (path, response.status_code, response.text)
    return error_of(response, path)


def answered(response, path: str) -> None:
    """A 200 with a whole answer of `path`'s API (a stream to its last event)."""
    assert response.status_code == 200, (path, response.status_code, response.text[:500])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        text = response.text
        last = {
            CHAT: "data: [DONE]",
            COMPLETIONS: "data: [DONE]",
            MESSAGES: "event: message_stop",
            RESPONSES: "event: response.",
        }[path]
        assert last in text, text[-500:]
        if path == RESPONSES:
            assert "response.completed" in text or "response.incomplete" in text, text[-500:]
        return
    body = response.json()
    if path in (CHAT, COMPLETIONS):
        assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), body
    elif path == RESPONSES:
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    elif path == MESSAGES:
        assert body["type"] == "message" and body["stop_reason"], body
    else:
        assert isinstance(body["input_tokens"], int) and body["input_tokens"] > 0, body


def answered_or_refused(response, path: str) -> None:
    if response.status_code == 200:
        answered(response, path)
    else:
        refused(response, path)


def settled(server, timeout: float = 30) -> None:
    """Nothing in flight (bounded wait: a cancelled call is released on the server's loop)."""
    deadline = time.monotonic() + timeout
    while in_flight(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert in_flight(server) == 0


def still_serving(client, server) -> None:
    for path in ALL:
        answered(post(client, path, GOOD[path]), path)
    settled(server)


# -- strategies ----------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and Infinity too: Python's JSON writes and reads them
    st.text(max_size=12),
)
VALUES = st.recursive(
    st.one_of(st.none(), SCALARS),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
TYPES = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}


def json_type(value) -> str:
    return "null" if value is None else TYPES[type(value)]


NUMBER = {"int", "float"}
# The JSON types each known field takes (null, its default, is taken by every one).
FIELDS = {
    CHAT: {
        "messages": {"list"},
        "model": {"str"},
        "max_tokens": {"int"},
        "max_completion_tokens": {"int"},
        "temperature": NUMBER,
        "top_p": NUMBER,
        "seed": {"int"},
        "n": {"int"},
        "stop": {"str", "list"},
        "stream": {"bool"},
        "stream_options": {"dict"},
        "tools": {"list"},
        "tool_choice": {"str", "dict"},
        "parallel_tool_calls": {"bool"},
        "chat_template_kwargs": {"dict"},
        "reasoning_effort": {"str"},
    },
    COMPLETIONS: {
        "prompt": {"str", "list"},
        "model": {"str"},
        "max_tokens": {"int"},
        "temperature": NUMBER,
        "top_p": NUMBER,
        "seed": {"int"},
        "n": {"int"},
        "stop": {"str", "list"},
        "stream": {"bool"},
        "stream_options": {"dict"},
    },
    RESPONSES: {
        "input": {"str", "list"},
        "model": {"str"},
        "instructions": {"str"},
        "max_output_tokens": {"int"},
        "temperature": NUMBER,
        "top_p": NUMBER,
        "stream": {"bool"},
        "tools": {"list"},
        "tool_choice": {"str", "dict"},
        "parallel_tool_calls": {"bool"},
        "reasoning": {"dict"},
        "text": {"dict"},
        "previous_response_id": {"str"},
    },
    MESSAGES: {
        "messages": {"list"},
        "model": {"str"},
        "system": {"str", "list"},
        "max_tokens": {"int"},
        "temperature": NUMBER,
        "top_p": NUMBER,
        "stop_sequences": {"list"},
        "stream": {"bool"},
        "tools": {"list"},
        "tool_choice": {"dict"},
    },
}
FIELDS[COUNT] = dict(FIELDS[MESSAGES])


@st.composite
def wrong_types(draw):
    """(path, body): a good body with one known field of a JSON type it does not take."""
    path = draw(st.sampled_from(ALL))
    name = draw(st.sampled_from(sorted(FIELDS[path])))
    takes = FIELDS[path][name]
    value = draw(VALUES.filter(lambda v: json_type(v) not in takes | {"null"}))
    return path, {**GOOD[path], name: value}


def nested(depth: int, leaf):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


NAMES = st.text(min_size=1, max_size=12)
DEPTHS = st.integers(min_value=2, max_value=400)  # well within the JSON reader's recursion


def _chat(messages: list) -> dict:
    return {**GOOD[CHAT], "messages": messages}


def _responses(items: list) -> dict:
    return {**GOOD[RESPONSES], "input": items}


def _messages(path: str, messages: list, **more) -> dict:
    return {**GOOD[path], "messages": messages, **more}


ASKED = {  # an assistant turn that made one call, id "call_1"
    CHAT: {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    },
    RESPONSES: {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
    MESSAGES: {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "call_1", "name": "f", "input": {}}],
    },
}
CHAT_PARTS = ("text", "image_url")
RESPONSES_ITEMS = (
    "message",
    "function_call",
    "custom_tool_call",
    "function_call_output",
    "custom_tool_call_output",
    "reasoning",
)
RESPONSES_PARTS = (
    "input_text",
    "output_text",
    "text",
    "summary_text",
    "reasoning_text",
    "refusal",
    "input_image",
)
ANTHROPIC_USER_BLOCKS = ("text", "image", "document", "tool_result")
ANTHROPIC_ASSISTANT_BLOCKS = ("text", "thinking", "tool_use", "redacted_thinking")


def _not_server_block(kind: str) -> bool:
    from mlx_nbengine.server.anthropic_shapes import SERVER_BLOCKS

    return kind not in SERVER_BLOCKS


def _not_skipped_item(kind: str) -> bool:
    from mlx_nbengine.server.responses_shapes import SKIPPED_ITEMS

    return kind not in SKIPPED_ITEMS


@st.composite
def malformed(draw):
    """(path, body): a conversation no API takes: unknown item or block types, a result
    for a call never made, an image on a text model, deep nesting, wrong inner types."""
    path = draw(st.sampled_from((CHAT, RESPONSES, MESSAGES, COUNT)))
    kind = draw(
        st.sampled_from(
            ("unknown", "never-issued", "image", "nested", "not-an-object", "role", "arguments")
        )
    )
    other = draw(NAMES)
    if path == CHAT:
        if kind == "unknown":
            part = {"type": draw(NAMES.filter(lambda k: k not in CHAT_PARTS)), "text": "x"}
            return path, _chat([{"role": "user", "content": [part]}])
        if kind == "never-issued":
            if draw(st.booleans()):  # no call at all before it
                return path, _chat([*USER, {"role": "tool", "tool_call_id": other, "content": "3"}])
            other = draw(NAMES.filter(lambda k: k != "call_1"))
            tool = {"role": "tool", "tool_call_id": other, "content": "3"}
            return path, _chat([*USER, ASKED[CHAT], tool])
        if kind == "image":
            part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
            return path, _chat([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}])
        if kind == "nested":
            return path, _chat([{"role": "user", "content": nested(draw(DEPTHS), "x")}])
        if kind == "not-an-object":
            return path, _chat([*USER, draw(VALUES.filter(lambda v: not isinstance(v, dict)))])
        if kind == "role":
            role = draw(NAMES.filter(lambda r: r not in ("system", "developer", "user")))
            role = role if role not in ("assistant", "tool") else "robot"
            return path, _chat([{"role": role, "content": "x"}])
        arguments = draw(VALUES.filter(lambda v: not isinstance(v, str | dict) and v is not None))
        asked = json.loads(json.dumps(ASKED[CHAT]))
        asked["tool_calls"][0]["function"]["arguments"] = arguments
        return path, _chat([*USER, asked])
    if path == RESPONSES:
        if kind == "unknown":
            item_type = draw(
                NAMES.filter(lambda k: k not in RESPONSES_ITEMS and _not_skipped_item(k))
            )
            return path, _responses([{"type": item_type, "content": "x"}])
        if kind == "never-issued":
            output = {"type": "function_call_output", "call_id": other, "output": "3"}
            asked = [ASKED[RESPONSES]] if other != "call_1" and draw(st.booleans()) else []
            return path, _responses([{"role": "user", "content": "Hello"}, *asked, output])
        if kind == "image":
            part = {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}
            return path, _responses([{"role": "user", "content": [part]}])
        if kind == "nested":
            return path, _responses(nested(draw(DEPTHS), "x"))
        if kind == "not-an-object":
            return path, _responses([draw(VALUES.filter(lambda v: not isinstance(v, dict)))])
        if kind == "role":
            role = draw(NAMES.filter(lambda r: r not in ("user", "system", "developer")))
            role = role if role != "assistant" else "robot"
            return path, _responses([{"type": "message", "role": role, "content": "x"}])
        part_type = draw(NAMES.filter(lambda k: k not in RESPONSES_PARTS))
        return path, _responses([{"role": "user", "content": [{"type": part_type, "text": "x"}]}])
    # the Messages API and count_tokens
    if kind == "unknown":
        if draw(st.booleans()):
            block = draw(
                NAMES.filter(lambda k: k not in ANTHROPIC_USER_BLOCKS and _not_server_block(k))
            )
            return path, _messages(path, [{"role": "user", "content": [{"type": block}]}])
        block = draw(
            NAMES.filter(lambda k: k not in ANTHROPIC_ASSISTANT_BLOCKS and _not_server_block(k))
        )
        turns = [*USER, {"role": "assistant", "content": [{"type": block, "text": "x"}]}]
        return path, _messages(path, turns)
    if kind == "never-issued":
        other = draw(NAMES.filter(lambda k: k != "call_1"))
        result = {"type": "tool_result", "tool_use_id": other, "content": "3"}
        turns = [*USER, ASKED[MESSAGES], {"role": "user", "content": [result]}]
        return path, _messages(path, turns[draw(st.sampled_from((0, 2))) :])
    if kind == "image":
        source = {"type": "base64", "media_type": "image/png", "data": PNG}
        block = {"type": "image", "source": source}
        return path, _messages(path, [{"role": "user", "content": [block]}])
    if kind == "nested":
        return path, _messages(path, [{"role": "user", "content": nested(draw(DEPTHS), "x")}])
    if kind == "not-an-object":
        block = draw(VALUES.filter(lambda v: not isinstance(v, dict | str)))
        return path, _messages(path, [{"role": "user", "content": [block]}])
    if kind == "role":
        role = draw(NAMES.filter(lambda r: r not in ("user", "assistant")))
        return path, _messages(path, [{"role": role, "content": "x"}])
    asked = json.loads(json.dumps(ASKED[MESSAGES]))
    asked["content"][0]["input"] = draw(VALUES.filter(lambda v: not isinstance(v, dict)))
    return path, _messages(path, [*USER, asked])


@st.composite
def maybe_valid(draw):
    """(path, body): bodies an API may take or refuse: bad JSON text in a call's
    arguments, deep objects in a call's input, odd text, unknown fields of any value."""
    path = draw(st.sampled_from(ALL))
    text = draw(st.text(max_size=40))
    kind = draw(st.sampled_from(("arguments", "deep", "text", "extra")))
    body = dict(GOOD[path])
    if kind == "extra":
        names = st.text(max_size=10).filter(lambda n: n not in FIELDS.get(path, {"prompt": 1}))
        body.update(draw(st.dictionaries(names, VALUES, max_size=3)))
        return path, body
    if kind == "text" or path == COMPLETIONS:
        if path == COMPLETIONS:
            body["prompt"] = text or "x"
        elif path == RESPONSES:
            body["input"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
        return path, body
    bad = draw(st.sampled_from(("{", '{"a": ', "[1, 2", "not json", "{'a': 1}", ""))) + text
    value = nested(draw(DEPTHS), {"a": 1})
    if path == CHAT:
        asked = json.loads(json.dumps(ASKED[CHAT]))
        function = asked["tool_calls"][0]["function"]
        function["arguments"] = bad if kind == "arguments" else {"deep": value}
        tool = {"role": "tool", "tool_call_id": "call_1", "content": "3"}
        body["messages"] = [*USER, asked, tool]
    elif path == RESPONSES:
        call = dict(ASKED[RESPONSES], arguments=bad if kind == "arguments" else json.dumps(value))
        output = {"type": "function_call_output", "call_id": "call_1", "output": "3"}
        body["input"] = [{"role": "user", "content": "Hello"}, call, output]
    else:
        asked = json.loads(json.dumps(ASKED[MESSAGES]))
        asked["content"][0]["input"] = {"text": bad} if kind == "arguments" else {"deep": value}
        result = {"type": "tool_result", "tool_use_id": "call_1", "content": "3"}
        body["messages"] = [*USER, asked, {"role": "user", "content": [result]}]
    return path, body


@st.composite
def raw_bodies(draw):
    """(path, bytes, content type, the statuses it may get): bodies that are no JSON
    object, or not sent as JSON."""
    path = draw(st.sampled_from(ALL))
    good = json.dumps(GOOD[path]).encode()
    kind = draw(
        st.sampled_from(
            (
                "empty",
                "bytes",
                "not-utf8",
                "cut",
                "not-an-object",
                "surrogate",
                "deep",
                "type",
                "no-type",
            )
        )
    )
    json_type_ = "application/json"
    if kind == "empty":
        return path, b"", json_type_, {400}
    if kind == "bytes":
        return path, draw(st.binary(max_size=64)), json_type_, {400}
    if kind == "not-utf8":
        bad = draw(st.sampled_from((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80")))
        return path, good.replace(b"Hello", b"Hel" + bad + b"lo"), json_type_, {400}
    if kind == "cut":
        return path, good[: draw(st.integers(1, len(good) - 1))], json_type_, {400}
    if kind == "not-an-object":
        value = draw(VALUES.filter(lambda v: not isinstance(v, dict)))
        return path, json.dumps(value).encode(), json_type_, {400}
    if kind == "surrogate":
        lone = draw(st.sampled_from((b"\\ud800", b"\\udfff", b"\\uDBFF x", b"\\udc00\\ud800")))
        return path, good.replace(b"Hello", b"Hel" + lone + b"lo"), json_type_, {400}
    if kind == "deep":
        opener = draw(st.sampled_from((b"[", b'{"a":')))
        closer = b"]" if opener == b"[" else b"}"
        most = (BODY_LIMIT - 16) // (len(opener) + 1)  # under the body limit
        depth = draw(st.integers(min_value=1000, max_value=most))
        body = b'{"x": ' + opener * depth + b"1" + closer * depth + b"}"
        return path, body, json_type_, {400}
    if kind == "type":
        other = draw(
            st.sampled_from(
                (
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "multipart/form-data; boundary=x",
                    "application/jsonx",
                    "application/octet-stream",
                )
            )
        )
        return path, good, other, {415}
    return path, good, None, {415}


# -- the fuzz ----------------------------------------------------------------------------------


@FUZZ
@given(case=wrong_types())
def test_a_field_of_the_wrong_json_type_is_a_400(client, server, case):
    path, body = case
    refused(post(client, path, body), path, {400})


@FUZZ
@given(case=malformed())
def test_a_malformed_conversation_is_a_400(client, server, case):
    path, body = case
    refused(post(client, path, body), path, {400})


@FUZZ
@given(case=maybe_valid())
def test_a_body_that_may_be_valid_is_answered_or_refused(client, server, case):
    path, body = case
    answered_or_refused(post(client, path, body), path)


@FUZZ
@given(case=raw_bodies())
def test_bytes_that_are_no_json_object_are_refused(client, server, case):
    path, data, kind, statuses = case
    refused(post(client, path, data, {"content-type": kind}), path, statuses)


@pytest.mark.parametrize("path", ALL)
@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_a_body_over_the_limit_is_a_413(client, server, path, chunked):
    text = "x" * (BODY_LIMIT + 1)
    body = json.dumps({**GOOD[path], "junk": text}).encode()
    if chunked:  # no Content-Length: counted as it is read

        def pieces():
            for start in range(0, len(body), 4096):
                yield body[start : start + 4096]

        data = pieces()
    else:
        data = body
    error = refused(post(client, path, data), path, {413})
    assert error["type" if path.startswith(MESSAGES) else "code"] == "request_too_large"


KNOWN = {  # bodies that once got a 500 (or a 200): each a 400 now
    "seed below 0": (CHAT, {**GOOD[CHAT], "seed": -1, "temperature": 1}),
    "seed past 64 bits": (COMPLETIONS, {**GOOD[COMPLETIONS], "seed": 2**64}),
    "a template of the client's": (
        CHAT,
        {**GOOD[CHAT], "chat_template_kwargs": {"chat_template": "{% if %}"}},
    ),
    "continue_final_message": (
        CHAT,
        {**GOOD[CHAT], "chat_template_kwargs": {"continue_final_message": True}},
    ),
    "documents not a list": (CHAT, {**GOOD[CHAT], "chat_template_kwargs": {"documents": 5}}),
    "a tool message before any call": (
        CHAT,
        _chat([*USER, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]),
    ),
    "an output of no call": (
        RESPONSES,
        _responses([{"type": "function_call_output", "call_id": "call_1", "output": "3"}]),
    ),
    "a result of no tool_use": (
        MESSAGES,
        _messages(
            MESSAGES,
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1"}]}],
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_bad_bodies_are_a_400(client, server, name):
    path, body = KNOWN[name]
    refused(post(client, path, body), path, {400})


SCHEMA = {"type": "object", "properties": {}}
ANTHROPIC_TOOLS = {  # what Anthropic's API refuses with a 400 and this server takes
    "a name twice": [{"name": "f", "input_schema": SCHEMA}, {"name": "f", "input_schema": SCHEMA}],
    "a description not a string": [{"name": "f", "description": 5, "input_schema": SCHEMA}],
}


@pytest.mark.parametrize("path", (MESSAGES, COUNT))
@pytest.mark.parametrize("name", sorted(ANTHROPIC_TOOLS))
def test_messages_tools_anthropic_refuses_are_a_400(client, server, path, name):
    body = {**GOOD[path], "tools": ANTHROPIC_TOOLS[name], "tool_choice": {"type": "any"}}
    refused(post(client, path, body), path, {400})


NOT_TEXT = {  # bytes in place of "Hello" that are no Unicode text
    "an encoded surrogate": b"\xed\xa0\x80",
    "a high surrogate escape": b"\\ud800",
    "a low surrogate escape": b"\\udfff",
    "surrogate escapes the wrong way round": b"\\udc00\\ud800",
    "no UTF-8": b"\xff",
}


@pytest.mark.parametrize("path", ALL)
def test_text_that_is_no_unicode_is_a_400(client, server, path):
    good = json.dumps(GOOD[path]).encode()
    for bad in NOT_TEXT.values():
        refused(post(client, path, good.replace(b"Hello", bad)), path, {400})
    pair = good.replace(b"Hello", b"\\ud83d\\ude00")  # an emoji as JSON escapes it
    answered(post(client, path, pair), path)


@pytest.mark.parametrize("path", ALL)
def test_json_nested_past_the_readers_depth_is_a_400(client, server, path):
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        depth = (BODY_LIMIT - 16) // (len(opener) + 1)
        body = b'{"x": ' + opener * depth + b"1" + closer * depth + b"}"
        refused(post(client, path, body), path, {400})
        refused(post(client, path, opener * depth), path, {400})


# A template in the way of Gemma's and Mistral's: it raises unless the turns alternate,
# starting with the user's.
STRICT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("strict-llama"))
    make_tiny_tokenizer(directory, chat_template=STRICT_TEMPLATE)
    with Engine.load(directory, block_size=BLOCK, parallel=2) as e:
        with ApiServer(e, port=0, max_pending=MAX_PENDING).start() as srv:
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
                yield srv, c


@pytest.mark.parametrize("path", MODEL_APIS)
def test_a_conversation_the_template_refuses_is_a_400(strict, path):
    srv, c = strict
    system = "You answer briefly."  # a system turn first: this template refuses it
    body = {
        CHAT: _chat([{"role": "system", "content": system}, *USER]),
        RESPONSES: {**GOOD[RESPONSES], "instructions": system},
        MESSAGES: {**GOOD[MESSAGES], "system": system},
        COUNT: {**GOOD[COUNT], "system": system},
    }[path]
    error = refused(post(c, path, body), path, {400})
    assert "alternate" in error["message"], error
    answered(post(c, path, GOOD[path]), path)
    settled(srv)


def test_the_server_still_serves_after_the_fuzz(client, server):
    still_serving(client, server)


def test_each_api_refuses_with_429_in_its_shape(client, server, monkeypatch):
    monkeypatch.setattr(server.app.state.handlers, "max_pending", 0)
    for path in JOURNALLED:
        error = refused(post(client, path, GOOD[path]), path, {429})
        assert error["type"] == "rate_limit_error", error
        if not path.startswith(MESSAGES):
            assert error["code"] == "rate_limit_exceeded", error
    monkeypatch.undo()
    still_serving(client, server)


def read_one(sock: socket.socket, buffer: bytes = b"") -> tuple[int, dict, bytes]:
    """One response of a kept-alive connection: (status, JSON body, bytes after it)."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {buffer!r}"
        buffer += chunk
    top, _, rest = buffer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in top.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        rest += chunk
    return int(top.split()[1]), json.loads(rest[:length]), rest[length:]


@pytest.mark.parametrize("path", (CHAT, MESSAGES))
def test_an_unforeseen_error_is_a_500_in_shape_and_the_connection_serves_on(
    client, server, monkeypatch, path
):
    """A fault injected into the real server (no request above makes one any more): its
    500 is in the API's shape, and the client's kept-alive connection takes its next
    request (Starlette's own 500 handler raised again, and uvicorn closed it)."""

    def broken(request):
        raise RuntimeError("injected\nfault")

    body = json.dumps(GOOD[path]).encode()
    request = (
        f"POST /v1{path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        monkeypatch.setattr(server.app.state.handlers.gate, "check_host", broken)
        sock.sendall(request)
        status, error, rest = read_one(sock)
        monkeypatch.undo()
        assert status == 500
        shaped = error_of(_Seen(json.dumps(error), 500, JSON), path)
        assert shaped["type"] in ("server_error", "api_error"), error
        sock.sendall(request)
        status, answer, _ = read_one(sock, rest)
    assert status == 200 and answer["usage"], answer
    settled(server)


# -- slow clients ----------------------------------------------------------------------------------


def head(server, path: str, length: int) -> bytes:
    return (
        f"POST /v1{path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of a response read to the connection's close."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    status = int(top.split()[1])
    return status, json.loads(rest)


def served_meanwhile(client, done: threading.Event) -> int:
    """Good requests answered while `done` is not set (at least one)."""
    count = 0
    while True:
        answered(post(client, CHAT, GOOD[CHAT]), CHAT)
        count += 1
        if done.is_set():
            return count


@pytest.mark.parametrize("path", (CHAT, MESSAGES))
def test_a_slow_body_is_answered_while_others_are_served(client, server, path):
    body = json.dumps(GOOD[path]).encode()
    slow, fast = body[:-12], body[-12:]  # the last 12 bytes one at a time: some 3 s
    finished = threading.Event()
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head(server, path, len(body)) + slow)
        meanwhile = []
        other = threading.Thread(
            target=lambda: meanwhile.append(served_meanwhile(client, finished))
        )
        other.start()
        try:
            for byte in fast:
                time.sleep(0.25)
                sock.sendall(bytes([byte]))
        finally:
            finished.set()
            other.join(TIMEOUT)
        status, answer = read_response(sock)
    assert meanwhile and meanwhile[0] >= 1
    assert status == 200, answer
    assert answer["usage"]
    settled(server)


@pytest.mark.parametrize("path", JOURNALLED)
def test_a_client_gone_mid_body_holds_no_place(client, server, path):
    body = json.dumps(GOOD[path]).encode()
    before = {e.number for e in server.journal.entries()}
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head(server, path, len(body) + 100))
        for byte in body[:8]:  # some 2 s of a body that never ends
            sock.sendall(bytes([byte]))
            time.sleep(0.25)
        answered(post(client, CHAT, GOOD[CHAT]), CHAT)  # served meanwhile
    deadline = time.monotonic() + 30
    gone = []
    while not gone and time.monotonic() < deadline:
        new = [e for e in server.journal.entries() if e.number not in before]
        gone = [e for e in new if e.endpoint == f"/v1{path}" and e.status == 499]
        time.sleep(0.05)
    assert gone, [e.as_dict() for e in server.journal.entries() if e.number not in before]
    assert gone[0].finish is not None and gone[0].prompt_tokens == 0
    settled(server)
    still_serving(client, server)


IDLE_S = 3  # the idle timeout of `impatient`: a body that stops this long is dropped


@pytest.fixture(scope="module")
def impatient(engine):
    srv = ApiServer(engine, port=0, idle_timeout_s=IDLE_S, max_pending=MAX_PENDING).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("path", (CHAT, MESSAGES))
def test_a_body_that_stops_coming_is_dropped_after_the_idle_timeout(impatient, path):
    """The idle timer runs while a body comes: a client that sends part of its body and
    then nothing is disconnected (journalled 499); one whose bytes come more often than
    that is answered."""
    body = json.dumps(GOOD[path]).encode()
    before = {e.number for e in impatient.journal.entries()}
    with socket.create_connection(("127.0.0.1", impatient.port), timeout=TIMEOUT) as sock:
        sock.sendall(head(impatient, path, len(body)) + body[:10])
        try:
            closed = sock.recv(65536)  # blocks until the server gives up on the body
        except ConnectionResetError:
            closed = b""
    assert closed == b"", closed
    deadline = time.monotonic() + 30
    gone = []
    while not gone and time.monotonic() < deadline:
        new = [e for e in impatient.journal.entries() if e.number not in before]
        gone = [e for e in new if e.status == 499 and e.finish is not None]
        time.sleep(0.05)
    assert gone, [e.as_dict() for e in impatient.journal.entries() if e.number not in before]
    settled(impatient)
    with socket.create_connection(("127.0.0.1", impatient.port), timeout=TIMEOUT) as sock:
        sock.sendall(head(impatient, path, len(body)) + body[:-20])
        for byte in body[-20:]:  # a gap far under the timeout: some 2 s in all
            time.sleep(0.1)
            sock.sendall(bytes([byte]))
        status, answer = read_response(sock)
    assert status == 200 and answer["usage"], answer
    settled(impatient)


# -- a thousand at once -------------------------------------------------------------------------


def at_once_body(i: int) -> tuple[str, dict]:
    """The i-th request: every API in turn, one in seven streamed, max 1 token."""
    path = ALL[i % len(ALL)]
    body = dict(GOOD[path])
    if path != COUNT and i % 7 == 0:
        body["stream"] = True
    return path, body


async def fire(url: str, n: int) -> list[tuple[str, int, str, str]]:
    """n requests at once: (path, status, content type, text) of each."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    timeout = httpx.Timeout(600, connect=600)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def one(i: int):
            path, body = at_once_body(i)
            response = await client.post(path, json=body)
            kind = response.headers.get("content-type", "")
            return path, response.status_code, kind, response.text

        return await asyncio.gather(*(one(i) for i in range(n)))


JSON = "application/json"


class _Seen:
    def __init__(self, text: str, status: int, kind: str) -> None:
        self.text, self.status_code = text, status
        self.headers = {"content-type": kind}

    def json(self):
        return json.loads(self.text)


@pytest.mark.timeout(600)
def test_a_thousand_at_once_are_answered_or_refused(server):
    entries: dict[int, object] = {}
    first = server.journal.entries()[-1].number if server.journal.entries() else 0
    unwatch = server.journal.watch(lambda e: e.number > first and entries.setdefault(e.number, e))
    try:
        results = asyncio.run(fire(server.url, AT_ONCE))
        settled(server, timeout=120)
        deadline = time.monotonic() + 60  # the journal's last finishes come after the bytes
        while time.monotonic() < deadline and any(e.finish is None for e in entries.values()):
            time.sleep(0.05)
    finally:
        unwatch()
    assert len(results) == AT_ONCE
    ok = {path: 0 for path in ALL}
    busy = {path: 0 for path in ALL}
    for path, status, kind, text in results:
        response = _Seen(text, status, kind)
        if status == 429:
            assert path in JOURNALLED
            assert refused(response, path, {429})["type"] == "rate_limit_error"
            busy[path] += 1
        else:
            answered(response, path)
            ok[path] += 1
    assert sum(ok.values()) + sum(busy.values()) == AT_ONCE
    journalled = [e for e in entries.values() if e.endpoint in {f"/v1{p}" for p in JOURNALLED}]
    assert len(journalled) == AT_ONCE - AT_ONCE // len(ALL), (ok, busy)
    assert all(e.finish is not None for e in journalled)
    assert sum(e.status == 429 for e in journalled) == sum(busy.values()), (ok, busy)
    answers = [e for e in journalled if e.finish in ("length", "stop")]
    assert len(answers) == sum(ok[p] for p in JOURNALLED), (ok, busy)
    assert in_flight(server) == 0
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        still_serving(client, server)
