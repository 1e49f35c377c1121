"""The tests' layout (tests/conftest.py): every test file lives in a package folder or in a
marked one (``integration/``, ``browser/``), none flat in ``tests/``, and the everyday run,
``pytest -m "not integration and not browser"``, holds at least half the suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import COLLECTED, MARKED_FOLDERS, TESTS, UNIT_FOLDERS

ROOT = TESTS.parent


def test_every_test_file_lives_in_a_package_or_a_marked_folder():
    folders = set(UNIT_FOLDERS) | set(MARKED_FOLDERS)
    found = [p.relative_to(TESTS) for p in sorted(TESTS.rglob("test_*.py"))]
    found = [path for path in found if "node_modules" not in path.parts]
    misplaced = [f"tests/{p}" for p in found if len(p.parts) != 2 or p.parts[0] not in folders]
    assert not misplaced, f"test files outside {sorted(folders)}: {misplaced}"


def test_each_package_folder_has_its_tests_folder():
    packages = {p.name for p in (ROOT / "mlx_nbengine").iterdir() if (p / "__init__.py").exists()}
    # kernels/ is compiled code: its tests compile it, so they are integration tests.
    assert packages - {"kernels"} <= set(UNIT_FOLDERS)
    assert all((TESTS / folder).is_dir() for folder in (*UNIT_FOLDERS, *MARKED_FOLDERS))


def test_the_everyday_run_holds_at_least_half_the_suite():
    if COLLECTED["counts"] is not None:  # this session collected the whole suite
        fast, total = COLLECTED["counts"]
        assert 2 * fast >= total, f"the everyday run holds {fast} of {total} tests"
        return
    env = {**os.environ, "CI": ""}  # collection only: no need is checked
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", "not integration and not browser", str(TESTS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = re.search(r"^(\d+)/(\d+) tests collected", done.stdout, re.MULTILINE)
    assert found, done.stdout[-2000:]
    fast, total = int(found[1]), int(found[2])
    assert 2 * fast >= total, f"the everyday run holds {fast} of {total} tests"
