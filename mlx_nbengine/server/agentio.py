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

`template_messages` turns such messages into what templates read (arguments as dicts).

Coming out, `OutputSplitter` reads the answer's text as it streams and splits it into
`Text`, `Reasoning` and `ToolCall` pieces, with mlx-lm's tool parser for the model (as
its tokenizer wrapper picks it from the chat template) and its thinking markers:

- The states and their markers are mlx-lm's (a ``TextStateMachine`` from
  ``mlx_lm.generate``, as mlx-lm's server builds one): *normal* text; *reasoning* between
  the tokenizer's ``think_start`` and ``think_end`` (``<think>``/``</think>``, Gemma 4's
  ``<|channel>thought``/``<channel|>``); *tool* between ``tool_call_start`` and
  ``tool_call_end`` (to the end of the answer where the format has no end, e.g. Mistral's);
  structural markers and a chat template's response format (its initial state and
  transitions) where mlx-lm's tokenizer wrapper names them. Text that might be the start of
  a marker is held back until it is known not to be one.
- The answer begins in reasoning where the prompt opened a reasoning block it did not close
  (a template whose generation prompt writes ``<think>``): pass the prompt's token ids as
  `prompt` (``Request.prompt_tokens``), as mlx-lm's server reads its prompt.
- A tool block is read with the model's parser (``tokenizer.tool_parser``). Where the
  model has no tool format, or the block does not parse with the model's own parser,
  mlx-lm's ``json_tools`` parser reads it: ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, the form `toolgrammar` writes forced calls in for such models (so the
  ``<tool_call>`` markers are read beside a model's own; a block that begins with ``{`` is
  tried as that form first). A block that parses with neither
  stays text, markers included (nothing is lost).
- Without `tools` there are no tool states: tool-call markup is text.

Additions to the interface first written here (names and semantics kept): `OutputSplitter`
takes `prompt` (keyword; see above) and accepts the loaded model (``engine.model``) for
`tokenizer`; the tokenizer to pass is the mlx-lm wrapper ``engine.model.tokenizer`` (not
``engine.model.text_tokenizer``, the Hugging Face tokenizer underneath, which is wrapped
here without a tool format). `OutputSplitter.state` names the current state;
`has_reasoning`/`has_text`; `split_all` splits a whole answer at once.
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "OutputSplitter",
    "Piece",
    "Reasoning",
    "Text",
    "ToolCall",
    "new_call_id",
    "split_all",
    "template_messages",
]

FALLBACK_PARSER = "json_tools"  # mlx-lm's parser of the JSON form (as `toolgrammar` names it)

