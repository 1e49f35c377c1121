"""OpenAI's wire format: requests checked into plain values, and the response, chunk and
error shapes built from an engine's results.

Terms:

- *body*: the request's JSON object. Fields this server does not know are ignored (clients
  send many: ``user``, ``frequency_penalty``...); a known field of the wrong type or out of
  range is an `APIError` naming it (``param``), status 400.
- *call*: what a checked body asks of the engine (`Call`): the prompt (chat messages, text
  or token ids), the images, the sampling values, ``stream`` and ``include_usage``; for
  chat, the tools, ``tool_choice``, ``parallel_tool_calls`` and what else the chat template
  reads (``reasoning_effort``, ``chat_template_kwargs``).
- *tool messages*: an assistant message may carry ``tool_calls`` (each ``{"id", "type":
  "function", "function": {"name", "arguments": JSON text}}``); a ``tool`` message answers
  one (``tool_call_id``, ``content``). The answer carries the model's calls the same way
  (``message.tool_calls``, ``finish_reason: "tool_calls"``) and its reasoning apart from its
  text (``reasoning_content``); a stream sends them as ``delta.tool_calls`` (with
  ``index``) and ``delta.reasoning_content``.
- *error shape*: ``{"error": {"message", "type", "param", "code"}}``, as OpenAI sends it.

Nothing here knows the engine or the HTTP stack; `app` joins them.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "APIError",
    "Call",
    "Limits",
    "chat_chunk",
    "chat_response",
    "check_chat",
    "check_completion",
    "completion_chunk",
    "completion_response",
    "error_body",
    "models_response",
    "new_id",
    "tool_call_delta",
    "tool_call_shape",
    "usage",
]

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4  # OpenAI's limit on `stop` strings


@dataclass(frozen=True)
class Limits:
    """What one request may ask. `context` is the model's context (None: unknown)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_messages: int = 1024
    max_images: int = 16
    context: int | None = None
    default_max_tokens: int = 4096  # when neither the request nor the model says


class APIError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",  # noqa: A002
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class Call:
    """A checked request: what to submit and how to answer."""

    prompt: Any  # chat messages, text or token ids
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    images: list[bytes] = field(default_factory=list)
    tools: list[dict] | None = None
    # None or "auto": the model may call; "none": it may not (the template is not shown the
    # tools); "required" or {"type": "function", "function": {"name": N}}: a call is forced.
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # more for the template

    @property
    def forced(self) -> bool:
        """A tool call is required (``tool_choice`` "required" or a named function)."""
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        )

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools the model is shown and may call (none with ``tool_choice: "none"``)."""
        return None if self.tool_choice == "none" else self.tools


# -- field checks ------------------------------------------------------------------------------


def _bad(param: str, message: str, *, code: str | None = None) -> APIError:
    return APIError(message, param=param, code=code)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, f"'{name}' must be a number, got {value!r}")
    if not low <= value <= high:
        raise _bad(name, f"'{name}' must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer, got {value!r}")
    return value


def _bool(body: dict, name: str, *, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be true or false, got {value!r}")
    return value


def _max_tokens(body: dict, limits: Limits) -> int:
    """``max_completion_tokens`` (the newer name) or ``max_tokens``; default: the context.
    More than the context is clamped to it (agents ask for 128,000), never refused."""
    newer = body.get("max_completion_tokens") is not None
    name = "max_completion_tokens" if newer else "max_tokens"
    value = _integer(body, name)
    if value is None:
        return limits.context or limits.default_max_tokens
    if value < 1:
        raise _bad(
            name, f"'{name}' must be at least 1, got {value}", code="integer_below_min_value"
        )
    if limits.context is not None and value > limits.context:
        return limits.context  # clamped: generation stops at the context's end anyway
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", f"'stop' must be a string or a list of non-empty strings, got {value!r}")
    if len(stops) > MAX_STOPS:
        raise _bad("stop", f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}")
    return list(stops)


def _common(body: dict, limits: Limits) -> dict[str, Any]:
    """The fields both endpoints take, checked."""
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise _bad("n", f"this server makes one choice per request ('n': 1), got {n}")
    if body.get("logprobs") not in (None, False):
        raise _bad("logprobs", "this server does not return logprobs")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", f"'stream_options' must be an object, got {options!r}")
    include_usage = _bool(options or {}, "include_usage")
    return {
        "max_tokens": _max_tokens(body, limits),
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        "seed": _integer(body, "seed"),
        "stop": _stop(body),
        "stream": _bool(body, "stream"),
        "include_usage": include_usage,
    }


def check_model(body: dict) -> str | None:
    """The request's ``model``: any name is taken while one model is loaded (agents send
    their own vendors' names, e.g. ``claude-opus-5-5``), and the answer names the loaded
    model; a ``model`` that is not a string is a 400."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"'model' must be a string, got {type(model).__name__}")
    return model


# -- chat --------------------------------------------------------------------------------------


