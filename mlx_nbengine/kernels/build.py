"""Compile the kernels' extension module once into the cache home, and find it again.

The module is built from the package's own sources (``src/``) with MLX's CMake package,
nanobind and the system C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``), in a
child process with a time limit, into ``$MLX_NBENGINE_HOME/kernels/<key>/`` (default
``~/.cache/mlx_nbengine``). The *key* hashes everything the binary depends on: the sources,
the MLX, nanobind and Python versions, and the compiler, so an upgrade of MLX builds anew
instead of loading a module built against another MLX. The finished file is moved into place
with one rename: a concurrent process sees no module or a whole one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from mlx_nbengine.compiler import cxx_compiler
from mlx_nbengine.home import home

__all__ = ["BuildError", "build", "built_module_path", "build_key"]

MODULE_NAME = "mlx_nbengine_qmv"
SOURCE_DIR = Path(__file__).parent / "src"
SOURCES = (
    "CMakeLists.txt",
    "attention.cpp",
    "attention.h",
    "attention_math.h",
    "attention_portable.cpp",
    "attention_x86.cpp",
    "bindings.cpp",
    "blas.h",
    "block_tail.cpp",
    "block_tail.h",
    "gated_delta.cpp",
    "gated_delta.h",
    "gated_mlp.cpp",
    "gated_mlp.h",
    "qgemm.cpp",
    "qgemm.h",
    "qgemm_x86.cpp",
    "qgemm_x86_body.h",
    "qgemm_x86_pack.h",
    "qgemm_x86_quads.h",
    "qkernels.h",
    "qkernels_portable.cpp",
    "qkernels_x86.cpp",
    "qkernels_x86_body.h",
    "qkv_step.cpp",
    "qkv_step.h",
    "qmatvec.cpp",
    "qmatvec.h",
    "rowops.cpp",
    "rowops.h",
    "rowops_bindings.cpp",
    "strided.h",
    "targets.h",
    "tokens.cpp",
    "tokens.h",
    "workers.h",
)
# Bumped when the build itself changes (flags, layout) in a way the sources do not show.
BUILD_FORMAT = 1
BUILD_TIMEOUT_S = 600.0


class BuildError(Exception):
    """The module could not be built; the message is one line saying why."""


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _cmake() -> str | None:
    """pip's cmake (>= 3.27, a dependency) before whatever the system has."""
    spec = importlib.util.find_spec("cmake")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "data" / "bin" / "cmake"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("cmake")


def build_key(compiler: str) -> str:
    h = hashlib.sha256(f"{BUILD_FORMAT}\0".encode())
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    for distribution in ("mlx", "nanobind"):
        h.update(f"{distribution}={_version(distribution)}\0".encode())
    h.update(f"{sys.implementation.cache_tag}\0{sysconfig.get_platform()}\0".encode())
    h.update(str(Path(compiler).resolve()).encode())
    return h.hexdigest()[:16]


def _suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def built_module_path(compiler: str) -> Path:
    """Where the module built with `compiler` lives (it may not exist yet)."""
    return home() / "kernels" / build_key(compiler) / f"{MODULE_NAME}{_suffix()}"


def _run(command: list[str], *, cwd: Path, deadline: float, env: dict[str, str]) -> None:
    try:
        done = subprocess.run(
            command,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=deadline,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{Path(command[0]).name} did not run: {e}") from None
    if done.returncode != 0:
        lines = (done.stderr + done.stdout).strip().splitlines()
        said = next((line.strip() for line in lines if "rror" in line), None)
        raise BuildError(f"{Path(command[0]).name} failed: {said or (lines or ['no message'])[0]}")


def build() -> Path:
    """The path of the compiled module, building it first if needed; raises `BuildError`."""
    compiler = cxx_compiler()
    if compiler is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++ or clang++)")
    target = built_module_path(compiler)
    if target.exists():
        return target
    cmake = _cmake()
    if cmake is None:
        raise BuildError("cmake is not installed (pip install 'cmake>=3.27')")
    if importlib.util.find_spec("nanobind") is None:
        raise BuildError("nanobind is not installed (pip install 'nanobind>=3,<4')")
    import mlx  # lazy: only a build needs MLX's CMake package

    mlx_cmake = Path(next(iter(mlx.__path__))) / "share" / "cmake" / "MLX"
    nanobind_spec = importlib.util.find_spec("nanobind")
    nanobind_cmake = Path(next(iter(nanobind_spec.submodule_search_locations))) / "cmake"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Long work says so: a first build takes from several seconds to about a minute.
    print(
        "mlx_nbengine: building the CPU kernels once (up to a minute)...",
        file=sys.stderr,
        flush=True,
    )
    env = {**os.environ, "CXX": compiler}
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        _run(
            [
                cmake,
                "-S",
                str(SOURCE_DIR),
                "-B",
                str(work),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython_EXECUTABLE={sys.executable}",
                f"-Dnanobind_DIR={nanobind_cmake}",
                f"-DMLX_DIR={mlx_cmake}",
            ],
            cwd=work,
            deadline=BUILD_TIMEOUT_S,
            env=env,
        )
        jobs = str(max(1, min(4, os.cpu_count() or 1)))
        _run([cmake, "--build", str(work), "-j", jobs], cwd=work, deadline=BUILD_TIMEOUT_S, env=env)
        built = next(work.glob(f"{MODULE_NAME}*{_suffix()}"), None)
        if built is None:
            raise BuildError("the build finished without a module file")
        os.replace(built, target)
    return target
