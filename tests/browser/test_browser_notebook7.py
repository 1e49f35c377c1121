"""The widgets in a real Jupyter Notebook 7, driven through Debian's Chromium with Playwright.

One scenario per module (`nb7_run`): Notebook 7 (``python -m notebook``) starts on
loopback with the JupyterLab harness's directories, kernelspec and settings
(`lab_server`'s helpers; only the command line differs), and the browser opens
``/notebooks/<name>.ipynb``: a notebook that loads a tiny random-weight llama with
16-token blocks, answers a long prompt (``%%llm --max-tokens 4``), answers it again with
its last line changed (``--blocks``), then shows ``%llm_cache``. Every cell runs from the
UI, through the menu Run > Run All Cells. The tests read the DOM of the live widgets
(``.mnb-strip .mnb-block`` with ``data-display``, ``.mnb-map`` rows, ``.mnb-store``), never
the static text/html fallback, and the browser console.

Screenshots of the notebook, light and dark, land in the module's temporary directory.
Without Chromium (Debian's ``chromium`` package) or Playwright the module is skipped with
the reason (under ``CI=true`` the run fails instead; see ``needs.py``); Playwright's own
browser download is never used.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from needs import PLAYWRIGHT_MISSING, chromium, module  # tests/ is on sys.path

sync_api = module("playwright.sync_api", PLAYWRIGHT_MISSING)
module("notebook", "Jupyter Notebook 7 (`notebook`) is missing")

CHROMIUM = chromium()

from lab_server import lab_server, notebook_json  # noqa: E402  (tests/ is on sys.path)
from llm_editing import TYPED_LINES, saved_source, styled_spans, type_lines  # noqa: E402
from test_kernel import BLOCK, LONG_PROMPT  # noqa: E402
from test_nbconvert import chat_tokens, first_change  # noqa: E402

FIRST_LAST_LINE = "Summarize this text."
EDITED_LAST_LINE = "Translate this text."
RESTORED = {"memory", "disk"}
WAIT_MS = 90_000
NOTEBOOK_NAME = "nb7_tiny.ipynb"
TYPED_HEAD = "%%llm --max-tokens 2"


@dataclass
class Step:
    """What the DOM showed in one cell's output."""

    strip: list[dict]  # per .mnb-strip .mnb-block: index, kind, reason
    map_rows: list[dict]  # per .mnb-map .mnb-block row
    stores: int  # .mnb-store elements
    roots: int  # .mnb-strip, .mnb-map and .mnb-store elements in the cell
    static_roots: int  # those of them inside a static text/html output


@dataclass
class Nb7Run:
    tokens_first: list[int]
    tokens_edited: list[int]
    first: Step
    edited: Step
    store: Step
    screenshot: Path
    dark_screenshot: Path
    # The quickstart after Run All and its "your turn" edit (`run_all_then_edit_the_quickstart`).
    quickstart: dict = field(default_factory=dict)
    console_errors: list[str] = field(default_factory=list)
    typed_llm: str = ""  # the lines typed into a `%%llm` cell, as saved
    styled_llm: int = -1  # words the editor coloured in that cell
    styled_python: int = -1  # and in the same lines typed into a Python cell (the control)

    def n_blocks(self, tokens: list[int]) -> int:
        return math.ceil(len(tokens) / BLOCK)

    @property
    def edit_at(self) -> int:
        return first_change(self.tokens_first, self.tokens_edited)


CELLS = ".jp-Notebook .jp-Cell"

READ_CELL = """(index) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
  const data = (e) => ({index: Number(e.dataset.index), display: e.dataset.display,
                        reason: e.dataset.reason});
  return {
    strip: [...cell.querySelectorAll('.mnb-strip .mnb-block')].map(data),
    map_rows: [...cell.querySelectorAll('.mnb-map .mnb-block')].map(data),
    stores: cell.querySelectorAll('.mnb-store').length,
    static_roots: [...cell.querySelectorAll('.mnb-strip, .mnb-map, .mnb-store')]
      .filter(e => e.closest('.jp-RenderedHTMLCommon, [data-mime-type="text/html"]')).length,
    roots: cell.querySelectorAll('.mnb-strip, .mnb-map, .mnb-store').length,
  };
}"""

