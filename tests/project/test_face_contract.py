"""The faces (notebook/, server/) speak the engine's types: no dispatch on class names.

Events and results are told apart with ``isinstance`` or ``match`` on the engine's classes
(`mlx_nbengine.engine.results`, `events`), never by comparing ``type(x).__name__`` (or
``x.__class__.__name__``) with a string: a renamed class would then fail quietly. A class
name is still fine in words (an error message, a log line).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mlx_nbengine"
FACES = ("notebook", "server")


def _is_class_name(node: ast.AST) -> bool:
    """``type(x).__name__`` or ``x.__class__.__name__``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "__name__"):
        return False
    inner = node.value
    if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name):
        return inner.func.id == "type"
    return isinstance(inner, ast.Attribute) and inner.attr == "__class__"


def class_name_dispatch(source: str) -> list[int]:
    """Lines where a class name is compared, matched on or kept to compare later."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Match):
            operands = [node.subject]
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr):
            operands = [node.value]
        elif isinstance(node, ast.Subscript):  # a table keyed by class name
            operands = [node.slice]
        else:
            continue
        if any(_is_class_name(sub) for op in operands if op for sub in ast.walk(op)):
            if isinstance(node, ast.Assign | ast.AnnAssign) and not _is_class_name(node.value):
                continue  # words built around it (a message): not a dispatch
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_check_finds_each_form_of_class_name_dispatch():
    found = class_name_dispatch(
        "if type(e).__name__ == 'Finished': pass\n"
        "kind = type(e).__name__\n"
        "if e.__class__.__name__ in ('A', 'B'): pass\n"
        "match type(e).__name__:\n    case 'A': pass\n"
        "handler = HANDLERS[type(e).__name__]\n"
    )
    assert found == [1, 2, 3, 4, 6]
    words = (
        "msg = f'got {type(x).__name__}'\nlog(type(e).__name__)\ns = str(e) or type(e).__name__\n"
    )
    assert class_name_dispatch(words) == []


@pytest.mark.parametrize("face", FACES)
def test_the_faces_never_dispatch_on_class_names(face):
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted((PACKAGE / face).rglob("*.py"))
        if (lines := class_name_dispatch(path.read_text(encoding="utf-8")))
    }
    assert found == {}, f"dispatch with isinstance or match on the engine's types: {found}"
