"""tests/notebooks/llm_tiny.ipynb executed headless with nbclient, then its saved outputs read.

This is what `jupyter nbconvert --execute` (or papermill, or CI) records: the final state of
each answer's display (not its first "queued" frame), the summary lines, the restored
blocks of the edited prompt, and a clean scratch directory after `%unload_model`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from test_kernel import REPO, kernel_manager  # noqa: E402  (tests/ is on sys.path)

NOTEBOOK = Path(__file__).parent / "notebooks" / "llm_tiny.ipynb"


def texts(cell) -> list[str]:
    """Every text/plain (and stream text) the saved cell shows."""
    out = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            out.append(output["text"])
        elif "data" in output:
            out.append(output["data"].get("text/plain", ""))
    return out


@pytest.fixture(scope="module")
def executed(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    env = {"MLX_NBENGINE_NOTEBOOK_MODEL": str(model), "MLX_NBENGINE_NOTEBOOK_BLOCK_SIZE": "16"}
    km = kernel_manager(tmp_path_factory.mktemp("nbkernel"), env=env)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, km=km, timeout=300, resources={"metadata": {"path": str(REPO)}}
    )
    client.execute()
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
        shown = texts(cell)
        assert len(shown) == 1, "one display per answer, updated in place"
        assert "queued" not in shown[0]
        assert re.search(r"\d+ prompt tokens: [\d,]+ restored", shown[0])


def test_the_edited_prompt_reports_restored_blocks(executed):
    (second,) = cell_starting(executed, "%%llm -o second")
    assert re.search(r"restored \(\d+ blocks? from (memory|disk)\)", texts(second)[0])
    (check,) = cell_starting(executed, 'print(f"restored')
    restored = int(re.search(r"restored (\d+) of", texts(check)[0]).group(1))
    assert restored >= 32


def test_chat_and_background_cells_show_their_answers(executed):
    for cell in cell_starting(executed, "%%llm --chat demo"):
        assert "prompt tokens" in texts(cell)[0]
    (waited,) = cell_starting(executed, "answer = job.result")
    printed, shown = texts(waited)
    assert re.match(r"(stop|length) \d+", printed)
    assert "prompt tokens" in shown, "the handle shows the finished answer"


def test_cache_status_and_unload_cells(executed):
    (cache,) = cell_starting(executed, "%llm_cache")
    assert texts(cache)[0].startswith("block store")
    (status,) = cell_starting(executed, "%llm_status")
    assert "active requests" in texts(status)[0]
    (unload,) = cell_starting(executed, "%unload_model")
    assert texts(unload)[-1].strip() == "[]"