ALL_RAN = """(n) => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
  const kernel = window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel;
  return cells.length === n && kernel?.status === 'idle' && cells.every(c =>
    /^\\[\\d+\\]:$/.test(c.querySelector('.jp-InputPrompt').textContent.trim()));
}"""

STRIP_DONE = """([index, n]) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
  const blocks = [...cell.querySelectorAll('.mnb-strip .mnb-block')];
  return blocks.length === n && blocks.every(b => b.dataset.display !== 'pending');
}"""


def run_all_from_menu(page) -> None:
    """Run > Run All Cells in Notebook 7's menu bar."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()


def add_cell_below(page, index: int, source: str) -> None:
    """A new code cell under cell `index` holding `source` (set through the model)."""
    page.evaluate(
        """([index, source]) => {
          const notebook = window.jupyterapp.shell.currentWidget.content;
          notebook.model.sharedModel.insertCell(index + 1, {cell_type: 'code', source});
        }""",
        [index, source],
    )
    page.wait_for_function(
        "(n) => document.querySelectorAll('.jp-Notebook .jp-Cell').length >= n", arg=index + 2
    )


QUICKSTART = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"
# The quickstart's "your turn": the question after the document, changed.
SECOND_CELL = "%%llm --interpolate --blocks -o second"
NEW_QUESTION = "The keeper who stayed longest was"

KERNEL_IDLE = (
    "() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel"
    "?.status === 'idle'"
)
CODE_CELLS_RAN = """() => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')];
  const kernel = window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel;
  return cells.length > 0 && kernel?.status === 'idle' && cells.every(c =>
    /^\\[\\d+\\]:$/.test(c.querySelector('.jp-InputPrompt').textContent.trim()));
}"""


def run_all_then_edit_the_quickstart(page, server, shot_dir: Path) -> dict:
    """The quickstart (on the tiny model) run with Run > Run All Cells, then its "your
    turn": the `second` cell's question changed in the editor and run again. Returns the
    code cells' sources, that cell's prompt before and after, and its strip's kinds."""
    nb = json.loads(QUICKSTART.read_text())
    for c in nb["cells"]:
        source = "".join(c["source"])
        if source.strip() == "%load_model default":
            c["source"] = "%load_model tiny-llama --cache-dir scratch"
    nb["metadata"]["kernelspec"] = notebook_json([])["metadata"]["kernelspec"]
    (server.root / "quickstart.ipynb").write_text(json.dumps(nb))
    page.goto(f"{server.base_url}/notebooks/quickstart.ipynb?token={server.token}")
    page.wait_for_function(KERNEL_IDLE)
    run_all_from_menu(page)
    page.wait_for_function(CODE_CELLS_RAN)
    cells = page.evaluate(
        "() => window.jupyterapp.shell.currentWidget.content.widgets.map("
        "(w) => [w.model.type, w.model.sharedModel.getSource()])"
    )
    index = next(i for i, (_, text) in enumerate(cells) if text.startswith(SECOND_CELL))
    cell = page.locator(CELLS).nth(index)
    before = cell.locator(".jp-InputPrompt").inner_text().strip()
    cell.locator(".cm-content").click()
    page.keyboard.press("Control+End")
    page.keyboard.press("Shift+Home")
    page.keyboard.type(NEW_QUESTION)
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        """([i, before]) => {
          const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[i]
            .querySelector('.jp-InputPrompt').textContent.trim();
          return /^\\[\\d+\\]:$/.test(p) && p !== before;
        }""",
        arg=[index, before],
    )
    page.wait_for_function(CODE_CELLS_RAN)
    page.wait_for_function(STRIP_DONE.replace("blocks.length === n && ", ""), arg=[index, 0])
    step = Step(**page.evaluate(READ_CELL, index))
    shots = {}
    for theme, light in (("JupyterLab Dark", False), ("JupyterLab Light", True)):
        page.evaluate(
            "(t) => window.jupyterapp.commands.execute('apputils:change-theme', {theme: t})",
            theme,
        )
        page.wait_for_function(
            "(light) => document.body.dataset.jpThemeLight === String(light)", arg=light
        )
        page.wait_for_timeout(500)  # the theme's CSS applies
        cell.evaluate("(e) => e.scrollIntoView({block: 'start'})")
        shots[theme] = shot_dir / f"quickstart-edit-{'light' if light else 'dark'}.png"
        cell.screenshot(path=shots[theme])
    return {
        "screenshots": shots,
        "code": [text for kind, text in cells if kind == "code"],
        "edited": page.evaluate(
            "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i]"
            ".model.sharedModel.getSource()",
            index,
        ),
        "kinds": kinds(step.strip),
        "errors": page.locator(CELLS)
        .nth(index)
        .locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        .all_inner_texts(),
    }


