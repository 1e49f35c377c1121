"""What a request ends with: its `Completion`, the `Report` in it, a `BlockReport` per
prompt block, and the `Finished` event that carries the completion.

A *block source* is where a prompt block's cache came from: ``"memory"`` (the hot cache
of the previous request), ``"disk"`` (records restored from the store) or ``"computed"``
(prefilled now). The reasons a block carries are named in `events`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["BlockReport", "BlockSource", "Completion", "Finished", "FinishReason", "Report"]

BlockSource = Literal["memory", "disk", "computed"]
FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class BlockReport:
    """Prompt block `index` (tokens ``start:end``) came from `source` in `seconds`: the
    event a stream yields once its source is known, and the report's entry for it.

    Blocks are `block_size` tokens; the last one may be shorter (the prompt's tail).

    `reason` says why (named in `events`); `records` are the record kinds read
    from disk for it (empty for memory and computed blocks); `edit_at` is the absolute
    position of the first changed token when this block is where the prompt leaves a
    stored continuation (an ``"edited"`` block, or the tail), else None; `restored` is
    how many of its tokens were restored (``end - start`` for memory and disk blocks, 0
    for computed ones, the unchanged tokens before a cut inside the block); `images` are
    the 0-based numbers of the request's images whose tokens overlap the block.
    """

    index: int
    start: int
    end: int
    source: BlockSource
    seconds: float
    reason: str
    records: tuple[str, ...] = ()
    edit_at: int | None = None
    restored: int = 0
    images: tuple[int, ...] = ()

    def split(self) -> tuple[int, int]:
        """(restored, computed) tokens of this block: the one count of its restored tokens."""
        length = max(0, self.end - self.start)
        restored = min(length, max(0, int(self.restored)))
        return restored, length - restored

    def is_tail(self, n_prompt: int | None = None) -> bool:
        """Whether this is the *tail*: the computed block holding the prompt's last token
        (its logits start the answer). The engine names it with reason ``"tail"``; with
        `n_prompt` (the prompt's length) a computed block ending there counts too. The one
        tail rule of the faces (the strip's ``"tail"`` display, the demo's ``T``)."""
        if self.source != "computed":
            return False
        return self.reason == "tail" or (n_prompt is not None and self.end >= n_prompt)


@dataclass
class Report:
    """How the prompt reached the cache and how fast the answer came.

    `restored_tokens` came from memory or disk, `computed_tokens` were prefilled
    (their sum is the prompt length); `ttft_s` runs from submit to the first token;
    `tokens_per_s` is the decode speed after the first token (0.0 for one token).
    `restored_bytes` is the size of the records read from disk (or of the hot cache
    reused from memory); `restore_source` names where the restored prefix came from.
    `edit_at` is the absolute position of the first prompt token that differs from a
    stored continuation of its prefix (also when it falls in the tail), else None.
    `kept_boundary` says why the restore stopped at a block boundary although a stored
    continuation shared more tokens (one of `events.KEPT_BOUNDARY`: ``"state"``,
    ``"window"``, ``"block"``, ``"evicted"``), else None. `images` are the request's
    image spans (token range and content digest), in order.
    """

    blocks: list[BlockReport] = field(default_factory=list)
    restored_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float = 0.0
    restore_source: BlockSource | None = None
    restored_bytes: int = 0
    edit_at: int | None = None
    kept_boundary: str | None = None
    images: list[Any] = field(default_factory=list)

    def restored_split(self) -> tuple[int, int]:
        """(from memory, from disk) restored prompt tokens: the one count the faces use.

        Each block's restored tokens (`BlockReport.split`) count toward its source; a block
        a token-exact restore ended inside (source ``"computed"``) toward `restore_source`.
        Where blocks are missing from the report, its `restored_tokens` total wins.
        """
        memory = disk = 0
        for block in self.blocks:
            source = block.source if block.source != "computed" else self.restore_source
            restored, _ = block.split()
            if source == "memory":
                memory += restored
            elif source == "disk":
                disk += restored
        total = self.restored_tokens
        if memory + disk != total:  # blocks missing from the report: trust its total
            if self.restore_source == "memory":
                memory = total - disk
            else:
                disk = total - memory
        return memory, disk


@dataclass
class Completion:
    """A finished request: generated `text` and `tokens`, the `prompt_tokens` ids.

    `stop_reason` says what stopped a ``finish_reason == "stop"`` request: ``"eos"``
    (an end-of-text token), ``"grammar"`` (the request's grammar was complete) or the stop
    string that matched; None for other endings.
    """

    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    finish_reason: FinishReason
    report: Report
    stop_reason: str | None = None


@dataclass(frozen=True)
class Finished:
    """The request ended; `completion` is what `Request.result()` returns."""

    completion: Completion
