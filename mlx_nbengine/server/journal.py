"""The server's journal: one `Entry` per API request, for the agent view and tests.

An entry holds figures (never the prompt's text or the answer; its token ids stay in
memory for the view's block words, and out of `Entry.as_dict`): when the request came, its
endpoint, its prompt tokens, where the restored ones came from (memory or disk), how many
were computed, the first-token time, the decode speed, how it finished, and its prompt
blocks (the engine's `BlockReport`s, as they arrive); the client (from its User-Agent), its
API, its conversation's label, and, where it restored less than the previous turn of its
conversation held, why (`conversations.Miss`: its one line in `as_dict`, the decoded text
around the changed token only with ``log_prompts``). Watchers (`Journal.watch`) are called
on the server's thread each time an entry changes; they must return quickly and never raise
into the server (an error there is swallowed).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_nbengine.server.conversations import (
    Conversations,
    Facts,
    Miss,
    Reader,
    Turn,
    api_name,
)

__all__ = ["Entry", "Journal"]


@dataclass
class Entry:
    """One request's figures; `finish` is None while it runs."""

    number: int
    endpoint: str
    started: float  # time.time()
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    restored_memory: int = 0
    restored_disk: int = 0
    computed: int = 0
    ttft_s: float | None = None
    tokens_per_s: float = 0.0
    finish: str | None = None
    error: str | None = None
    blocks: list[Any] = field(default_factory=list)  # BlockReport, in arrival order
    report: Any = None  # the engine's Report once finished
    # The client's conversation key (the Responses API's prompt_cache_key), if it sent one.
    conversation_key: str | None = None
    client: str = ""  # from the User-Agent (`conversations.client_name`)
    api: str = ""  # "chat completions", "completions", "responses", "messages"
    conversation: str = ""  # its conversation's label ("A", "B"...), once admitted
    miss: Miss | None = None  # why it restored less than the previous turn held
    # The id of the response it answered with (the Responses API sets it, so a later
    # request's previous_response_id finds its conversation).
    response_id: str | None = None
    # The prompt's token ids, in memory only (the view's block words); never in as_dict.
    tokens: list[int] = field(default_factory=list, repr=False)
    answer_tokens: list[int] = field(default_factory=list, repr=False)  # likewise
    turn: Turn | None = field(default=None, repr=False)
    log_prompts: bool = field(default=False, repr=False)  # as_dict may hold miss text

    @property
    def cached_tokens(self) -> int:
        return self.restored_memory + self.restored_disk

    def as_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "endpoint": self.endpoint,
            "started": self.started,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "restored_memory": self.restored_memory,
            "restored_disk": self.restored_disk,
            "computed": self.computed,
            "ttft_s": self.ttft_s,
            "tokens_per_s": self.tokens_per_s,
            "finish": self.finish,
            "error": self.error,
            "conversation_key": self.conversation_key,
            "client": self.client,
            "api": self.api,
            "conversation": self.conversation,
            "miss": self.miss.as_dict(text=self.log_prompts) if self.miss else None,
        }


class Journal:
    """The last `keep` entries, newest last; thread-safe. `log_prompts`: entries' `as_dict`
    may hold the decoded text around a miss."""

    def __init__(self, keep: int = 200, *, log_prompts: bool = False) -> None:
        self._entries: deque[Entry] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._count = 0
        self._watchers: list[Callable[[Entry], None]] = []
        self.log_prompts = log_prompts
        self.conversations = Conversations(keep)
        self.reader = Reader()

    def open(self, endpoint: str) -> Entry:
        with self._lock:
            self._count += 1
            entry = Entry(
                number=self._count,
                endpoint=endpoint,
                started=time.time(),
                api=api_name(endpoint),
                log_prompts=self.log_prompts,
            )
            self._entries.append(entry)
        self.changed(entry)
        return entry

    def admitted(self, entry: Entry, facts: Facts, reader: Reader | None = None) -> None:
        """`entry`'s request was submitted (its `tokens` set): place it in its conversation
        with its request's `facts`; `reader` reads the engine's tokens (for the misses)."""
        with self._lock:
            if reader is not None:
                self.reader = reader
            entry.client = facts.client or entry.client
            turn = Turn(entry.number, entry.tokens, facts)
            after = None
            if facts.previous_response_id is not None:
                for other in self._entries:
                    if other.response_id == facts.previous_response_id and other.turn:
                        after = other.turn
            try:
                entry.conversation = self.conversations.place(
                    turn, block_size=self.reader.block_size, after=after
                )
                entry.turn = turn
            except Exception:  # grouping never breaks a request
                entry.turn = None
        self.changed(entry)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries)

    def watch(self, fn: Callable[[Entry], None]) -> Callable[[], None]:
        """Call `fn(entry)` on every change; returns the function that stops it."""
        with self._lock:
            self._watchers.append(fn)

        def unwatch() -> None:
            with self._lock:
                if fn in self._watchers:
                    self._watchers.remove(fn)

        return unwatch

    def changed(self, entry: Entry) -> None:
        with self._lock:
            watchers = list(self._watchers)
        for fn in watchers:
            try:
                fn(entry)
            except Exception:  # a view's failure must never break a request
                pass

    def finish(self, entry: Entry, completion: Any) -> None:
        """Fill `entry` from the engine's `Completion`."""
        report = completion.report
        entry.report = report
        entry.completion_tokens = len(completion.tokens)
        entry.prompt_tokens = len(completion.prompt_tokens)
        entry.restored_memory, entry.restored_disk = report.restored_split()
        entry.computed = report.computed_tokens
        entry.ttft_s = report.ttft_s
        entry.tokens_per_s = report.tokens_per_s
        entry.finish = completion.finish_reason
        if report.blocks:
            entry.blocks = list(report.blocks)
        entry.answer_tokens = list(completion.tokens)
        if entry.turn is not None:
            with self._lock:
                self.conversations.finish(entry.turn, entry.answer_tokens)
                try:
                    entry.miss = self.conversations.explain(
                        entry.turn,
                        entry.cached_tokens,
                        self.reader,
                        reasons=[b.reason for b in entry.blocks if b.source == "computed"],
                        kept_boundary=getattr(report, "kept_boundary", None),
                    )
                except Exception:  # an explanation never breaks a request
                    entry.miss = None
        self.changed(entry)

    def cancel(self, entry: Entry) -> None:
        """The client went away before the answer ended: its request was cancelled."""
        entry.status = 499  # nginx's "client closed request"
        entry.error = "the client disconnected"
        entry.finish = "cancelled"
        self.changed(entry)

    def fail(self, entry: Entry, status: int, message: str) -> None:
        entry.status = status
        entry.error = message
        entry.finish = "error"
        self.changed(entry)
