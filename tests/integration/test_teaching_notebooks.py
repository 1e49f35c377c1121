"""The teaching notebooks, executed headless on tiny models, then read for the block story.

`notebooks/kv_cache_explained.ipynb` and `notebooks/iterative_prompt_editing.ipynb` run
on the default model for a reader; here `MLX_NBENGINE_NOTEBOOK_MODEL` swaps it for a tiny
random-weight model (the default model is too slow for the suite): a two-layer
``gemma3_text`` (one sliding-window layer, one global) with Gemma 3 270M's 512-token window
for the KV-cache notebook, so that its window section has window records to show, and a
``llama`` for the editing notebook. `notebooks/vision_prompts.ipynb` runs on the tiny
``qwen2_vl`` it writes itself (`MLX_NBENGINE_VISION_MODEL` unset). Each
notebook is executed once per module with nbclient, widget state saved, the way
`jupyter nbconvert --execute` records it.

Terms: a cell's *strip* and *map* are the saved outputs of its block strip and its
``--blocks`` block map (widget view, static ``text/html`` and the widget state in the
notebook's metadata); a block's *kind* is what the strip colours (memory, disk,
computed, tail). The tests read what the notebooks promise a reader: blocks restored
after an edit and computed from the edit on, ``kv+window`` records for sliding-window
blocks, a ``state`` checkpoint for the hybrid model, the agent's follow-up restored up to
where its prompt leaves the first one, the plots, the block maps in the HTML export, and a
picture's blocks: computed, restored for a new question, never restored for another
picture of the same size, read back from disk without encoding the picture again.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

from kernelwatch import REPO, execute_notebook, kernel_manager  # noqa: E402  (tests/ on sys.path)
from test_kernel import WIDGET_VIEW  # noqa: E402

from mlx_nbengine.notebook.export import notebook_to_html  # noqa: E402

NOTEBOOKS = REPO / "notebooks"
KV_NOTEBOOK = NOTEBOOKS / "kv_cache_explained.ipynb"
EDITING_NOTEBOOK = NOTEBOOKS / "iterative_prompt_editing.ipynb"
VISION_NOTEBOOK = NOTEBOOKS / "vision_prompts.ipynb"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
BLOCK = 256  # the notebooks keep the engine's default block size
WINDOW = 512  # Gemma 3 270M's sliding window, which the tiny gemma3_text copies
RESTORED = {"memory", "disk"}
NUMBER = r"(\d+(?:,\d{3})*)"  # a printed count: 3,288


def execute(path: Path, model: Path | None, tmp: Path) -> nbformat.NotebookNode:
    """`path` executed in a fresh kernel with `model` as its model; temp files under `tmp`."""
    env = {
        "MLX_NBENGINE_NOTEBOOK_MODEL": str(model or ""),
        # The editing notebook's chat section writes its own tiny chat model without this,
        # the vision notebook its own tiny vision model.
        "MLX_NBENGINE_CHAT_MODEL": "",
        "MLX_NBENGINE_VISION_MODEL": "",
        # Scratch files and the notebooks' temporary model folders land in the test's tmp.
        "TMPDIR": str(tmp),
    }
    km = kernel_manager(tmp / "kernel", env=env, asynchronous=True)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=300,
        store_widget_state=True,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    execute_notebook(client)
    return nb


@pytest.fixture(scope="module")
def kv_notebook(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("gemma3_text", sliding_window=WINDOW, num_layers=2)
    return execute(KV_NOTEBOOK, model, tmp_path_factory.mktemp("kv-notebook"))


@pytest.fixture(scope="module")
def editing_notebook(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    return execute(EDITING_NOTEBOOK, model, tmp_path_factory.mktemp("editing-notebook"))


@pytest.fixture(scope="module")
def vision_notebook(tmp_path_factory):
    return execute(VISION_NOTEBOOK, None, tmp_path_factory.mktemp("vision-notebook"))


@pytest.fixture(params=["kv", "editing", "vision"])
def any_notebook(request):
    return request.getfixturevalue(f"{request.param}_notebook")


# -- reading saved outputs ---------------------------------------------------------------------


def cell(nb, prefix: str):
    """The one code cell whose source starts with `prefix`."""
    (found,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(prefix)]
    return found


def printed(c) -> str:
    return "".join(o["text"] for o in c.outputs if o["output_type"] == "stream")


def widgets(c) -> list[dict]:
    """The cell's widget outputs in order: the strip, then the map (``--blocks``)."""
    return [o for o in c.outputs if "data" in o and WIDGET_VIEW in o["data"]]