NORMAL, REASONING, TOOL, TOOL_JSON = "normal", "reasoning", "tool", "tool_json"


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
    """A fresh tool call id: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _wrapper(tokenizer: Any) -> Any:
    """mlx-lm's `TokenizerWrapper` for `tokenizer` (a wrapper, a loaded model holding one,
    or a Hugging Face tokenizer, wrapped here), or None."""
    if tokenizer is None:
        return None
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if isinstance(tokenizer, TokenizerWrapper):
        return tokenizer
    inner = getattr(tokenizer, "tokenizer", None)  # a LoadedModel
    if isinstance(inner, TokenizerWrapper):
        return inner
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "encode"):
        return TokenizerWrapper(tokenizer)
    return None


def _fallback_module() -> Any:
    return importlib.import_module(f"mlx_lm.tool_parsers.{FALLBACK_PARSER}")


@dataclass(frozen=True)
class _Block:
    """A tool state: the markers that open and close it, the parsers that read it."""

    start: str
    end: str
    parsers: tuple[Callable[..., Any], ...]


class OutputSplitter:
    """Splits one answer's streamed text into pieces.

    `tokenizer`: the model's mlx-lm `TokenizerWrapper` (``engine.model.tokenizer``; the
    loaded model ``engine.model`` is taken too), or None (no tool format, no thinking).
    `tools`: the request's chat-format tools (None or empty: tool-call markup is left as
    text). `prompt`: the prompt's token ids, which say whether the answer begins inside a
    reasoning block the prompt opened. `feed(text)` returns the pieces that are certain so
    far (text that might be the start of a marker is held back); `close()` returns the rest
    at the end of the answer. `calls` lists the calls made so far."""

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict] | None,
        *,
        prompt: Sequence[int] | None = None,
    ) -> None:
        from mlx_lm.generate import TextStateMachine

        self._machine = TextStateMachine
        self._tools = list(tools) if tools else None
        self._calls: list[ToolCall] = []
        self._blocks: dict[str, _Block] = {}
        self._body = ""  # the open tool block's text so far
        self._closed = False
        self.has_reasoning = False
        self.has_text = False
        tok = _wrapper(tokenizer)
        transitions = self._transitions(tok)
        initial = self._initial_state(tok, prompt)
        machine = TextStateMachine(transitions or None)
        self._sm = machine.make_state(initial)
        self.state: str | None = initial

    # -- the states ---------------------------------------------------------------------------

    def _transitions(self, tok: Any) -> dict[str, list[tuple[str, str | None]]]:
        transitions: dict[str, list[tuple[str, str | None]]] = {}
        if tok is None:
            tok_start = None
        else:
            tok_start = getattr(tok, "tool_call_start", None)
        thinking = tok is not None and bool(getattr(tok, "has_thinking", False))
        if thinking:
            transitions.setdefault(NORMAL, []).append((tok.think_start, REASONING))
            transitions[REASONING] = [(tok.think_end, NORMAL)]
        response = dict(getattr(tok, "response_transitions", None) or {}) if tok is not None else {}
        if self._tools:
            fallback = _fallback_module()
            entries = []
            native = getattr(tok, "tool_parser", None) if tok is not None else None
            if tok_start and native is not None and getattr(tok, "has_tool_calling", False):
                end = getattr(tok, "tool_call_end", None) or ""
                parsers = (native,)
                if (tok_start, end) == (fallback.tool_call_start, fallback.tool_call_end):
                    if native is not fallback.parse_tool_call:
                        parsers = (native, fallback.parse_tool_call)
                self._blocks[TOOL] = _Block(tok_start, end, parsers)
                # A response format that goes to "tool" decides where calls start (mlx-lm).
                goes_to_tool = any(dst == TOOL for edges in response.values() for _, dst in edges)
                if not goes_to_tool:
                    entries.append((tok_start, TOOL))
                if fallback.tool_call_start != tok_start:
                    self._blocks[TOOL_JSON] = _Block(
                        fallback.tool_call_start,
                        fallback.tool_call_end,
                        (fallback.parse_tool_call,),
                    )
                    entries.append((fallback.tool_call_start, TOOL_JSON))
            else:
                self._blocks[TOOL] = _Block(
                    fallback.tool_call_start, fallback.tool_call_end, (fallback.parse_tool_call,)
                )
                entries.append((fallback.tool_call_start, TOOL))
            for marker, state in entries:
                transitions.setdefault(NORMAL, []).append((marker, state))
                if thinking:
                    transitions[REASONING].append((marker, state))
            for state, block in self._blocks.items():
                transitions[state] = [(block.end, NORMAL)] if block.end else []
        markers = (getattr(tok, "structural_markers", None) or ()) if tok is not None else ()
        for marker in markers:
            transitions.setdefault(NORMAL, []).append((marker, NORMAL))
        for state, edges in response.items():
            if not self._tools:
                edges = [(m, dst) for m, dst in edges if dst != TOOL]
            transitions.setdefault(state, []).extend(edges)
        if TOOL in transitions and TOOL not in self._blocks:  # a response format's tool state
            start = getattr(tok, "tool_call_start", None) or ""
            end = getattr(tok, "tool_call_end", None) or ""
            native = getattr(tok, "tool_parser", None)
            self._blocks[TOOL] = _Block(start, end, (native,) if native else ())
        return transitions

    @staticmethod
    def _initial_state(tok: Any, prompt: Sequence[int] | None) -> str:
        """As mlx-lm's server: reasoning where the prompt's last think start comes after its
        last think end; the template's response format may name another."""
        initial = NORMAL
        if tok is not None and getattr(tok, "has_thinking", False) and prompt:
            tokens = list(prompt)
            if tok.rfind_think_start(tokens) > tok.rfind_think_end(tokens):
                initial = REASONING
        if tok is None:
            return initial
        return getattr(tok, "response_initial_state", None) or initial

    # -- splitting ------------------------------------------------------------------------------

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    def feed(self, text: str) -> list[Piece]:
        if self._closed:
            raise RuntimeError("this answer's splitter was closed")
        if not text or self.state is None:
            return []
        self._sm, segments = self._machine.split(self._sm, text)
        out: list[Piece] = []
        for state, chunk in segments:
            self._take(state, chunk, out)
        return _merged(out)

    def close(self) -> list[Piece]:
        if self._closed:
            return []
        self._closed = True
        out: list[Piece] = []
        if self.state is not None:
            self._sm, rest, state = self._machine.flush(self._sm)
            self._take(state, rest, out)
            if self.state in self._blocks:
                self._end_block(self.state, out, ended=False)
        return _merged(out)

    def _take(self, state: str | None, chunk: str, out: list[Piece]) -> None:
        """`chunk` of `state`'s text; a state changed from the last one closes a block."""
        if state != self.state:
            if self.state in self._blocks:
                self._end_block(self.state, out, ended=True)
            self.state = state
        if not chunk or state is None:
            return
        if state in self._blocks:
            self._body += chunk
        elif state == REASONING:
            self.has_reasoning = True
            out.append(Reasoning(chunk))
        elif state == NORMAL:
            self.has_text = True
            out.append(Text(chunk))
        # other states (a response format's headers) carry no answer text

    def _end_block(self, state: str, out: list[Piece], *, ended: bool) -> None:
        block, body = self._blocks[state], self._body
        self._body = ""
        calls = self._parse(block, body)
        if calls is None:  # not a call: the markup stays text
            text = block.start + body + (block.end if ended else "")
            if text:
                self.has_text = True
                out.append(Text(text))
            return
        self._calls.extend(calls)
        out.extend(calls)

    def _parse(self, block: _Block, body: str) -> list[ToolCall] | None:
        if not self._tools or not body.strip():
            return None
        parsers = block.parsers
        fallback = _fallback_module().parse_tool_call
        if fallback in parsers and body.lstrip().startswith("{"):
            # The JSON form first: some parsers (e.g. GLM's) read any text as a call.
            parsers = (fallback, *(p for p in parsers if p is not fallback))
        for parser in parsers:
            try:
                parsed = parser(body, self._tools)
                calls = _calls(parsed)
            except Exception:  # noqa: BLE001 - mlx-lm's parsers raise many kinds
                continue
            if calls:
                return calls
        return None


