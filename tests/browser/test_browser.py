"""The widgets in a real JupyterLab, driven through Debian's Chromium with Playwright.

One scenario per module (`lab_run`), as a person would do it: JupyterLab starts on
loopback (`lab_server.lab_server`), the browser opens a notebook that loads a tiny
random-weight llama with 16-token blocks and runs a long-prompt ``%%llm --blocks`` cell;
then the cell's last line is edited in the editor (click, select, type) and the cell
re-run with Shift+Enter, and ``%llm_cache`` runs. After each step the test reads the DOM
of the rendered widgets (the contract's selectors: ``.mnb-strip .mnb-block`` cells with
``data-display``, the ``.mnb-edit`` marker's ``data-position``, the ``.mnb-store`` figures).
The tests below check what was read.

The expected edit position comes from the tokenizer here, not from the kernel: the first
token at which the edited prompt's chat-templated ids differ from the first prompt's.

Screenshots of the notebook in the light and the dark theme land in the module's output
directory (``browser0/screenshots`` under pytest's temporary directory), and are copied
to ``$MLX_NBENGINE_SCREENSHOTS`` when that is set. Without Chromium (Debian's
``chromium`` package) or Playwright the module is skipped with the reason (under
``CI=true`` the run fails instead; see ``needs.py``); Playwright's own browser download
is never used.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from needs import PLAYWRIGHT_MISSING, chromium, module  # tests/ is on sys.path

sync_api = module("playwright.sync_api", PLAYWRIGHT_MISSING)

CHROMIUM = chromium()

from lab_server import lab_server, notebook_json  # noqa: E402  (tests/ is on sys.path)
from llm_editing import TYPED_LINES, saved_source, styled_spans, type_lines  # noqa: E402
from test_kernel import BLOCK, LONG_PROMPT  # noqa: E402
from test_nbconvert import chat_tokens, first_change  # noqa: E402

FIRST_LAST_LINE = "Summarize this text."
EDITED_LAST_LINE = "Translate this text."
TYPED_HEAD = "%%llm --max-tokens 2"
# Tokens the stopped answers may write: far more than they get to before their Stop click.
# At 6,000 the tiny model once finished its answer before the click landed (a CI run); the
# notebook's copy of the model gets a context of LONG_CONTEXT for them.
LONG_ANSWER = 60_000
LONG_CONTEXT = 65_536
RESTORED = {"memory", "disk"}
# Every wait in the browser, in milliseconds: generous for a busy 2-core machine.
WAIT_MS = 90_000


@dataclass
class Step:
    """What the DOM showed after one cell ran."""

    strip: list[dict]  # per .mnb-strip .mnb-block: index, kind, reason
    map_rows: list[dict]  # per .mnb-map .mnb-block row
    edits: list[int]  # data-position of every .mnb-edit in the cell's output
    roots: int  # .mnb-strip, .mnb-map and .mnb-store elements in the cell
    static_roots: int  # those of them inside a static text/html output


@dataclass
class LabRun:
    """The scenario's record: the two prompts' ids, the edited source, what each step showed."""

    tokens_first: list[int]
    tokens_edited: list[int]
    source_after_edit: str
    first: Step
    rerun: Step
    store_figures: dict[str, str] = field(default_factory=dict)
    # The same store view's figures after the stopped answers below it ended.
    store_figures_later: dict[str, str] = field(default_factory=dict)
    store: Step | None = None
    screenshots: dict[str, Path] = field(default_factory=dict)
    console_errors: list[str] = field(default_factory=list)
    # The lines typed into a `%%llm` cell and into a Python cell (the control):
    # the sources saved, and the words the editor coloured in each.
    typed_llm: str = ""
    typed_python: str = ""
    styled_llm: int = -1
    styled_python: int = -1
    # A --bg answer and a foreground one stopped with their Stop buttons (`stop_answer`),
    # the --bg one's text as its Copy button copied it, and what its handle said after.
    stopped_bg: dict = field(default_factory=dict)
    # The block map's details title after hovering a strip cell, and its selected row
    # after clicking that cell (`point_at_block`).
    strip_to_map: dict = field(default_factory=dict)
    # Every state a cold prompt's strip and status line went through (`WATCH_STRIP`).
    cold_states: list[dict] = field(default_factory=list)
    stopped_fg: dict = field(default_factory=dict)
    copied: dict = field(default_factory=dict)
    job: str = ""

    @property
    def n_blocks(self) -> int:
        return math.ceil(len(self.tokens_edited) / BLOCK)

    @property
    def edit_at(self) -> int:
        return first_change(self.tokens_first, self.tokens_edited)


# --- the page -------------------------------------------------------------------------------

APP = "window.jupyterapp"
NOTEBOOK = f"{APP}.shell.currentWidget"

READ_CELL = """(index) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
  const data = (e) => ({index: Number(e.dataset.index), display: e.dataset.display,
                        reason: e.dataset.reason});
  return {
    strip: [...cell.querySelectorAll('.mnb-strip .mnb-block')].map(data),
    map_rows: [...cell.querySelectorAll('.mnb-map .mnb-block')].map(data),
    edits: [...cell.querySelectorAll('.mnb-edit')].map(e => Number(e.dataset.position)),
    // Roots drawn by the static text/html fallback rather than by the live widget.
    static_roots: [...cell.querySelectorAll('.mnb-strip, .mnb-map, .mnb-store')]
      .filter(e => e.closest('.jp-RenderedHTMLCommon, [data-mime-type="text/html"]')).length,
    roots: cell.querySelectorAll('.mnb-strip, .mnb-map, .mnb-store').length,
  };
}"""

STRIP_DONE = """([index, n]) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
  const blocks = [...cell.querySelectorAll('.mnb-strip .mnb-block')];
  return blocks.length === n && blocks.every(b => b.dataset.display !== 'pending');
}"""


def wait_kernel_idle(page) -> None:
    # Optional chaining throughout: the app object appears only once JupyterLab has started.
    page.wait_for_function(
        "() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel"
        "?.status === 'idle'",
        timeout=WAIT_MS,
    )


def prompt_text(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputPrompt").inner_text()


def run_cell(page, index: int, keys: str = "Shift+Enter") -> None:
    """Focus cell `index`'s editor, press `keys`, wait for a new execution count."""
    before = prompt_text(page, index).strip()
    editor = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".cm-content")
    editor.click()
    page.keyboard.press(keys)
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
    errors = (
        page.locator(".jp-Notebook .jp-Cell")
        .nth(index)
        .locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    )
    assert not [t for t in errors.all_inner_texts() if "Error" in t], errors.all_inner_texts()


