"""tests/notebooks/llm_tiny.ipynb executed headless with nbclient, then its saved outputs read.

This is what `jupyter nbconvert --execute` (or papermill, or CI) records: the final state of
each answer's display (not its first "queued" frame), the summary lines, the block strip
under every answer (its widget view, its static ``text/html`` and its widget state in the
notebook's metadata), the ``--blocks`` map and the ``%llm_cache`` store view, the restored
blocks of the edited prompt, and a clean scratch directory after `%unload_model`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from kernelwatch import REPO, execute_notebook, kernel_manager  # noqa: E402  (tests/ on sys.path)
from test_kernel import WIDGET_VIEW  # noqa: E402

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "llm_tiny.ipynb"
BLOCK = 16
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def texts(cell) -> list[str]:
    """Every text/plain (and stream text) the saved cell shows."""
    out = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            out.append(output["text"])
        elif "data" in output:
            out.append(output["data"].get("text/plain", ""))
    return out


def answers(cell) -> list[dict]:
    """The saved outputs of the cell's answer (its widgets' outputs left out)."""
    return [o for o in cell.outputs if "data" in o and WIDGET_VIEW not in o["data"]]


def widget_outputs(cell) -> list[dict]:
    return [o for o in cell.outputs if "data" in o and WIDGET_VIEW in o["data"]]


def saved_state(nb, output: dict) -> dict:
    """The widget state the notebook's metadata saved for a widget view output."""
    model_id = output["data"][WIDGET_VIEW]["model_id"]
    return nb.metadata["widgets"][WIDGET_STATE]["state"][model_id]["state"]


def block_kinds(static_html: str) -> list[str]:
    return re.findall(r'class="mnb-block" data-index="\d+" data-display="(\w+)"', static_html)


@pytest.fixture(scope="module")
def executed(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    env = {
        "MLX_NBENGINE_NOTEBOOK_MODEL": str(model),
        "MLX_NBENGINE_NOTEBOOK_BLOCK_SIZE": str(BLOCK),
    }
    km = kernel_manager(tmp_path_factory.mktemp("nbkernel"), env=env, asynchronous=True)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, km=km, timeout=300, resources={"metadata": {"path": str(REPO)}}
    )
    execute_notebook(client)
    return nb


def cell_starting(nb, prefix: str):
    matches = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(prefix)]
    assert matches, prefix
    return matches


def test_every_code_cell_ran_without_error(executed):
    for cell in executed.cells:
        if cell.cell_type == "code":
            assert cell.execution_count is not None
            assert not [o for o in cell.outputs if o["output_type"] == "error"], cell.source


def test_saved_answers_are_final_with_a_summary_line(executed):
    for cell in cell_starting(executed, "%%llm -o"):
        (answer,) = answers(cell)  # one display per answer, updated in place
        shown = answer["data"]["text/plain"]
        assert "queued" not in shown
        assert re.search(
            r"\d+ prompt tokens(: [\d,]+ restored .*computed|, all computed); first token", shown
        )
        assert re.search(r"; (end of text after|stopped at max tokens \()\d+", shown)
        # The model's text as written: escaped, in a pre-wrap block, the summary below it.
        assert set(answer["data"]) == {"text/plain", "text/html"}
        assert "white-space: pre-wrap" in answer["data"]["text/html"]


def test_every_answer_saves_its_final_block_strip(executed):
    for cell in cell_starting(executed, "%%llm -o"):
        strip = widget_outputs(cell)[0]
        # The static picture (what nbconvert shows) is the final one, nothing pending.
        kinds = block_kinds(strip["data"]["text/html"])
        assert kinds and "pending" not in kinds and kinds[-1] == "tail"
        assert strip["data"]["text/plain"].startswith(f"{len(kinds)} prompt blocks: ")
        # The widget's state, saved in the notebook's metadata, holds the same blocks.
        state = saved_state(executed, strip)
        assert [b["display"] for b in state["blocks"]] == kinds
        assert state["n_blocks"] == len(kinds) == math.ceil(state["prompt_tokens"] / BLOCK)


def test_the_edited_prompt_reports_restored_blocks(executed):
    (second,) = cell_starting(executed, "%%llm -o second")
    assert re.search(r"restored \(\d+ blocks? from (memory|disk)\)", texts(second)[0])
    (check,) = cell_starting(executed, 'print(f"restored')
    restored = int(re.search(r"restored (\d+) of", texts(check)[0]).group(1))
    assert restored >= 32
    strip = widget_outputs(second)[0]
    kinds = block_kinds(strip["data"]["text/html"])
    # The previous answer's cache was still in memory: every whole block before the edit.
    assert kinds[: restored // BLOCK] == ["memory"] * (restored // BLOCK)
    # With --blocks the map below marks the edit; the strip does not repeat its banner.
    block_map = widget_outputs(second)[1]
    assert 'class="mnb-edit"' in block_map["data"]["text/html"]
    assert 'class="mnb-edit"' not in strip["data"]["text/html"]


def test_blocks_saves_the_block_map_after_the_strip(executed):
    (second,) = cell_starting(executed, "%%llm -o second --blocks")
    strip, block_map = widget_outputs(second)
    assert 'class="mnb-root mnb-map"' in block_map["data"]["text/html"]
    assert block_map["data"]["text/plain"].startswith("Block map: ")
    state = saved_state(executed, block_map)
    assert len(state["blocks"]) == saved_state(executed, strip)["n_blocks"]
    assert state["layer_kinds"] == ["kv", "kv"]
    assert state["edit"]["position"] > 0


def test_chat_and_background_cells_show_their_answers(executed):
    for cell in cell_starting(executed, "%%llm --chat demo"):
        assert "prompt tokens" in texts(cell)[0]
    (waited,) = cell_starting(executed, "answer = job.result")
    printed, shown = texts(waited)
    assert re.match(r"(stop|length) \d+", printed)
    assert "prompt tokens" in shown, "the handle shows the finished answer"
    # ... and its block strip's picture, which the --bg cell's own output missed.
    html = waited.outputs[-1]["data"]["text/html"]
    assert block_kinds(html) and "pending" not in block_kinds(html)


def test_cache_status_and_unload_cells(executed):
    (cache,) = cell_starting(executed, "%llm_cache")
    (store,) = widget_outputs(cache)
    assert store["data"]["text/plain"].startswith("Block store: ")
    assert 'class="mnb-root mnb-store"' in store["data"]["text/html"]
    assert saved_state(executed, store)["view"]["blocks_held"] > 0
    (status,) = cell_starting(executed, "%llm_status")
    assert "active requests" in texts(status)[0]
    assert " (llama)" in texts(status)[0]
    (unload,) = cell_starting(executed, "%unload_model")
    assert texts(unload)[-1].strip() == "[]"
