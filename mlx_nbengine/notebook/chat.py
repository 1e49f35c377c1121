"""Named conversations kept in the kernel for `%%llm --chat NAME`.

Terms:

- *conversation*: an optional system message and an ordered list of turns, under a name.
- *turn*: one user message (a cell's prompt, with the images its cell gave, which stay
  in the conversation) and the assistant's answer to it. A turn is
  *pending* while its request runs; its answer is filled in when the request finishes
  (the partial text if it was interrupted, so the history matches what the user saw).
- *turn key*: what identifies the cell a turn came from, so that re-running that cell
  replaces its turn and every later one instead of appending. It is the cell id that
  JupyterLab sends with each execution (IPython's ``pre_run_cell`` info ``cell_id``),
  plus the position of the `%%llm` call within that cell run. Without a cell id (nbclient,
  the terminal, `run_cell` from code) the key falls back to the cell's source text: running
  an identical cell again replaces its turn; an edited cell without an id is a new turn.

No IPython and no engine here: plain data with the rewind rule, so it is tested alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatBook", "Conversation", "PendingTurnError", "Turn", "turn_key"]


class PendingTurnError(Exception):
    """A new turn was started while an earlier turn of the same conversation still runs."""


def turn_key(*, cell_id: str | None, source: str, index: int = 0) -> str:
    """Key of the `index`-th chat call in a cell run: the cell id if known, else its source."""
    if cell_id:
        return f"cell:{cell_id}:{index}"
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]
    return f"source:{digest}:{index}"


@dataclass
class Turn:
    key: str
    user: str
    assistant: str | None = None  # None while pending
    images: list[Any] = field(default_factory=list)  # what the cell gave (any objects)

    @property
    def pending(self) -> bool:
        return self.assistant is None


@dataclass
class Conversation:
    name: str
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def begin(
        self, key: str, user: str, *, system: str | None = None, images: list[Any] | None = None
    ) -> tuple[Turn, list[dict]]:
        """Start the turn `key` and return it with the chat messages to send.

        `images` go with this turn's message (image parts before its text) and stay in the
        conversation; `images()` lists every turn's, in order, for the request.

        A turn with the same key and every turn after it are dropped first (re-running an
        edited cell rewrites history from there). `system`, when given, replaces the
        conversation's system message.
        """
        kept = self.turns
        for i, turn in enumerate(self.turns):
            if turn.key == key:
                kept = self.turns[:i]
                break
        for turn in kept:
            if turn.pending:
                raise PendingTurnError(
                    f"conversation {self.name!r} still has a turn running; wait for it "
                    "(handle.result()) or cancel it before the next turn"
                )
        if system is not None:
            self.system = system
        turn = Turn(key=key, user=user, images=list(images or []))
        self.turns = [*kept, turn]
        return turn, self.messages()

    def messages(self) -> list[dict]:
        """The chat messages of the whole conversation; a pending last turn ends it."""
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": self.system})
        for turn in self.turns:
            if turn.images:
                parts = [{"type": "image"} for _ in turn.images]
                content: Any = [*parts, {"type": "text", "text": turn.user}]
            else:
                content = turn.user
            out.append({"role": "user", "content": content})
            if turn.assistant is not None:
                out.append({"role": "assistant", "content": turn.assistant})
        return out

    def images(self) -> list[Any]:
        """Every turn's images, in the order their image parts appear in `messages`."""
        return [image for turn in self.turns for image in turn.images]

    def finish(self, turn: Turn, answer: str) -> None:
        """Record the answer of `turn` (ignored if the turn was replaced meanwhile)."""
        turn.assistant = answer

    def abandon(self, turn: Turn) -> None:
        """Drop `turn` (its request failed before producing anything worth keeping)."""
        self.turns = [t for t in self.turns if t is not turn]


class ChatBook:
    """All conversations of a kernel session, by name."""

    def __init__(self) -> None:
        self._conversations: dict[str, Conversation] = {}

    def get(self, name: str) -> Conversation:
        if name not in self._conversations:
            self._conversations[name] = Conversation(name)
        return self._conversations[name]

    def names(self) -> list[str]:
        return list(self._conversations)

    def __contains__(self, name: str) -> bool:
        return name in self._conversations

    def clear(self) -> None:
        self._conversations.clear()
