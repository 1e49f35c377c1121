"""`python -m mlx_nbengine`: demo tells the story (tests/integration/test_demo.py has the
notebook run), convert prints the converted directory, errors are one line with a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from mlx_nbengine.testing import make_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_NBENGINE_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "mlx_nbengine", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_quick_runs_the_story_and_ends_with_the_table(tiny_model_dir, tmp_path):
    out = cli("demo", "--quick", "--model", str(tiny_model_dir("llama")), home=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # The edited re-run restores the document's blocks and says so, block by block.
    second = next(line for line in lines if line.startswith("second "))
    assert second.split()[1].endswith("T") and "C" not in second.split()[1][:-1]
    header = next(i for i, line in enumerate(lines) if line.startswith("answer  prompt"))
    rows = {line.split()[0]: line for line in lines[header + 2 :]}
    assert set(rows) == {"answer", "first", "second"}
    assert rows["first"].endswith("-") and rows["second"].endswith("x")


def test_convert_prints_the_model_directory_and_reuses_it(tmp_path):
    gguf_file = make_tiny_gguf("llama", tmp_path / "tiny.gguf")
    first = cli("convert", str(gguf_file), home=tmp_path / "home")
    assert first.returncode == 0, first.stderr
    directory = Path(first.stdout.strip())
    assert (directory / "config.json").is_file()
    assert directory.parent == tmp_path / "home" / "gguf"
    assert cli("convert", str(gguf_file), home=tmp_path / "home").stdout == first.stdout


def test_errors_are_one_line_with_a_nonzero_exit(tmp_path):
    out = cli("demo", "--model", str(tmp_path / "missing"), home=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("error: No model at")


def test_blas_reports_what_this_machine_should_have(tmp_path):
    """Linux with scipy-openblas32 (the package's dependency): the runtime-dispatched
    OpenBLAS is active, with its config, chosen core, thread count and verdict."""
    from mlx_nbengine import _blaslib

    out = cli("blas", home=tmp_path)
    assert out.returncode == 0, out.stderr
    if not sys.platform.startswith("linux") or os.environ.get("MLX_NBENGINE_BLAS"):
        assert out.stdout.startswith("optimized BLAS active:")
        return
    assert _blaslib.scipy_openblas() is not None, "scipy-openblas32 is a dependency on Linux"
    lines = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    assert lines["optimized BLAS active"].startswith("True (scipy-openblas32")
    assert "DYNAMIC_ARCH" in lines["config"] and "MAX_THREADS=" in lines["config"]
    assert lines["core"] and lines["core"] in lines["config"]
    assert int(lines["threads"]) == len(os.sched_getaffinity(0))
    assert lines["verdict"] == "passed its check"  # a fresh cache home: the check ran
    assert Path(lines["serving"]) == _blaslib.scipy_openblas()


def test_html_exports_the_static_block_pictures_even_with_widget_state(tmp_path):
    import nbformat
    from fakes import block

    from mlx_nbengine.notebook.widgets import BlockStrip

    strip = BlockStrip(n_blocks=2, block_size=16, prompt_tokens=20)
    strip.add_block(block(0))
    bundle = {k: v for k, v in strip._repr_mimebundle_()[0].items()}
    model_id = bundle["application/vnd.jupyter.widget-view+json"]["model_id"]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%%llm", outputs=[])]
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data=bundle)]
    state = {model_id: {"model_name": "AnyModel", "state": {"_model_name": "AnyModel"}}}
    nb.metadata.widgets = {"application/vnd.jupyter.widget-state+json": {"state": state}}
    path = tmp_path / "saved.ipynb"
    nbformat.write(nb, path)
    out = cli("html", str(path), home=tmp_path)
    assert out.returncode == 0, out.stderr
    page = Path(out.stdout.strip()).read_text()
    assert 'data-display="disk"' in page and "mnb-strip" in page.split("<body")[1]


def test_an_output_folder_that_cannot_be_made_is_one_line_before_any_model(tmp_path):
    # Neither a folder under a file nor one in /proc can be made, not even by root.
    (tmp_path / "a-file").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    targets = [tmp_path / "a-file" / "out"]
    if Path("/proc/self").is_dir():
        targets.append(Path("/proc/nope"))
    for target in targets:
        started = time.monotonic()
        out = cli("demo", "--out", str(target), home=home)
        assert out.returncode == 1
        line = f"error: cannot create the output folder {target}: "
        assert out.stderr.startswith(line) and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stdout == ""
        assert time.monotonic() - started < 60
    # No model was resolved (the default one is not converted): the home holds at most the
    # BLAS set-up, which every start makes before it reads its command.
    assert [p.name for p in home.iterdir() if p.name != "blas"] == []


def test_help_is_plain_text(tmp_path):
    for args in [("--help",), ("demo", "--help"), ("convert", "--help"), ("html", "--help")]:
        out = cli(*args, home=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("usage: python -m mlx_nbengine")
        assert "`" not in out.stdout, out.stdout
    demo_help = cli("demo", "--help", home=tmp_path).stdout
    assert "the main job" in demo_help and "--notebook NB" in demo_help
