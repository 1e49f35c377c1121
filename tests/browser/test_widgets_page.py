"""The widgets' ES module in Chromium, with a stand-in for anywidget's model: the live
markup draws what Python drew (tests/notebook/test_widgets.py has the rest of the widgets'
tests, whose helpers these reuse)."""

from __future__ import annotations

import needs  # tests/ is on sys.path
import pytest
from test_widgets import (  # every test folder is on sys.path
    CUT_EDIT,
    EDIT,
    REPO,
    cut_blocks,
    image_blocks,
    image_inputs,
    long_blocks,
    parse,
    rerun_blocks,
    select,
    store_view,
)

from mlx_nbengine.notebook import widgets
from mlx_nbengine.notebook.widgets import BlockMap, BlockStrip, StoreView, map_html, store_html

# --- the front end in a browser -------------------------------------------------------------

# The ES module with a stand-in for anywidget's model (get/on/off, and set to drive it).
PAGE = """<!doctype html><meta charset="utf-8"><style>{css}</style><body>
<script type="module">
import widget from "data:text/javascript;base64,{esm}";
window.models = {{}};
window.els = {{}};
// attach false: render into an element not yet on the page (as a notebook may), so the
// test can attach it later with window.attach(name).
window.draw = (name, state, attach = true) => {{
  const handlers = {{}};
  const model = {{
    get: (key) => state[key],
    on: (event, f) => (handlers[event] ||= []).push(f),
    off: (event, f) => (handlers[event] = (handlers[event] || []).filter((g) => g !== f)),
    // One message of several traitlets: every value first, then the change events.
    set: (values) => {{
      Object.assign(state, values);
      Object.keys(values).forEach((key) => (handlers["change:" + key] || []).forEach((f) => f()));
    }},
  }};
  const el = document.createElement("div");
  el.id = name;
  if (attach) document.body.append(el);
  window.models[name] = model;
  window.els[name] = el;
  widget.render({{ model, el }});
}};
window.attach = (name) => document.body.append(window.els[name]);
window.ready = true;
</script>"""

READ_CELLS = """(sel) => [...document.querySelectorAll(sel)].map((e) => [
  e.dataset.index, e.dataset.display, e.dataset.reason, e.dataset.edit || null,
  e.getAttribute("title"), e.textContent])"""


def synced(widget) -> dict:
    """The widget's state as the browser gets it (its ES module and CSS left out)."""
    return {k: v for k, v in widget.get_state().items() if k not in ("_esm", "_css")}


def draw(page, name, widget, *, attach=True) -> None:
    page.evaluate("([n, s, a]) => window.draw(n, s, a)", [name, synced(widget), attach])


def resync(page, name, widget) -> None:
    """Send the widget's new state, as one comm message would."""
    page.evaluate("([n, s]) => window.models[n].set(s)", [name, synced(widget)])


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    # Without Playwright or a system Chromium: skipped, failed under CI=true.
    sync_api = needs.module("playwright.sync_api", needs.PLAYWRIGHT_MISSING)
    chromium = needs.chromium()
    import base64

    esm = base64.b64encode((REPO / "widgets" / "blocks.js").read_bytes()).decode()
    css = (REPO / "widgets" / "blocks.css").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("page") / "widgets.html"
    path.write_text(PAGE.format(css=css, esm=esm), encoding="utf-8")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function("window.ready === true", timeout=30_000)
        yield page
        browser.close()
        assert not errors, errors


def _static_cells(html: str, cls: str) -> list[list]:
    return [
        [e.attrs["data-index"], e.attrs["data-display"], e.attrs["data-reason"],
         e.attrs.get("data-edit"), e.attrs.get("title"), e.text]
        for e in select(parse(html), cls)
    ]  # fmt: skip


def test_live_strip_shows_the_picture_python_drew(page):
    strip = BlockStrip(n_blocks=6, block_size=16, prompt_tokens=85, blocks=rerun_blocks()[:2])
    draw(page, "strip", strip)
    live = page.evaluate(READ_CELLS, "#strip .mnb-strip .mnb-block")
    assert live == _static_cells(strip.html(), "mnb-block")
    assert [c[1] for c in live] == ["memory", "disk"] + ["pending"] * 4
    assert page.inner_text("#strip .mnb-caption") == "6 blocks of 16 tokens · 85 prompt tokens"


