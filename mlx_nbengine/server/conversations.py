"""Which conversation an API request belongs to, and why a turn missed the cache.

Pure Python over token lists and a few facts of each request (no model, no MLX): the
journal (`journal.Journal`) gives every admitted request a `Turn` and asks `Conversations`
to place it, and, once it has finished, to `explain` a restore shorter than what the
previous turn of its conversation left in the cache.

Terms:

- *facts* (`Facts`, from `request_facts`): what a request says besides its tokens: the
  client (from the User-Agent, `client_name`), the API, the conversation key a client
  sends (``prompt_cache_key``; a session id in ``metadata`` or in a session header), the
  ``previous_response_id`` (Responses), the model name asked for, and digests (never the
  text) of its system prompt, its tools and each other message.
- *conversation*: requests grouped by their key (with the model name asked for: an agent's
  side calls to a small model are a conversation of their own), by ``previous_response_id``
  (the turn that response answered), or else by the longest token prefix shared with an
  earlier request's prompt and answer: at least one block, or half the shorter prompt (and
  `MIN_SHARED` tokens), where both requests open with the same first message. Each has a
  short label, "A", "B", ..., "Z", "AA", ... in order of first appearance.
- *held*: the tokens a finished turn left in the cache: its prompt and its answer but the
  last token (sampled, never fed to the model).
- *miss* (`Miss`): a turn restored fewer tokens than the previous turn of its conversation
  held (as far as this prompt reaches, its last token always computed), where that turn
  held at least a block. The previous turn is the earlier finished one of the conversation
  whose prompt and answer share the longest prefix with this prompt (the newest on a tie);
  it finished before this turn came. Its *position* is the first token where this prompt
  leaves that turn's prompt and answer, or, where the client kept all of it, the token
  where the restore stopped.

A miss is classified by its cause (`Miss.cause`), first match wins:

1. ``reasoning``: the previous turn's tokens at the position are inside (or open) a
   reasoning block (``<think>``...; `REASONING_MARKERS` and the tokenizer's own): the
   client, or its chat template, dropped the reasoning from an earlier assistant turn.
2. ``answer``: the position is in the previous turn's answer: the client sent it back
   rendered otherwise (a tool call written anew, text re-tokenized).
3. ``system``, ``tools``, ``edited`` (an earlier message differs), ``dropped`` (earlier
   messages are gone): the facts that differ from the previous turn's; several may be named.
4. ``differs``: the prompt differs at the position and no fact says why.
5. Where the client kept the whole previous turn: ``evicted`` (the engine named a block
   evicted: stored once, its records gone), ``boundary`` (the restore kept to a block
   boundary), else ``store`` (the store no longer held the rest).

`Miss.why` is one line of fixed words and numbers (never prompt text; it may go into
`Entry.as_dict`); `Miss.detail`, `before`, `was` and `now` hold prompt text (tool names, a
few decoded tokens either side of the position, control characters escaped): the agent
view shows them, and `Entry.as_dict` only with ``log_prompts``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "APIS",
    "MIN_SHARED",
    "REASONING_MARKERS",
    "SESSION_HEADERS",
    "Conversations",
    "Facts",
    "Miss",
    "Reader",
    "Turn",
    "api_name",
    "client_name",
    "common_prefix",
    "label",
    "reader_of",
    "request_facts",
    "visible",
]

APIS = {
    "/v1/chat/completions": "chat completions",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}

# Headers some clients send with a session or conversation id (lower case).
SESSION_HEADERS = (
    "x-claude-code-session-id",
    "session_id",
    "session-id",
    "x-session-id",
    "conversation_id",
    "conversation-id",
    "x-conversation-id",
)

MIN_SHARED = 8  # a prefix-grouped request shares at least this many tokens
SNIPPET_TOKENS = 8  # tokens decoded either side of a miss's position
REASONING_LOOKBACK = 4096  # tokens before a position searched for an open reasoning block

# (open, close) markers of reasoning blocks models write; the tokenizer's own come first.
REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|channel>thought", "<channel|>"),
    ("<|channel|>analysis", "<|end|>"),
)

# Why a restore kept to a block boundary (the engine's `Report.kept_boundary`).
BOUNDARY_WHY = {
    "state": "the model's recurrent state is stored at block boundaries only",
    "window": "its sliding-window records cannot be cut there",
    "block": "the engine restores whole blocks",
}

Decode = Callable[[Sequence[int]], str]


# -- facts -------------------------------------------------------------------------------------


def api_name(endpoint: str) -> str:
    """The API an endpoint speaks, in words ("chat completions", "responses"...)."""
    return APIS.get(endpoint, endpoint.removeprefix("/v1/"))


_PRODUCT = re.compile(r"([A-Za-z][\w.+-]*)(?:/([\w.+-]+))?")


def client_name(user_agent: str | None) -> str:
    """The client named by a User-Agent: "codex 0.169.0" (``codex_exec/0.169.0``,
    ``codex_cli_rs/...``), "claude-cli 1.0.83", "openai-python 1.99.0" (``OpenAI/Python``),
    "anthropic-python 0.60.0", "opencode 0.5.1", "ai-sdk", "curl 8.5.0", else the first
    product token's name and version; "" without one."""
    ua = (user_agent or "").strip()
    if not ua:
        return ""
    products = [(m.group(1), m.group(2) or "") for m in _PRODUCT.finditer(ua)]
    lower = ua.lower()

    def named(name: str, version: str) -> str:
        return f"{name} {version}".strip()

    for name, version in products:
        low = name.lower()
        if low.startswith("codex"):
            return named("codex", version)
        if low == "claude-cli":
            return named("claude-cli", version)
        if low == "opencode":
            return named("opencode", version)
    match = re.match(r"(openai|anthropic)/(python|js|node|go|java)\s+([\w.+-]+)", lower)
    if match:
        vendor, language, version = match.groups()
        return named(f"{vendor}-{language}", version)
    if "ai-sdk" in lower:
        return "ai-sdk"
    if not products:
        return ua.split()[0][:40]
    name, version = products[0]
    return named(name[:40], version[:20])


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]


