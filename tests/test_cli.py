"""`python -m mlx_nbengine`: demo streams a greedy completion, convert prints the converted
directory, errors are one line with a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlx_nbengine.testing import make_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_NBENGINE_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "mlx_nbengine", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_streams_a_completion_of_the_prompt_and_reports_speed(tiny_model_dir, tmp_path):
    out = cli("demo", "--model", str(tiny_model_dir("llama")), "--max-tokens", "4", home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The Eiffel Tower is located in the city of")
    assert "prefill" in out.stderr and "decode 4 tokens" in out.stderr


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


def test_blas_reports_its_state(tmp_path):
    out = cli("blas", home=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("optimized BLAS active:")
