"""What some tests need from the system beyond the Python packages: a system Chromium, node,
and our CPU kernels built (a C++ compiler).

Outside CI a test (or module) whose need is missing skips with the reason. Under
``CI=true`` a missing need fails instead: `tests/conftest.py` checks every need at the
start of the session and stops the run with one line, so CI cannot pass with the browser
tests or the kernel tests skipped. `.ci/run` installs Chromium and node (Debian packages
``chromium`` and ``nodejs``); the kernels build at first use (`mlx_nbengine.kernels.build`).
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI") == "true"

CHROMIUM_MISSING = "no system Chromium (Debian package `chromium`); .ci/run installs it"
NODE_MISSING = "no node to parse the widgets' ES module (Debian package `nodejs`)"
PLAYWRIGHT_MISSING = "Playwright for Python is missing (the `test` extra)"


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def node_path() -> str | None:
    return shutil.which("node")


def playwright_found() -> bool:
    try:
        importlib.import_module("playwright.sync_api")
    except ImportError:
        return False
    return True


def missing(reason: str) -> NoReturn:
    """Skip with `reason`; under CI=true fail with it."""
    if IN_CI:
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def chromium() -> str:
    """The system Chromium's path (a browser test's need)."""
    return chromium_path() or missing(CHROMIUM_MISSING)


def node() -> str:
    """node's path."""
    return node_path() or missing(NODE_MISSING)


def module(name: str, reason: str) -> ModuleType:
    """`pytest.importorskip`, failing under CI=true."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(reason)


def kernels_missing() -> str | None:
    """Why our CPU kernels are not active in this process (None: they are). Sets them up
    (`kernels.status()`: the build at first use, about a minute) where nothing has yet."""
    from mlx_nbengine import kernels  # lazy: MLX, after conftest bound the BLAS

    status = kernels.status()
    return None if status.active else f"the CPU kernels are not active ({status.reason})"


def missing_in_ci() -> list[str]:
    """Every need that is missing, as its reason (the session check under CI=true)."""
    found = [
        (chromium_path() is not None, CHROMIUM_MISSING),
        (node_path() is not None, NODE_MISSING),
        (playwright_found(), PLAYWRIGHT_MISSING),
    ]
    absent = [reason for ok, reason in found if not ok]
    return absent + [reason] if (reason := kernels_missing()) else absent