def state(nb, output: dict) -> dict:
    """The widget state the notebook's metadata saved for a widget view output."""
    model_id = output["data"][WIDGET_VIEW]["model_id"]
    return nb.metadata["widgets"][WIDGET_STATE]["state"][model_id]["state"]


def static_kinds(output: dict) -> list[str]:
    """The block kinds of a strip's or map's static picture (what nbconvert shows)."""
    return re.findall(r'class="mnb-block[^"]*" data-index="\d+" data-display="(\w+)"', html(output))


def html(output: dict) -> str:
    return output["data"]["text/html"]


def block_map(nb, prefix: str) -> dict:
    """The saved state of the block map of the ``%%llm --blocks`` cell starting with `prefix`."""
    strip, shown = widgets(cell(nb, prefix))
    assert 'class="mnb-root mnb-map"' in html(shown)
    assert "pending" not in static_kinds(strip)
    return state(nb, shown)


def sources(blocks: list[dict]) -> list[str]:
    return [b["source"] for b in blocks]


def restored_count(blocks: list[dict]) -> int:
    return sum(b["source"] in RESTORED for b in blocks)


def number(text: str | re.Match) -> int:
    """The count printed as `text` ("3,288"), or the first group of a match of NUMBER."""
    return int((text if isinstance(text, str) else text[1]).replace(",", ""))


