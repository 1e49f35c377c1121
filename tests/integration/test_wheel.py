"""The built wheel carries the widgets' front end and loads it from the installed package.

The widgets' ES module and CSS live in the repository's top-level ``widgets/`` folder and
ship inside the package as ``mlx_nbengine/notebook/static/`` (pyproject's package-dir
mapping). The test builds a wheel from a clean copy of the source tree, installs it without
dependencies into a fresh virtual environment whose dependencies come from the running
one (a ``.pth`` line naming this environment's site-packages: a venv made from a venv
would otherwise see only the base interpreter's packages), and imports the widgets there,
from a folder outside the repository.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
    "node_modules", "bench",
)  # fmt: skip

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("build") is None, reason="needs the `build` package (test extra)"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a clean copy of the source tree (no stale build/ folder)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    shutil.copytree(REPO, source, ignore=SOURCE_IGNORE)
    out = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(root / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        log = out.stdout + out.stderr
        if "No matching distribution" in log or "Could not find a version" in log:
            pytest.skip("the build backend (setuptools) cannot be installed here")
        raise AssertionError(f"building the wheel failed:\n{log[-4000:]}")
    (built,) = (root / "dist").glob("mlx_nbengine-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The python of a fresh venv holding the wheel and, by reference, our dependencies."""
    env = tmp_path_factory.mktemp("venv") / "env"
    try:
        venv.create(env, with_pip=False)
    except Exception as exc:  # noqa: BLE001 - no venv support: nothing to test here
        pytest.skip(f"cannot create a virtual environment: {exc}")
    python = env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    # This environment's pip installs into the new one (no ensurepip: it takes long).
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        check=True,
        timeout=120,
    )  # fmt: skip
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Added after the install, so pip saw a clean environment.
    ours = sysconfig.get_paths()["purelib"]
    (Path(site) / "repo_dependencies.pth").write_text(ours + "\n", encoding="utf-8")
    return python


def test_wheel_ships_the_widgets_folder_as_package_data(wheel):
    with zipfile.ZipFile(wheel) as zf:
        for name in ("blocks.js", "blocks.css"):
            shipped = zf.read(f"mlx_nbengine/notebook/static/{name}")
            assert shipped == (REPO / "widgets" / name).read_bytes(), name


def test_wheel_ships_the_notebooks_for_the_demo(wheel):
    with zipfile.ZipFile(wheel) as zf:
        for notebook in (REPO / "notebooks").glob("*.ipynb"):
            shipped = zf.read(f"mlx_nbengine/examples/{notebook.name}")
            assert shipped == notebook.read_bytes(), notebook.name


def test_wheel_installs_the_prebuilt_lab_extension_where_jupyterlab_finds_it(wheel):
    # Data files: installed under sys.prefix, share/jupyter/labextensions/mlx-nbengine.
    data = "mlx_nbengine-0.1.0.data/data/share/jupyter/labextensions/mlx-nbengine"
    prebuilt = REPO / "labextension" / "prebuilt"
    with zipfile.ZipFile(wheel) as zf:
        for path in [prebuilt / "package.json", *(prebuilt / "static").iterdir()]:
            shipped = zf.read(f"{data}/{path.relative_to(prebuilt).as_posix()}")
            assert shipped == path.read_bytes(), path.name
        assert json.loads(zf.read(f"{data}/install.json"))["packageName"] == "mlx_nbengine"


def test_wheel_holds_every_module_of_the_source_tree(wheel):
    # The package list in pyproject.toml is explicit: a new subpackage must be added there.
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    modules = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "mlx_nbengine").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert modules <= names, sorted(modules - names)


def test_installed_widgets_load_their_front_end_from_the_installed_package(installed, tmp_path):
    script = textwrap.dedent(
        """
        import json, sysconfig
        from mlx_nbengine.notebook import widgets
        strip = widgets.BlockStrip(n_blocks=2)
        print(json.dumps({
            "site": sysconfig.get_paths()["purelib"],
            "module": widgets.__file__,
            "static": str(widgets.STATIC),
            "esm": strip._esm,
            "css": strip._css,
            "html": widgets.StoreView(view={}).html(),
        }))
        """
    )
    out = subprocess.run(
        [str(installed), "-c", script],
        cwd=tmp_path,  # outside the repository: nothing of the source tree is importable
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    site = Path(got["site"]).resolve()
    assert Path(got["module"]).resolve().is_relative_to(site)
    assert Path(got["static"]).resolve() == site / "mlx_nbengine" / "notebook" / "static"
    assert got["esm"] == (REPO / "widgets" / "blocks.js").read_text(encoding="utf-8")
    assert got["css"] == (REPO / "widgets" / "blocks.css").read_text(encoding="utf-8")
    assert 'class="mnb-root mnb-store"' in got["html"]
