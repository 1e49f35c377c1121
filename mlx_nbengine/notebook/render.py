"""What the notebook shows: one updatable display per answer, its block strip, readable tables.

Terms:

- *answer view* (`AnswerView`): the single display output of one `%%llm` request. It is
  created once in the executing cell (`display(..., display_id=True)`) and then updated in
  place, at most every `interval` seconds. Whoever owns the view calls `apply` for each
  engine event and `refresh` regularly; the view itself starts no thread.
- *answer bundle*: ``text/plain`` and ``text/html``. The model's text is shown as the model
  wrote it: HTML-escaped inside a ``white-space: pre-wrap`` block, so line breaks stay and
  any markup in the text (``<em>``...) shows as text, never as formatting. With
  ``markdown=True`` (``%%llm --markdown``) the bundle is ``text/markdown`` instead, the
  model's HTML still escaped (Markdown stays Markdown, tags never become HTML).
- *state*: ``queued`` (submitted, not admitted yet: the engine's first event says it
  was, even with nothing to restore), ``running``, ``done``,
  ``interrupted`` (cancelled; the partial text stays) or ``failed``.
- *status line*: below the text, visually apart (a small muted line): the prefill
  progress while the prompt is read ("prefill 512/2,048 tokens"), then the *summary line*.
- *summary line*: the block story of a finished request and why it stopped, e.g.
  "2,048 prompt tokens: 1,792 restored (7 blocks from disk), 256 computed; first token
  0.41 s; 38 tok/s; end of text after 57 tokens". "restored" appears only when tokens
  really were restored; a cold prompt reads "2,048 prompt tokens, all computed".
- *model table* (`models_bundle`, `models_text`): what `%llm_models` shows, one row per
  model found locally (a `mlx_nbengine.models.LocalModel`): name, source, kind (text,
  vision or gguf), size on disk, and whether a GGUF model was converted already (``-`` for
  MLX models, which need no conversion); below it, where the listing looked.
- *image display* (`images_bundle`): with ``%%llm --image``, one display right above the
  answer: a thumbnail per image (``figure.mnb-image``) captioned with its name (file or
  variable) and original size; ``text/plain`` "[image 1: cat.png, 640x480]".
- *strip feed* (`StripFeed`): a `BlockStrip` widget shown as a second display output right
  under the answer, created when the request is submitted with one pending cell per prompt
  block, filled in as `BlockEvent`s arrive and marked with the edit at the end. Terminal
  IPython gets no strip (`TerminalView` writes text only).

Only duck typing on the engine's events and completions (their class names and fields,
read with `getattr` defaults where a field is newer); the words come from `words` (the
engine's phrases), the widget classes from the caller.
"""

from __future__ import annotations

import hashlib
import html
import re
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from mlx_nbengine.engine.events import Event, Progress, TextDelta
from mlx_nbengine.engine.results import BlockReport, Completion, Finished
from mlx_nbengine.notebook.blockinfo import block_dicts, edit_dict, image_spans, thumbnail_uri
from mlx_nbengine.notebook.words import format_bytes, kept_boundary_phrase
from mlx_nbengine.notebook.words import plural as _plural

__all__ = [
    "ANSWER_METADATA_KEY",
    "AnswerView",
    "StripFeed",
    "TerminalView",
    "answer_facts",
    "cache_rows",
    "format_bytes",
    "images_bundle",
    "images_text",
    "key_value_bundle",
    "prefill_stop_phrase",
    "model_rows",
    "models_bundle",
    "models_text",
    "progress_bundle",
    "stop_phrase",
    "stopped_in_prefill",
    "summary_line",
]

Bundle = dict[str, str]


# -- the summary line ------------------------------------------------------------------------


def _restored_part(report: Any) -> str | None:
    """ "1,792 restored (7 blocks from disk)", or None when nothing was restored."""
    restored = int(getattr(report, "restored_tokens", 0) or 0)
    if restored <= 0:
        return None
    sources = Counter(getattr(block, "source", None) for block in report.blocks)
    counts = [(sources[s], s) for s in ("memory", "disk") if sources[s]]
    if counts:
        # "7 blocks from disk", or "2 blocks from memory, 5 from disk".
        (n, source), *rest = counts
        where = [f"{_plural(n, 'block')} from {source}", *(f"{m} from {s}" for m, s in rest)]
        return f"{restored:,} restored ({', '.join(where)})"
    # Tokens restored inside a block that still counts as computed (the hot cache of a
    # short prompt): true, but no block came back, so no block count is claimed.
    source = getattr(report, "restore_source", None)
    where = f" from {source}" if source else ""
    return f"{restored:,} restored{where} (part of a block)"


