"""The notebook session's API without IPython (`mlx_nbengine.notebook.session`), and the size
of the notebook face's magics: argument tables and one-line calls into that API.

The session runs a real `Engine` on a tiny random model; its output goes to a list.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from mlx_nbengine.engine import Engine
from mlx_nbengine.errors import SessionError
from mlx_nbengine.notebook.session import LLMSession, Output, cell_text

PACKAGE = Path(__file__).resolve().parents[2] / "mlx_nbengine" / "notebook"
THIN = ("magics.py", "session.py", "cellview.py")
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60


def _sizes(path: Path) -> list[tuple[str, type, int]]:
    tree = ast.parse(path.read_text())
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [
        (node.name, type(node), node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
    ]


@pytest.mark.parametrize("name", THIN)
def test_no_class_is_over_300_lines(name):
    long = [
        (what, lines)
        for what, kind, lines in _sizes(PACKAGE / name)
        if kind is ast.ClassDef and lines > MAX_CLASS_LINES
    ]
    assert long == []


@pytest.mark.parametrize("name", THIN)
def test_no_function_is_over_60_lines(name):
    long = [
        (what, lines)
        for what, kind, lines in _sizes(PACKAGE / name)
        if kind is not ast.ClassDef and lines > MAX_FUNCTION_LINES
    ]
    assert long == []


@pytest.mark.parametrize("name", ["session.py", "cellview.py"])
def test_the_session_api_imports_no_ipython(name):
    tree = ast.parse((PACKAGE / name).read_text())
    modules = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    modules += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert [m for m in modules if m.split(".")[0] == "IPython"] == []


# -- the session, driven without a shell ------------------------------------------------------


class Handle:
    """What IPython's display returns for ``display_id=True``: a display to update."""

    def __init__(self, shown: list) -> None:
        self.shown = shown

    def update(self, obj, **kwargs) -> None:
        self.shown.append(obj)


@pytest.fixture
def shown() -> list:
    return []


@pytest.fixture
def out(shown) -> Output:
    def show(obj, **kwargs):
        shown.append(obj)
        return Handle(shown)

    return Output(show=show, live=False)


def lines(shown: list) -> list[str]:
    return [item["text/plain"] for item in shown if isinstance(item, dict)]


def cell_args(**given) -> argparse.Namespace:
    """A `%%llm` line's options as the magic parses them (defaults, then `given`)."""
    options = dict(
        output=None,
        max_tokens=None,
        temperature=None,
        seed=None,
        stop=None,
        system=None,
        chat=None,
        raw=False,
        interpolate=False,
        bg=False,
        markdown=False,
        blocks=False,
        image=None,
    )
    return argparse.Namespace(**{**options, **given})


@pytest.fixture
def loaded(tiny_model_dir, tmp_path, out, shown) -> LLMSession:
    session = LLMSession()
    model = str(tiny_model_dir("llama"))
    session.load(Engine.load, "tiny", model, {"cache_dir": str(tmp_path)}, revision=None, out=out)
    yield session
    session.close_engine()


def test_a_session_without_a_model_says_how_to_load_one():
    with pytest.raises(SessionError, match="run `%load_model default`"):
        LLMSession().require_engine()


def test_unloading_without_a_model_is_an_error(out):
    with pytest.raises(SessionError, match="nothing to unload"):
        LLMSession().unload(out)


def test_status_without_a_model_is_one_line(out, shown):
    LLMSession().show_status(out)
    assert lines(shown) == ["no model loaded; run `%load_model default`"]


def test_load_shows_its_progress_and_keeps_the_engine(loaded, shown):
    assert loaded.model == "tiny"
    assert lines(shown)[-1].startswith("loaded ")
    assert loaded.require_engine() is loaded.engine


def test_a_failed_load_is_a_session_error(out, tmp_path):
    session = LLMSession()
    with pytest.raises(SessionError, match="could not load"):
        session.load(Engine.load, "nope", str(tmp_path / "nope"), {}, revision=None, out=out)
    assert session.engine is None


def test_an_empty_cell_is_a_session_error(loaded):
    with pytest.raises(SessionError, match="the cell is empty"):
        cell_text(cell_args(), loaded.engine, "  \n")


def test_ask_stores_the_completion_in_the_namespace(loaded, out):
    namespace: dict = {}
    args = cell_args(output="answer", max_tokens=4, temperature=0.0, raw=True)
    loaded.ask(args, "Hello there", [], source="cell", out=out, namespace=namespace, shell=None)
    completion = namespace["answer"]
    assert 0 < len(completion.tokens) <= 4


def test_status_rows_name_the_model_and_its_requests(loaded):
    rows = dict(loaded.status_rows())
    assert rows["model"].startswith("tiny (llama")
    assert rows["active requests"] == 0
    assert rows["conversations"] == "-"


def test_cache_view_in_a_terminal_is_a_table_of_the_store(loaded, out, shown):
    loaded.show_cache(clear=False, out=out)
    assert "block store" in shown[-1]["text/plain"]


def test_close_engine_returns_the_model_name_and_forgets_it(loaded):
    engine = loaded.engine
    assert loaded.close_engine() == "tiny"
    assert engine.closed and loaded.engine is None
    assert loaded.close_engine() is None
