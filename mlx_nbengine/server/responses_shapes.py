"""OpenAI's Responses API on the wire: a request's input items and tools turned into the
shared chat form (`agentio`), and the response, its output items, usage and stream events
built from what the model wrote.

Terms:

- *item*: one element of ``input`` (or of a response's ``output``): a ``message`` (roles
  user, system, developer, assistant; a bare ``{"role", "content"}`` is one too), a
  ``function_call`` / ``custom_tool_call`` the model made, its ``function_call_output`` /
  ``custom_tool_call_output``, a ``reasoning`` item. Items of OpenAI's own tools (web
  search, file search...) are skipped; anything else malformed is a 400 naming it.
- *custom tool*: a freeform tool (Codex's ``apply_patch``) whose call carries one raw
  string ``input``. Chat templates know functions only, so it is shown to the model as a
  function with one string parameter ``input`` (a Lark grammar, if it has one, in the
  description; a regex format as the parameter's ``pattern``, which a forced call's grammar
  holds) and the model's call of it comes back as a ``custom_tool_call`` item.
- *namespace*: a group of function tools (Codex's sub-agent tools); they are shown to the
  model by their own names, and a call of one goes out with its ``namespace``.
- *conversion*: consecutive assistant-side items (reasoning, message, calls) become one
  chat-format assistant message (``reasoning_content``, ``content``, ``tool_calls``); a
  call's output becomes a ``tool`` message. The leading run of system messages (the
  ``instructions`` and the first developer messages, as Codex sends them) is joined into
  one, since many templates take a system message only first.

Nothing here knows the engine or the HTTP stack; `responses` joins them.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_nbengine.server.openai_shapes import APIError, Limits

__all__ = [
    "CONTEXT_EXCEEDED",
    "Output",
    "ResponsesRequest",
    "check_responses",
    "response_object",
    "response_usage",
]

CONTEXT_EXCEEDED = "context_length_exceeded"

# An agent's conversation is many items (each call and its output are two, reasoning one
# more): `Limits.max_messages` of them times this, so long sessions are not refused (the
# context and the body limit hold them).
ITEMS_PER_MESSAGE = 16

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# Items of OpenAI's hosted tools and of clients' own bookkeeping (Codex's), which this server
# neither runs nor shows the model: skipped. An item type outside these and the rendered
# ones is a 400.
SKIPPED_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
        "additional_tools",
        "program",
        "program_output",
        "compaction",
        "compaction_trigger",
        "context_compaction",
        "ghost_snapshot",
        "item_reference",
    }
)
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
CUSTOM_PARAMETERS_DOC = "The tool's whole input, as raw text."


def new_item_id(prefix: str) -> str:
    """An id in OpenAI's form: ``resp_``, ``msg_``, ``rs_``, ``fc_``, ``ctc_`` + hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(param: str, message: str, *, code: str | None = None) -> APIError:
    return APIError(message, param=param, code=code)


@dataclass
class ResponsesRequest:
    """A checked ``/v1/responses`` body: the chat form to submit and what to echo."""

    messages: list[dict]  # chat-format, instructions first
    items: list[dict]  # the input items (with the previous response's), for the store
    images: list[bytes]
    tools: list[dict] | None  # chat-format function tools (custom ones included)
    custom_tools: frozenset[str]  # names of the freeform tools among them
    namespaces: dict[str, str]  # a namespaced tool's name -> its namespace
    tool_choice: Any  # chat-format: "auto", "none", "required" or {"type": "function", ...}
    parallel_tool_calls: bool
    max_output_tokens: int
    temperature: float
    top_p: float
    stream: bool
    effort: str | None  # reasoning.effort
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats


# -- field checks ------------------------------------------------------------------------------


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, f"'{name}' must be a number, got {value!r}")
    if not low <= value <= high:
        raise _bad(name, f"'{name}' must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be true or false, got {value!r}")
    return value


