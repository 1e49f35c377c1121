"""Regenerate the README's screenshots: ``.venv/bin/python docs/screenshots.py``.

A real JupyterLab (the test harness ``tests/lab_server.py``: loopback, random token, its
own Jupyter directories) runs a notebook in Debian's Chromium driven by Playwright; the
pictures are cut from the rendered widgets and written to ``docs/images/``:

- ``block-map.png``: an edited re-run's answer, its block strip (blocks read back from
  disk, then the computed tail) and its block map with the edit marker (light theme);
- ``store-view.png``: the ``%llm_cache`` store view (light theme);
- ``block-map-dark.png``: the same cell in JupyterLab's dark theme.

The notebook: load the extension and the embedded default model (Gemma 3 270M, converted
on first use into the user's cache home); the long document of
``notebooks/quickstart.ipynb`` (its ``doc = '''...'''`` cell, read from the notebook so
the text lives in one place) asked one question (the *cold run*, every block computed);
a short unrelated prompt, which replaces the live cache, so the next request's blocks
come back from *disk* rather than memory; the same document with another question
(``--blocks``: the *edited re-run*); ``%llm_cache``. The summary line of each answer is
printed, so a change in timings or restored blocks is seen when the pictures are remade.

Needs Chromium (Debian's ``chromium``) and Playwright for Python; Playwright's own browser
download is never used. On a failure the whole page and the server's log are kept in a
temporary directory, whose path is printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(REPO / "tests"))

from lab_server import lab_server, notebook_json  # noqa: E402  (tests/ is on sys.path)

QUICKSTART = REPO / "notebooks" / "quickstart.ipynb"
NOTEBOOK = "screenshots.ipynb"
FIRST_QUESTION = "In one sentence, the document tells the story of"
EDITED_QUESTION = "The light was automated in the year"
# Every wait in the browser, in milliseconds: a busy 2-core machine prefills ~900 tokens of
# Gemma in up to half a minute, and the first model load may convert the GGUF file.
WAIT_MS = 600_000
VIEWPORT = {"width": 1200, "height": 1400}
# Pictures over this size are reported: the README should stay light.
MAX_BYTES = 300_000

# Cell indices of the notebook below.
LOAD, DOC, COLD, OTHER, EDITED, STORE = range(6)


def document_cell() -> str:
    """The source of the quickstart's ``doc = '''...'''`` cell."""
    notebook = json.loads(QUICKSTART.read_text())
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith("doc = '''"):
            return source
    raise LookupError(f"no `doc = '''...'''` cell in {QUICKSTART.name}")


def cells() -> list[str]:
    def ask(options: str, question: str) -> str:
        return f"%%llm {options}\nHere is a document:\n\n{{doc}}\n\n{question}"

    return [
        "%load_ext mlx_nbengine\n%load_model default",
        document_cell(),
        ask("--interpolate --max-tokens 24", FIRST_QUESTION),
        "%%llm --max-tokens 8\nThe capital of France is",
        ask("--interpolate --blocks --max-tokens 24", EDITED_QUESTION),
        "%llm_cache",
    ]


# --- the page -------------------------------------------------------------------------------

CELLS = ".jp-Notebook .jp-Cell"


def cell(page, index: int):
    return page.locator(CELLS).nth(index)


def wait_kernel_idle(page) -> None:
    page.wait_for_function(
        "() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel"
        "?.status === 'idle'",
        timeout=WAIT_MS,
    )


def run_cell(page, index: int) -> None:
    """Run cell `index` (Control+Enter: the selection stays), wait for its new count."""
    prompt = cell(page, index).locator(".jp-InputPrompt")
    before = prompt.inner_text().strip()
    cell(page, index).locator(".cm-content").click()
    page.keyboard.press("Control+Enter")
    page.wait_for_function(
        """([index, before]) => {
          const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[index]
            .querySelector('.jp-InputPrompt').textContent.trim();
          return /^\\[\\d+\\]:$/.test(p) && p !== before;
        }""",
        arg=[index, before],
        timeout=WAIT_MS,
    )
    wait_kernel_idle(page)
    errors = cell(page, index).locator(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
    )
    failed = [t for t in errors.all_inner_texts() if "Error" in t]
    if failed:
        raise RuntimeError(f"cell {index} failed:\n" + "\n".join(failed))


def wait_answer(page, index: int, *, block_map: bool = False) -> None:
    """Wait until cell `index`'s strip is complete (and its block map drawn)."""
    page.wait_for_function(
        """([index, map]) => {
          const c = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
          const blocks = [...c.querySelectorAll('.mnb-strip .mnb-block')];
          const done = blocks.length > 0 && blocks.every(b => b.dataset.display !== 'pending');
          return done && (!map || c.querySelectorAll('.mnb-map .mnb-block').length > 0);
        }""",
        arg=[index, block_map],
        timeout=WAIT_MS,
    )


