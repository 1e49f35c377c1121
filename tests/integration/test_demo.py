"""`python -m mlx_nbengine demo`: the quickstart executed headless, then the story's table.

The notebook run executes `notebooks/quickstart.ipynb` (its `%load_model default` swapped
for a tiny random-weight llama) in a kernel of this interpreter; the tests check the
progress lines, the files it writes and the closing table: the edited re-run restored
the document's blocks and computed only the rest (the speed-up is asserted only on the
default model, by the slow test).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_nbengine.demo import Row, add_speedups, table

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_run(tiny_model_dir, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    work = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_NBENGINE_HOME": str(work / "home")}
    out = subprocess.run(
        [sys.executable, "-m", "mlx_nbengine", "demo", "--model", str(tiny_model_dir("llama"))],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out, work / "mlx-nbengine-demo"


def test_the_demo_prints_a_progress_line_per_cell(demo_run):
    out, _ = demo_run
    assert out.returncode == 0, out.stderr
    cells = [line for line in out.stdout.splitlines() if line.startswith("[")]
    n = int(cells[0].split("/")[1].split("]")[0])
    assert len(cells) == n and cells[1].lstrip("[ 0123456789/]").startswith("%load_model")
    assert all(line.rstrip().endswith(" s") for line in cells)


def test_the_demo_writes_the_executed_notebook_with_widget_state_and_its_html(demo_run):
    out, folder = demo_run
    nb = json.loads((folder / "quickstart.ipynb").read_text())
    assert "application/vnd.jupyter.widget-state+json" in nb["metadata"]["widgets"]
    html = (folder / "quickstart.html").read_text()
    # The static pictures are in the page itself (no kernel, no network needed).
    assert 'class="mnb-root mnb-map' in html or "mnb-map" in html.split("<body")[1]
    assert str(folder.name) in out.stdout


def test_the_demo_ends_with_the_table_of_what_the_edited_rerun_restored_and_computed(demo_run):
    # What was restored and computed, not how fast: millisecond timings of a tiny model
    # are noise. The speed-up is asserted on the default model (the slow test below).
    out, _ = demo_run
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("answer  prompt"))
    rows = {}
    for line in lines[header + 2 :]:
        if line.strip():
            label, prompt, restored, computed, _first_token, speedup = re.split(r"\s{2,}", line)
            memory, disk = (int(n.replace(",", "")) for n in restored.split(" / "))
            prompt, computed = (int(n.replace(",", "")) for n in (prompt, computed))
            rows[label] = (prompt, memory + disk, computed, speedup)
    prompt, restored, computed, speedup = rows["first"]
    assert restored == 0 and computed == prompt and speedup == "-"
    prompt, restored, computed, speedup = rows["second"]
    # The edit is in the prompt's last line: all but a block or two come back.
    assert restored + computed == prompt and 0 < computed < prompt // 4
    assert re.fullmatch(r"\d+\.\dx", speedup), speedup


def test_a_run_all_of_the_quickstart_ends_with_the_model_still_loaded(demo_run):
    # Run All must leave the model (and its block store) for the "your turn" edit: the
    # notebook shows `%unload_model` in Markdown and runs `%llm_status` last.
    _, folder = demo_run
    nb = json.loads((folder / "quickstart.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert not any("%unload_model" in source for source in code)
    last = [c for c in nb["cells"] if c["cell_type"] == "code"][-1]
    assert "".join(last["source"]).startswith("%llm_status")
    shown = "".join("".join(o.get("data", {}).get("text/plain", "")) for o in last["outputs"])
    assert "active requests" in shown and "no model loaded" not in shown


def test_speedups_compare_each_rerun_with_its_documents_cold_run():
    rows = add_speedups(
        [
            Row("a", 900, 0, 0, 900, 4.0, document="d1"),
            Row("b", 40, 0, 0, 40, 0.2, document=None),
            Row("c", 890, 0, 768, 122, 0.5, document="d1"),
            Row("d", 900, 0, 0, 900, 5.0, document="d2"),
        ]
    )
    assert [r.speedup for r in rows] == [None, None, 8.0, None]
    text = table(rows)
    assert text.splitlines()[0].split()[:2] == ["answer", "prompt"]
    assert "8.0x" in text and "0 / 768" in text


@pytest.mark.slow
def test_the_readme_first_command_on_the_default_model_ends_with_faster_reruns(tmp_path):
    # The main job end to end: the real quickstart on Gemma 3 270M (converted once into the
    # user's cache home, shared with the other default-model tests).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "mlx_nbengine", "demo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("answer  prompt"))
    rows = [line.split() for line in lines[header + 2 :] if line.strip()]
    reruns = [row for row in rows if row[-1].endswith("x")]
    assert reruns, "the edited re-run got a speed-up over its first run"
    assert all(float(row[-1][:-1]) > 1 for row in reruns)
    saved = (tmp_path / "mlx-nbengine-demo" / "quickstart.ipynb").read_text()
    assert "PyTorch" not in out.stdout + out.stderr + saved, "transformers' torch advice"
    assert (tmp_path / "mlx-nbengine-demo" / "quickstart.html").is_file()