def test_live_strip_fills_in_block_by_block_without_moving(page):
    strip = BlockStrip(n_blocks=6, block_size=16, prompt_tokens=85)
    draw(page, "filling", strip)
    places = (
        "() => [...document.querySelectorAll('#filling .mnb-block')]"
        ".map((e) => { const r = e.getBoundingClientRect(); return [r.x, r.y]; })"
    )
    before = page.evaluate(places)
    page.evaluate("window.cells = [...document.querySelectorAll('#filling .mnb-block')]")
    for b in rerun_blocks():
        strip.add_block(b)
        resync(page, "filling", strip)
        display = page.get_attribute(
            f"#filling .mnb-block[data-index='{b['index']}']", "data-display"
        )
        assert display == b["display"]
    strip.set_edit(EDIT)
    resync(page, "filling", strip)
    assert page.evaluate(places) == before  # fixed cells laid out for all blocks from the start
    same = (
        "() => [...document.querySelectorAll('#filling .mnb-block')]"
        ".every((e, i) => e === window.cells[i])"
    )
    assert page.evaluate(same)  # the cells were filled in, never replaced
    live = page.evaluate(READ_CELLS, "#filling .mnb-block")
    assert live == _static_cells(strip.html(), "mnb-block")
    assert page.evaluate("document.querySelector('#filling .mnb-edit').dataset.position") == "53"


def test_live_map_hover_shows_a_block_and_a_click_pins_it(page):
    block_map = BlockMap(blocks=rerun_blocks(), edit=EDIT, block_size=16, prompt_tokens=85,
                         layer_kinds=["window", "kv", "kv"])  # fmt: skip
    draw(page, "map", block_map)
    (title,) = select(parse(block_map.html()), "mnb-title")
    assert page.inner_text("#map .mnb-title") == title.text
    # No strip of its own: the answer's strip is just above it.
    assert page.locator("#map .mnb-map :is(.mnb-cells, .mnb-legend)").count() == 0
    # With nothing chosen the details show the edited block; hovering a row shows another.
    assert "block 3" in page.inner_text("#map .mnb-details")
    page.hover("#map tr.mnb-block[data-index='2']")
    details = page.inner_text("#map .mnb-details")
    assert "block 2" in details and "32–48" in details and "window read" in details
    page.click("#map tr.mnb-block[data-index='1']")
    page.mouse.move(0, 0)
    assert "block 1" in page.inner_text("#map .mnb-details")
    assert page.get_attribute("#map tr.mnb-block[data-index='1']", "aria-selected") == "true"
    assert page.get_attribute("#map tr.mnb-block[data-index='3']", "data-edit") == "true"
    page.click("#map tr.mnb-block[data-index='1']")  # a second click unpins it
    page.mouse.move(0, 0)
    assert "block 3" in page.inner_text("#map .mnb-details")
    assert page.get_attribute("#map tr.mnb-block[data-index='1']", "aria-selected") is None


def test_live_map_rows_open_the_details_by_keyboard(page):
    draw(page, "keys", BlockMap(blocks=rerun_blocks(), edit=EDIT, layer_kinds=["kv"]))
    page.focus("#keys tr.mnb-block[data-index='0']")
    assert "block 0" in page.inner_text("#keys .mnb-details")
    page.keyboard.press("Enter")
    assert page.get_attribute("#keys tr.mnb-block[data-index='0']", "aria-selected") == "true"


def test_live_map_details_of_a_partly_restored_block_split_its_tokens(page):
    draw(page, "cutmap", BlockMap(blocks=cut_blocks(), edit=CUT_EDIT, block_size=16,
                                  prompt_tokens=60, layer_kinds=["kv"]))  # fmt: skip
    assert "12 restored + 4 computed" in page.inner_text("#cutmap tr.mnb-block[data-index='2']")
    details = page.inner_text("#cutmap .mnb-details")  # the edited block, nothing chosen
    assert "16 tokens: 12 restored + 4 computed" in details
    assert "(first 12 tokens restored)" in details
    assert "read for the first 12 tokens, made now for the other 4" in details
    # The restored share reaches the fill through the stylesheet, not an inline style.
    fill = "#cutmap .mnb-details .mnb-fill"
    assert page.get_attribute(fill, "style") is None
    share = page.eval_on_selector(fill, "e => getComputedStyle(e).getPropertyValue('--mnb-share')")
    assert share.strip() == "0.75"


