"""The lab extension (``labextension/``): its committed build is current and installed.

Its TypeScript sources are built with node into ``labextension/prebuilt/`` (``npm run
build`` there), which is committed and installed as data files to
``share/jupyter/labextensions/mlx-nbengine/``, so no user needs node. The build records a
digest of its sources (``prebuilt/sources.sha256``, written by ``record-sources.mjs``);
these tests compute it again, so a source changed without a rebuild fails here, and
check that the build is whole and that this environment's install carries it.
What the extension does in a browser is tested in test_browser.py and
test_browser_notebook7.py.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXTENSION = REPO / "labextension"
PREBUILT = EXTENSION / "prebuilt"
SOURCES = ["package.json", "tsconfig.json", "src/index.ts"]  # as in record-sources.mjs
INSTALLED = Path("share/jupyter/labextensions/mlx-nbengine")
REBUILD = "rebuild it: cd labextension && npm install && npm run build, and commit prebuilt/"


def sources_digest() -> str:
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.encode() + b"\0" + (EXTENSION / path).read_bytes() + b"\0")
    return digest.hexdigest()


def test_the_committed_build_is_made_from_the_current_sources():
    recorded = (PREBUILT / "sources.sha256").read_text().strip()
    assert recorded == sources_digest(), f"prebuilt/ is older than its sources; {REBUILD}"


def test_the_build_loads_a_file_it_has_and_keeps_no_stale_ones():
    build = json.loads((PREBUILT / "package.json").read_text())["jupyterlab"]["_build"]
    static = {p.name for p in (PREBUILT / "static").iterdir()}
    assert Path(build["load"]).name in static
    entries = {name for name in static if name.startswith("remoteEntry.")}
    assert entries == {Path(build["load"]).name}, f"old builds left in prebuilt/static; {REBUILD}"


def test_the_build_is_named_as_the_data_files_install_it():
    assert json.loads((PREBUILT / "package.json").read_text())["name"] == INSTALLED.name


def test_this_environments_install_carries_the_extension():
    # The dist-info in site-packages: the tree's own egg-info (on sys.path from the
    # repository root) lists sources, not what was installed.
    purelib = Path(sysconfig.get_paths()["purelib"])
    records = list(purelib.glob("mlx_nbengine-*.dist-info/RECORD"))
    if not records:
        pytest.skip("mlx_nbengine is not installed here (only importable from the tree)")
    installed = records[0].read_text()
    assert f"{INSTALLED.as_posix()}/package.json" in installed, (
        "the install has no lab extension: pip install -e . (or the wheel) again"
    )
    root = Path(sys.prefix) / INSTALLED
    assert (root / "package.json").read_bytes() == (PREBUILT / "package.json").read_bytes(), (
        "the installed lab extension is not the committed build: pip install -e . again"
    )