def _tool_name(tool: Any) -> str:
    if not isinstance(tool, dict):
        return str(tool)
    function = tool.get("function")
    if isinstance(function, dict) and function.get("name"):
        return str(function["name"])
    return str(tool.get("name") or tool.get("type") or "?")


@dataclass(frozen=True)
class Facts:
    """What a request says besides its tokens (digests only: no prompt text but the tools'
    names, which are kept for the view's detail)."""

    client: str = ""
    api: str = ""
    key: str | None = None  # "<source>:<value>", e.g. "prompt_cache_key:abc"
    previous_response_id: str | None = None
    model: str = ""
    system: str | None = None  # digest of the system messages, in order
    tools: tuple[tuple[str, str], ...] = ()  # (name, digest) per tool offered
    messages: tuple[tuple[str, str], ...] = ()  # (role, digest) per other message
    chat: bool = False  # the prompt was chat messages (so the digests mean something)

    @property
    def first_message(self) -> str | None:
        return self.messages[0][1] if self.messages else None


def _session_key(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return f"prompt_cache_key:{key}"
    conversation = body.get("conversation")  # the Responses API's conversation object or id
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    if isinstance(conversation, str) and conversation:
        return f"conversation:{conversation}"
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        for name in ("session_id", "conversation_id", "user_id"):
            value = metadata.get(name)
            if isinstance(value, str) and value:
                return f"metadata.{name}:{value}"
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return f"{name}:{value}"
    return None


def request_facts(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    call: Any = None,
    *,
    endpoint: str = "",
) -> Facts:
    """The facts of a request: its headers (case-insensitive, as Starlette's), its JSON
    body, and the checked call (`openai_shapes.Call`: its chat-form messages and the tools
    the template is shown). Never raises: a part it cannot read is left out."""
    try:
        return _request_facts(headers, body, call, endpoint)
    except Exception:  # the journal's facts never break a request
        return Facts(client=client_name(headers.get("user-agent")), api=api_name(endpoint))


def _request_facts(headers: Mapping[str, str], body: Mapping[str, Any], call: Any, endpoint: str):
    previous = body.get("previous_response_id")
    model = body.get("model")
    prompt = getattr(call, "prompt", None)
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    system: list[Any] = []
    messages: list[tuple[str, str]] = []
    if chat:
        for message in prompt:
            if not isinstance(message, dict):
                continue
            role = str(message.get("role", ""))
            if role in ("system", "developer"):
                system.append(message.get("content"))
            else:
                messages.append((role, _digest(message)))
    tools = getattr(call, "offered_tools", getattr(call, "tools", None)) or []
    return Facts(
        client=client_name(headers.get("user-agent")),
        api=api_name(endpoint) if endpoint else "",
        key=_session_key(headers, body),
        previous_response_id=previous if isinstance(previous, str) and previous else None,
        model=model if isinstance(model, str) else "",
        system=_digest(system) if system else None,
        tools=tuple((_tool_name(t), _digest(t)) for t in tools),
        messages=tuple(messages),
        chat=chat,
    )


# -- the tokenizer, as far as the explanations need it -------------------------------------------


@dataclass(frozen=True)
class Reader:
    """How to read token ids: `decode` (special tokens kept; None: no snippets), the
    reasoning markers, and the engine's block size (0: unknown)."""

    decode: Decode | None = None
    markers: tuple[tuple[str, str], ...] = REASONING_MARKERS
    block_size: int = 0

    def text(self, tokens: Sequence[int]) -> str:
        if self.decode is None or not tokens:
            return ""
        try:
            return str(self.decode(list(tokens)))
        except Exception:  # a tokenizer that cannot decode these ids: no snippet
            return ""


def reader_of(engine: Any) -> Reader:
    """The `Reader` of an engine (its model's `decode`, its tokenizer's thinking markers)."""
    lm = getattr(engine, "model", None)
    decode = getattr(lm, "decode", None)
    tok = getattr(lm, "tokenizer", None)
    markers = REASONING_MARKERS
    start, end = getattr(tok, "think_start", None), getattr(tok, "think_end", None)
    if isinstance(start, str) and isinstance(end, str) and start and end:
        markers = ((start, end), *(m for m in REASONING_MARKERS if m != (start, end)))
    block_size = getattr(engine, "block_size", 0)
    return Reader(
        decode if callable(decode) else None,
        markers,
        block_size if isinstance(block_size, int) else 0,
    )


def visible(text: str) -> str:
    """`text` with its control characters escaped (``\\n``, ``\\t``, ``\\x1b``...), as a
    snippet shows what the model wrote."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def common_prefix(a: Sequence[int], b: Sequence[int], offset: int = 0) -> int:
    """How many leading tokens `a` shares with `b` from `offset` on (a slice at a time)."""
    n, limit, step = 0, min(len(a), len(b) - offset), 256
    while n + step <= limit and list(a[n : n + step]) == list(b[offset + n : offset + n + step]):
        n += step
    while n < limit and a[n] == b[offset + n]:
        n += 1
    return max(n, 0)


def label(n: int) -> str:
    """The `n`-th conversation's label (from 0): "A" ... "Z", "AA", "AB"..."""
    out = ""
    n += 1
    while n:
        n, rest = divmod(n - 1, 26)
        out = chr(ord("A") + rest) + out
    return out


# -- turns and conversations ---------------------------------------------------------------------


@dataclass(eq=False)
class Turn:
    """One admitted request as the conversations see it."""

    number: int
    prompt: Sequence[int]
    facts: Facts = field(default_factory=Facts)
    answer: Sequence[int] = ()
    finished: bool = False
    conversation: str = ""  # its label
    grouped_by: str = ""  # "key", "previous_response_id", "prefix" or "" (it began one)
    after: Turn | None = None  # the turn named by previous_response_id
    admitted_at: int = 0  # the tracker's clock when placed / when finished
    finished_at: int = 0

    @property
    def held(self) -> int:
        """The tokens it left in the cache: prompt and answer but the answer's last."""
        return len(self.prompt) + max(len(self.answer) - 1, 0)

    def sequence(self) -> list[int]:
        return [*self.prompt, *self.answer]

    def shared(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` are this turn's prompt and answer."""
        n = common_prefix(self.prompt, tokens)
        if n < len(self.prompt) or not self.answer:
            return n
        return n + common_prefix(self.answer, tokens, n)


@dataclass(frozen=True)
class Miss:
    """Why a turn restored less than the previous turn of its conversation held."""

    cause: str
    position: int
    restored: int
    expected: int
    previous: int  # the previous turn's number
    why: str  # fixed words and numbers only
    detail: str = ""  # prompt text (tool names, the message): the view only
    before: str = ""  # decoded text before the position, escaped
    was: str = ""  # the previous turn's text from the position
    now: str = ""  # this prompt's text from the position

    def as_dict(self, *, text: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cause": self.cause,
            "position": self.position,
            "restored": self.restored,
            "expected": self.expected,
            "previous": self.previous,
            "why": self.why,
        }
        if text:
            out.update(detail=self.detail, before=self.before, was=self.was, now=self.now)
        return out


class Conversations:
    """The recent turns (`keep`) and their conversations; not thread-safe (the journal
    calls it under its lock)."""

    def __init__(self, keep: int = 200) -> None:
        self._turns: deque[Turn] = deque(maxlen=keep)
        self._keys: dict[tuple[str, str], str] = {}
        self._count = 0
        self._clock = itertools.count(1)

    def _new_label(self) -> str:
        self._count += 1
        return label(self._count - 1)

    def turns(self) -> list[Turn]:
        return list(self._turns)

    def place(self, turn: Turn, *, block_size: int = 0, after: Turn | None = None) -> str:
        """Give `turn` its conversation (its label, also returned) and remember it. `after`:
        the turn whose response `turn` names as ``previous_response_id``."""
        turn.admitted_at = next(self._clock)
        facts = turn.facts
        if after is not None and after.conversation:
            turn.conversation, turn.after = after.conversation, after
            turn.grouped_by = "previous_response_id"
        elif facts.key is not None:
            keyed = (facts.key, facts.model)
            if keyed not in self._keys:
                self._keys[keyed] = self._new_label()
            turn.conversation, turn.grouped_by = self._keys[keyed], "key"
        else:
            best, shared = self._longest(turn, list(self._turns))
            if best is not None and self._continues(best, turn, shared, block_size):
                turn.conversation, turn.grouped_by = best.conversation, "prefix"
            else:
                turn.conversation = self._new_label()
        self._turns.append(turn)
        return turn.conversation

    @staticmethod
    def _longest(turn: Turn, candidates: Iterable[Turn]) -> tuple[Turn | None, int]:
        """The candidate sharing the longest prefix with `turn`'s prompt (newest on a tie)."""
        best, shared = None, -1
        for other in candidates:
            if other is turn:
                continue
            n = other.shared(turn.prompt)
            if n > shared or (n == shared and best is not None and other.number > best.number):
                best, shared = other, n
        return best, shared

    @staticmethod
    def _continues(earlier: Turn, turn: Turn, shared: int, block_size: int) -> bool:
        if shared < MIN_SHARED:
            return False
        a, b = earlier.facts, turn.facts
        if a.chat and b.chat and a.first_message != b.first_message:
            return False  # a new chat under the same system prompt
        shorter = min(len(earlier.prompt), len(turn.prompt))
        return (block_size > 0 and shared >= block_size) or 2 * shared >= shorter

    def finish(self, turn: Turn, answer: Sequence[int]) -> None:
        turn.answer = answer
        turn.finished = True
        turn.finished_at = next(self._clock)

    def previous(self, turn: Turn) -> Turn | None:
        """The turn `turn` continues: the one its ``previous_response_id`` names, else the
        finished turn of its conversation (finished before `turn` came) sharing the longest
        prefix with its prompt, the newest on a tie."""
        if turn.after is not None:
            return turn.after if turn.after.finished else None
        candidates = [
            t
            for t in self._turns
            if t is not turn
            and t.conversation == turn.conversation
            and t.finished
            and t.finished_at < turn.admitted_at
        ]
        best, _ = self._longest(turn, candidates)
        return best

    def explain(
        self,
        turn: Turn,
        restored: int,
        reader: Reader | None = None,
        *,
        reasons: Iterable[str] = (),
        kept_boundary: str | None = None,
    ) -> Miss | None:
        """Why `turn` (finished) restored only `restored` tokens where the previous turn of
        its conversation held more; None when it did not (or it has no previous turn).
        `reasons`: its computed blocks' reasons; `kept_boundary`: the engine's note that
        a restore kept to a block boundary."""
        previous = self.previous(turn)
        if previous is None:
            return None
        return explain(previous, turn, restored, reader or Reader(), reasons, kept_boundary)


# -- explanations ----------------------------------------------------------------------------


def explain(
    previous: Turn,
    turn: Turn,
    restored: int,
    reader: Reader,
    reasons: Iterable[str] = (),
    kept_boundary: str | None = None,
) -> Miss | None:
    """The `Miss` of `turn` against `previous` (see the module's doc), or None."""
    prompt = turn.prompt
    expected = min(previous.held, len(prompt) - 1)
    if expected <= 0 or restored >= expected or expected < reader.block_size:
        return None  # nothing missed (less than a block: the hot cache gives none of it)
    old = previous.sequence()
    position = previous.shared(prompt)

    def miss(cause: str, why: str, at: int, detail: str = "", *, was: bool = True) -> Miss:
        lo, hi = max(0, at - SNIPPET_TOKENS), at + SNIPPET_TOKENS
        return Miss(
            cause=cause,
            position=at,
            restored=restored,
            expected=expected,
            previous=previous.number,
            why=why,
            detail=detail,
            before=visible(reader.text(prompt[lo:at])),
            was=visible(reader.text(old[at:hi])) if was else "",
            now=visible(reader.text(prompt[at:hi])),
        )

    if position >= expected:  # the client kept all of it: the cache lost it
        cause, why = _lost(set(reasons), kept_boundary, restored, expected)
        return miss(cause, why, restored, was=False)

    at = f"token {position:,}"
    markers = _reasoning_at(old, position, reader)
    if markers is not None:
        start, end = markers
        why = f"the client rewrote history at {at}: {start}…{end} removed"
        return miss("reasoning", why, position)
    if position >= len(previous.prompt):
        index = position - len(previous.prompt)
        why = (
            f"the client sent the previous answer back changed at {at} "
            f"(its token {index + 1:,} of {len(previous.answer):,})"
        )
        return miss("answer", why, position)
    found = _changed_facts(previous.facts, turn.facts)
    if found:
        causes = [cause for cause, _, _ in found]
        phrases = [phrase for _, phrase, _ in found]
        details = [detail for _, _, detail in found if detail]
        why = f"{'; '.join(phrases)} (first change at {at})"
        return miss(causes[0], why, position, "; ".join(details))
    return miss("differs", f"the prompt differs from the previous turn at {at}", position)


def _lost(reasons: set[str], kept_boundary: str | None, restored: int, expected: int):
    """The cause and why of a miss where the client kept the previous turn whole: the
    store lost part of it (evicted, kept to a boundary, or never held it)."""
    if "evicted" in reasons or kept_boundary == "evicted":
        why = (
            f"evicted from the store: the previous turn's tokens from {restored:,} on "
            "are no longer stored"
        )
        return "evicted", why
    if kept_boundary:
        why = f"the restore kept to a block boundary at token {restored:,}"
        because = BOUNDARY_WHY.get(kept_boundary)
        return "boundary", f"{why} ({because})" if because else why
    why = (
        f"the store held {restored:,} of the {expected:,} tokens the previous turn "
        "left in the cache"
    )
    return "store", why


def _reasoning_at(old: Sequence[int], position: int, reader: Reader) -> tuple[str, str] | None:
    """The (open, close) markers of the reasoning block the previous turn's tokens open or
    are inside at `position`, or None."""
    if reader.decode is None:
        return None
    after = reader.text(old[position : position + SNIPPET_TOKENS]).lstrip()
    before = reader.text(old[max(0, position - REASONING_LOOKBACK) : position])
    for start, end in reader.markers:
        if after.startswith(start):
            return start, end
        opened = before.rfind(start)
        if opened >= 0 and before.rfind(end) < opened:
            return start, end
    # A marker split across the position (a marker of several tokens).
    around = reader.text(old[max(0, position - SNIPPET_TOKENS) : position + SNIPPET_TOKENS])
    cut = len(reader.text(old[max(0, position - SNIPPET_TOKENS) : position]))
    for start, end in reader.markers:
        at = around.find(start)
        if 0 <= at < cut < at + len(start):
            return start, end
    return None


def _changed_facts(old: Facts, new: Facts) -> list[tuple[str, str, str]]:
    """(cause, phrase, detail) for each fact that differs, in the order templates render
    them: the system prompt, the tools, the messages."""
    found: list[tuple[str, str, str]] = []
    if old.system != new.system:
        found.append(("system", "the system prompt changed", ""))
    if old.tools != new.tools:
        found.append(("tools", "the tools list changed", _tools_detail(old.tools, new.tools)))
    if old.chat and new.chat:
        shared = min(len(old.messages), len(new.messages))
        for i in range(shared):
            if old.messages[i] != new.messages[i]:
                role = new.messages[i][0]
                phrase = f"an earlier message was edited (message {i + 1}, {role})"
                found.append(("edited", phrase, ""))
                break
        else:
            if len(new.messages) < len(old.messages):
                n = len(old.messages) - len(new.messages)
                phrase = f"{n:,} earlier messages were dropped"
                if n == 1:
                    phrase = "an earlier message was dropped"
                found.append(("dropped", phrase, ""))
    return found


def _tools_detail(old: Sequence[tuple[str, str]], new: Sequence[tuple[str, str]]) -> str:
    before, after = dict(old), dict(new)
    added = [name for name in after if name not in before]
    removed = [name for name in before if name not in after]
    changed = [name for name in after if name in before and before[name] != after[name]]
    parts = []
    for word, names in (("added", added), ("removed", removed), ("changed", changed)):
        if names:
            parts.append(f"{word}: {', '.join(names)}")
    if not parts and [n for n, _ in old] != [n for n, _ in new]:
        parts.append("reordered")
    return "; ".join(parts)
