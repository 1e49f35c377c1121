"""Readable tables: the two-column *key/value table* (`key_value_bundle`; `cache_rows` are
`%llm_cache`'s rows), and the *model table* (`models_bundle`, `models_text`): what
`%llm_models` shows, one row per model found locally (a `mlx_nbengine.models.LocalModel`):
name, source, kind (text, vision or gguf), size on disk, and whether a GGUF model was
converted already (``-`` for MLX models, which need no conversion); below it, where the
listing looked.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from typing import Any

from mlx_nbengine.notebook.pictures import view_style
from mlx_nbengine.notebook.render import Bundle
from mlx_nbengine.notebook.words import format_bytes
from mlx_nbengine.notebook.words import plural as _plural

__all__ = [
    "MODEL_COLUMNS",
    "cache_rows",
    "key_value_bundle",
    "model_rows",
    "models_bundle",
    "models_text",
]


def key_value_bundle(title: str, rows: Iterable[tuple[str, Any]]) -> Bundle:
    """A two-column table (labels, values) as text/plain (aligned) and text/html (no header)."""
    rows = [(str(k), str(v)) for k, v in rows]
    width = max((len(k) for k, _ in rows), default=0)
    plain = "\n".join([title, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    table = f'<table class="mnb-table"><tbody>{cells}</tbody></table>' if rows else ""
    heading = f'<div class="mnb-kv-title">{html.escape(title)}</div>'
    markup = f'{view_style()}<div class="mnb-kv">{heading}{table}</div>'
    return {"text/plain": plain, "text/html": markup}


def cache_rows(view: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Rows of `%llm_cache` from `engine.cache_view()`: blocks and tokens first, records after."""
    get = view.get

    def num(key: str) -> int:
        return int(get(key) or 0)

    budget = num("budget_bytes")
    held = format_bytes(num("bytes_held"))
    rows = [
        ("blocks held", f"{num('blocks_held'):,} ({_plural(num('records'), 'record')})"),
        ("bytes held", f"{held} of {format_bytes(budget)} budget" if budget else held),
        (
            "blocks restored",
            f"{num('blocks_restored'):,} ({_plural(num('tokens_restored'), 'token')})",
        ),
        (
            "blocks computed",
            f"{num('blocks_computed'):,} ({_plural(num('tokens_computed'), 'token')})",
        ),
        (
            "blocks evicted",
            f"{num('blocks_evicted'):,} ({_plural(num('records_evicted'), 'record')})",
        ),
        ("requests", f"{num('requests'):,}"),
    ]
    kinds = [
        f"{kind} {int(v.get('records') or 0):,} ({format_bytes(v.get('bytes') or 0)})"
        for kind, v in (get("by_kind") or {}).items()
        if isinstance(v, Mapping) and v.get("records")
    ]
    if kinds:
        rows.append(("records by kind", ", ".join(kinds)))
    size, free = format_bytes(num("file_size")), format_bytes(num("free_bytes"))
    rows.append(("scratch file", f"{size} ({free} free inside for reuse)"))
    if get("backend"):
        rows.append(("backend", str(get("backend"))))
    return rows


# -- the local models ----------------------------------------------------------------------------

MODEL_COLUMNS = ("name", "source", "kind", "size", "converted")


def model_rows(models: Iterable[Any]) -> list[tuple[str, str, str, str, str]]:
    """A row of `MODEL_COLUMNS` per `LocalModel` (duck-typed: its fields by name)."""
    return [
        (
            str(m.name),
            str(m.source),
            str(m.category),
            format_bytes(m.size_bytes),
            ("yes" if m.converted else "no") if m.category == "gguf" else "-",
        )
        for m in models
    ]


def models_text(models: Iterable[Any], *, looked_in: str) -> str:
    """The model table as aligned text (sizes right-aligned), then `looked_in`."""
    rows = model_rows(models)
    if not rows:
        return f"no models to load here; {looked_in}"
    table = [MODEL_COLUMNS, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(MODEL_COLUMNS))]
    size = MODEL_COLUMNS.index("size")
    lines = [
        "  ".join(
            cell.rjust(width) if i == size else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    return "\n".join([*lines, looked_in])


def models_bundle(models: Iterable[Any], *, looked_in: str) -> Bundle:
    """The model table as text/plain (`models_text`) and text/html (escaped), for notebooks."""
    models = list(models)
    rows = model_rows(models)
    plain = models_text(models, looked_in=looked_in)
    if not rows:
        return {
            "text/plain": plain,
            "text/html": f'<div class="mnb-models">{html.escape(plain)}</div>',
        }
    size = MODEL_COLUMNS.index("size")

    def cell(tag: str, i: int, text: str) -> str:
        align = ' data-align="right"' if i == size else ""
        return f"<{tag}{align}>{html.escape(text)}</{tag}>"

    head = "".join(cell("th", i, name) for i, name in enumerate(MODEL_COLUMNS))
    body = "".join(
        "<tr>" + "".join(cell("td", i, text) for i, text in enumerate(row)) + "</tr>"
        for row in rows
    )
    table = f'<table class="mnb-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    note = f'<div class="mnb-note">{html.escape(looked_in)}</div>'
    markup = f'{view_style()}<div class="mnb-models">{table}{note}</div>'
    return {"text/plain": plain, "text/html": markup}