def _max_output_tokens(body: dict, limits: Limits) -> int:
    """``max_output_tokens``; default: the context. More than the context is clamped."""
    value = body.get("max_output_tokens")
    if value is None:
        return limits.context or limits.default_max_tokens
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad("max_output_tokens", f"'max_output_tokens' must be an integer, got {value!r}")
    if value < 1:
        raise _bad(
            "max_output_tokens",
            f"'max_output_tokens' must be at least 1, got {value}",
            code="integer_below_min_value",
        )
    return min(value, limits.context) if limits.context is not None else value


def _effort(body: dict) -> str | None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad("reasoning", f"'reasoning' must be an object, got {reasoning!r}")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _bad("reasoning.effort", f"'reasoning.effort' must be a string, got {effort!r}")
    return effort


# -- tools -------------------------------------------------------------------------------------


def _flat_tools(tools: list) -> list[tuple[str, Any, str | None]]:
    """(where, tool, namespace) for each tool, a namespace's own tools in its place."""
    out: list[tuple[str, Any, str | None]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            name, inner = tool.get("name"), tool.get("tools")
            if not isinstance(name, str) or not isinstance(inner, list):
                raise _bad(where, f"{where}: a namespace needs a 'name' and a list of 'tools'")
            out += [(f"{where}.tools[{j}]", t, name) for j, t in enumerate(inner)]
        else:
            out.append((where, tool, None))
    return out


def _tools(body: dict) -> tuple[list[dict], frozenset[str], dict[str, str]]:
    """The request's function and custom tools in chat form (a namespace's tools among
    them, by their own names), the custom tools' names and each namespaced tool's
    namespace; other tool types are skipped, and a name given twice is shown once."""
    tools = body.get("tools")
    if tools is None:
        return [], frozenset(), {}
    if not isinstance(tools, list):
        raise _bad("tools", f"'tools' must be a list of tools, got {type(tools).__name__}")
    out: list[dict] = []
    custom: set[str] = set()
    namespaces: dict[str, str] = {}
    names: set[str] = set()
    for where, tool, namespace in _flat_tools(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise _bad(where, f"{where} must be an object with a 'type'")
        kind = tool["type"]
        if kind not in ("function", "custom"):
            continue  # web_search, local_shell...: OpenAI's own, not run here
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name", f"{where}.name must be a non-empty string")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.description", f"{where}.description must be a string")
        if kind == "function":
            parameters = tool.get("parameters")
            if parameters is None:
                parameters = {"type": "object", "properties": {}}
            if not isinstance(parameters, dict):
                raise _bad(f"{where}.parameters", f"{where}.parameters must be a JSON schema")
        else:
            fmt = tool.get("format")
            description = _custom_description(description, fmt)
            text: dict[str, Any] = {"type": "string", "description": CUSTOM_PARAMETERS_DOC}
            if isinstance(fmt, dict) and fmt.get("syntax") == "regex":
                pattern = fmt.get("definition")
                if isinstance(pattern, str) and pattern:
                    text["pattern"] = f"^(?:{pattern})$"  # a forced call's grammar holds it
            parameters = {"type": "object", "properties": {"input": text}, "required": ["input"]}
        if name in names:
            continue
        names.add(name)
        if kind == "custom":
            custom.add(name)
        if namespace is not None:
            namespaces[name] = namespace
        function: dict[str, Any] = {"name": name}
        if description:
            function["description"] = description
        function["parameters"] = parameters
        out.append({"type": "function", "function": function})
    return out, frozenset(custom), namespaces


def _custom_description(description: str | None, fmt: Any) -> str:
    """A custom tool's description, with the grammar its input follows (if it has one)."""
    text = description or ""
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("syntax") != "regex":
        definition = fmt.get("definition")
        syntax = fmt.get("syntax") or "lark"
        if isinstance(definition, str) and definition:
            text += f"\n\nThe input follows this {syntax} grammar:\n{definition}"
    return text.strip()


def _tool_choice(body: dict, tools: list[dict], custom: frozenset[str]) -> Any:
    """``tool_choice`` in chat form: "auto", "none", "required" or a named function."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return "auto"
    if choice in ("none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom"):
            name = choice.get("name")
            if name is None and isinstance(choice.get("function"), dict):
                name = choice["function"].get("name")  # the chat form, sent here
            names = [t["function"]["name"] for t in tools]
            if not isinstance(name, str) or name not in names:
                raise _bad(
                    "tool_choice",
                    f"'tool_choice' names {name!r}, which is not among the request's "
                    f"function and custom tools ({', '.join(names) or 'none'})",
                )
            return {"type": "function", "function": {"name": name}}
        if kind == "allowed_tools":
            mode = choice.get("mode")
            return "required" if mode == "required" else "auto"
        return "auto"  # a hosted tool (web_search...): not run here, the model chooses
    raise _bad(
        "tool_choice",
        "'tool_choice' must be 'auto', 'none', 'required' or "
        f"{{'type': 'function', 'name': ...}}, got {choice!r}",
    )


# -- input items -------------------------------------------------------------------------------


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, f"{where} must be a string")
    return value


def _image(part: dict, where: str, images: list[bytes], vision: bool) -> dict:
    if not vision:
        raise _bad(where, "this model reads text only; load a vision model to send images")
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url.startswith("data:"):
        raise _bad(
            where,
            f"{where}: images must be data URLs in 'image_url' (data:image/png;base64,...); "
            "this server fetches nothing and holds no files",
        )
    head, _, data = url.partition(",")
    if not head.endswith(";base64"):
        raise _bad(where, f"{where}: the data URL must be base64-encoded")
    try:
        images.append(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        raise _bad(where, f"{where}: the data URL is not valid base64") from None
    return {"type": "image"}


def _content(content: Any, where: str, images: list[bytes], vision: bool) -> str | list[dict]:
    """A message's content as the chat form holds it: a string, or parts where it has
    images."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"{where} must be a string or a list of content parts")
    parts: list[dict] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            text = part.get("text", part.get("refusal"))
            parts.append({"type": "text", "text": _text(text, f"{at}.text")})
        elif kind == "input_image":
            parts.append(_image(part, at, images, vision))
        else:
            raise _bad(
                at, f"{at} must be an input_text, output_text or input_image part, got {kind!r}"
            )
    if any(p["type"] == "image" for p in parts):
        return parts
    return _join_parts([p["text"] for p in parts])


def _join_parts(texts: list[str]) -> str:
    """Text parts as one text, a newline between two that would touch (Codex sends its
    instruction blocks as parts: ``</skills_instructions>`` + ``<permissions ...>``)."""
    out = ""
    for text in texts:
        if out and text and not out[-1].isspace() and not text[0].isspace():
            out += "\n"
        out += text
    return out


def _output_text(output: Any, where: str) -> str:
    """A tool call's output: a string, or text parts joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            if isinstance(part, dict) and part.get("type") in TEXT_PARTS:
                texts.append(_text(part.get("text"), f"{where}[{j}].text"))
            elif not (isinstance(part, dict) and part.get("type") in ("input_image", "input_file")):
                raise _bad(f"{where}[{j}]", f"{where}[{j}] must be a text part")
        return "".join(texts)
    raise _bad(where, f"{where} must be a string or a list of text parts")


def _call_id(item: dict, where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.call_id", f"{where}.call_id must be a non-empty string")
    return call_id


class _Conversation:
    """Builds the chat-format messages item by item."""

    def __init__(self, images: list[bytes], vision: bool) -> None:
        self.messages: list[dict] = []
        self.images = images
        self.vision = vision
        self.calls: dict[str, str] = {}  # call_id -> the tool's name
        self.assistant: dict | None = None  # the assistant message items still add to

    def _assistant(self) -> dict:
        if self.assistant is None:
            self.assistant = {"role": "assistant", "content": ""}
            self.messages.append(self.assistant)
        return self.assistant

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise _bad(where, f"{where} must be an object (an input item)")
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            self._message(item, where)
        elif kind in ("function_call", "custom_tool_call"):
            self._call(item, where, custom=kind == "custom_tool_call")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _call_id(item, where)
            if call_id not in self.calls:
                raise _bad(
                    f"{where}.call_id",
                    f"{where} is the output of call {call_id!r}, which no function_call or "
                    "custom_tool_call before it in the input made",
                )
            content = _output_text(item.get("output"), f"{where}.output")
            self.assistant = None
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": self.calls[call_id],
                    "content": content,
                }
            )
        elif kind == "reasoning":
            self._reasoning(item, where)
        elif isinstance(kind, str) and kind in SKIPPED_ITEMS:
            return
        else:
            raise _bad(f"{where}.type", f"{where} has an unknown item type {kind!r}")

    def _message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise _bad(
                f"{where}.role",
                f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
            )
        content = _content(item.get("content"), f"{where}.content", self.images, self.vision)
        if role != "assistant":
            self.assistant = None
            self.messages.append(
                {"role": "system" if role == "developer" else role, "content": content}
            )
            return
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        message = self._assistant()
        if message.get("tool_calls"):  # text after calls: a new turn of the assistant
            self.assistant = None
            message = self._assistant()
        message["content"] += text

    def _call(self, item: dict, where: str, *, custom: bool) -> None:
        call_id = _call_id(item, where)
        name = _text(item.get("name"), f"{where}.name")
        if custom:
            arguments = json.dumps({"input": _text(item.get("input"), f"{where}.input")})
        else:
            arguments = _text(item.get("arguments"), f"{where}.arguments")
        self.calls[call_id] = name
        message = self._assistant()
        message.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )

    def _reasoning(self, item: dict, where: str) -> None:
        texts = []
        for key in ("content", "summary"):
            parts = item.get(key)
            if parts is None:
                continue
            if not isinstance(parts, list):
                raise _bad(f"{where}.{key}", f"{where}.{key} must be a list of text parts")
            for j, part in enumerate(parts):
                if not isinstance(part, dict):
                    raise _bad(f"{where}.{key}[{j}]", f"{where}.{key}[{j}] must be a text part")
                texts.append(_text(part.get("text"), f"{where}.{key}[{j}].text"))
            if texts:
                break  # the full reasoning where given, else its summary
        message = self._assistant()
        if message["content"] or message.get("tool_calls"):
            self.assistant = None
            message = self._assistant()
        if texts:
            joined = "\n".join(texts)
            before = message.get("reasoning_content")
            message["reasoning_content"] = f"{before}\n{joined}" if before else joined


def _join_leading_system(messages: list[dict]) -> list[dict]:
    """The leading run of system messages as one (text only)."""
    n = 0
    while (
        n < len(messages)
        and messages[n]["role"] == "system"
        and isinstance(messages[n]["content"], str)
    ):
        n += 1
    if n < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": joined}, *messages[n:]]


def input_items(body: dict) -> list[Any]:
    """The request's ``input`` as a list of items (a string is one user message)."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("input", "'input' must be a string or a list of items")
    return list(value)


def check_responses(
    body: dict, limits: Limits, *, vision: bool, previous: list[dict] | None = None
) -> ResponsesRequest:
    """A ``/v1/responses`` body as a `ResponsesRequest`; `previous`: the items of the
    response named by ``previous_response_id`` (its input and output), put before
    ``input``."""
    new = input_items(body)
    items = [*(previous or []), *new]
    if not new and not previous:
        raise _bad("input", "'input' is empty: send a string or a list of items")
    most = limits.max_messages * ITEMS_PER_MESSAGE
    if len(items) > most:
        raise _bad("input", f"'input' holds {len(items)} items; this server takes at most {most}")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", "'instructions' must be a string")
    images: list[bytes] = []
    messages = _messages(items, instructions, images, vision, base=len(previous or []))
    if len(images) > limits.max_images:
        raise _bad("input", f"{len(images)} images; this server takes at most {limits.max_images}")
    tools, custom, namespaces = _tools(body)
    choice = _tool_choice(body, tools, custom)
    if choice == "required" and not tools:
        raise _bad("tool_choice", "'tool_choice' is 'required' but 'tools' holds no function")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise _bad("text", f"'text' must be an object, got {text!r}")
    echo = _echo(body, instructions, text)
    return ResponsesRequest(
        messages=messages,
        items=[i for i in items if isinstance(i, dict)],
        images=images,
        tools=tools or None,
        custom_tools=custom,
        namespaces=namespaces,
        tool_choice=choice,
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        max_output_tokens=_max_output_tokens(body, limits),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        stream=_bool(body, "stream", False),
        effort=echo["reasoning"]["effort"],
        echo=echo,
    )


def _messages(
    items: list, instructions: str | None, images: list[bytes], vision: bool, *, base: int
) -> list[dict]:
    """The chat messages of `items` (the first `base` of them from ``previous_response_id``),
    `instructions` first as a system message; their images appended to `images`."""
    conversation = _Conversation(images, vision)
    for i, item in enumerate(items):
        where = f"input[{i - base}]" if i >= base else "previous_response_id"
        conversation.add(item, where)
    messages = [  # an assistant turn of nothing (e.g. a reasoning item with only
        # encrypted_content) is left out
        m
        for m in conversation.messages
        if m["role"] != "assistant"
        or m["content"]
        or m.get("tool_calls")
        or m.get("reasoning_content")
    ]
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    messages = _join_leading_system(messages)
    if not messages:
        raise _bad("input", "'input' holds no message the model can read")
    return messages


def _echo(body: dict, instructions: str | None, text: Any) -> dict:
    """The request's fields a response echoes back (OpenAI's response object)."""
    return {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": _effort(body), "summary": None},
        "store": body.get("store") if isinstance(body.get("store"), bool) else True,
        "text": text if text is not None else {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "truncation": "disabled",
        "user": body.get("user"),
    }


# -- the response --------------------------------------------------------------------------------


@dataclass
class Output:
    """The response's output items as they are built (dicts in OpenAI's shape)."""

    items: list[dict] = field(default_factory=list)
    reasoning_text: str = ""

    def text(self) -> str:
        return "".join(
            part["text"]
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
            if part["type"] == "output_text"
        )


def response_usage(
    input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int
) -> dict[str, Any]:
    """The Responses API's ``usage``; `cached_tokens`: the prompt tokens restored."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(
    id_: str,
    created_at: float,
    model: str,
    request: ResponsesRequest | None,
    *,
    status: str,
    output: list[dict] | None = None,
    usage: dict | None = None,
    error: dict | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """The ``response`` object (``status``: in_progress, completed, incomplete, failed)."""
    echo = request.echo if request is not None else {}
    body: dict[str, Any] = {
        "id": id_,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "max_tool_calls": None,
        "metadata": echo.get("metadata", {}),
        "model": model,
        "output": output or [],
        "parallel_tool_calls": request.parallel_tool_calls if request is not None else True,
        "previous_response_id": echo.get("previous_response_id"),
        "prompt_cache_key": echo.get("prompt_cache_key"),
        "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
        "service_tier": "default",
        "store": echo.get("store", True),
        "temperature": request.temperature if request is not None else 1.0,
        "text": echo.get("text", {"format": {"type": "text"}}),
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools", []),
        "top_p": request.top_p if request is not None else 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": echo.get("user"),
    }
    if status in ("completed", "incomplete"):
        body["completed_at"] = int(time.time())
    return body