def cell_source(page, index: int) -> str:
    return page.evaluate(
        f"(i) => {NOTEBOOK}.content.widgets[i].model.sharedModel.getSource()", index
    )


def replace_last_line(page, index: int, text: str) -> None:
    """Select the last line of cell `index` in its editor and type `text` over it."""
    editor = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+End")
    page.keyboard.press("Shift+Home")
    page.keyboard.type(text)


# A prompt new to the store, of many 16-token blocks: its prefill on the tiny model lasts
# long enough for the page to draw the strip before the last blocks arrive.
COLD_PROMPT = "\n".join(
    f"Log {i}: the keepers wound the clockwork, trimmed the wicks and polished the lens."
    for i in range(120)
)
# Records, in `window.mnbStripStates`, every strip the page draws from here on (the ES
# module parses each new markup with a <template>: one entry per update the kernel sent,
# however close together they arrive) as its kinds, one letter each (p: pending), and
# every status line cell `index` shows; each entry with its time.
WATCH_STRIP = """(index) => {
  const states = window.mnbStripStates = [];
  const html = Object.getOwnPropertyDescriptor(Element.prototype, 'innerHTML');
  Object.defineProperty(HTMLTemplateElement.prototype, 'innerHTML', {
    configurable: true,
    get() { return html.get.call(this); },
    set(markup) {
      if (markup && markup.includes('mnb-root mnb-strip')) {
        const cells = /class="mnb-block" data-index="\\d+" data-display="(\\w+)"/g;
        const kinds = [...markup.matchAll(cells)].map(m => m[1][0]).join('');
        states.push({t: performance.now(), kinds, status: null});
      }
      html.set.call(this, markup);
    },
  });
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
  new MutationObserver(() => {
    const status = cell.querySelector('.mnb-answer .mnb-status');
    const text = status ? status.textContent : '';
    const last = states.filter(s => s.status !== null).at(-1);
    if (!last || last.status !== text) {
      states.push({t: performance.now(), kinds: null, status: text});
    }
  }).observe(cell, {subtree: true, childList: true, characterData: true});
}"""

