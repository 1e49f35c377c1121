"""What the notebook shows: one updatable display per answer, and readable tables.

Terms:

- *answer view* (`AnswerView`): the single display output of one `%%llm` request. It is
  created once in the executing cell (`display(..., display_id=True)`) and then updated in
  place, at most every `interval` seconds, with a bundle of ``text/plain`` and
  ``text/markdown``. Whoever owns the view calls `apply` for each engine event and
  `refresh` regularly; the view itself starts no thread.
- *state*: ``queued`` (submitted, nothing heard yet), ``running``, ``done``,
  ``interrupted`` (cancelled; the partial text stays) or ``failed``.
- *summary line*: the block story of a finished request, e.g.
  "2,048 prompt tokens: 1,792 restored (7 blocks from disk), 256 computed; first token
  0.41 s; 38 tok/s".

Only duck typing on the engine's events and completions (their class names and fields, as
in CONTRACTS.md), so this module imports neither MLX nor the engine.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "AnswerView",
    "TerminalView",
    "format_bytes",
    "key_value_bundle",
    "progress_bundle",
    "stats_rows",
    "summary_line",
]

Bundle = dict[str, str]


def format_bytes(n: int | float | None) -> str:
    """Human-readable byte count, binary units: 1536 -> '1.5 KiB'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def summary_line(completion: Any) -> str:
    """One line: where the prompt's tokens came from, time to first token, decode speed."""
    report = completion.report
    sources = Counter(getattr(block, "source", None) for block in report.blocks)
    counts = [(sources[s], s) for s in ("memory", "disk") if sources[s]]
    # "7 blocks from disk", or "2 blocks from memory, 5 from disk".
    restored_blocks = [f"{n} {'block' if n == 1 else 'blocks'} from {s}" for n, s in counts[:1]]
    restored_blocks += [f"{n} from {s}" for n, s in counts[1:]]
    restored = f"{report.restored_tokens:,} restored"
    if restored_blocks:
        restored += f" ({', '.join(restored_blocks)})"
    elif report.restored_tokens and getattr(report, "restore_source", None):
        # Restored tokens that end inside a block: the block itself counts as computed.
        restored += f" (from {report.restore_source})"
    # `prompt_tokens` is the list of prompt ids (an int is accepted too).
    n_prompt = completion.prompt_tokens
    if not isinstance(n_prompt, int):
        n_prompt = len(n_prompt)
    parts = [f"{n_prompt:,} prompt tokens: {restored}, {report.computed_tokens:,} computed"]
    if report.ttft_s is not None:
        parts.append(f"first token {report.ttft_s:.2f} s")
    if report.tokens_per_s:
        parts.append(f"{report.tokens_per_s:.0f} tok/s")
    if completion.finish_reason == "length":
        parts.append(f"stopped at max tokens ({len(completion.tokens):,})")
    return "; ".join(parts)


def _close_fences(markdown: str) -> str:
    # An answer cut mid code block would swallow everything after it in Markdown.
    if markdown.count("```") % 2:
        return markdown.rstrip("\n") + "\n```"
    return markdown


