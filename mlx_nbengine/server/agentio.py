"""What agents send and read, shared by every API the server speaks (chat completions,
Responses, Messages): one conversation form going in, one split of the model's output
coming out.

Going in, every API turns its request into OpenAI *chat-format* messages and tools (the
form chat templates read), so one path renders and submits them:

- messages: ``{"role": "system"|"user"|"assistant"|"tool", "content": str | parts}``; an
  assistant message may carry ``tool_calls`` (``[{"id", "type": "function", "function":
  {"name", "arguments": JSON text}}]``) and ``reasoning_content``; a tool message carries
  ``tool_call_id`` (and ``name``).
- tools: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``.

Coming out, `OutputSplitter` reads the answer's text as it streams and splits it into
`Text`, `Reasoning` and `ToolCall` pieces, with mlx-lm's tool parser for the model (as
its tokenizer wrapper picks it from the chat template) and its thinking markers.

(The interface is fixed here; the implementation is being written.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "OutputSplitter",
    "Piece",
    "Reasoning",
    "Text",
    "ToolCall",
    "new_call_id",
    "template_messages",
]


@dataclass(frozen=True)
class Text:
    """Answer text, as the model wrote it."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text (inside the model's thinking markers, the markers left out)."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call: `arguments` is the JSON object's text."""

    id: str  # "call_" + hex, unique
    name: str
    arguments: str


Piece = Text | Reasoning | ToolCall


def new_call_id() -> str:
    raise NotImplementedError


class OutputSplitter:
    """Splits one answer's streamed text into pieces.

    `tokenizer`: the model's mlx-lm `TokenizerWrapper` (``engine.model.text_tokenizer``),
    or None (no tool format, no thinking). `tools`: the request's chat-format tools (None:
    tool-call markup is left as text). `feed(text)` returns the pieces that are certain so
    far (text that might be the start of a marker is held back); `close()` returns the rest
    at the end of the answer. `calls` lists the calls made so far."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None) -> None:
        raise NotImplementedError

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def close(self) -> list[Piece]:
        raise NotImplementedError

    @property
    def calls(self) -> list[ToolCall]:
        raise NotImplementedError


def template_messages(messages: list[dict]) -> list[dict]:
    """Chat-format messages as chat templates read them (e.g. a tool call's ``arguments``
    as a dict, which most templates render with ``tojson``)."""
    raise NotImplementedError