def stop_phrase(completion: Any) -> str:
    """Why generation stopped and how many tokens it made: "end of text after 57 tokens"."""
    n = len(completion.tokens)
    reason = completion.finish_reason
    if reason == "length":
        return f"stopped at max tokens ({n:,})"
    if reason == "cancelled":
        return f"cancelled after {_plural(n, 'token')}"
    stop = getattr(completion, "stop_reason", None)
    if stop == "eos":
        return f"end of text after {_plural(n, 'token')}"
    if stop:
        return f"stop string {stop!r} after {_plural(n, 'token')}"
    return f"stopped after {_plural(n, 'token')}"


def stopped_in_prefill(completion: Any) -> bool:
    """The request was cancelled before it generated a token (during its prefill)."""
    return completion.finish_reason == "cancelled" and not completion.tokens


def prefill_stop_phrase(completion: Any) -> str:
    """ "stopped during prefill at token 512 of 861; nothing generated" (the tokens
    restored, when any, before it)."""
    report = completion.report
    n_prompt = _n_prompt(completion)
    done = int(getattr(report, "restored_tokens", 0) or 0) + int(report.computed_tokens or 0)
    restored = _restored_part(report)
    where = f"at token {done:,} of {n_prompt:,}" if done else "before it began"
    stop = f"stopped during prefill {where}; nothing generated"
    return f"{restored}; {stop}" if restored else stop


def _n_prompt(completion: Any) -> int:
    # `prompt_tokens` is the list of prompt ids (an int is accepted too).
    n_prompt = completion.prompt_tokens
    return n_prompt if isinstance(n_prompt, int) else len(n_prompt)


def summary_line(completion: Any) -> str:
    """One line: where the prompt's tokens came from, speed, why generation stopped, and
    why a restore kept to a block boundary when a stored continuation shared more. A
    request stopped during its prefill says where (`prefill_stop_phrase`)."""
    if stopped_in_prefill(completion):
        return prefill_stop_phrase(completion)
    report = completion.report
    n_prompt = _n_prompt(completion)
    restored = _restored_part(report)
    if restored is None:
        head = f"{_plural(n_prompt, 'prompt token')}, all computed"
    else:
        head = (
            f"{_plural(n_prompt, 'prompt token')}: {restored}, {report.computed_tokens:,} computed"
        )
    parts = [head]
    if report.ttft_s is not None:
        parts.append(f"first token {report.ttft_s:.2f} s")
    if report.tokens_per_s:
        parts.append(f"{report.tokens_per_s:.0f} tok/s")
    parts.append(stop_phrase(completion))
    kept = getattr(report, "kept_boundary", None)
    if kept:
        parts.append(f"restore kept to a block boundary: {kept_boundary_phrase(kept)}")
    return "; ".join(parts)


# -- the answer bundle -----------------------------------------------------------------------

# Inline styles (a notebook's saved HTML has no stylesheet of ours) with JupyterLab's theme
# variables and fallbacks. The text keeps the prose font: a base model writes prose.
_TEXT_STYLE = (
    "white-space: pre-wrap; overflow-wrap: anywhere; margin: 0; padding: 0; border: 0; "
    "background: none; font-family: var(--jp-content-font-family, inherit); "
    "font-size: inherit; line-height: var(--jp-content-line-height, 1.5); color: inherit"
)
_TITLE_STYLE = "font-weight: bold; margin-bottom: 0.25em"
_STATUS_STYLE = (
    "margin-top: 0.4em; font-size: 0.85em; font-style: normal; "
    "color: var(--jp-ui-font-color2, #757575)"
)


def _close_fences(markdown: str) -> str:
    # An answer cut mid code block would swallow everything after it in Markdown.
    if markdown.count("```") % 2:
        return markdown.rstrip("\n") + "\n```"
    return markdown


# Code (fenced blocks, then inline spans) where Markdown shows `<` as it is anyway.
_MD_CODE = re.compile(r"(```.*?(?:```|\Z)|`[^`\n]*`)", re.DOTALL)


def pre_text(text: str) -> str:
    """`text` as the content of a ``<pre>`` whose DOM text is `text` exactly: escaped, each
    carriage return as a character reference (an HTML parser turns a literal one into a line
    feed), and a leading line feed doubled (the parser drops the first one after ``<pre>``)."""
    escaped = html.escape(text).replace("\r", "&#13;")
    return "\n" + escaped if escaped.startswith("\n") else escaped


def escape_markdown_html(text: str) -> str:
    """`text` for Markdown with its HTML shown as text: ``&`` and ``<`` escaped outside code.

    Inside code spans and fenced blocks Markdown prints characters as they are (an escape
    there would show as ``&lt;``), so those parts are left alone.
    """
    parts = _MD_CODE.split(text)
    for i in range(0, len(parts), 2):  # even parts are outside code
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;")
    return "".join(parts)


def _escape_md(text: str) -> str:
    return html.escape(text, quote=False).replace("*", r"\*").replace("_", r"\_")


