"""The guard in front of any native BLAS (`mlx_nbengine._blaslib`): a library that dies,
hangs or computes wrong in a child process is refused with one line, MLX keeps its reference
BLAS and the process lives on; the verdict is cached per library build and CPU. Also the
no-compiler way: the renamed copy's symbol tables (every symbol still found by the dynamic
linker) and its refusals of what it cannot rename."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_nbengine import _blas, _blaslib
from mlx_nbengine._blaslib import BlasBuildError, rename_dynamic_symbols
from mlx_nbengine.compiler import c_compiler

ROOT = Path(__file__).resolve().parents[2]
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard is for Linux")
compiler = c_compiler()
needs_cc = pytest.mark.skipif(compiler is None, reason="builds a test library with a C compiler")

GEMM_ARGS = "int o, int ta, int tb, int m, int n, int k, {S} al, const {T} *a, int lda, "
GEMM_ARGS += "const {T} *b, int ldb, {S} be, {T} *c, int ldc"


def gemm(name: str, body: str, T: str = "float", S: str = "float") -> str:
    return f"void {name}({GEMM_ARGS.format(T=T, S=S)}) {{ {body} }}\n"


def build_library(tmp_path: Path, name: str, sgemm_body: str, *, cgemm: bool = True) -> Path:
    """A CBLAS-shaped library whose cblas_sgemm runs `sgemm_body`."""
    source = "#include <unistd.h>\n" + gemm("cblas_sgemm", sgemm_body)
    source += gemm("cblas_dgemm", "", "double", "double")
    if cgemm:
        source += gemm("cblas_cgemm", "", "void", "const void *")
    c_file = tmp_path / f"{name}.c"
    c_file.write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", out, c_file], check=True)
    return out


# An illegal instruction, as the AVX-512 kernel was on a CPU without AVX-512.
ILLEGAL = 'asm volatile("ud2");' if os.uname().machine == "x86_64" else "__builtin_trap();"


def run_engine_import(library: Path, home: Path) -> subprocess.CompletedProcess:
    code = (
        "import mlx_nbengine\n"
        "import mlx.core as mx\n"
        "from mlx_nbengine._blas import blas_status\n"
        "x = mx.arange(12, dtype=mx.float32).reshape(3, 4)\n"
        "print(float((x @ x.T).sum()), blas_status().active)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_NBENGINE_HOME": str(home)}
    env["MLX_NBENGINE_BLAS"] = str(library)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@linux
@needs_cc
def test_a_library_whose_sgemm_is_an_illegal_instruction_is_refused_and_the_process_lives(
    tmp_path,
):
    library = build_library(tmp_path, "libillegal", ILLEGAL)
    for attempt in ("first", "cached"):
        out = run_engine_import(library, tmp_path / "home")
        assert out.returncode == 0, out.stderr
        # The matmul ran on the reference BLAS: right, and the process is alive to say so.
        assert out.stdout.split() == ["1134.0", "False"], attempt
        [line] = out.stderr.strip().splitlines()
        signal_name = "SIGILL" if "ud2" in ILLEGAL else "SIG"
        assert line.startswith(
            "mlx_nbengine: the BLAS libillegal.so was refused: its check died of signal "
        ), line
        assert signal_name in line and "in sgemm 1x1x1 NN beta=0" in line, line
        assert line.endswith(_blas.REFERENCE_COST)
    # One verdict file, so the second process did not run the check again.
    assert len(list((tmp_path / "home" / "blas" / "verdicts").glob("*.json"))) == 1


@linux
@needs_cc
def test_a_library_that_computes_wrong_is_refused(tmp_path):
    library = build_library(tmp_path, "libwrong", "for (int i = 0; i < m * n; i++) c[i] = 1;")
    verdict = _blaslib.probe(library)
    assert not verdict.ok
    assert verdict.reason.startswith("it computes sgemm 1x1x1 NN beta=0 wrong")


@linux
@needs_cc
def test_a_library_missing_a_name_mlx_binds_is_refused(tmp_path):
    library = build_library(tmp_path, "libpartial", "", cgemm=False)
    assert _blaslib.probe(library) == _blaslib.Verdict(False, "it does not export cblas_cgemm")


@linux
@needs_cc
def test_a_check_that_hangs_is_refused_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_NBENGINE_HOME", str(tmp_path / "home"))
    library = build_library(tmp_path, "libslow", "sleep(60);")
    monkeypatch.setattr(_blaslib, "PROBE_TIMEOUT_S", 5.0)
    verdict, cached = _blaslib.vet(library)
    assert (verdict.ok, cached) == (False, False)
    assert verdict.reason == "its check did not finish in 5 s"
    assert _blaslib.cached_verdict(library) is None  # a busy machine may do better next time


@linux
def test_the_verdict_is_cached_per_library_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_NBENGINE_HOME", str(tmp_path))
    library = tmp_path / "libany.so"
    library.write_bytes(b"not really a library")
    calls = []

    def fake_probe(path, timeout=None):  # isolates the cache from the child process
        calls.append(path)
        return _blaslib.Verdict(True, "passed its check", "cfg", "Core", 1e-7)

    monkeypatch.setattr(_blaslib, "probe", fake_probe)
    assert _blaslib.vet(library) == (fake_probe(library), False)
    assert _blaslib.vet(library) == (fake_probe(library), True)
    assert len(calls) == 3  # two here, one inside the first vet
    # Other kernels: another verdict (some machines run with OPENBLAS_CORETYPE=Haswell set).
    other = "Zen" if os.environ.get("OPENBLAS_CORETYPE") == "Haswell" else "Haswell"
    monkeypatch.setenv("OPENBLAS_CORETYPE", other)
    assert _blaslib.vet(library)[1] is False
    library.write_bytes(b"another build of it")  # another build: another verdict
    assert _blaslib.vet(library)[1] is False


@linux
def test_a_bad_setting_is_one_line_and_the_reference_blas(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_NBENGINE_HOME": str(tmp_path)}
    env["MLX_NBENGINE_BLAS"] = "fastest-please"
    out = subprocess.run(
        [sys.executable, "-m", "mlx_nbengine", "blas"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("mlx_nbengine: no optimized BLAS: MLX_NBENGINE_BLAS='fastest-please'")
    assert out.stdout.startswith("optimized BLAS active: False")


@linux
def test_shim_without_a_compiler_says_so(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_NBENGINE_HOME": str(tmp_path)}
    env.update(MLX_NBENGINE_BLAS="shim", CC="")
    out = subprocess.run(
        [sys.executable, "-m", "mlx_nbengine", "blas"], env=env, capture_output=True, text=True
    )
    assert "no C compiler to build the BLAS shim with" in out.stderr.strip()
    assert len(out.stderr.strip().splitlines()) == 1


@linux
def test_a_failing_compiler_falls_back_to_the_renamed_copy(tmp_path):
    if _blaslib.scipy_openblas() is None:
        pytest.skip("needs scipy-openblas32")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_NBENGINE_HOME": str(tmp_path)}
    env.pop("MLX_NBENGINE_BLAS", None)
    env["CC"] = shutil.which("false") or "false"
    out = subprocess.run(
        [sys.executable, "-m", "mlx_nbengine", "blas"], env=env, capture_output=True, text=True
    )
    assert out.stdout.startswith("optimized BLAS active: True (scipy-openblas32, renamed")
    assert out.stderr == ""


# -- the renamed copy ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def renamed(tmp_path_factory) -> tuple[Path, list[bytes]]:
    source = _blaslib.scipy_openblas()
    if source is None or not sys.platform.startswith("linux"):
        pytest.skip("needs scipy-openblas32 on Linux")
    out = tmp_path_factory.mktemp("renamed") / "librenamed.so"
    renames = {"scipy_" + n: n for n in _blaslib.CBLAS_NAMES + _blaslib.OPENBLAS_NAMES}
    out.write_bytes(rename_dynamic_symbols(source.read_bytes(), renames))
    elf = _blaslib._Elf(bytearray(source.read_bytes()))
    defined = [n for i, n in enumerate(elf.names()) if n and elf.symbol(i)[3] != 0]
    return out, defined


def test_every_symbol_of_the_renamed_copy_is_found_by_the_dynamic_linker(renamed):
    """The rebuilt hash table serves every defined symbol (dlsym walks it), under its name."""
    path, defined = renamed
    lib = ctypes.CDLL(str(path))  # RTLD_LOCAL: nothing of it reaches this process's scope
    new = {n.encode() for n in _blaslib.CBLAS_NAMES + _blaslib.OPENBLAS_NAMES}
    old = {b"scipy_" + n for n in new}
    missing = []
    for name in defined:
        wanted = name[len("scipy_") :] if name in old else name
        try:
            ctypes.cast(getattr(lib, wanted.decode()), ctypes.c_void_p)
        except AttributeError:
            missing.append(wanted)
    assert missing == [] and len(defined) > 1000
    assert not hasattr(lib, "scipy_cblas_sgemm")
    lib.openblas_get_corename.restype = ctypes.c_char_p
    assert lib.openblas_get_corename()


def test_renaming_refuses_what_it_cannot_do(renamed):
    path, _ = renamed
    data = path.read_bytes()
    with pytest.raises(BlasBuildError, match="has no symbol scipy_nothing"):
        rename_dynamic_symbols(data, {"scipy_nothing": "nothing"})
    with pytest.raises(BlasBuildError, match="is not a tail of"):
        rename_dynamic_symbols(data, {"scipy_cblas_sgemv": "cblas_dgemv"})
    with pytest.raises(BlasBuildError, match="already has a symbol gemv"):
        rename_dynamic_symbols(
            data,
            {"scipy_cblas_zgemm": "gemm", "scipy_cblas_zgemv": "gemv", "scipy_cblas_cgemv": "gemv"},
        )
    with pytest.raises(BlasBuildError, match="not an ELF64"):
        rename_dynamic_symbols(b"#!/bin/sh\n", {"a_b": "b"})
