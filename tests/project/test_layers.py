"""The layers of ARCHITECTURE.md as import-linter contracts (pyproject.toml): imports point
down only, function-level imports included."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_imports_keep_the_layers_contracts():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _package_imports(path: Path) -> set[str]:
    """The modules of the package that the file at `path` imports, anywhere in it."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] == "mlx_nbengine")
    return found


def test_cache_types_is_a_leaf():
    # The planner, the reader and the engine share these types; they must not pull in
    # anything but the record itself, which imports nothing of the package.
    cache = ROOT / "mlx_nbengine" / "cache"
    assert _package_imports(cache / "types.py") <= {"mlx_nbengine.cache.records"}
    assert _package_imports(cache / "records.py") == set()


def test_the_cache_home_and_the_compiler_finder_import_nothing_of_the_package():
    package = ROOT / "mlx_nbengine"
    assert _package_imports(package / "home.py") == set()
    assert _package_imports(package / "compiler.py") == set()