def answer(page, index: int) -> tuple[str, str]:
    """Cell `index`'s answer text and summary line, as shown."""
    out = cell(page, index)
    return (
        out.locator(".mnb-answer .mnb-text").first.inner_text(),
        out.locator(".mnb-answer .mnb-status").first.inner_text(),
    )


def settle(page) -> None:
    """No selection, no focus ring, no hover: the page as a reader would see it."""
    page.evaluate(
        """() => {
          const nb = window.jupyterapp.shell.currentWidget.content;
          nb.mode = 'command';
          nb.activeCellIndex = 0;
          nb.deselectAll();
          document.activeElement?.blur();
        }"""
    )
    page.mouse.move(0, 0)
    page.wait_for_timeout(500)


def shoot(page, locator, path: Path) -> None:
    """Screenshot `locator`'s element, scrolled to the top of the window, mouse away."""
    locator.evaluate("(e) => e.scrollIntoView({block: 'start'})")
    page.mouse.move(0, 0)
    page.wait_for_timeout(300)
    locator.screenshot(path=path, animations="disabled", caret="hide")


def set_theme(page, theme: str, *, light: bool) -> None:
    page.evaluate(
        "(t) => window.jupyterapp.commands.execute('apputils:change-theme', {theme: t})", theme
    )
    page.wait_for_function(
        "(light) => document.body.dataset.jpThemeLight === String(light)",
        arg=light,
        timeout=WAIT_MS,
    )
    page.wait_for_timeout(1000)  # the theme's CSS applies, transitions end


# --- the run --------------------------------------------------------------------------------


def make_pictures(out: Path, work: Path) -> dict[str, tuple[str, str]]:
    """Run the notebook in JupyterLab, write the PNGs to `out`; answers by cell name."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no system Chromium: install Debian's `chromium` package")
    answers: dict[str, tuple[str, str]] = {}
    console_errors: list[str] = []
    with lab_server(work / "lab") as server:
        (server.root / NOTEBOOK).write_text(json.dumps(notebook_json(cells())))
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=chromium,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
            try:
                page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)
                page.set_default_timeout(WAIT_MS)
                page.on(
                    "console",
                    lambda m: console_errors.append(m.text) if m.type == "error" else None,
                )
                try:
                    page.goto(server.notebook_url(NOTEBOOK), timeout=WAIT_MS)
                    wait_kernel_idle(page)
                    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
                    for index in (LOAD, DOC, COLD, OTHER, EDITED, STORE):
                        started = time.monotonic()
                        run_cell(page, index)
                        if index in (COLD, OTHER, EDITED):
                            wait_answer(page, index, block_map=index == EDITED)
                            answers[("cold", "other", "edited")[index - COLD]] = answer(page, index)
                        print(f"cell {index} ran in {time.monotonic() - started:.1f} s")
                    page.wait_for_selector(f"{CELLS} >> nth={STORE} >> .mnb-store")

                    settle(page)
                    shoot(page, cell(page, EDITED), out / "block-map.png")
                    shoot(
                        page,
                        cell(page, STORE).locator(".jp-Cell-outputWrapper"),
                        out / "store-view.png",
                    )
                    set_theme(page, "JupyterLab Dark", light=False)
                    settle(page)
                    shoot(page, cell(page, EDITED), out / "block-map-dark.png")
                except Exception:
                    page.screenshot(path=work / "failure.png", full_page=True)
                    (work / "console-errors.txt").write_text("\n".join(console_errors))
                    shutil.copy2(server.log, work / "server.log")
                    raise
            finally:
                browser.close()
    # The harness turns JupyterLab's language-server client off; the plugins that need it
    # say so on every start. Anything else is worth a look.
    console_errors = [e for e in console_errors if "ILSPDocumentConnectionManager" not in e]
    if console_errors:
        print("browser console errors:", *(e.splitlines()[0] for e in console_errors), sep="\n  ")
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DOCS / "images", help="where the PNGs go (docs/images)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mlx_nbengine-screenshots-"))
    try:
        answers = make_pictures(args.out, work)
    except BaseException:
        print(f"failed; the page, console errors and server log are in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    for name, (text, summary) in answers.items():
        print(f"{name}: {text!r}\n  {summary}")
    for path in sorted(args.out.glob("*.png")):
        size = path.stat().st_size
        flag = "  (over the size budget)" if size > MAX_BYTES else ""
        print(f"{path.name}: {size:,} bytes{flag}")


if __name__ == "__main__":
    main()