@pytest.fixture(scope="module")
def nb7_run(tiny_model_dir, tmp_path_factory) -> Nb7Run:
    model = tiny_model_dir("llama")
    tmp = tmp_path_factory.mktemp("notebook7")
    first_prompt = f"{LONG_PROMPT}\n{FIRST_LAST_LINE}"
    edited_prompt = f"{LONG_PROMPT}\n{EDITED_LAST_LINE}"
    cells = [
        f"%load_ext mlx_nbengine\n%load_model tiny-llama --block-size {BLOCK} --cache-dir scratch",
        f"%%llm --max-tokens 4\n{first_prompt}",
        f"%%llm --max-tokens 4 --blocks\n{edited_prompt}",
        "%llm_cache",
    ]
    tokens_first = chat_tokens(model, first_prompt)
    tokens_edited = chat_tokens(model, edited_prompt)
    shot, dark_shot = tmp / "notebook7.png", tmp / "notebook7-dark.png"
    console_errors: list[str] = []
    kernel_extra = {"MLX_NBENGINE_HOME": str(tmp / "cache-home")}
    with lab_server(tmp / "nb7", kernel_extra_env=kernel_extra, app="notebook") as server:
        shutil.copytree(model, server.root / "tiny-llama")
        (server.root / "scratch").mkdir()
        (server.root / NOTEBOOK_NAME).write_text(json.dumps(notebook_json(cells)))
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1400})
                page.set_default_timeout(WAIT_MS)
                page.on(
                    "console",
                    lambda m: console_errors.append(m.text) if m.type == "error" else None,
                )
                try:
                    url = f"{server.base_url}/notebooks/{NOTEBOOK_NAME}?token={server.token}"
                    page.goto(url, timeout=WAIT_MS)
                    page.wait_for_function(
                        "() => window.jupyterapp?.shell?.currentWidget?.sessionContext"
                        "?.session?.kernel?.status === 'idle'",
                        timeout=WAIT_MS,
                    )
                    run_all_from_menu(page)
                    page.wait_for_function(ALL_RAN, arg=len(cells), timeout=WAIT_MS)
                    page.wait_for_function(
                        STRIP_DONE, arg=[1, math.ceil(len(tokens_first) / BLOCK)]
                    )
                    page.wait_for_function(
                        STRIP_DONE, arg=[2, math.ceil(len(tokens_edited) / BLOCK)]
                    )
                    page.wait_for_selector(f"{CELLS} >> nth=3 >> .mnb-store")
                    page.wait_for_timeout(500)  # the last updates settle before the picture
                    first, edited, store = (Step(**page.evaluate(READ_CELL, i)) for i in (1, 2, 3))
                    # Two cells added below (not run): the lines typed into each.
                    add_cell_below(page, 3, TYPED_HEAD)
                    add_cell_below(page, 4, "x = 1")
                    type_lines(page, 4)
                    type_lines(page, 5)
                    styled = {i: styled_spans(page, i) for i in (4, 5)}
                    typed_llm = saved_source(page, server.root / NOTEBOOK_NAME, 4)
                    page.locator(CELLS).nth(1).evaluate("(e) => e.scrollIntoView({block: 'start'})")
                    page.wait_for_timeout(200)
                    page.screenshot(path=shot, full_page=True)
                    page.evaluate(
                        "() => window.jupyterapp.commands.execute('apputils:change-theme', "
                        "{theme: 'JupyterLab Dark'})"
                    )
                    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")
                    page.wait_for_timeout(500)  # the theme's CSS applies
                    page.screenshot(path=dark_shot, full_page=True)
                    quickstart = run_all_then_edit_the_quickstart(page, server, tmp)
                except Exception:
                    page.screenshot(path=tmp / "failure.png")
                    (tmp / "console-errors.txt").write_text("\n".join(console_errors))
                    raise
            finally:
                browser.close()
    return Nb7Run(
        tokens_first=tokens_first,
        tokens_edited=tokens_edited,
        first=first,
        edited=edited,
        store=store,
        screenshot=shot,
        dark_screenshot=dark_shot,
        quickstart=quickstart,
        console_errors=console_errors,
        typed_llm=typed_llm,
        styled_llm=styled[4],
        styled_python=styled[5],
    )


