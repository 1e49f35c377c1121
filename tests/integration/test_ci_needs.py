"""Under ``CI=true`` the CPU-kernel tests cannot vanish: kernels that are not active stop the
session with one line saying why (`needs.kernels_missing`, checked by `conftest.py`), where
outside CI those tests skip with the same reason.

Each run below is a pytest in a child process whose kernel build is made impossible (``CXX``
set empty: no C++ compiler, `compiler.cxx_compiler`) in an empty cache home; it stops
at the session's start, before any test is collected, in about two seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_ACTIVE = "the CPU kernels are not active (not built: no C++ compiler found"


def pytest_without_a_compiler(home: Path, *args: str, ci: bool) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "CXX": "",  # empty: no compiler (compiler.cxx_compiler)
        "MLX_NBENGINE_HOME": str(home),
        "MLX_NBENGINE_BLAS": "reference",  # cheap: nothing of the BLAS built in the new home
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for name in ("CI", "MLX_NBENGINE_KERNELS", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def test_ci_stops_the_session_in_one_line_where_the_kernels_are_not_active(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    done = pytest_without_a_compiler(home, "tests/integration/test_grid_quantize.py", ci=True)
    assert done.returncode == 1, done.stdout + done.stderr
    # pytest writes the reason it stopped once on stderr ("Exit: ..."), one line.
    stops = [line for line in done.stderr.splitlines() if line.startswith("Exit: ")]
    assert len(stops) == 1, done.stderr
    assert stops[0].startswith("Exit: CI=true, but ") and NOT_ACTIVE in stops[0]
    assert "passed" not in done.stdout and "skipped" not in done.stdout
    assert not list(home.rglob("*.so")), "a kernel module was built without a compiler"


def test_outside_ci_the_kernel_tests_skip_with_the_reason(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    done = pytest_without_a_compiler(home, "tests/integration/test_grid_quantize.py", ci=False)
    assert done.returncode == 0, done.stdout + done.stderr
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and all("kernels not active: not built: no C++ compiler" in s for s in skips)