class AnswerView:
    """The live display of one request's answer; owned by the thread that feeds it events.

    `display` is IPython's `display` function (injectable for tests). The first `show`
    creates the output in the current cell; every later change goes through the same
    display handle, so the output stays in the cell that created it even when a background
    thread does the updating.
    """

    def __init__(
        self,
        *,
        title: str = "",
        interval: float = 0.1,
        display: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if display is None:
            from IPython.display import display
        self.title = title
        self.interval = interval
        self.text = ""
        self.state = "queued"
        self.progress = ""
        self.summary = ""
        self.error = ""
        self.blocks: Counter[str] = Counter()
        self._display = display
        self._clock = clock
        self._handle: Any = None
        self._dirty = False
        self._last = 0.0

    # -- events ---------------------------------------------------------------------------

    def apply(self, event: Any) -> None:
        """Fold one engine event into the view (no output until the next `refresh`)."""
        kind = type(event).__name__
        if kind == "TextDelta":
            self.text += event.text
            self.state = "running"
            self.progress = ""
        elif kind == "BlockEvent":
            self.blocks[event.source] += 1
            self.state = "running"
            if not self.text:
                self.progress = self._block_progress()
        elif kind == "Progress":
            self.state = "running"
            if not self.text:
                done, total = event.done, event.total
                self.progress = f"{event.phase} {done:,}/{total:,}" if total else event.phase
        elif kind == "Finished":
            self.finish(event.completion)
            return
        else:
            return
        self._dirty = True

    def _block_progress(self) -> str:
        parts = [f"{n} {source}" for source, n in sorted(self.blocks.items())]
        return "blocks: " + ", ".join(parts)

    def finish(self, completion: Any, *, interrupted: bool = False) -> None:
        """Final text and summary line from the engine's `Completion`."""
        self.text = completion.text
        self.progress = ""
        cancelled = interrupted or completion.finish_reason == "cancelled"
        self.state = "interrupted" if cancelled else "done"
        self.summary = summary_line(completion)
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

    def bundle(self) -> Bundle:
        status = self.status_line()
        plain = self.text
        markdown = _close_fences(self.text)
        if self.title:
            plain = f"[{self.title}]\n{plain}"
            markdown = f"**{self.title}**\n\n{markdown}"
        if status:
            plain = f"{plain.rstrip()}\n\n{status}" if plain.strip() else status
            note = f"*{_escape_md(status)}*"
            markdown = f"{markdown.rstrip()}\n\n{note}" if markdown.strip() else note
        return {"text/plain": plain, "text/markdown": markdown}

    def show(self) -> None:
        """Create the display output in the current cell."""
        self._handle = self._display(self.bundle(), raw=True, display_id=True)
        self._dirty = False
        self._last = self._clock()

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
        self._handle.update(self.bundle(), raw=True)
        self._dirty = False
        self._last = now
        return True

    def close(self) -> None:
        """The request ended: send the final state now."""
        self.refresh(force=True)


class TerminalView(AnswerView):
    """An `AnswerView` for a shell without a front end that updates displays (terminal IPython).

    Re-printing the whole answer every 100 ms would flood a terminal, so this view writes
    only the new text as it arrives, then the status line once at the end.
    """

    def __init__(self, *, write: Callable[[str], Any] | None = None, **kwargs: Any) -> None:
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


def _escape_md(text: str) -> str:
    return text.replace("*", r"\*").replace("_", r"\_")


def key_value_bundle(title: str, rows: Iterable[tuple[str, Any]]) -> Bundle:
    """A two-column table as text/plain (aligned) and text/markdown."""
    rows = [(str(k), str(v)) for k, v in rows]
    width = max((len(k) for k, _ in rows), default=0)
    plain = "\n".join([title, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])
    md_rows = "\n".join(f"| {k} | {v} |" for k, v in rows)
    markdown = f"**{title}**\n\n| | |\n|---|---|\n{md_rows}" if rows else f"**{title}**"
    return {"text/plain": plain, "text/markdown": markdown}


def stats_rows(stats: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Rows for a stats mapping: byte counts readable, nested mappings flattened."""
    rows: list[tuple[str, Any]] = []
    for key, value in stats.items():
        if isinstance(value, Mapping):
            rows.extend((f"{key}.{k}", v) for k, v in stats_rows(value))
        elif _is_byte_count(key, value):
            rows.append((key, f"{format_bytes(value)} ({int(value):,} B)"))
        elif isinstance(value, float):
            rows.append((key, f"{value:.3g}"))
        elif isinstance(value, int) and not isinstance(value, bool):
            rows.append((key, f"{value:,}"))
        else:
            rows.append((key, value))
    return rows


def _is_byte_count(key: str, value: Any) -> bool:
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return numeric and ("bytes" in key or key == "file_size")


def progress_bundle(what: str, *, elapsed: float) -> Bundle:
    """The line shown while something runs without progress reports: what, and for how long."""
    text = f"{what}… {elapsed:.1f} s"
    return {"text/plain": text, "text/markdown": _escape_md(text)}