def test_live_store_view_shows_model_text_as_written(page):
    draw(page, "store", StoreView(view=store_view()))
    figures = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('#store .mnb-figure')]"
        ".map((f) => [f.dataset.name, f.querySelector('.mnb-value').textContent]))"
    )
    assert figures["blocks_held"] == "12" and figures["bytes_held"] == "3.0 MiB"
    assert page.evaluate("document.querySelectorAll('#store svg.mnb-chart polyline').length") == 3
    assert page.evaluate("document.querySelectorAll('#store .mnb-evictions li').length") == 2
    text = page.inner_text("#store")
    assert "Once <em>upon</em> a time" in text  # model text shown as written
    assert page.evaluate("document.querySelectorAll('#store em').length") == 0


def test_live_store_view_follows_a_new_view(page):
    view = StoreView(view={})
    draw(page, "grows", view)
    assert page.locator("#grows svg.mnb-chart[data-empty]").count() == 1
    view.view = store_view()
    resync(page, "grows", view)
    assert page.get_attribute("#grows svg.mnb-chart", "data-points") == "2"
    dashes = page.evaluate(
        "() => [...document.querySelectorAll('#grows .mnb-legend line')]"
        ".map((l) => l.getAttribute('stroke-dasharray'))"
    )
    assert dashes == [None, "7 3", "2 2"]


def test_live_strip_without_show_edit_marks_the_cell_but_shows_no_banner(page):
    strip = BlockStrip(n_blocks=6, blocks=rerun_blocks(), edit=EDIT, show_edit=False)
    draw(page, "quiet", strip)
    assert page.locator("#quiet .mnb-edit").count() == 0
    assert page.get_attribute("#quiet .mnb-block[data-index='3']", "data-edit") == "true"
    strip.show_edit = True
    resync(page, "quiet", strip)
    assert page.get_attribute("#quiet .mnb-edit", "data-position") == "53"


# Where each of a map's rows lies against its rows' box: -1 above, 0 inside, 1 below.
ROW_PLACES = """(id) => {
  const box = document.querySelector(`#${id} .mnb-scroll`).getBoundingClientRect();
  const head = document.querySelector(`#${id} thead`).getBoundingClientRect().height;
  return [...document.querySelectorAll(`#${id} tr.mnb-block`)].map((row) => {
    const r = row.getBoundingClientRect();
    return r.bottom <= box.top + head + 1 ? -1 : r.top >= box.bottom - 1 ? 1 : 0;
  });
}"""


def _draw_map(page, name, blocks, edited, *, attach=True):
    edit = {"position": edited * 16 + 2, "block": edited, "before": "a", "after": "b"}
    block_map = BlockMap(blocks=blocks, edit=edit, block_size=16,
                         prompt_tokens=16 * len(blocks), layer_kinds=["kv"])  # fmt: skip
    draw(page, name, block_map, attach=attach)


def test_live_map_of_up_to_forty_blocks_shows_every_row(page):
    n = widgets.TALL_ROWS
    _draw_map(page, "forty", long_blocks(n, n - 4), n - 4)
    assert page.get_attribute("#forty .mnb-scroll", "data-tall") is None
    assert page.evaluate(ROW_PLACES, "forty") == [0] * n  # the edited and tail rows too


