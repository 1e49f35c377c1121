"""An executed notebook exported to HTML shows the block map and the store, without a kernel.

The module executes one small notebook with nbclient, as ``jupyter nbconvert --execute``
does: a tiny random-weight llama with 16-token blocks, a long prompt, an unrelated
question (so the next prompt's blocks come back from the disk store, not from the previous
request's live cache), the long prompt with its last line edited under ``--blocks``, and
``%llm_cache``. The notebook is saved with its widget state and read back, then converted
with nbconvert's `HTMLExporter`; the tests parse the HTML (script bodies are text, never
elements) for the contract's selectors: ``.mnb-map`` rows ``.mnb-block`` with
``data-display`` and ``data-reason``, the ``.mnb-edit`` marker's ``data-position``, the
``.mnb-strip`` under each answer and the ``.mnb-store`` figures.

*Saved without widget state* is what JupyterLab writes by default (its "save widget state"
setting is off): nbconvert then shows each output's static ``text/html``. *Saved with
widget state* is what nbclient writes (``store_widget_state``, on by default): stock
nbconvert then prefers the widget view, which only a browser with the widgets' JavaScript
can draw, so the project's exporter (`mlx_nbengine.notebook.export`, used by the demo and
``python -m mlx_nbengine html``) ranks the static pictures first.
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
nbconvert = pytest.importorskip("nbconvert")
bs4 = pytest.importorskip("bs4")

from kernelwatch import execute_notebook, kernel_manager  # noqa: E402  (tests/ on sys.path)
from test_kernel import BLOCK, LONG_PROMPT  # noqa: E402

FIRST = f"{LONG_PROMPT}\nSummarize this text."
EDITED = f"{LONG_PROMPT}\nTranslate this text."
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def chat_tokens(model_dir: Path, text: str) -> list[int]:
    """The prompt ids `%%llm` sends for `text` (the user message, chat template applied)."""
    from mlx_nbengine.models import load

    return load(model_dir).apply_chat_template([{"role": "user", "content": text.strip()}])


def first_change(before: list[int], after: list[int]) -> int:
    """The first position where two token lists differ (the edit position)."""
    pairs = zip(before, after, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(before), len(after)))


def notebook() -> nbformat.NotebookNode:
    cells = [
        f"%load_ext mlx_nbengine\n%load_model tiny-llama --block-size {BLOCK} --cache-dir scratch",
        f"%%llm --max-tokens 4\n{FIRST}",
        "%%llm --max-tokens 4\nHi",
        f"%%llm --max-tokens 4 --blocks\n{EDITED}",
        "%llm_cache",
    ]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    return nb


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory) -> Path:
    """The executed notebook, written to disk with its widget state."""
    model = tiny_model_dir("llama")
    work = tmp_path_factory.mktemp("nbconvert")
    shutil.copytree(model, work / "tiny-llama")
    (work / "scratch").mkdir()
    km = kernel_manager(
        tmp_path_factory.mktemp("nbconvert-kernel"),
        env={"MLX_NBENGINE_HOME": str(work / "cache-home")},
        asynchronous=True,
    )
    nb = notebook()
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=300,
        store_widget_state=True,
        resources={"metadata": {"path": str(work)}},
    )
    execute_notebook(client)
    path = work / "blocks.ipynb"
    nbformat.write(nb, path)
    return path


def export(nb: nbformat.NotebookNode, path: Path, name: str) -> bs4.BeautifulSoup:
    """`nb` (saved at `path`) as nbconvert's HTML, also written next to it as `name`."""
    exporter = nbconvert.HTMLExporter()
    html, _ = exporter.from_notebook_node(
        nb, resources={"metadata": {"name": path.stem, "path": str(path.parent)}}
    )
    (path.parent / name).write_text(html)
    return bs4.BeautifulSoup(html, "html.parser")


@pytest.fixture(scope="module")
def with_state(saved) -> bs4.BeautifulSoup:
    nb = nbformat.read(saved, as_version=4)
    assert WIDGET_STATE in nb.metadata.get("widgets", {}), "nbclient stored the widget state"
    return export(nb, saved, "with-state.html")


