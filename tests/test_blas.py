"""`mlx_nbengine._blas`: on Linux CPU, MLX's matmuls land in OpenBLAS when mlx_nbengine is
imported first; the reference BLAS stays when asked or when MLX came first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_nbengine import _blas

ROOT = Path(__file__).resolve().parent.parent
linux_with_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or _blas._find_in_site("cmeel.prefix/lib/libopenblas.so.0") is None,
    reason="the OpenBLAS binding is for Linux with cmeel-openblas installed",
)

MATMUL = "import mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"


def run_python(code: str, tmp_path: Path, **env: str) -> tuple[str, str]:
    """Run `code` in a fresh interpreter with symbol-binding tracing; return (stdout, trace)."""
    trace = tmp_path / "ld"
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLX_NBENGINE_HOME": str(tmp_path / "home"),
        "LD_DEBUG": "bindings",
        "LD_DEBUG_OUTPUT": str(trace),
        **env,
    }
    full_env.pop("LD_PRELOAD", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, check=True
    )
    traced = "".join(p.read_text(errors="replace") for p in tmp_path.glob("ld.*"))
    return out.stdout, traced


def sgemm_binding(trace: str) -> str:
    lines = [line for line in trace.splitlines() if "libmlx.so" in line and "`cblas_sgemm'" in line]
    assert lines, "libmlx.so never bound cblas_sgemm"
    return lines[0]


@linux_with_openblas
def test_importing_mlx_nbengine_first_binds_mlx_sgemm_to_openblas(tmp_path):
    code = "import mlx_nbengine.models as m; from mlx_nbengine._blas import blas_status\n"
    code += MATMUL + "\nprint(blas_status().active)"
    stdout, trace = run_python(code, tmp_path)
    assert stdout.strip() == "True"
    assert "libopenblas.so.0" in sgemm_binding(trace).split(" to ")[1]


@linux_with_openblas
def test_reference_setting_keeps_the_bundled_blas(tmp_path):
    code = "import mlx_nbengine.models; from mlx_nbengine._blas import blas_status\n"
    code += MATMUL + "\nprint(blas_status().reason)"
    stdout, trace = run_python(code, tmp_path, MLX_NBENGINE_BLAS="reference")
    assert "asks for the reference BLAS" in stdout
    assert "libblas-" in sgemm_binding(trace).split(" to ")[1]


@linux_with_openblas
def test_after_mlx_is_imported_it_is_too_late_and_says_so(tmp_path):
    code = "import mlx.core\nfrom mlx_nbengine._blas import ensure_fast_blas\n"
    code += "print(ensure_fast_blas().reason)"
    stdout, _ = run_python(code, tmp_path)
    assert "mlx.core was imported first" in stdout


@linux_with_openblas
def test_gfortran_shim_is_cached_and_renamed(tmp_path, monkeypatch):
    source = _blas._find_mlx_gfortran()
    if source is None:
        pytest.skip("mlx-cpu's libgfortran not found")
    monkeypatch.setenv("MLX_NBENGINE_HOME", str(tmp_path))
    first = _blas._gfortran_shim(source)
    assert first == _blas._gfortran_shim(source)
    assert first.name == "libgfortran.so.5"
    assert b"libgfortran.so.5\0" in first.read_bytes()
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".")] == []


def test_other_platforms_are_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _blas._ensure() == _blas.BlasStatus(False, "not Linux: MLX uses the platform BLAS")


def test_decode_steps_get_one_thread():
    assert _blas.blas_threads_for(1) == 1
    with _blas.blas_step(1) as threads:
        assert threads == 1
        if _blas._openblas is not None:
            assert _blas._openblas.openblas_get_num_threads() == 1


@linux_with_openblas
def test_prefill_tries_both_thread_counts_then_keeps_the_faster(monkeypatch):
    _blas.ensure_fast_blas()
    if _blas._openblas is None or _blas._max_threads < 2:
        pytest.skip("needs OpenBLAS with at least two threads")
    monkeypatch.setattr(_blas, "_seconds_per_token", {})
    monkeypatch.setattr(_blas, "_prefill_steps", 1)
    n = _blas.PARALLEL_MIN_TOKENS
    with _blas.blas_step(n) as first:
        pass
    with _blas.blas_step(n) as second:
        pass
    assert {first, second} == {_blas._max_threads, 1}
    _blas._seconds_per_token.update({1: 0.001, _blas._max_threads: 0.003})
    with _blas.blas_step(n) as third:
        assert third == 1 == _blas._openblas.openblas_get_num_threads()
    # Every PROBE_EVERY prefill steps the other count is tried again.
    monkeypatch.setattr(_blas, "_prefill_steps", _blas.PROBE_EVERY)
    with _blas.blas_step(n) as probe:
        assert probe == _blas._max_threads