STRIP_TO_MAP_BLOCK = 3
MAP_STATE = """(index) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
  const title = cell.querySelector('.mnb-map .mnb-details-title');
  return {
    details: title ? title.textContent.trim() : '',
    selected: [...cell.querySelectorAll('.mnb-map tr.mnb-block[aria-selected="true"]')]
      .map(r => Number(r.dataset.index)),
  };
}"""


def point_at_block(page, index: int, block: int) -> dict:
    """Hover strip cell `block` of cell `index`, then click it: the map's state each time."""
    strip_cell = (
        page.locator(".jp-Notebook .jp-Cell")
        .nth(index)
        .locator(f".mnb-strip .mnb-block[data-index='{block}']")
    )
    strip_cell.hover()
    hovered = page.evaluate(MAP_STATE, index)
    strip_cell.click()
    clicked = page.evaluate(MAP_STATE, index)
    page.mouse.move(0, 0)
    return {"hovered": hovered, "clicked": clicked}


def start_cell(page, index: int) -> None:
    """Run cell `index` (Shift+Enter) without waiting for it to end."""
    page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".cm-content").click()
    page.keyboard.press("Shift+Enter")


# The store view's figures in cell `index`: data-name -> the number shown.
STORE_FIGURES = """(index) => Object.fromEntries([...document.querySelectorAll(
  '.jp-Notebook .jp-Cell')[index].querySelectorAll('.mnb-store .mnb-figure')].map(
  f => [f.dataset.name, f.querySelector('.mnb-value').textContent.trim()]))"""

ANSWER_STATE = """(index) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
  const status = cell.querySelector('.mnb-answer .mnb-status');
  const text = cell.querySelector('.mnb-answer .mnb-text');
  return {
    state: status ? status.dataset.state : '',
    status: status ? status.textContent : '',
    text: text ? text.textContent : '',
    buttons: [...cell.querySelectorAll('.mnb-strip .mnb-controls button')]
      .map(b => b.dataset.action),
    outputs: cell.querySelector('.jp-OutputArea').innerText,
  };
}"""


def stop_answer(page, index: int) -> dict:
    """Once cell `index`'s answer has text, click its Stop button; wait for the answer to
    end and its Copy button; return its `ANSWER_STATE` before and after."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    stop = cell.locator(".mnb-strip .mnb-controls button[data-action='stop']")
    stop.wait_for(state="visible")
    page.wait_for_function(f"(i) => ({ANSWER_STATE})(i).text.length > 0", arg=index)
    before = page.evaluate(ANSWER_STATE, index)
    stop.click()
    try:
        page.wait_for_function(
            f"(i) => {{ const s = ({ANSWER_STATE})(i); return s.state !== 'running' "
            "&& s.buttons.includes('copy'); }",
            arg=index,
        )
    except sync_api.TimeoutError as e:
        now = page.evaluate(ANSWER_STATE, index)
        raise AssertionError(f"cell {index} ran on after Stop: {before} then {now}") from e
    wait_kernel_idle(page)  # a foreground cell ends after its answer: its error line comes
    return {"before": before, "after": page.evaluate(ANSWER_STATE, index)}


def copy_answer(page, index: int) -> dict:
    """Click cell `index`'s Copy button; the clipboard's text and the answer's shown text."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".mnb-strip .mnb-controls button[data-action='copy']").click()
    page.wait_for_function("() => navigator.clipboard.readText().then(t => t.length > 0)")
    return {
        "clipboard": page.evaluate("() => navigator.clipboard.readText()"),
        "shown": page.evaluate(ANSWER_STATE, index)["text"],
    }


