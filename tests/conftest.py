"""Shared pytest fixtures.

`tiny_model_dir(family, **kw)` writes (once per session and per argument set) a
tiny random-weight model directory from `mlx_nbengine.testing.make_tiny_model`
and returns its path; tests that need a model load it with
`mlx_nbengine.models.load`. Keyword arguments are those of `make_tiny_model`
(``sliding_window``, ``seed``, ``num_layers``, ``dtype``).

Every test runs offline: `offline_hub` (autouse, whole session) sets ``HF_HUB_OFFLINE=1``
and points ``HF_HOME`` / ``HF_HUB_CACHE`` at an empty temporary folder, so no test reads
the machine's Hugging Face cache or reaches the network (kernels started by tests inherit it).

Layout: the tests mirror the package (``cache/``, ``engine/``, ``models/``, ``notebook/``,
``server/``, ``project/`` for the repository-wide checks), plus ``integration/`` (compiled
kernels, subprocesses, Jupyter kernels, ranks, the agent CLIs, llama.cpp, the default model)
and ``browser/`` (Chromium). A test gets the marker of its folder (`MARKED_FOLDERS`), so
``pytest -m "not integration and not browser"`` is the everyday run. The helpers here
(`fakes`, `needs`, `kernelwatch`, ...) and every test folder are on ``sys.path``: tests
import helpers and each other's modules by their bare names.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_nbengine._blas import ensure_fast_blas

TESTS = Path(__file__).resolve().parent
# The package's folders (unit tests) and the folders whose tests carry a marker.
UNIT_FOLDERS = ("cache", "engine", "models", "notebook", "server", "testing", "project")
MARKED_FOLDERS = ("integration", "browser")

for _folder in (*UNIT_FOLDERS, *MARKED_FOLDERS):
    if str(TESTS / _folder) not in sys.path:
        sys.path.append(str(TESTS / _folder))

# Before any test imports MLX: bind MLX's matmuls to the optimized BLAS (Linux CPU).
ensure_fast_blas()


def pytest_sessionstart(session: pytest.Session) -> None:
    # Under CI=true the browser, ES-module and CPU-kernel tests may not skip: a missing
    # Chromium, node or Playwright, or kernels that are not active (no compiler, a failed
    # build), stop the run here, with one line (outside CI they skip; see needs.py).
    from needs import IN_CI, missing_in_ci

    if IN_CI and (absent := missing_in_ci()):
        pytest.exit("CI=true, but " + "; ".join(absent), returncode=1)


# The session's collection, before any deselection: (the everyday run's tests, all tests),
# where the session collected every test file (test_tests_layout then needs no collection
# of its own), else None.
COLLECTED: dict[str, tuple[int, int] | None] = {"counts": None}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The marker comes from where the test lives: tests/integration/... is `integration`.
    # (First of the hooks: `-m` has deselected nothing yet.)
    files = set()
    for item in items:
        path = Path(item.path).resolve()
        files.add(path)
        folder = path.relative_to(TESTS).parts[0]
        if folder in MARKED_FOLDERS:
            item.add_marker(getattr(pytest.mark, folder))
    every_file = {p.resolve() for p in TESTS.rglob("test_*.py") if "node_modules" not in p.parts}
    if every_file <= files and not config.getoption("keyword"):
        everyday = sum(
            not any(item.get_closest_marker(m) for m in MARKED_FOLDERS) for item in items
        )
        COLLECTED["counts"] = (everyday, len(items))


@pytest.fixture(scope="session", autouse=True)
def offline_hub(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("hf-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_HUB_CACHE", str(home / "hub"))
        # huggingface_hub reads these once, at import, which may have happened already.
        from huggingface_hub import constants

        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        mp.setattr(constants, "HF_HOME", str(home))
        mp.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from mlx_nbengine.testing import make_tiny_model

    made: dict[tuple, Path] = {}

    def factory(family: str, **kwargs) -> Path:
        key = (family, *sorted(kwargs.items()))
        if key not in made:
            name = "-".join([family, *(f"{k}{v}" for k, v in sorted(kwargs.items()))])
            made[key] = make_tiny_model(family, tmp_path_factory.mktemp(name), **kwargs)
        return made[key]

    return factory
