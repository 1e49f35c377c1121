"""Anthropic's Messages API wire format: a request checked into a `Call` over the shared
conversation form (`agentio`), and the message, stream-event, usage and error shapes.

Terms:

- *body*: the request's JSON object, as Claude Code and the ``anthropic`` SDK send it.
  Fields this server does not know are ignored (``metadata``, ``thinking``,
  ``context_management``, ``output_config``, ``top_k``, ``cache_control`` on any block...);
  a known field of the wrong type is an `APIError` (status 400) naming it.
- *conversation*: ``system`` and ``messages`` rendered as chat-format messages: the system
  text first (Claude Code's billing line, ``x-anthropic-billing-header: ...``, left out; a
  system turn in ``messages`` before any other joins it, a later one joins the user turn
  it follows: templates take a system message first only), consecutive turns of one role
  joined (as Anthropic's API combines them), text blocks joined by newlines, ``thinking``
  blocks as the assistant's ``reasoning_content`` (``redacted_thinking`` dropped: opaque),
  ``tool_use`` blocks as the assistant's ``tool_calls`` (``input`` as JSON text), each
  ``tool_result`` block as a ``tool`` message
  (``tool_call_id``: its ``tool_use_id``, which an earlier ``tool_use`` must have issued),
  base64 ``image`` blocks as ``{"type": "image"}`` parts with their bytes in `Call.images`.
- *tools*: custom tools (``name``, ``description``, ``input_schema``) as chat-format
  function tools; Anthropic's own tool types (web search, code execution...) are skipped,
  and so are deferred tools (``defer_loading``) until a ``tool_reference`` block loads them.
  ``tool_choice`` becomes the chat form's: ``auto`` "auto", ``any`` "required", ``tool`` a
  named function, ``none`` "none".
- *blocks*: the answer's content blocks, built from the `agentio` pieces the output splitter
  gives (`Blocks`): text, thinking (with a signature) and tool_use blocks, and the stream
  events that open, fill and close them.

Nothing here knows the engine or the HTTP stack; `messages` joins them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
import uuid
from typing import Any

from mlx_nbengine.server.agentio import Reasoning, Text, ToolCall
from mlx_nbengine.server.openai_shapes import APIError, Call, Limits

__all__ = [
    "Blocks",
    "check_messages",
    "error_body",
    "error_type",
    "message_response",
    "new_message_id",
    "stop_reason",
    "too_long",
    "usage",
]

# Anthropic's error type for each status this server answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "api_error",
    500: "api_error",
    503: "api_error",
    529: "overloaded_error",
}

# The first system block Claude Code sends: a billing header, not prompt text (its value
# changes between sessions and versions; Anthropic's API strips it).
BILLING = "x-anthropic-billing-header:"

# Blocks of Anthropic's own (server) tools in a conversation: this server issues none and
# runs none, so a client's record of them is skipped.
SERVER_BLOCKS = (
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "container_upload",
)


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


_TOO_LONG = re.compile(r"the prompt has (\d+) tokens but the model's context holds (\d+)")


def too_long(message: str) -> tuple[int, int] | None:
    """(prompt tokens, the most a prompt may hold) from the engine's prompt-too-long line;
    None for another message. The engine keeps one place for a generated token, so the
    most is the context less one."""
    found = _TOO_LONG.search(message)
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2)) - 1


# -- field checks ------------------------------------------------------------------------------


def _bad(message: str) -> APIError:
    return APIError(message)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{name}: must be a number, got {value!r}")
    if not low <= value <= high:
        raise _bad(f"{name}: must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _max_tokens(body: dict, limits: Limits) -> int:
    """``max_tokens``; more than the context is clamped to it (Claude Code asks 128,000);
    without one, the context (or the server's default)."""
    value = body.get("max_tokens")
    if value is None:
        return limits.context or limits.default_max_tokens
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"max_tokens: must be an integer, got {value!r}")
    if value < 1:
        raise _bad(f"max_tokens: must be at least 1, got {value}")
    if limits.context is not None and value > limits.context:
        return limits.context
    return value


def _stop_sequences(body: dict) -> list[str]:
    value = body.get("stop_sequences")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise _bad(f"stop_sequences: must be a list of non-empty strings, got {value!r}")
    return list(value)


def _stream(body: dict) -> bool:
    value = body.get("stream", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"stream: must be true or false, got {value!r}")
    return value


# -- the conversation ----------------------------------------------------------------------------