@pytest.mark.parametrize("attach", [True, False], ids=["on-the-page", "attached-later"])
def test_live_map_of_a_long_prompt_opens_at_its_first_computed_block(page, attach):
    name = f"long-{attach}".lower()
    n, edited = widgets.TALL_ROWS + 40, widgets.TALL_ROWS + 32
    _draw_map(page, name, long_blocks(n, edited), edited, attach=attach)
    if not attach:
        page.evaluate("(n) => window.attach(n)", name)
        page.wait_for_function(
            "(n) => document.querySelector(`#${n} .mnb-scroll`).scrollTop > 0", arg=name
        )
    assert page.get_attribute(f"#{name} .mnb-scroll", "data-tall") == "true"
    places = page.evaluate(ROW_PLACES, name)
    assert places[edited:] == [0] * (n - edited)  # from the edit to the tail, in sight
    assert places[0] == -1 and places[edited - 1] == 0  # restored context just above


# A notebook page's own table and list rules, with the selectors JupyterLab and nbconvert
# use for rendered HTML output, placed after the widgets' CSS so only specificity can win.
PAGE_RULES = """
.jp-RenderedHTMLCommon table { table-layout: fixed; margin: 0 auto 1em; border: none; }
.jp-RenderedHTMLCommon td, .jp-RenderedHTMLCommon th, .jp-RenderedHTMLCommon tr {
  padding: 0.5em; line-height: normal; white-space: normal; max-width: none; border: none; }
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon th,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon tr { text-align: right; }
.jp-RenderedHTMLCommon tbody tr:nth-child(odd) { background: rgb(255, 0, 0); }
.jp-RenderedHTMLCommon ul:not(.list-inline) { padding-left: 2em; }
.jp-RenderedHTMLCommon ul { list-style: disc; }
"""

READ_STYLES = """(id) => {
  const style = (sel, prop) => getComputedStyle(document.querySelector(`#${id} ${sel}`))[prop];
  const table = document.querySelector(`#${id} .mnb-map table`).getBoundingClientRect();
  const text = document.querySelector(`#${id} td.mnb-text`).getBoundingClientRect();
  return {
    layout: style(".mnb-map table", "tableLayout"),
    text: [style("td.mnb-text", "textAlign"), style("td.mnb-text", "whiteSpace")],
    range: style("td.mnb-range", "textAlign"),
    source: [style("td.mnb-text + td", "textAlign"), style("td.mnb-text + td", "whiteSpace")],
    header: style(".mnb-map th:nth-child(3)", "textAlign"),
    stripes: style(".mnb-map tbody tr", "backgroundColor"),
    list: [style(".mnb-evictions", "paddingLeft"), style(".mnb-evictions", "listStyleType")],
    textShare: text.width / table.width,
  };
}"""


def test_static_tables_keep_their_own_alignment_and_widths_on_a_notebook_page(page):
    html = map_html(rerun_blocks(), edit=EDIT, layer_kinds=["kv"]) + store_html(store_view())
    page.evaluate(
        """([html, rules]) => {
          const out = document.createElement("div");
          out.id = "rendered";
          out.className = "jp-RenderedHTMLCommon jp-OutputArea-output";
          out.style.width = "1000px";
          out.innerHTML = html;
          const style = document.createElement("style");
          style.textContent = rules;
          document.body.append(out, style);
        }""",
        [html, PAGE_RULES],
    )
    styles = page.evaluate(READ_STYLES, "rendered")
    assert styles["layout"] == "auto"
    assert styles["text"] == ["left", "normal"]  # words wrap, never cut
    assert styles["range"] == "right" and styles["header"] == "left"
    assert styles["source"] == ["left", "nowrap"]
    assert styles["stripes"] != "rgb(255, 0, 0)"
    assert styles["list"] == ["0px", "none"]
    assert styles["textShare"] > 0.25  # not one of seven equal fixed columns


READ_IMAGE_CELLS = """(sel) => [...document.querySelectorAll(sel)].map((e) => [
  e.dataset.index, e.dataset.image || null, e.getAttribute("title"), e.textContent,
  getComputedStyle(e, "::after").content])"""


# The floating preview of the strip drawn in `#id`: hidden, its figures, and whether its
# box lies inside the window (None: no preview).
PREVIEW = """(id) => {
  const root = document.querySelector(`#${id} .mnb-strip`);
  const box = [...document.querySelectorAll('.mnb-preview')].find((e) => e.mnbStrip === root);
  if (!box) return null;
  const r = box.getBoundingClientRect();
  return {
    hidden: box.hidden,
    figures: [...box.querySelectorAll('figure')].map((f) => [f.dataset.imageIndex,
      f.querySelector('img').getAttribute('src'), f.textContent]),
    inside: r.left >= 0 && r.top >= 0 && r.right <= innerWidth && r.bottom <= innerHeight,
    height: r.height,
  };
}"""