ANSWER_METADATA_KEY = "mlx_nbengine"


def answer_facts(completion: Completion) -> dict[str, Any]:
    """What a finished answer's display carries as metadata (under `ANSWER_METADATA_KEY`):
    prompt tokens, tokens restored from memory and from disk, tokens computed, time to first
    token, and `document`, a digest of the prompt's first block (answers that share it are
    re-runs of one document; None for a prompt shorter than a block). The demo's table is
    read back from these in the saved notebook."""
    report = completion.report
    # The prompt's ids (a bare count is accepted too, as in `summary_line`).
    ids = completion.prompt_tokens
    prompt = [] if isinstance(ids, int) else list(ids)
    from_memory, from_disk = report.restored_split()
    blocks = report.blocks
    block_size = blocks[0].end - blocks[0].start if blocks else 0
    document = None
    if block_size and len(prompt) > block_size:
        head = ",".join(map(str, prompt[:block_size])).encode()
        document = hashlib.sha256(head).hexdigest()[:16]
    return {
        "prompt_tokens": ids if isinstance(ids, int) else len(prompt),
        "restored_memory": from_memory,
        "restored_disk": from_disk,
        "computed": report.computed_tokens,
        "ttft_s": report.ttft_s,
        "document": document,
    }


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
        parts = ['<div class="mnb-answer">']
        if self.title:
            parts.append(
                f'<div class="mnb-title" style="{_TITLE_STYLE}">{html.escape(self.title)}</div>'
            )
        if self.text:
            # <pre> keeps the line breaks even where a sanitizer drops the style.
            parts.append(f'<pre class="mnb-text" style="{_TEXT_STYLE}">{pre_text(self.text)}</pre>')
        status = self.status_line()
        if status:
            parts.append(
                f'<div class="mnb-status" data-state="{self.state}" style="{_STATUS_STYLE}">'
                f"{html.escape(status)}</div>"
            )
        parts.append("</div>")
        return "".join(parts)

    def markdown_text(self) -> str:
        markdown = _close_fences(escape_markdown_html(self.text))
        if self.title:
            markdown = f"**{_escape_md(self.title)}**\n\n{markdown}"
        status = self.status_line()
        if status:
            # A thematic break and italics: the status never reads as part of the answer.
            note = f"*{_escape_md(status)}*"
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


# -- the images above the answer ---------------------------------------------------------------

# The thumbnails' longest side in the answer's image display.
IMAGE_THUMB_SIDE = 96
_FIGURES_STYLE = "display: flex; flex-wrap: wrap; gap: 8px; margin: 0 0 0.4em"
_FIGURE_STYLE = "margin: 0; display: inline-flex; flex-direction: column; align-items: flex-start"
_IMG_STYLE = (
    "display: block; max-width: 96px; max-height: 96px; border-radius: 3px; "
    "border: 1px solid var(--jp-border-color2, #d1d9e0)"
)
_CAPTION_STYLE = "font-size: 0.8em; margin-top: 2px; color: var(--jp-ui-font-color2, #757575)"


def images_text(images: Sequence[Any]) -> str:
    """One line per image: "[image 1: cat.png, 640x480]"."""
    return "\n".join(
        f"[image {i + 1}: {item.name}, {item.width}x{item.height}]" for i, item in enumerate(images)
    )


def images_bundle(images: Sequence[Any], *, max_side: int = IMAGE_THUMB_SIDE) -> Bundle:
    """The display shown above an answer: a captioned thumbnail per image.

    `images` are the request's `mlx_nbengine.notebook.prompting.ImageInput`s (duck-typed:
    `name`, `width`, `height` and the PIL `image`), in the order the model gets them.
    """
    figures = []
    for i, item in enumerate(images):
        name = html.escape(str(item.name))
        caption = f"{name} · {item.width}x{item.height}"
        figures.append(
            f'<figure class="mnb-image" data-index="{i}" style="{_FIGURE_STYLE}">'
            f'<img src="{thumbnail_uri(item.image, max_side=max_side)}" '
            f'alt="image {i + 1}: {name}" title="image {i + 1}: {name}" style="{_IMG_STYLE}">'
            f'<figcaption style="{_CAPTION_STYLE}">{caption}</figcaption></figure>'
        )
    markup = f'<div class="mnb-images" style="{_FIGURES_STYLE}">{"".join(figures)}</div>'
    return {"text/plain": images_text(images), "text/html": markup}


# -- the block strip ---------------------------------------------------------------------------


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


# -- tables ------------------------------------------------------------------------------------