def _text_of(value: Any, where: str) -> str:
    """``system`` or a tool result's text: a string or a list of text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{where}: must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or not isinstance(block.get("text"), str):
            raise _bad(f"{where}.{j}: must be a text block ({{'type': 'text', 'text': ...}})")
        texts.append(block["text"])
    return "\n".join(texts)


def _image(block: dict, where: str, images: list[bytes], *, vision: bool) -> None:
    """A base64 image block's bytes, appended to `images`."""
    if not vision:
        raise _bad(f"{where}: this model reads text only; load a vision model to send images")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind != "base64":
        raise _bad(
            f"{where}: images must have a base64 source ({{'type': 'base64', 'media_type': "
            f"..., 'data': ...}}), got {kind!r}; this server fetches nothing from the network"
        )
    try:
        images.append(base64.b64decode(source.get("data") or "", validate=True))
    except (binascii.Error, ValueError, TypeError):
        raise _bad(f"{where}: the image's data is not valid base64") from None


def _document(block: dict, where: str) -> str:
    """A document block with a plain-text source, as text."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "text":
        data = source.get("data")
        if isinstance(data, str):
            return data
    if isinstance(source, dict) and source.get("type") == "content":
        return _text_of(source.get("content"), f"{where}.source.content")
    raise _bad(f"{where}: this server reads documents with a text source only (no PDFs)")


class _Conversation:
    """Anthropic's ``system`` and ``messages`` turned into chat-format messages."""

    def __init__(self, *, vision: bool) -> None:
        self.vision = vision
        self.out: list[dict] = []
        self.images: list[bytes] = []
        self.issued: dict[str, str] = {}  # tool_use id -> tool name
        self.referenced: set[str] = set()  # deferred tools a tool_reference block loaded

    def system(self, value: Any, where: str = "system") -> None:
        """``system`` (or a system turn in ``messages``): Claude Code's billing line (a
        header it sends as the first system block, which Anthropic's API strips) is left
        out, so that the prompt's start is the same in every session."""
        if value is None:
            return
        blocks = [{"type": "text", "text": value}] if isinstance(value, str) else value
        if isinstance(blocks, list):
            blocks = [
                b
                for b in blocks
                if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING))
            ]
        text = _text_of(blocks, where)
        if not text:
            return
        if all(m["role"] == "system" for m in self.out):  # the leading system text
            if self.out:
                self.out[0]["content"] += "\n" + text
            else:
                self.out.append({"role": "system", "content": text})
        else:  # mid-conversation: what the user turn carries (templates take system first)
            self._add({"role": "user", "content": text})

    def _add(self, message: dict) -> None:
        """Append `message`; a user or assistant message right after one of the same role
        joins it (Anthropic's API combines consecutive turns of a role too)."""
        last = self.out[-1] if self.out else None
        role = message["role"]
        if last is None or last["role"] != role or role not in ("user", "assistant"):
            self.out.append(message)
            return
        if role == "user":
            last["content"] = _concat(last["content"], message["content"])
            return
        last["content"] = "\n".join(t for t in (last["content"], message["content"]) if t)
        for key in ("reasoning_content",):
            if message.get(key):
                last[key] = "\n".join(t for t in (last.get(key), message[key]) if t)
        if message.get("tool_calls"):
            last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]

    def message(self, message: Any, index: int) -> None:
        where = f"messages.{index}"
        if not isinstance(message, dict):
            raise _bad(f"{where}: must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}")
        content = message.get("content")
        if role == "system":  # Claude Code's mid-conversation system turns
            self.system(content, f"{where}.content")
            return
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise _bad(f"{where}.content: must be a string or a list of content blocks")
        if role == "assistant":
            self._assistant(content, where)
        else:
            self._user(content, where)

    def _blocks(self, content: list, where: str):
        for j, block in enumerate(content):
            place = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(kind, str):
                raise _bad(f"{place}: must be a content block with a 'type'")
            yield place, kind, block

    def _assistant(self, content: list, where: str) -> None:
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        for place, kind, block in self._blocks(content, where):
            if kind == "text":
                texts.append(_string(block, "text", place))
            elif kind == "thinking":
                reasoning.append(_string(block, "thinking", place))
            elif kind == "tool_use":
                id_, name = _string(block, "id", place), _string(block, "name", place)
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise _bad(f"{place}.input: must be an object")
                self.issued[id_] = name
                calls.append(
                    {
                        "id": id_,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(arguments)},
                    }
                )
            elif kind == "redacted_thinking" or kind in SERVER_BLOCKS:
                continue
            else:
                raise _bad(f"{place}: an assistant turn cannot hold a {kind!r} block")
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        self._add(message)

    def _user(self, content: list, where: str) -> None:
        parts: list[dict] = []  # the user message's text and image parts, in order
        for place, kind, block in self._blocks(content, where):
            if kind == "text":
                parts.append({"type": "text", "text": _string(block, "text", place)})
            elif kind == "image":
                _image(block, place, self.images, vision=self.vision)
                parts.append({"type": "image"})
            elif kind == "document":
                parts.append({"type": "text", "text": _document(block, place)})
            elif kind == "tool_result":
                parts.extend(self._tool_result(block, place))
            elif kind in SERVER_BLOCKS:
                continue
            else:
                raise _bad(
                    f"{place}: a user turn holds text, image, document and tool_result "
                    f"blocks, not {kind!r}"
                )
        if parts:
            self._add({"role": "user", "content": _joined(parts)})

    def _tool_result(self, block: dict, place: str) -> list[dict]:
        """Append the ``tool`` message; return image parts for the user message after."""
        id_ = _string(block, "tool_use_id", place)
        if id_ not in self.issued:
            raise _bad(
                f"{place}: tool_result block with tool_use_id {id_!r} answers no tool_use "
                "block of an earlier assistant turn"
            )
        content = block.get("content", "")
        texts: list[str] = []
        images: list[dict] = []
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for k, part in enumerate(content):
                inner = f"{place}.content.{k}"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    _image(part, inner, self.images, vision=self.vision)
                    images.append({"type": "image"})
                elif kind == "document":
                    texts.append(_document(part, inner))
                elif kind == "tool_reference" and isinstance(part.get("tool_name"), str):
                    self.referenced.add(part["tool_name"])  # a deferred tool, loaded now
                    texts.append(f"Tool {part['tool_name']} loaded.")
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    texts.append(part["text"])  # text, search results' text...
                elif not isinstance(part, dict) or not isinstance(kind, str):
                    raise _bad(f"{inner}: must be a content block with a 'type'")
        elif content is not None:
            raise _bad(f"{place}.content: must be a string or a list of content blocks")
        text = "\n".join(texts)
        if block.get("is_error") is True:
            text = f"Error: {text}"
        self.out.append(
            {"role": "tool", "tool_call_id": id_, "name": self.issued[id_], "content": text}
        )
        return images