def images(nb) -> list[str]:
    return [
        o["data"]["image/png"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "data" in o and "image/png" in o["data"]
    ]


# -- both notebooks ----------------------------------------------------------------------------


def test_every_code_cell_runs_without_error(any_notebook):
    for c in any_notebook.cells:
        if c.cell_type == "code":
            assert c.execution_count is not None, c.source
            errors = [o for o in c.outputs if o["output_type"] == "error"]
            assert not errors, (c.source, errors)


def test_the_notebooks_are_committed_without_outputs():
    for path in (KV_NOTEBOOK, EDITING_NOTEBOOK, VISION_NOTEBOOK):
        nb = nbformat.read(path, as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                assert c.outputs == [] and c.execution_count is None, (path.name, c.source)


def test_a_run_all_ends_with_a_model_loaded_and_never_unloads(any_notebook):
    sources_ = [c.source for c in any_notebook.cells if c.cell_type == "code"]
    assert not any("%unload_model" in s for s in sources_)
    assert any(s.startswith("%load_model") for s in sources_)


def test_the_html_export_shows_every_block_map_without_a_kernel(any_notebook):
    page = notebook_to_html(any_notebook)
    body = page.split("<body", 1)[1]
    maps = sum(
        1 for c in any_notebook.cells if c.cell_type == "code" and "--blocks" in c.source[:80]
    )
    assert maps >= 3
    assert body.count('class="mnb-root mnb-map"') == maps
    assert 'data-display="disk"' in body or 'data-display="memory"' in body


# -- kv_cache_explained.ipynb ------------------------------------------------------------------


def test_the_cost_and_prefix_sections_save_their_plots(kv_notebook):
    assert len(images(kv_notebook)) == 2
    cost = cell(kv_notebook, "bench = Engine.load(MODEL)")
    lengths = re.findall(r"<tr>\s*<th>(\d+)</th>\s*<td>", html(cost.outputs[-1]))
    assert lengths == ["128", "256", "512", "1024"]
    summary = printed(cell(kv_notebook, "fig, (left, right)"))
    assert re.match(r"prefill: [\d.]+ ms per prompt token; decode: \d+ ms per generated", summary)


def test_the_edited_report_restores_the_blocks_before_the_edit(kv_notebook):
    edited = block_map(kv_notebook, "%%llm --interpolate --blocks -o edited")
    blocks, edit = edited["blocks"], edited["edit"]
    first_computed = edit["position"] // BLOCK
    assert first_computed >= 2
    assert sources(blocks[:first_computed]) == ["disk"] * first_computed  # a rotated window
    assert blocks[first_computed]["reason"] == "edited"
    assert {b["reason"] for b in blocks[first_computed + 1 : -1]} == {"after_miss"}
    assert blocks[-1]["display"] == "tail"
    strip, _ = widgets(cell(kv_notebook, "%%llm --interpolate --blocks -o edited"))
    assert static_kinds(strip)[:first_computed] == ["disk"] * first_computed
    assert f"first changed token: {edit['position']:,}" in printed(
        cell(kv_notebook, 'print(\n    f"{edited.report')
    )


def test_the_sliding_window_blocks_read_window_records(kv_notebook):
    blocks = block_map(kv_notebook, "%%llm --interpolate --blocks -o edited")["blocks"]
    restored = [b for b in blocks if b["source"] == "disk"]
    in_window = WINDOW // BLOCK
    assert [b["reason"] for b in restored[-in_window:]] == ["kv+window"] * in_window
    assert {b["reason"] for b in restored[:-in_window]} == {"kv"}
    table = html(cell(kv_notebook, "pd.DataFrame(").outputs[-1])
    assert table.count("kv + window") == in_window


def test_the_ring_buffer_shows_overwritten_positions(kv_notebook):
    shown = printed(cell(kv_notebook, "import mlx.core as mx"))
    assert "positions held: [8, 9, 10, 11, 4, 5, 6, 7]" in shown
    assert "can be trimmed: False" in shown


def test_the_hybrid_model_restores_to_a_boundary_with_a_state_checkpoint(kv_notebook):
    hybrid = block_map(kv_notebook, "%%llm --interpolate --blocks -o hybrid_edited")
    assert "state" in hybrid["layer_kinds"] and "kv" in hybrid["layer_kinds"]
    blocks = hybrid["blocks"]
    restored = [b for b in blocks if b["source"] == "disk"]
    assert restored and restored[-1]["reason"] == "kv+state"
    assert {b["reason"] for b in restored[:-1]} == {"kv"}
    # The restore stops at the boundary before the edit, not at the edited token.
    edit = hybrid["edit"]["position"]
    assert restored[-1]["end"] == edit // BLOCK * BLOCK < edit
    summary = printed(cell(kv_notebook, "restored = [b for b"))
    assert "read kv + state" in summary and summary.rstrip().endswith("boundary: state")


def test_a_real_shape_hybrid_restores_its_blocks_and_one_state_checkpoint(kv_notebook):
    # Qwen3.5-0.8B's published shape with random weights: 6 full layers of 2 key/value heads
    # of 256 (6.3 MB a block in float32), 18 linear layers of 16 states of 128 x 128 and
    # their convolutions' last 3 inputs (20.2 MB, whatever the length). Rows: a block's, a
    # fixed size's and 4,096 tokens' MB.
    sizes = html(cell(kv_notebook, "import json").outputs[-1])
    found = re.findall(r"<td>(\d+\.\d)</td>", sizes)
    assert found == ["6.3", "0.0", "100.7", "0.0", "20.2", "20.2"]
    real = block_map(kv_notebook, "%%llm --interpolate --blocks -o real_edited")
    assert "state" in real["layer_kinds"] and "kv" in real["layer_kinds"]
    restored = [b for b in real["blocks"] if b["source"] == "disk"]
    assert len(restored) >= 2 and restored[-1]["reason"] == "kv+state"
    assert {b["reason"] for b in restored[:-1]} == {"kv"}
    edit = real["edit"]["position"]
    assert restored[-1]["end"] == edit // BLOCK * BLOCK < edit
    summary = printed(cell(kv_notebook, "r = real_edited.report"))
    found = re.search(
        rf"edited: {NUMBER} restored \((\d+) blocks of keys and values and 1 state checkpoint, "
        r"([\d.]+) MB read; by the config: ([\d.]+) MB\)",
        summary,
    )
    assert found, summary
    assert number(found) == restored[-1]["end"] and int(found[2]) == len(restored)
    assert found[3] == found[4]  # the bytes read are the config's arithmetic
    cold = float(re.search(r"cold: .* after ([\d.]+) s", summary)[1])
    warm = float(re.search(r"edited: .* after ([\d.]+) s", summary)[1])
    assert warm < cold


def test_the_agent_step_restores_its_prompt_up_to_where_it_leaves_the_first(kv_notebook):
    summary = printed(cell(kv_notebook, 'print(\n    f"steps 1-2'))
    found = re.search(rf"{NUMBER} restored \(the prompts diverge at token {NUMBER}", summary)
    restored, diverge = map(number, found.groups())
    assert restored == diverge
    step1 = number(re.search(rf"steps 1-2: {NUMBER} prompt tokens", summary))
    # Everything but the "Reasoning:" cue that ended the first prompt came back.
    assert step1 - 8 <= restored < step1
    blocks = block_map(kv_notebook, "%%llm --raw --interpolate --blocks -o next_step")["blocks"]
    n_whole = restored // BLOCK
    assert sources(blocks[:n_whole]) == ["disk"] * n_whole


def test_the_prefix_table_restores_more_the_later_the_edit(kv_notebook):
    table = html(cell(kv_notebook, "def with_edit(").outputs[-1])
    restored = [int(n) for n in re.findall(r"<tr>\s*<th>\d+</th>\s*<td>(\d+)</td>", table)]
    assert len(restored) == 5 and restored == sorted(restored) and restored[0] > 0


def test_the_notebook_ends_on_the_store_view_of_the_loaded_model(kv_notebook):
    (store,) = widgets(cell(kv_notebook, "%llm_cache"))
    assert 'class="mnb-root mnb-store"' in html(store)
    assert state(kv_notebook, store)["view"]["blocks_held"] > 0


# -- iterative_prompt_editing.ipynb ------------------------------------------------------------


def test_an_edit_near_the_end_restores_every_whole_block(editing_notebook):
    blocks = block_map(editing_notebook, "%%llm --interpolate --blocks -o end_edit")["blocks"]
    assert len(blocks) >= 5
    assert set(sources(blocks[:-1])) <= RESTORED and blocks[-1]["display"] == "tail"


def test_an_edit_in_the_middle_restores_the_blocks_before_it(editing_notebook):
    middle = block_map(editing_notebook, "%%llm --interpolate --blocks -o middle_edit")
    blocks, edited = middle["blocks"], middle["edit"]["position"] // BLOCK
    assert 0 < edited < len(blocks) - 2
    assert restored_count(blocks) == edited
    assert blocks[edited]["reason"] == "edited"
    strip, _ = widgets(cell(editing_notebook, "%%llm --interpolate --blocks -o middle_edit"))
    assert set(static_kinds(strip)[:edited]) <= RESTORED


def test_an_edit_at_the_start_restores_nothing(editing_notebook):
    blocks = block_map(editing_notebook, "%%llm --interpolate --blocks -o start_edit")["blocks"]
    assert restored_count(blocks) == 0


def test_the_side_by_side_table_compares_every_run(editing_notebook):
    table = html(cell(editing_notebook, "import pandas as pd").outputs[-1])
    runs = ["first run", "edit near the end", "edit in the middle", "edit at the start"]
    assert re.findall(r"<th>([a-z ]+)</th>\s*<td>", table) == runs
    for column in ("restored", "computed", "first token s", "vs first run", "answer"):
        assert f"<th>{column}</th>" in table


def test_the_second_chat_turn_restores_the_first(editing_notebook):
    turn2 = block_map(editing_notebook, "%%llm --chat minutes --blocks -o turn2")
    assert restored_count(turn2["blocks"]) >= len(turn2["blocks"]) - 2
    (status,) = [o for o in cell(editing_notebook, "%llm_status").outputs if "data" in o]
    assert re.search(r"conversations\s+minutes", status["data"]["text/plain"])


# -- the vision notebook -----------------------------------------------------------------------

ASKED = "%%llm --image sunset --blocks --max-tokens 16\nDescribe"


def image_blocks(blocks: list[dict]) -> list[dict]:
    return [b for b in blocks if b.get("images")]


def test_the_first_image_prompt_computes_its_image_blocks(vision_notebook):
    first = next(c for c in vision_notebook.cells if c.source.startswith(ASKED))
    shown = [o for o in first.outputs if "data" in o]
    # The picture above the answer, then the answer, the strip and the map.
    assert 'class="mnb-images"' in shown[0]["data"]["text/html"]
    assert "data:image/png;base64," in shown[0]["data"]["text/html"]
    blocks = state(vision_notebook, widgets(first)[1])["blocks"]
    assert len(image_blocks(blocks)) >= 2
    assert {b["source"] for b in image_blocks(blocks)} == {"computed"}


def test_a_new_question_restores_the_pictures_blocks_from_memory(vision_notebook):
    blocks = block_map(vision_notebook, "%%llm --image sunset --blocks --max-tokens 16\nWhich")[
        "blocks"
    ]
    pictured = image_blocks(blocks)
    whole = [b for b in pictured if b["source"] != "computed"]
    assert whole and {b["source"] for b in whole} == {"memory"}
    assert 'data-image="0"' in html(
        widgets(cell(vision_notebook, "%%llm --image sunset --blocks --max-tokens 16\nWhich"))[1]
    )


def test_another_picture_of_the_same_size_restores_nothing_of_it(vision_notebook):
    blocks = block_map(vision_notebook, "%%llm --image stripes")["blocks"]
    assert {b["source"] for b in image_blocks(blocks)} == {"computed"}
    assert all(b["restored"] == 0 for b in image_blocks(blocks))


def test_the_first_picture_again_comes_from_disk_without_encoding_it_again(vision_notebook):
    asked = [c for c in vision_notebook.cells if c.source.startswith(ASKED)]
    assert len(asked) == 2
    blocks = state(vision_notebook, widgets(asked[1])[1])["blocks"]
    assert {b["source"] for b in image_blocks(blocks)} == {"disk"}
    status = "".join(
        o["data"]["text/plain"] for o in cell(vision_notebook, "%llm_status").outputs if "data" in o
    )
    assert re.search(r"pictures encoded\s+2\b", status), status