def check_chat(body: dict, limits: Limits, *, vision: bool) -> Call:
    """A ``/v1/chat/completions`` body as a `Call`; `vision`: the model reads images."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of messages")
    if len(messages) > limits.max_messages:
        raise _bad(
            "messages",
            f"'messages' holds {len(messages)} messages; this server takes at most "
            f"{limits.max_messages}",
        )
    images: list[bytes] = []
    out = [_message(m, i, images, vision=vision) for i, m in enumerate(messages)]
    if len(images) > limits.max_images:
        raise _bad(
            "messages", f"{len(images)} images; this server takes at most {limits.max_images}"
        )
    tools = check_tools(body.get("tools"))
    choice = check_tool_choice(body.get("tool_choice"), tools)
    _tool_answers(out)
    return Call(
        prompt=out,
        images=images,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=_bool(body, "parallel_tool_calls", default=True),
        template_kwargs=_template_kwargs(body),
        **_common(body, limits),
    )


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _template_kwargs(body: dict) -> dict[str, Any]:
    """What else the chat template reads: ``chat_template_kwargs`` (an object, given to the
    template as it is, e.g. ``{"enable_thinking": false}``) and ``reasoning_effort``
    (given as it is to templates that read it; ``"none"`` also turns thinking off)."""
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise _bad(
            "chat_template_kwargs", f"'chat_template_kwargs' must be an object, got {extra!r}"
        )
    out: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise _bad(
                "reasoning_effort",
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
            )
        out["reasoning_effort"] = effort
        if effort == "none":
            out["enable_thinking"] = False
    # apply_chat_template's own arguments: a client may not swap the template or its output
    reserved = {
        "messages",
        "tools",
        "tokenize",
        "add_generation_prompt",
        "chat_template",
        "documents",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
    for key, value in (extra or {}).items():
        if key in reserved:
            raise _bad("chat_template_kwargs", f"'chat_template_kwargs' may not set {key!r}")
        out[key] = value
    return out


def check_tools(tools: Any, param: str = "tools") -> list[dict] | None:
    """Chat-format function tools, checked (``[{"type": "function", "function": {"name",
    "description", "parameters"}}]``); None for none."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad(param, f"'{param}' must be a list of tool objects, got {type(tools).__name__}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(where, f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{where}.function", f"{where}.function must be an object with a 'name'")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise _bad(
                f"{where}.function.name", f"{where}.function.name must be a non-empty string"
            )
        if name in names:
            raise _bad(f"{where}.function.name", f"{where}.function.name {name!r} is given twice")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(
                f"{where}.function.parameters",
                f"{where}.function.parameters must be a JSON schema object",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(
                f"{where}.function.description", f"{where}.function.description must be a string"
            )
    return tools or None


def check_tool_choice(choice: Any, tools: list[dict] | None) -> str | dict | None:
    """``tool_choice``: None, "auto", "none", "required" or ``{"type": "function",
    "function": {"name": N}}`` naming one of `tools`."""
    if choice is None or choice in ("auto", "none"):
        return choice
    if choice == "required":
        if not tools:
            raise _bad("tool_choice", "'tool_choice' is 'required' but no 'tools' are given")
        return choice
    name = None
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _bad(
            "tool_choice",
            "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', "
            f"'function': {{'name': ...}}}}, got {choice!r}",
        )
    known = [t["function"]["name"] for t in tools or []]
    if name not in known:
        raise _bad(
            "tool_choice",
            f"'tool_choice' names {name!r}, which is not one of the tools "
            f"({', '.join(known) or 'none given'})",
        )
    return {"type": "function", "function": {"name": name}}


def _tool_answers(messages: list[dict]) -> None:
    """Each tool message answers a call of an earlier assistant message, by its id where
    that message gave the call one (clients that send ids see a mismatch as the 400 it is);
    a tool message before any call answers nothing (OpenAI's 400 too)."""
    ids: set[str] = set()
    called = False
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or ():
            called = True
            if call.get("id"):
                ids.add(call["id"])
        if m["role"] == "tool" and not called:
            param = f"messages[{i}]"
            raise _bad(param, f"{param} is a tool message before any assistant tool call")
        if m["role"] == "tool" and ids and m.get("tool_call_id") not in ids:
            param = f"messages[{i}].tool_call_id"
            raise _bad(
                param, f"{param} {m.get('tool_call_id')!r} answers no earlier assistant tool call"
            )


def _message(message: Any, index: int, images: list[bytes], *, vision: bool) -> dict:
    """One chat message as the chat template takes it: text content a string (parts
    joined), image parts ``{"type": "image"}`` with their bytes appended to `images`."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(param, f"{param} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{param}.role", f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}")
    content = message.get("content")
    out = {k: v for k, v in message.items() if k != "content"}
    if role == "developer":  # OpenAI's newer name for the system message
        out["role"] = "system"
    if "tool_calls" in message:
        if role != "assistant":
            raise _bad(f"{param}.tool_calls", f"only assistant messages carry tool_calls ({param})")
        calls = message["tool_calls"]
        if calls is None:
            out.pop("tool_calls")
        else:
            out["tool_calls"] = _tool_calls(calls, f"{param}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"{param}.tool_call_id", f"{param}.tool_call_id must be a non-empty string")
        if content is None or isinstance(content, list) and not content:
            raise _bad(f"{param}.content", f"{param}.content is missing (the tool's result)")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise _bad(f"{param}.reasoning_content", f"{param}.reasoning_content must be a string")
    if content is None:
        if role != "assistant":
            raise _bad(f"{param}.content", f"{param}.content is missing")
        out["content"] = ""
        return out
    if isinstance(content, str):
        out["content"] = content
        return out
    if not isinstance(content, list):
        raise _bad(f"{param}.content", f"{param}.content must be a string or a list of parts")
    parts: list[dict] = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if not vision:
                raise _bad(where, "this model reads text only; load a vision model to send images")
            images.append(_data_url(part.get("image_url"), where))
            parts.append({"type": "image"})
        else:
            raise _bad(where, f"{where} must be a text part or an image_url part")
    if any(p["type"] == "image" for p in parts):
        out["content"] = parts
    else:
        out["content"] = "".join(p["text"] for p in parts)
    return out


def _tool_calls(calls: Any, param: str) -> list[dict]:
    """An assistant message's ``tool_calls``, checked; ``arguments`` given as an object is
    taken as its JSON text (some clients send it so)."""
    if not isinstance(calls, list):
        raise _bad(param, f"{param} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise _bad(where, f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{where}.function", f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.function.name", f"{where}.function.name must be a string")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif not isinstance(arguments, str):
            raise _bad(
                f"{where}.function.arguments", f"{where}.function.arguments must be JSON text"
            )
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"{where}.id", f"{where}.id must be a string")
        shaped = {"type": "function", "function": {"name": name, "arguments": arguments}}
        out.append({"id": call_id, **shaped} if call_id else shaped)
    return out


def _data_url(image_url: Any, where: str) -> bytes:
    """The bytes of an ``image_url`` part's data URL (``data:image/png;base64,...``)."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise _bad(
            where,
            f"{where}: images must be data URLs (data:image/png;base64,...); this server "
            "fetches nothing from the network",
        )
    head, _, data = url.partition(",")
    if not head.endswith(";base64"):
        raise _bad(where, f"{where}: the data URL must be base64-encoded")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(where, f"{where}: the data URL is not valid base64") from None