def output_text(page, index: int) -> str:
    outputs = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea-output")
    return "\n".join(outputs.all_inner_texts())


def read_cell(page, index: int) -> Step:
    return Step(**page.evaluate(READ_CELL, index))


def wait_strip(page, index: int, n_blocks: int) -> None:
    page.wait_for_function(STRIP_DONE, arg=[index, n_blocks], timeout=WAIT_MS)


def screenshot(page, out: Path, theme: str, cells: dict[str, int]) -> dict[str, Path]:
    """Each cell of `cells` (name: index) alone, then the window; PNG paths by name."""
    first = min(cells.values())
    shots = {}
    for name, index in cells.items():
        path = out / f"{name}-{theme}.png"
        cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
        cell.evaluate("(e) => e.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(200)
        cell.screenshot(path=path)
        shots[f"{name}-{theme}"] = path
    # The whole window last, scrolled to the edited cell: strip, map and store together.
    page.locator(".jp-Notebook .jp-Cell").nth(first).evaluate(
        "(e) => e.scrollIntoView({block: 'start'})"
    )
    page.wait_for_timeout(200)
    shots[f"notebook-{theme}"] = out / f"notebook-{theme}.png"
    page.screenshot(path=shots[f"notebook-{theme}"])
    return shots


def set_theme(page, theme: str, *, light: bool) -> None:
    page.evaluate(f"(t) => {APP}.commands.execute('apputils:change-theme', {{theme: t}})", theme)
    page.wait_for_function(
        "(light) => document.body.dataset.jpThemeLight === String(light)",
        arg=light,
        timeout=WAIT_MS,
    )
    page.wait_for_timeout(500)  # the theme's CSS applies, transitions end


# --- the scenario ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab_run(tiny_model_dir, tmp_path_factory) -> LabRun:
    model = tiny_model_dir("llama")
    tmp = tmp_path_factory.mktemp("browser")
    out = tmp / "screenshots"
    out.mkdir()
    first_prompt = f"{LONG_PROMPT}\n{FIRST_LAST_LINE}"
    # Paths relative to the notebook (the kernel's working directory): the screenshots
    # show no temporary directories.
    cells = [
        f"%load_ext mlx_nbengine\n%load_model tiny-llama --block-size {BLOCK} --cache-dir scratch",
        f"%%llm --max-tokens 4 --blocks\n{first_prompt}",
        "%llm_cache",
        TYPED_HEAD,
        "x = 1",
        f"%%llm --bg -o job --max-tokens {LONG_ANSWER}\nTell a long story.",
        f"%%llm --max-tokens {LONG_ANSWER}\nTell another long story.",
        "job.result().finish_reason, len(job.result().tokens) < "
        f"{LONG_ANSWER}, job.text == job.result().text",
        f"%%llm --max-tokens 2\n{COLD_PROMPT}",
    ]
    tokens_first = chat_tokens(model, first_prompt)
    tokens_edited = chat_tokens(model, f"{LONG_PROMPT}\n{EDITED_LAST_LINE}")
    n_blocks = math.ceil(len(tokens_edited) / BLOCK)
    assert n_blocks == math.ceil(len(tokens_first) / BLOCK)

    console_errors: list[str] = []
    kernel_env = {"MLX_NBENGINE_HOME": str(tmp / "cache-home")}
    with lab_server(tmp / "lab", kernel_extra_env=kernel_env) as server:
        shutil.copytree(model, server.root / "tiny-llama")
        config_path = server.root / "tiny-llama" / "config.json"
        config = json.loads(config_path.read_text())
        config["max_position_embeddings"] = LONG_CONTEXT
        config_path.write_text(json.dumps(config))
        (server.root / "scratch").mkdir()
        (server.root / "browser_tiny.ipynb").write_text(json.dumps(notebook_json(cells)))
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1200})
                page.set_default_timeout(WAIT_MS)
                page.on(
                    "console",
                    lambda m: console_errors.append(m.text) if m.type == "error" else None,
                )
                try:
                    page.goto(server.notebook_url("browser_tiny.ipynb"), timeout=WAIT_MS)
                    wait_kernel_idle(page)
                    page.evaluate(f"() => {{ {APP}.shell.collapseLeft(); }}")

                    run_cell(page, 0)
                    run_cell(page, 1)
                    wait_strip(page, 1, n_blocks)
                    first = read_cell(page, 1)

                    replace_last_line(page, 1, EDITED_LAST_LINE)
                    source_after_edit = cell_source(page, 1)
                    run_cell(page, 1)
                    wait_strip(page, 1, n_blocks)
                    rerun = read_cell(page, 1)
                    strip_to_map = point_at_block(page, 1, STRIP_TO_MAP_BLOCK)

                    run_cell(page, 2, "Control+Enter")
                    page.wait_for_selector(
                        ".jp-Notebook .jp-Cell >> nth=2 >> .mnb-store", timeout=WAIT_MS
                    )
                    figures = page.evaluate(STORE_FIGURES, 2)
                    store = read_cell(page, 2)

                    type_lines(page, 3)
                    type_lines(page, 4)
                    styled = {i: styled_spans(page, i) for i in (3, 4)}
                    typed = {i: saved_source(page, server.root / "browser_tiny.ipynb", i)
                             for i in (3, 4)}  # fmt: skip

                    page.context.grant_permissions(
                        ["clipboard-read", "clipboard-write"], origin=server.base_url
                    )
                    run_cell(page, 5)  # a --bg cell: returns at once, the answer streams on
                    stopped_bg = stop_answer(page, 5)
                    copied = copy_answer(page, 5)
                    start_cell(page, 6)  # a foreground answer: the cell stays busy
                    stopped_fg = stop_answer(page, 6)
                    run_cell(page, 7)
                    job = output_text(page, 7)
                    # The store view shown before these answers counts them now.
                    page.wait_for_function(
                        f"([i, n]) => ({STORE_FIGURES})(i).requests !== n",
                        arg=[2, figures["requests"]],
                    )
                    figures_later = page.evaluate(STORE_FIGURES, 2)

                    page.evaluate(WATCH_STRIP, 8)
                    run_cell(page, 8)
                    wait_strip(page, 8, math.ceil(len(chat_tokens(model, COLD_PROMPT)) / BLOCK))
                    cold_states = page.evaluate("() => window.mnbStripStates")

                    # Let the answer's last update and the widgets settle before pictures.
                    page.wait_for_timeout(500)
                    cells_to_shoot = {"llm-cell": 1, "store": 2, "typed": 3, "stopped": 5}
                    shots = screenshot(page, out, "light", cells_to_shoot)
                    set_theme(page, "JupyterLab Dark", light=False)
                    shots |= screenshot(page, out, "dark", cells_to_shoot)
                except Exception:
                    page.screenshot(path=out / "failure.png")
                    (out / "console-errors.txt").write_text("\n".join(console_errors))
                    raise
            finally:
                browser.close()

    if os.environ.get("MLX_NBENGINE_SCREENSHOTS"):
        target = Path(os.environ["MLX_NBENGINE_SCREENSHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        for path in shots.values():
            shutil.copy2(path, target / path.name)
    return LabRun(
        tokens_first=tokens_first,
        tokens_edited=tokens_edited,
        source_after_edit=source_after_edit,
        first=first,
        rerun=rerun,
        store_figures=figures,
        store_figures_later=figures_later,
        store=store,
        screenshots=shots,
        console_errors=console_errors,
        strip_to_map=strip_to_map,
        cold_states=cold_states,
        stopped_bg=stopped_bg,
        stopped_fg=stopped_fg,
        copied=copied,
        job=job,
        typed_llm=typed[3],
        typed_python=typed[4],
        styled_llm=styled[3],
        styled_python=styled[4],
    )


def kinds(blocks: list[dict]) -> list[str]:
    return [b["display"] for b in sorted(blocks, key=lambda b: b["index"])]


# --- the checks -----------------------------------------------------------------------------


def test_the_answer_is_drawn_by_the_live_widgets_not_the_static_fallback(lab_run):
    for step in (lab_run.first, lab_run.rerun, lab_run.store):
        assert step.roots > 0
        assert step.static_roots == 0, "drawn by the text/html fallback"
    widget_errors = [e for e in lab_run.console_errors if re.search(r"widget|mnb|esm", e, re.I)]
    assert not widget_errors


def test_the_strip_has_one_cell_per_prompt_block(lab_run):
    assert [b["index"] for b in lab_run.first.strip] == list(range(lab_run.n_blocks))
    assert [b["index"] for b in lab_run.rerun.strip] == list(range(lab_run.n_blocks))


def test_a_new_prompt_computes_every_block_and_ends_with_the_tail(lab_run):
    assert kinds(lab_run.first.strip) == ["computed"] * (lab_run.n_blocks - 1) + ["tail"]
    assert {b["reason"] for b in lab_run.first.strip[:-1]} == {"new"}
    assert lab_run.first.edits == [], "nothing was edited yet"


def test_the_edit_typed_in_the_editor_is_the_cells_new_source(lab_run):
    source = lab_run.source_after_edit
    assert source.endswith(f"\n{EDITED_LAST_LINE}"), source[-80:]
    assert FIRST_LAST_LINE not in source
    assert source.startswith("%%llm --max-tokens 4 --blocks\n")


def test_the_rerun_restores_the_blocks_before_the_edit_and_computes_the_rest(lab_run):
    edit_block = lab_run.edit_at // BLOCK
    got = kinds(lab_run.rerun.strip)
    assert edit_block >= 2, "the edit is near the end of a long prompt"
    assert set(got[:edit_block]) <= RESTORED, got
    assert set(got[edit_block:-1]) <= {"computed"}, got
    assert got[-1] == "tail"
    if edit_block < lab_run.n_blocks - 1:
        assert lab_run.rerun.strip[edit_block]["reason"] == "edited"


def test_the_edit_marker_sits_at_the_first_changed_token(lab_run):
    assert lab_run.rerun.edits, "an .mnb-edit marker in the re-run cell"
    assert set(lab_run.rerun.edits) == {lab_run.edit_at}


def test_the_block_map_has_one_row_per_block_with_the_strips_kinds(lab_run):
    assert kinds(lab_run.rerun.map_rows) == kinds(lab_run.rerun.strip)
    assert [b["reason"] for b in lab_run.rerun.map_rows] == [
        b["reason"] for b in lab_run.rerun.strip
    ]


def test_hovering_a_strip_cell_shows_its_block_in_the_map_and_a_click_selects_it(lab_run):
    block = STRIP_TO_MAP_BLOCK
    assert lab_run.strip_to_map["hovered"]["details"].endswith(f"block {block}")
    assert lab_run.strip_to_map["clicked"]["selected"] == [block]


def test_a_cold_prefill_fills_the_strip_block_by_block(lab_run):
    strips = [s["kinds"] for s in lab_run.cold_states if s["kinds"] is not None]
    n = max(map(len, strips), default=0)
    assert n >= 4, strips
    # Some blocks done, some still pending: states between the empty and the full strip.
    partial = {k for k in strips if len(k) == n and "p" in k and k != "p" * n}
    assert len(partial) >= 2, strips


def test_a_running_prefill_never_says_queued(lab_run):
    states = lab_run.cold_states
    started = [s["t"] for s in states if s["kinds"] and s["kinds"].strip("p")]
    assert started, states
    later = [s["status"] for s in states if s["status"] is not None and s["t"] >= started[0]]
    assert later and not [text for text in later if "queued" in text], later


def test_the_store_view_shows_the_blocks_held(lab_run):
    held = lab_run.store_figures.get("blocks_held", "")
    assert int(held.replace(",", "") or 0) > 0, lab_run.store_figures
    restored = lab_run.store_figures.get("blocks_restored", "0")
    assert int(restored.replace(",", "")) >= lab_run.edit_at // BLOCK


def test_lines_typed_into_an_llm_cell_are_saved_without_added_spaces(lab_run):
    assert lab_run.typed_llm == "\n".join([TYPED_HEAD, *TYPED_LINES])


def test_an_llm_cell_shows_no_python_highlighting(lab_run):
    assert lab_run.styled_python > 0, "the control: the same lines in a Python cell are coloured"
    assert lab_run.styled_llm == 0


def test_a_python_cell_is_still_edited_as_python(lab_run):
    # The extension changes `%%llm` cells only: a Python cell indents "Summary:" (the bug
    # the issue met in `%%llm` cells).
    assert "\n    Summary:" in lab_run.typed_python


def test_a_stop_button_stops_a_background_answer_keeping_its_text_and_summary(lab_run):
    before, after = lab_run.stopped_bg["before"], lab_run.stopped_bg["after"]
    assert before["state"] == "running" and "stop" in before["buttons"]
    assert after["state"] == "interrupted", after
    assert re.search(r"cancelled after [\d,]+ tokens?$", after["status"]), after["status"]
    assert after["text"].startswith(before["text"]), "the partial answer stays"
    assert after["buttons"] == ["copy"], "no Stop button once it has stopped"
    assert lab_run.job.strip() == "('cancelled', True, True)", lab_run.job


def test_a_stop_button_stops_a_foreground_answer_as_an_interrupt_does(lab_run):
    before, after = lab_run.stopped_fg["before"], lab_run.stopped_fg["after"]
    assert before["state"] == "running"
    assert after["state"] == "interrupted", after
    assert "cancelled after" in after["status"]
    assert (
        "interrupted: generation cancelled; the partial answer is kept above" in (after["outputs"])
    )


def test_the_copy_button_copies_the_answer_as_written(lab_run):
    assert lab_run.copied["clipboard"] == lab_run.copied["shown"] != ""


def test_the_store_view_updates_after_later_requests(lab_run):
    def count(figures: dict[str, str], name: str) -> int:
        return int(figures[name].replace(",", ""))

    before, later = lab_run.store_figures, lab_run.store_figures_later
    assert count(later, "requests") > count(before, "requests"), (before, later)
    assert count(later, "blocks_computed") > count(before, "blocks_computed")


def test_screenshots_are_saved_in_light_and_dark(lab_run):
    for theme in ("light", "dark"):
        # A picture with something in it (the typed cell is a few lines of text only).
        for name, least in (("notebook", 10_000), ("llm-cell", 10_000), ("store", 10_000),
                            ("typed", 3_000), ("stopped", 10_000)):  # fmt: skip
            path = lab_run.screenshots[f"{name}-{theme}"]
            assert path.stat().st_size > least, path
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    light = lab_run.screenshots["store-light"].read_bytes()
    assert light != lab_run.screenshots["store-dark"].read_bytes()
