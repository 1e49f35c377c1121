"""Typing a prompt into a `%%llm` cell with the keyboard, in JupyterLab or Notebook 7.

The lines are the ones a user typed when JupyterLab edited the cell as Python: a line
ending in ``:`` (Python indents the next line), ``{doc}``, an apostrophe (a Python string
runs to the end of the line), words that are Python keywords (``for``, ``in``, ``is``) and a
blank line. `type_lines` types them at the end of a cell; `saved_source` saves the
notebook and reads that cell back from the file; `styled_spans` counts the words the
editor colours. The same lines typed into a Python cell are the control: they are
coloured there, so a count of 0 in the `%%llm` cell means something.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

TYPED_LINES = [
    "Notes for a summary:",
    "{doc}",
    "Summary:",
    "It's a story in ten chapters, and it is long.",
    "",
    "Chapter 1",
]

CELL = "document.querySelectorAll('.jp-Notebook .jp-Cell')[index]"

# Spans in the cell's editor lines whose colour differs from the line's: the words the
# language's highlighting styled (CodeMirror's classes for them are generated names).
STYLED_SPANS = f"""(index) => {{
  const cell = {CELL};
  let styled = 0;
  for (const line of cell.querySelectorAll('.cm-content .cm-line')) {{
    const plain = getComputedStyle(line).color;
    for (const span of line.querySelectorAll('span')) {{
      if (getComputedStyle(span).color !== plain) styled += 1;
    }}
  }}
  return styled;
}}"""


def type_lines(page, index: int, lines: list[str] = TYPED_LINES) -> None:
    """Click cell `index`'s editor, go to its end and type `lines`, Enter before each."""
    editor = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+End")
    for line in lines:
        page.keyboard.press("Enter")
        if line:
            page.keyboard.type(line)
    page.keyboard.press("Escape")  # command mode: nothing typed later lands in the cell


def styled_spans(page, index: int) -> int:
    return page.evaluate(STYLED_SPANS, index)


def saved_source(page, path: Path, index: int) -> str:
    """Save the notebook (Ctrl+S) and return cell `index`'s source as written to `path`."""
    page.keyboard.press("Control+s")
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget.context.model.dirty === false",
        timeout=60_000,
    )
    source = _notebook(path)["cells"][index]["source"]
    return "".join(source) if isinstance(source, list) else source


def _notebook(path: Path, *, within_s: float = 30.0) -> dict:
    """`path` parsed, once a write in flight has ended: the server may still be writing the
    file (an autosave after ours) when the front end's model is no longer dirty."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
