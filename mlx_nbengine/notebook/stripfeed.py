"""The *strip feed* (`StripFeed`): a `BlockStrip` widget shown as a second display output
right under the answer, created when the request is submitted with one pending cell per
prompt block, filled in as `BlockEvent`s arrive and marked with the edit at the end.
Terminal IPython gets no strip (`answerview.TerminalView` writes text only).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from mlx_nbengine.notebook.blockinfo import block_dicts, edit_dict, image_spans

__all__ = [
    "StripFeed",
]


class StripFeed:
    """Feeds one request's prompt blocks to a `BlockStrip` shown under its answer.

    `strip` is the widget (created with `n_blocks` pending cells when the request was
    submitted); `decode` and `tokens` (the prompt's ids) give each block its first and last
    words, leaving out the `special` token ids; `display` is IPython's `display`. The
    thread that owns the `AnswerView` owns this too. Each `add` syncs the widget at once
    (one comm message per block), so the strip fills in live during the prefill. `close`
    re-sends the display so that its saved ``text/html`` (what nbconvert shows) is the
    final picture, not the pending one.
    """

    def __init__(
        self,
        strip: Any,
        *,
        tokens: Sequence[int] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        special: Collection[int] = frozenset(),
        block_size: int,
        display: Callable[..., Any] | None = None,
    ) -> None:
        if display is None:
            # Looked up at each call: a shell (or a test) may replace IPython.display.display.
            from IPython.display import display
        self.strip = strip
        self.tokens = tokens
        self.decode = decode
        self.special = frozenset(special)
        self.block_size = block_size
        self._display = display
        self._handle: Any = None

    def show(self) -> None:
        self._handle = self._display(self.strip, display_id=True)

    def stoppable(self, stop_by: str, stop: Callable[[], Any] | None = None) -> None:
        """Give the strip its Stop button (see `BlockStrip.stoppable`)."""
        self.strip.stoppable(stop_by, stop)

    def add(self, event: Any) -> None:
        """A `BlockEvent` arrived: fill in its cell."""
        self.strip.add_block(self._block_dicts([event], self.tokens)[0])

    def finish(self, completion: Any) -> None:
        """The report is final: every block as reported, and the edit marked."""
        tokens = completion.prompt_tokens
        if isinstance(tokens, int):  # a count, not the ids: use the ids given at submit
            tokens = self.tokens
        report = completion.report
        if report.blocks:
            spans = image_spans(report)
            self.strip.add_blocks(self._block_dicts(report.blocks, tokens, spans=spans))
        position = getattr(report, "edit_at", None)
        if position is not None and tokens is not None:
            self.strip.set_edit(
                edit_dict(
                    position,
                    tokens,
                    decode=self.decode,
                    block_size=self.block_size,
                    special=self.special,
                )
            )

    def _block_dicts(
        self,
        blocks: Sequence[Any],
        tokens: Sequence[int] | None,
        *,
        spans: Sequence[tuple[int, int]] = (),
    ) -> list[dict]:
        return block_dicts(
            blocks, decode=self.decode, tokens=tokens, special=self.special, spans=spans
        )

    def close(self, *, answer: str = "") -> None:
        """The answer ended with `answer`: the Stop button goes, Copy comes; the display is
        sent again (its saved text/html becomes the final picture)."""
        self.strip.ended(answer)
        if self._handle is not None:
            self._handle.update(self.strip)

    def html(self) -> str:
        return self.strip.html()