@pytest.fixture(scope="module")
def without_state(saved) -> bs4.BeautifulSoup:
    nb = copy.deepcopy(nbformat.read(saved, as_version=4))
    nb.metadata.pop("widgets", None)
    return export(nb, saved, "without-state.html")


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> dict:
    """The edit position and block count, from the tokenizer."""
    model = tiny_model_dir("llama")
    first, edited = chat_tokens(model, FIRST), chat_tokens(model, EDITED)
    return {"edit_at": first_change(first, edited), "n_blocks": math.ceil(len(edited) / BLOCK)}


def rows(soup: bs4.BeautifulSoup) -> list[bs4.Tag]:
    (block_map,) = soup.select("div.mnb-map")
    return sorted(block_map.select(".mnb-block"), key=lambda r: int(r["data-index"]))


def check_block_map(soup: bs4.BeautifulSoup, expected: dict) -> None:
    edit_block = expected["edit_at"] // BLOCK
    got = rows(soup)
    assert [int(r["data-index"]) for r in got] == list(range(expected["n_blocks"]))
    kinds = [r["data-display"] for r in got]
    assert kinds[:edit_block] == ["disk"] * edit_block, kinds
    assert set(kinds[edit_block:-1]) <= {"computed"} and kinds[-1] == "tail", kinds
    assert {r["data-reason"] for r in got[:edit_block]} == {"kv"}, "kv records were read"
    if edit_block < expected["n_blocks"] - 1:
        assert got[edit_block]["data-reason"] == "edited"
    (marker,) = soup.select("div.mnb-map .mnb-edit")
    assert int(marker["data-position"]) == expected["edit_at"]


def test_every_cell_ran_without_error(saved):
    nb = nbformat.read(saved, as_version=4)
    for cell in nb.cells:
        assert cell.execution_count is not None
        assert not [o for o in cell.outputs if o["output_type"] == "error"], cell.source


def test_each_widget_output_carries_its_static_html(saved):
    nb = nbformat.read(saved, as_version=4)
    shown = [o for c in nb.cells for o in c.outputs if "data" in o]
    widgets = [o for o in shown if "application/vnd.jupyter.widget-view+json" in o["data"]]
    assert len(widgets) >= 5, "three strips, one map, one store view"
    for output in widgets:
        assert 'class="mnb-root' in output["data"]["text/html"]
        assert "<script" not in output["data"]["text/html"]


def test_html_without_widget_state_shows_the_block_map(without_state, expected):
    check_block_map(without_state, expected)


def test_html_without_widget_state_shows_a_strip_under_every_answer(without_state, expected):
    strips = without_state.select("div.mnb-strip")
    assert len(strips) == 3
    last = sorted(strips[-1].select(".mnb-block"), key=lambda b: int(b["data-index"]))
    assert len(last) == expected["n_blocks"]
    assert "pending" not in {b["data-display"] for b in last}, "the strip's final state was saved"
    # That answer ran with --blocks: the map below carries the edit banner, the strip only
    # outlines the edited block.
    assert not strips[-1].select(".mnb-edit")
    edited = [int(b["data-index"]) for b in last if b.get("data-edit") == "true"]
    assert edited == [expected["edit_at"] // BLOCK]


def test_html_without_widget_state_shows_the_store_view(without_state):
    (store,) = without_state.select("div.mnb-store")
    figures = {
        f["data-name"]: f.select_one(".mnb-value").get_text() for f in store.select(".mnb-figure")
    }
    assert int(figures["blocks_held"].replace(",", "")) > 0, figures
    assert int(figures["blocks_restored"].replace(",", "")) > 0, figures
    assert store.select("svg.mnb-chart")


def test_stock_nbconvert_prefers_the_widget_view_when_the_state_is_saved(with_state):
    # What `jupyter nbconvert` does with nbclient's notebooks: it needs the widgets' JavaScript.
    assert not with_state.select("div.mnb-map")
    assert with_state.select('script[type="application/vnd.jupyter.widget-view+json"]')


def test_our_export_shows_the_block_map_when_the_widget_state_is_saved(saved, expected):
    from mlx_nbengine.notebook.export import write_html

    page = write_html(saved, saved.parent / "ours.html")
    check_block_map(bs4.BeautifulSoup(page.read_text(), "html.parser"), expected)
