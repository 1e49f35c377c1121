"""What every display of the notebook shares: the *bundle* (a MIME type -> its text), the
text of a ``<pre>`` that shows exactly what the model wrote, Markdown with its HTML shown as
text, and the line shown while something runs without progress reports.

The displays themselves, each in the module named after what it draws: `answerview` (the
answer), `summary` (its summary line and stop phrases), `imagesview` (the images above it),
`stripfeed` (its block strip), `tables` (key/value and model tables).
"""

from __future__ import annotations

import html
import re

__all__ = [
    "Bundle",
    "close_fences",
    "escape_markdown_html",
    "escape_md",
    "pre_text",
    "progress_bundle",
]


Bundle = dict[str, str]


def close_fences(markdown: str) -> str:
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


def escape_md(text: str) -> str:
    return html.escape(text, quote=False).replace("*", r"\*").replace("_", r"\_")


def progress_bundle(what: str, *, elapsed: float) -> Bundle:
    """The line shown while something runs without progress reports: what, and for how long."""
    text = f"{what}… {elapsed:.1f} s"
    return {"text/plain": text, "text/markdown": escape_md(text)}
