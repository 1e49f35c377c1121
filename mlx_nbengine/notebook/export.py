"""HTML of an executed notebook that shows the block pictures with no kernel and no network.

Every widget output of mlx_nbengine carries two pictures: the live widget view
(``application/vnd.jupyter.widget-view+json``) and a static ``text/html`` one. nbconvert
draws the first it finds in its *display priority*; it puts widget views first whenever
the notebook was saved with its widget state (nbclient's default, and
``jupyter nbconvert --execute``'s), and a widget view needs the widgets' JavaScript,
fetched from a CDN when the page opens. Offline, such a page shows no block map.

`html_exporter` is nbconvert's `HTMLExporter` with static HTML ranked above widget views,
so the pictures are in the page itself; `notebook_to_html` converts one notebook with it.
`python -m mlx_nbengine html NOTEBOOK` and the demo use it. A notebook saved without
widget state (JupyterLab's default) exports the same pictures with plain nbconvert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DISPLAY_PRIORITY", "html_exporter", "notebook_to_html", "write_html"]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# nbconvert's HTML priority, with the widget view moved after the static pictures.
DISPLAY_PRIORITY = [
    "application/javascript",
    "text/html",
    "text/markdown",
    "image/svg+xml",
    "text/vnd.mermaid",
    "text/latex",
    "image/png",
    "image/jpeg",
    WIDGET_VIEW,
    "text/plain",
]


def html_exporter() -> Any:
    """An nbconvert `HTMLExporter` that prefers static HTML to widget views."""
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    config = Config()
    config.NbConvertBase.display_data_priority = DISPLAY_PRIORITY
    return HTMLExporter(config=config)


def notebook_to_html(nb: Any, *, path: str | Path | None = None) -> str:
    """The HTML page of notebook node `nb` (saved at `path`, if it was)."""
    resources: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        resources["metadata"] = {"name": path.stem, "path": str(path.parent)}
    html, _ = html_exporter().from_notebook_node(nb, resources=resources)
    return html


def write_html(notebook: str | Path, out: str | Path | None = None) -> Path:
    """Convert the notebook file `notebook` to `out` (default: beside it, .html)."""
    import nbformat

    notebook = Path(notebook)
    target = Path(out) if out is not None else notebook.with_suffix(".html")
    nb = nbformat.read(notebook, as_version=4)
    target.write_text(notebook_to_html(nb, path=notebook), encoding="utf-8")
    return target