def kinds(blocks: list[dict]) -> list[str]:
    return [b["display"] for b in sorted(blocks, key=lambda b: b["index"])]


def test_notebook7_draws_the_live_widgets_without_errors(nb7_run):
    for step in (nb7_run.first, nb7_run.edited, nb7_run.store):
        assert step.roots > 0
        assert step.static_roots == 0, "drawn by the text/html fallback"
    widget_errors = [e for e in nb7_run.console_errors if re.search(r"widget|mnb|esm", e, re.I)]
    assert not widget_errors


def test_notebook7_strips_have_one_cell_per_prompt_block(nb7_run):
    n_first = nb7_run.n_blocks(nb7_run.tokens_first)
    n_edited = nb7_run.n_blocks(nb7_run.tokens_edited)
    assert [b["index"] for b in nb7_run.first.strip] == list(range(n_first))
    assert [b["index"] for b in nb7_run.edited.strip] == list(range(n_edited))
    assert kinds(nb7_run.first.strip) == ["computed"] * (n_first - 1) + ["tail"]


def test_notebook7_edited_prompt_restores_blocks_before_the_edit(nb7_run):
    edit_block = nb7_run.edit_at // BLOCK
    got = kinds(nb7_run.edited.strip)
    assert edit_block >= 2, "the edit is near the end of a long prompt"
    assert set(got[:edit_block]) <= RESTORED, got
    assert set(got[edit_block:-1]) <= {"computed"}, got
    assert got[-1] == "tail"


def test_notebook7_block_map_and_store_view_are_shown(nb7_run):
    assert nb7_run.edited.map_rows, "an .mnb-map with rows under the --blocks answer"
    assert kinds(nb7_run.edited.map_rows) == kinds(nb7_run.edited.strip)
    assert nb7_run.store.stores >= 1
    png = nb7_run.screenshot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    dark = nb7_run.dark_screenshot.read_bytes()
    assert dark[:8] == b"\x89PNG\r\n\x1a\n" and len(dark) > 10_000 and dark != png


def test_notebook7_llm_cells_are_edited_as_text(nb7_run):
    assert nb7_run.typed_llm == "\n".join([TYPED_HEAD, *TYPED_LINES])
    assert nb7_run.styled_python > 0, "the control: the same lines in a Python cell are coloured"
    assert nb7_run.styled_llm == 0


def test_the_quickstart_survives_run_all_and_its_edit_restores_blocks(nb7_run):
    quickstart = nb7_run.quickstart
    assert not [code for code in quickstart["code"] if "%unload_model" in code]
    assert quickstart["edited"].endswith(f"\n{NEW_QUESTION}")
    assert not quickstart["errors"], quickstart["errors"]
    got = quickstart["kinds"]
    assert len(got) >= 2 and got[0] in RESTORED, f"the document's blocks come back: {got}"
    assert got[-1] == "tail"
    light, dark = (p.read_bytes() for p in quickstart["screenshots"].values())
    assert light != dark and min(len(light), len(dark)) > 10_000