def test_live_strip_marks_image_blocks_and_hover_shows_their_thumbnails(page):
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    strip = BlockStrip(n_blocks=5, block_size=16, prompt_tokens=60, blocks=image_blocks(),
                       images=images)  # fmt: skip
    draw(page, "imgstrip", strip)
    live = page.evaluate(READ_IMAGE_CELLS, "#imgstrip .mnb-block")
    static = [
        [e.attrs["data-index"], e.attrs.get("data-image"), e.attrs["title"], e.text]
        for e in select(parse(strip.html()), "mnb-block")
    ]
    assert [row[:4] for row in live] == static
    # The mark: a pseudo-element on image blocks only.
    assert [row[4] != "none" for row in live] == [False, True, True, False, False]
    assert page.get_attribute("#imgstrip .mnb-key[data-images]", "data-count") == "2"
    assert page.evaluate(PREVIEW, "imgstrip")["hidden"]
    page.hover("#imgstrip .mnb-block[data-index='2']")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.mnb-preview img')].every((i) => i.complete)"
    )
    shown = page.evaluate(PREVIEW, "imgstrip")
    assert not shown["hidden"] and shown["height"] > 60, "the whole thumbnail, never clipped"
    assert shown["inside"], "the preview lies inside the window"
    assert shown["figures"] == [
        ["0", images[0]["src"], "cat.png · 640x480"],
        ["1", images[1]["src"], "<b>dog</b>.jpg · 30x90"],
    ]
    page.hover("#imgstrip .mnb-block[data-index='0']")
    assert page.evaluate(PREVIEW, "imgstrip")["hidden"]  # a text block shows none
    page.hover("#imgstrip .mnb-block[data-index='1']")
    assert len(page.evaluate(PREVIEW, "imgstrip")["figures"]) == 1
    page.mouse.move(0, 0)
    assert page.evaluate(PREVIEW, "imgstrip")["hidden"]


def test_live_strip_keeps_its_preview_while_blocks_arrive(page):
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    strip = BlockStrip(n_blocks=5, block_size=16, prompt_tokens=60, images=images)
    draw(page, "imgfill", strip)
    strip.add_blocks(image_blocks())
    resync(page, "imgfill", strip)
    page.hover("#imgfill .mnb-block[data-index='1']")
    shown = page.evaluate(PREVIEW, "imgfill")
    assert not shown["hidden"] and shown["figures"]


def test_live_map_marks_image_rows_and_its_details_show_the_thumbnails(page):
    from mlx_nbengine.notebook.blockinfo import image_dicts

    images = image_dicts(image_inputs())
    block_map = BlockMap(blocks=image_blocks(), block_size=16, prompt_tokens=60,
                         layer_kinds=["kv"], images=images)  # fmt: skip
    draw(page, "imgmap", block_map)
    chips = page.evaluate(
        "() => [...document.querySelectorAll('#imgmap tr.mnb-block')].map((r) => "
        "[...r.querySelectorAll('.mnb-img-chip')].map((c) => c.getAttribute('title')))"
    )
    assert chips == [[], ["image 1: cat.png"], ["image 1: cat.png", "image 2: <b>dog</b>.jpg"], []]
    page.hover("#imgmap tr.mnb-block[data-index='2']")
    details = page.inner_text("#imgmap .mnb-details")
    assert "block 2" in details and "image 1: cat.png, image 2: <b>dog</b>.jpg" in details
    srcs = page.evaluate(
        "() => [...document.querySelectorAll('#imgmap .mnb-details img')].map((i) => i.src)"
    )
    assert srcs == [images[0]["src"], images[1]["src"]]
    page.hover("#imgmap tr.mnb-block[data-index='0']")
    assert page.locator("#imgmap .mnb-details img").count() == 0