# -- completions -------------------------------------------------------------------------------


def check_completion(body: dict, limits: Limits) -> Call:
    """A ``/v1/completions`` body as a `Call`: one prompt, text or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "'prompt' is empty")
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompt = list(prompt)
    else:
        raise _bad(
            "prompt", "'prompt' must be a string or a list of token ids (one prompt per request)"
        )
    if body.get("echo") or body.get("suffix") or (body.get("best_of") or 1) != 1:
        raise _bad("prompt", "this server takes no 'echo', 'suffix' or 'best_of'")
    return Call(prompt=prompt, **_common(body, limits))


# -- responses -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage``, ``cached_tokens`` the prompt tokens restored from the cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _head(id_: str, object_: str, created: int, model: str) -> dict[str, Any]:
    return {"id": id_, "object": object_, "created": created, "model": model}


def tool_call_shape(call: Any, index: int | None = None) -> dict[str, Any]:
    """One of the answer's tool calls (an `agentio.ToolCall`) in OpenAI's shape; with
    `index`, as a stream's ``delta.tool_calls`` item."""
    shaped = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return shaped if index is None else {"index": index, **shaped}


def tool_call_delta(call: Any, index: int) -> dict[str, Any]:
    """A stream's delta carrying one whole tool call."""
    return {"tool_calls": [tool_call_shape(call, index)]}


def chat_response(
    id_: str,
    created: int,
    model: str,
    text: str | None,
    finish: str,
    use: dict,
    *,
    reasoning: str | None = None,
    tool_calls: list[Any] | None = None,
) -> dict[str, Any]:
    """A whole chat answer: ``message.content`` (None where the answer is only calls),
    ``reasoning_content`` where the model reasoned, ``tool_calls`` where it called."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [tool_call_shape(c) for c in tool_calls]
    return {
        **_head(id_, "chat.completion", created, model),
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": use,
    }


def chat_chunk(
    id_: str,
    created: int,
    model: str,
    delta: dict | None = None,
    finish: str | None = None,
    use: dict | None = None,
) -> dict[str, Any]:
    """One stream chunk; ``delta`` None with `use`: the usage chunk (no choices)."""
    chunk = _head(id_, "chat.completion.chunk", created, model)
    if delta is None and use is not None:
        chunk["choices"] = []
        chunk["usage"] = use
        return chunk
    chunk["choices"] = [
        {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    ]
    return chunk


def completion_response(
    id_: str, created: int, model: str, text: str, finish: str, use: dict
) -> dict[str, Any]:
    return {
        **_head(id_, "text_completion", created, model),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": use,
    }


def completion_chunk(
    id_: str,
    created: int,
    model: str,
    text: str | None = None,
    finish: str | None = None,
    use: dict | None = None,
) -> dict[str, Any]:
    chunk = _head(id_, "text_completion", created, model)
    if text is None and finish is None and use is not None:
        chunk["choices"] = []
        chunk["usage"] = use
        return chunk
    chunk["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    return chunk


def models_response(models: list[str], created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "mlx_nbengine"}
            for m in models
        ],
    }