def _calls(parsed: Any) -> list[ToolCall] | None:
    """A parser's result (a ``{"name", "arguments"}`` dict or a list of them) as calls;
    None where it is not one."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name = item.get("name")
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        text = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(new_call_id(), name, text))
    return calls or None


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text (or reasoning) pieces joined."""
    out: list[Piece] = []
    for piece in pieces:
        if out and type(piece) is type(out[-1]) and not isinstance(piece, ToolCall):
            out[-1] = type(piece)(out[-1].text + piece.text)  # type: ignore[union-attr]
        else:
            out.append(piece)
    return out


def split_all(
    tokenizer: Any, tools: list[dict] | None, text: str, *, prompt: Sequence[int] | None = None
) -> list[Piece]:
    """A whole answer's pieces (`OutputSplitter` fed once and closed)."""
    splitter = OutputSplitter(tokenizer, tools, prompt=prompt)
    return _merged([*splitter.feed(text), *splitter.close()])


def template_messages(messages: list[dict]) -> list[dict]:
    """Chat-format messages as chat templates read them (e.g. a tool call's ``arguments``
    as a dict, which most templates render with ``tojson``).

    Copies; the given messages are not changed. A tool call's ``arguments`` that is JSON
    object text becomes the dict (other text is kept as it is); a missing or None
    ``content`` becomes ``""`` (templates test and slice it); ``tool`` messages,
    ``tool_call_id``, ``name`` and ``reasoning_content`` are kept for the templates that
    read them."""
    out = []
    for message in messages:
        m = dict(message)
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = [_template_call(c) for c in calls]
        out.append(m)
    return out


def _template_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    call = dict(call)
    function = call.get("function")
    if isinstance(function, dict):
        function = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except ValueError:
                value = None
            if isinstance(value, dict):
                function["arguments"] = value
        elif arguments is None:
            function["arguments"] = {}
        call["function"] = function
    return call