def key_value_bundle(title: str, rows: Iterable[tuple[str, Any]]) -> Bundle:
    """A two-column table (labels, values) as text/plain (aligned) and text/html (no header)."""
    rows = [(str(k), str(v)) for k, v in rows]
    width = max((len(k) for k, _ in rows), default=0)
    plain = "\n".join([title, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])
    cells = "".join(
        f'<tr><th style="text-align: left; padding-right: 1.5em; font-weight: normal; '
        f'color: var(--jp-ui-font-color2, #757575)">{html.escape(k)}</th>'
        f'<td style="text-align: left">{html.escape(v)}</td></tr>'
        for k, v in rows
    )
    table = f'<table class="mnb-table"><tbody>{cells}</tbody></table>' if rows else ""
    heading = f'<div style="font-weight: bold">{html.escape(title)}</div>'
    markup = f'<div class="mnb-kv">{heading}{table}</div>'
    return {"text/plain": plain, "text/html": markup}


def cache_rows(view: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Rows of `%llm_cache` from `engine.cache_view()`: blocks and tokens first, records after."""
    get = view.get

    def num(key: str) -> int:
        return int(get(key) or 0)

    budget = num("budget_bytes")
    held = format_bytes(num("bytes_held"))
    rows = [
        ("blocks held", f"{num('blocks_held'):,} ({_plural(num('records'), 'record')})"),
        ("bytes held", f"{held} of {format_bytes(budget)} budget" if budget else held),
        (
            "blocks restored",
            f"{num('blocks_restored'):,} ({_plural(num('tokens_restored'), 'token')})",
        ),
        (
            "blocks computed",
            f"{num('blocks_computed'):,} ({_plural(num('tokens_computed'), 'token')})",
        ),
        (
            "blocks evicted",
            f"{num('blocks_evicted'):,} ({_plural(num('records_evicted'), 'record')})",
        ),
        ("requests", f"{num('requests'):,}"),
    ]
    kinds = [
        f"{kind} {int(v.get('records') or 0):,} ({format_bytes(v.get('bytes') or 0)})"
        for kind, v in (get("by_kind") or {}).items()
        if isinstance(v, Mapping) and v.get("records")
    ]
    if kinds:
        rows.append(("records by kind", ", ".join(kinds)))
    size, free = format_bytes(num("file_size")), format_bytes(num("free_bytes"))
    rows.append(("scratch file", f"{size} ({free} free inside for reuse)"))
    if get("backend"):
        rows.append(("backend", str(get("backend"))))
    return rows


# -- the local models ----------------------------------------------------------------------------

MODEL_COLUMNS = ("name", "source", "kind", "size", "converted")
_MUTED_STYLE = "color: var(--jp-ui-font-color2, #757575)"


def model_rows(models: Iterable[Any]) -> list[tuple[str, str, str, str, str]]:
    """A row of `MODEL_COLUMNS` per `LocalModel` (duck-typed: its fields by name)."""
    return [
        (
            str(m.name),
            str(m.source),
            str(m.category),
            format_bytes(m.size_bytes),
            ("yes" if m.converted else "no") if m.category == "gguf" else "-",
        )
        for m in models
    ]


def models_text(models: Iterable[Any], *, looked_in: str) -> str:
    """The model table as aligned text (sizes right-aligned), then `looked_in`."""
    rows = model_rows(models)
    if not rows:
        return f"no models to load here; {looked_in}"
    table = [MODEL_COLUMNS, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(MODEL_COLUMNS))]
    size = MODEL_COLUMNS.index("size")
    lines = [
        "  ".join(
            cell.rjust(width) if i == size else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    return "\n".join([*lines, looked_in])


def models_bundle(models: Iterable[Any], *, looked_in: str) -> Bundle:
    """The model table as text/plain (`models_text`) and text/html (escaped), for notebooks."""
    models = list(models)
    rows = model_rows(models)
    plain = models_text(models, looked_in=looked_in)
    if not rows:
        return {
            "text/plain": plain,
            "text/html": f'<div class="mnb-models">{html.escape(plain)}</div>',
        }
    size = MODEL_COLUMNS.index("size")

    def cell(tag: str, i: int, text: str) -> str:
        align = "right" if i == size else "left"
        return f'<{tag} style="text-align: {align}">{html.escape(text)}</{tag}>'

    head = "".join(cell("th", i, name) for i, name in enumerate(MODEL_COLUMNS))
    body = "".join(
        "<tr>" + "".join(cell("td", i, text) for i, text in enumerate(row)) + "</tr>"
        for row in rows
    )
    table = f'<table class="mnb-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    note = f'<div class="mnb-note" style="{_MUTED_STYLE}">{html.escape(looked_in)}</div>'
    return {"text/plain": plain, "text/html": f'<div class="mnb-models">{table}{note}</div>'}


def progress_bundle(what: str, *, elapsed: float) -> Bundle:
    """The line shown while something runs without progress reports: what, and for how long."""
    text = f"{what}… {elapsed:.1f} s"
    return {"text/plain": text, "text/markdown": _escape_md(text)}