def _string(block: dict, name: str, place: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise _bad(f"{place}.{name}: must be a string")
    return value


def _concat(a: Any, b: Any) -> Any:
    """Two user contents as one (text joined by a newline; parts where there are images)."""
    if isinstance(a, str) and isinstance(b, str):
        return "\n".join(t for t in (a, b) if t)

    def parts(c: Any) -> list[dict]:
        return [{"type": "text", "text": c}] if isinstance(c, str) else list(c)

    return [*parts(a), *parts(b)]


def _joined(parts: list[dict]) -> Any:
    """A user message's content: its text parts joined by newlines, or the parts as they
    are where there are images (the chat template places them)."""
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _tools(body: dict, referenced: set[str]) -> list[dict] | None:
    """The custom tools as chat-format function tools: Anthropic's own tools are skipped,
    and so are deferred ones (``defer_loading``) until a ``tool_reference`` block in the
    conversation loads them (`referenced`), as Anthropic's API shows them."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad(f"tools: must be a list of tools, got {type(tools).__name__}")
    out: list[dict] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools.{i}: must be an object")
        if tool.get("type") not in (None, "custom"):
            continue  # web_search_..., bash_..., text_editor_...: Anthropic's own tools
        name = tool.get("name")
        schema = tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools.{i}.name: must be a non-empty string")
        if not isinstance(schema, dict):
            raise _bad(f"tools.{i}.input_schema: must be a JSON schema object")
        if name in names:
            raise _bad(f"tools.{i}.name: the tool name {name!r} is given twice")
        names.add(name)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"tools.{i}.description: must be a string")
        if tool.get("defer_loading") is True and name not in referenced:
            continue
        function = {"name": name, "parameters": schema}
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[Any, bool]:
    """The chat form's ``tool_choice`` and whether parallel calls are allowed."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else None), True
    if not isinstance(choice, dict):
        raise _bad(f"tool_choice: must be an object with a 'type', got {choice!r}")
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind == "auto":
        return ("auto" if tools else None), parallel
    if kind == "none":
        return "none", parallel
    if kind not in ("any", "tool"):
        raise _bad(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")
    if not tools:
        raise _bad(f"tool_choice: {kind!r} needs at least one tool in 'tools'")
    if kind == "any":
        return "required", parallel
    name = choice.get("name")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise _bad(f"tool_choice.name: {name!r} is not one of the tools ({', '.join(names)})")
    return {"type": "function", "function": {"name": name}}, parallel


def check_messages(body: dict, limits: Limits, *, vision: bool) -> Call:
    """A ``/v1/messages`` (or ``count_tokens``) body as a `Call`; `vision`: the model reads
    images. ``thinking: {"type": "disabled"}`` renders with ``enable_thinking: False``;
    other thinking settings leave the template's default."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: must be a non-empty list of messages")
    if len(messages) > limits.max_messages:
        raise _bad(
            f"messages: {len(messages)} messages; this server takes at most {limits.max_messages}"
        )
    conversation = _Conversation(vision=vision)
    conversation.system(body.get("system"))
    for i, message in enumerate(messages):
        conversation.message(message, i)
    if len(conversation.images) > limits.max_images:
        raise _bad(
            f"messages: {len(conversation.images)} images; this server takes at most "
            f"{limits.max_images}"
        )
    tools = _tools(body, conversation.referenced)
    choice, parallel = _tool_choice(body, tools)
    thinking = body.get("thinking")
    template_kwargs = {}
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        template_kwargs["enable_thinking"] = False  # a template that can think is told not to
    return Call(
        prompt=conversation.out,
        max_tokens=_max_tokens(body, limits),
        temperature=_number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        stop=_stop_sequences(body),
        stream=_stream(body),
        images=conversation.images,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        template_kwargs=template_kwargs,
    )


# -- the answer ------------------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic writes them (``toolu_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """A thinking block's signature: opaque to clients (who pass it back unread by us)."""
    return hashlib.sha256(thinking.encode()).hexdigest()[:32]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` the prompt tokens computed now, those
    restored from the cache ``cache_read_input_tokens``."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": completion_tokens,
    }


def stop_reason(completion: Any, tool_calls: int, stops: list[str]) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a finished answer."""
    if tool_calls:
        return "tool_use", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    reason = getattr(completion, "stop_reason", None)
    if reason in stops:
        return "stop_sequence", reason
    return "end_turn", None


def message_response(
    id_: str,
    model: str,
    content: list[dict],
    reason: str | None,
    sequence: str | None,
    use: dict,
) -> dict[str, Any]:
    return {
        "id": id_,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": use,
    }


Event = tuple[str, dict[str, Any]]


class Blocks:
    """The answer's content blocks, built from the output splitter's pieces, with the
    stream events that build them: consecutive text (or reasoning) pieces fill one text
    (or thinking) block, each tool call is a block of its own. `content` lists the blocks;
    `tool_calls` counts the calls."""

    def __init__(self) -> None:
        self.content: list[dict] = []
        self.tool_calls = 0
        self._open: str | None = None  # the kind of the last block while it is open

    def feed(self, pieces: list[Any]) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, Text) and piece.text:
                events += self._fill("text", piece.text)
            elif isinstance(piece, Reasoning) and piece.text:
                events += self._fill("thinking", piece.text)
            elif isinstance(piece, ToolCall):
                events += self._tool_use(piece)
        return events

    def close(self) -> list[Event]:
        """The events that close the open block (call once the answer ends)."""
        if self._open is None:
            return []
        index = len(self.content) - 1
        block = self.content[index]
        events: list[Event] = []
        if block["type"] == "thinking":
            block["signature"] = signature(block["thinking"])
            delta = {"type": "signature_delta", "signature": block["signature"]}
            events.append(_delta(index, delta))
        self._open = None
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return events

    def _fill(self, kind: str, text: str) -> list[Event]:
        events = [] if self._open == kind else [*self.close(), *self._start(kind)]
        index = len(self.content) - 1
        self.content[index][kind] += text
        key = "text_delta" if kind == "text" else "thinking_delta"
        events.append(_delta(index, {"type": key, kind: text}))
        return events

    def _start(self, kind: str) -> list[Event]:
        block = {"type": "text", "text": ""}
        if kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        self.content.append(block)
        self._open = kind
        start = {"type": "content_block_start", "index": len(self.content) - 1}
        return [("content_block_start", {**start, "content_block": dict(block)})]

    def _tool_use(self, call: ToolCall) -> list[Event]:
        events = self.close()
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # not an object: handed on as the text it is
            arguments = {"arguments": call.arguments}
        block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}}
        index = len(self.content)
        self.content.append({**block, "input": arguments})
        self.tool_calls += 1
        start = {"type": "content_block_start", "index": index, "content_block": block}
        events.append(("content_block_start", start))
        if arguments:
            text = json.dumps(arguments, ensure_ascii=False)
            events.append(_delta(index, {"type": "input_json_delta", "partial_json": text}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return events


def _delta(index: int, delta: dict) -> Event:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
