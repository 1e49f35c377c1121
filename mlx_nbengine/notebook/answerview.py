"""The answer display: one updatable display per `%%llm` answer, its text and status line.

Terms:

- *answer view* (`AnswerView`): the single display output of one `%%llm` request. It is
  created once in the executing cell (`display(..., display_id=True)`) and then updated in
  place, at most every `interval` seconds. Whoever owns the view calls `apply` for each
  engine event and `refresh` regularly; the view itself starts no thread.
- *answer bundle*: ``text/plain`` and ``text/html``. The model's text is shown as the model
  wrote it: HTML-escaped inside a ``<pre>`` (``white-space: pre-wrap``, from the
  ``views.css`` block the HTML starts with), so line breaks stay and any markup in the text
  (``<em>``...) shows as text, never as formatting. With ``markdown=True``
  (``%%llm --markdown``) the bundle is ``text/markdown`` instead, the model's HTML still
  escaped (Markdown stays Markdown, tags never become HTML).
- *state*: ``queued`` (submitted, not admitted yet: the engine's first event says it
  was, even with nothing to restore), ``running``, ``done``,
  ``interrupted`` (cancelled; the partial text stays) or ``failed``.
- *status line*: below the text, visually apart (a small muted line): the prefill
  progress while the prompt is read ("prefill 512/2,048 tokens"), then the *summary line*
  (`summary`).

Only duck typing on the engine's events and completions (their class names and fields,
read with `getattr` defaults where a field is newer); the words come from `words` (the
engine's phrases), the widget classes from the caller.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

from mlx_nbengine.engine.events import Event, Progress, TextDelta
from mlx_nbengine.engine.results import BlockReport, Finished
from mlx_nbengine.notebook.pictures import view_style
from mlx_nbengine.notebook.render import (
    Bundle,
    close_fences,
    escape_markdown_html,
    escape_md,
    pre_text,
)
from mlx_nbengine.notebook.stripfeed import StripFeed
from mlx_nbengine.notebook.summary import (
    ANSWER_METADATA_KEY,
    answer_facts,
    summary_line,
)

__all__ = [
    "AnswerView",
    "TerminalView",
]


# -- the answer bundle -----------------------------------------------------------------------


class AnswerView:
    """The live display of one request's answer; owned by the thread that feeds it events.

    `display` is IPython's `display` function (injectable for tests). The first `show`
    creates the output in the current cell (and the `strip`'s, right under it); every later
    change goes through the same display handle, so the output stays in the cell that
    created it even when a background thread does the updating.
    """

    def __init__(
        self,
        *,
        title: str = "",
        interval: float = 0.1,
        markdown: bool = False,
        strip: StripFeed | None = None,
        display: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if display is None:
            # Looked up at each call: a shell (or a test) may replace IPython.display.display.
            from IPython.display import display
        self.title = title
        self.interval = interval
        self.markdown = markdown
        self.strip = strip
        self.text = ""
        self.state = "queued"
        self.progress = ""
        self.summary = ""
        self.error = ""
        self._display = display
        self._clock = clock
        self._handle: Any = None
        self._dirty = False
        self._last = 0.0
        self.facts: dict[str, Any] | None = None  # `answer_facts`, once finished

    # -- events ---------------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        """Fold one engine event into the view (no output until the next `refresh`)."""
        match event:
            case TextDelta():
                self.text += event.text
                self.state = "running"
                self.progress = ""
            case BlockReport():  # a block's event (`BlockEvent`) is its report
                # The strip shows the blocks (and stays); the status line keeps the progress.
                if self.strip is not None:
                    self.strip.add(event)
                self.state = "running"
            case Progress():
                self.state = "running"
                if not self.text:
                    self.progress = _progress_phrase(event)
            case Finished():
                self.finish(event.completion)
                return
            case _:
                return
        self._dirty = True

    def finish(self, completion: Any, *, interrupted: bool = False) -> None:
        """Final text and summary line from the engine's `Completion`."""
        self.text = completion.text
        self.progress = ""
        cancelled = interrupted or completion.finish_reason == "cancelled"
        self.state = "interrupted" if cancelled else "done"
        self.summary = summary_line(completion)
        self.facts = answer_facts(completion)
        if self.strip is not None:
            self.strip.finish(completion)
        self._dirty = True

    def fail(self, message: str) -> None:
        """The request failed: keep what streamed so far and say why."""
        self.state = "failed"
        self.error = message
        self.progress = ""
        self._dirty = True

    def mark_interrupted(self) -> None:
        self.state = "interrupted"
        self.progress = ""
        self._dirty = True

    # -- output ---------------------------------------------------------------------------

    def status_line(self) -> str:
        if self.state == "queued":
            return "queued…"
        if self.state == "running":
            return self.progress or "generating…"
        if self.state == "interrupted":
            return "[interrupted] " + self.summary if self.summary else "[interrupted]"
        if self.state == "failed":
            return f"[failed] {self.error}"
        return self.summary

    def plain(self) -> str:
        status = self.status_line()
        plain = f"[{self.title}]\n{self.text}" if self.title else self.text
        if status:
            plain = f"{plain.rstrip()}\n\n{status}" if plain.strip() else status
        return plain

    def html(self) -> str:
        """The answer as HTML: the text escaped, as written; the status line muted below."""
        parts = [view_style(), '<div class="mnb-answer">']
        if self.title:
            parts.append(f'<div class="mnb-title">{html.escape(self.title)}</div>')
        if self.text:
            # <pre> keeps the line breaks even where a sanitizer drops the style block.
            parts.append(f'<pre class="mnb-text">{pre_text(self.text)}</pre>')
        status = self.status_line()
        if status:
            parts.append(
                f'<div class="mnb-status" data-state="{self.state}">{html.escape(status)}</div>'
            )
        parts.append("</div>")
        return "".join(parts)

    def markdown_text(self) -> str:
        markdown = close_fences(escape_markdown_html(self.text))
        if self.title:
            markdown = f"**{escape_md(self.title)}**\n\n{markdown}"
        status = self.status_line()
        if status:
            # A thematic break and italics: the status never reads as part of the answer.
            note = f"*{escape_md(status)}*"
            markdown = f"{markdown.rstrip()}\n\n---\n\n{note}" if markdown.strip() else note
        return markdown

    def bundle(self) -> Bundle:
        if self.markdown:
            return {"text/plain": self.plain(), "text/markdown": self.markdown_text()}
        return {"text/plain": self.plain(), "text/html": self.html()}

    def metadata(self) -> dict[str, Any]:
        return {ANSWER_METADATA_KEY: self.facts} if self.facts is not None else {}

    def show(self) -> None:
        """Create the display output in the current cell (and the strip's, right under it)."""
        self._handle = self._display(
            self.bundle(), raw=True, display_id=True, metadata=self.metadata()
        )
        self._dirty = False
        self._last = self._clock()
        if self.strip is not None:
            self.strip.show()

    def refresh(self, *, force: bool = False) -> bool:
        """Send the current bundle if something changed and `interval` has passed."""
        if self._handle is None:
            self.show()
            return True
        if not self._dirty:
            return False
        now = self._clock()
        if not force and now - self._last < self.interval:
            return False
        self._handle.update(self.bundle(), raw=True, metadata=self.metadata())
        self._dirty = False
        self._last = now
        return True

    def close(self) -> None:
        """The request ended: send the final state now."""
        self.refresh(force=True)
        if self.strip is not None:
            self.strip.close(answer=self.text)


def _progress_phrase(event: Any) -> str:
    done, total = event.done, event.total
    if event.phase == "restore" and not done:
        # Admitted with nothing to restore: the prefill begins.
        return f"prefill 0/{total:,} tokens"
    verb = "restored" if event.phase == "restore" else event.phase
    return f"{verb} {done:,}/{total:,} tokens" if total else event.phase


class TerminalView(AnswerView):
    """An `AnswerView` for a shell without a front end that updates displays (terminal IPython).

    Re-printing the whole answer every 100 ms would flood a terminal, so this view writes
    only the new text as it arrives, then the status line once at the end. No strip.
    """

    def __init__(self, *, write: Callable[[str], Any] | None = None, **kwargs: Any) -> None:
        kwargs.pop("strip", None)
        super().__init__(display=lambda *a, **k: None, **kwargs)
        if write is None:
            import sys

            write = sys.stdout.write
        self._write = write
        self._written = 0
        self._closed = False

    def show(self) -> None:
        if self.title:
            self._write(f"[{self.title}]\n")
        self._handle = self

    def refresh(self, *, force: bool = False) -> bool:
        if self._handle is None:
            self.show()
        if self._closed or len(self.text) <= self._written:
            return False
        self._write(self.text[self._written :])
        self._written = len(self.text)
        return True

    def close(self) -> None:
        self.refresh()
        if not self._closed:
            self._write(f"\n\n{self.status_line()}\n")
            self._closed = True
