"""The notebook's widgets: where each prompt block came from, and what the block store holds.

Three anywidget classes. Their Python traitlets are the truth, and Python draws them:
`pictures` (the strip and the map) and `storepicture` (the store view) write the HTML,
sent to the browser in the `markup` traitlet. The ES module (``widgets/blocks.js``,
shipped as ``mlx_nbengine/notebook/static/``) puts it on the page, patches it in place
when it changes and adds the behaviour: hover, scroll. Terms:

- `BlockStrip`: under every ``%%llm`` answer, one cell per prompt block, filled in as the
  blocks' sources become known; `previews` are its image blocks' hover thumbnails;
  `controls` its answer's Stop and Copy buttons.
- `BlockMap` (``%%llm --blocks``): one row per block; `details` is its details panel
  per block, shown on hover or click.
- `StoreView` (``%llm_cache``): the engine's `cache_view()` dict.

Every widget's display bundle also carries ``text/html``: the same picture as static
HTML (a ``<style>`` block, no JavaScript), so that a notebook exported without its
widget state still shows it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import anywidget
import traitlets

from mlx_nbengine.notebook.pictures import (
    DISPLAYS,
    STATIC,
    TALL_ROWS,
    by_index,
    controls_html,
    display_counts,
    image_ids,
    image_label,
    map_details,
    map_html,
    previews,
    record_kinds,
    static_dir,
    strip_html,
)
from mlx_nbengine.notebook.storepicture import request_ticks, store_html
from mlx_nbengine.notebook.words import format_bytes, plural, reason_phrase, token_split

__all__ = [
    "DISPLAYS",
    "STATIC",
    "TALL_ROWS",
    "BlockMap",
    "BlockStrip",
    "StoreView",
    "map_html",
    "reason_phrase",
    "record_kinds",
    "request_ticks",
    "static_dir",
    "store_html",
    "strip_html",
    "token_split",
]


class _Widget(anywidget.AnyWidget):
    """What the three widgets share: the ES module and CSS, the markup, the bundle."""

    _esm = STATIC / "blocks.js"
    _css = STATIC / "blocks.css"
    # Which behaviour the shared ES module adds.
    _behaviour = traitlets.Unicode("").tag(sync=True)
    # The picture's live HTML (no style block: the widget has `_css`).
    markup = traitlets.Unicode("").tag(sync=True)
    # The traitlets the picture is drawn from: a change to one redraws it.
    _drawn_from: tuple[str, ...] = ()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Observed from here on: one drawing for all the constructor's values.
        self._redraw()
        self.observe(self._redraw, names=list(self._drawn_from))

    def _redraw(self, change: Any = None) -> None:
        """Draw `markup` (and the other drawn traitlets) from the data traitlets."""
        raise NotImplementedError

    def html(self) -> str:
        """The widget's picture as static HTML (no JavaScript)."""
        raise NotImplementedError

    def text(self) -> str:
        """A one-line description for ``text/plain``."""
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict]:
        data, metadata = super()._repr_mimebundle_(**kwargs)
        return {**data, "text/plain": self.text(), "text/html": self.html()}, metadata


def _images_text(blocks: list[dict], images: list[dict]) -> str:
    """ "; 2 image blocks (image 1: cat.png)" for blocks with images, else ""."""
    marked = [b for b in blocks if image_ids(b)]
    if not marked:
        return ""
    ids = sorted({i for b in marked for i in image_ids(b)})
    names = ", ".join(image_label(i, images) for i in ids)
    return f"; {plural(len(marked), 'image block')} ({names})"


class BlockStrip(_Widget):
    """One cell per prompt block, filled in as the blocks' sources become known.

    `add_block` may be called from the thread that follows the request: it reassigns
    `blocks` (traitlets only sync on assignment) under a lock, so no block is lost, and
    sends the new markup in the same message. `show_edit` False keeps the edited cell's
    mark but drops the edit's banner, for when a `BlockMap` (which shows it) follows.
    """

    _behaviour = traitlets.Unicode("strip").tag(sync=True)
    n_blocks = traitlets.Int(0).tag(sync=True)
    block_size = traitlets.Int(0).tag(sync=True)
    prompt_tokens = traitlets.Int(0).tag(sync=True)
    blocks = traitlets.List(traitlets.Dict()).tag(sync=True)
    edit = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    show_edit = traitlets.Bool(True).tag(sync=True)
    # The request's images (`blockinfo.image_dicts`): named and shown on image blocks.
    images = traitlets.List(traitlets.Dict()).tag(sync=True)
    # Image index (a string) -> the thumbnail shown over its blocks' cells.
    previews = traitlets.Dict().tag(sync=True)
    # How the Stop button stops the running answer: "interrupt" (the kernel's main thread
    # follows it, so the front end interrupts the kernel), "message" (a --bg answer: the
    # widget's message calls the stop given to `stoppable`), "" (not running: no button).
    stop_by = traitlets.Unicode("").tag(sync=True)
    # The finished answer's text as the model wrote it, for the Copy button.
    answer = traitlets.Unicode("").tag(sync=True)
    # The buttons' live HTML (`controls_html`).
    controls = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._stop: Callable[[], Any] | None = None
        super().__init__(**kwargs)
        self.on_msg(self._on_msg)

    def stoppable(self, stop_by: str, stop: Callable[[], Any] | None = None) -> None:
        """Show the Stop button (`stop_by` as in the traitlet); a "stop" message from the
        front end calls `stop`."""
        self._stop = stop
        self.stop_by = stop_by

    def ended(self, answer: str) -> None:
        """The answer ended with `answer`: no Stop button, a Copy button for its text."""
        with self.hold_sync():
            self.stop_by = ""
            self.answer = answer

    def _on_msg(self, widget: Any, content: Any, buffers: Any) -> None:
        if isinstance(content, dict) and content.get("action") == "stop":
            if self.stop_by and self._stop is not None:
                self._stop()

    def _picture(self, *, live: bool) -> str:
        return strip_html(
            self.blocks,
            n_blocks=self.n_blocks,
            block_size=self.block_size,
            prompt_tokens=self.prompt_tokens,
            edit=self.edit,
            show_edit=self.show_edit,
            images=self.images,
            live=live,
        )

    _drawn_from = (
        "n_blocks",
        "block_size",
        "prompt_tokens",
        "blocks",
        "edit",
        "show_edit",
        "images",
        "stop_by",
        "answer",
    )

    def _redraw(self, change: Any = None) -> None:
        with self.hold_sync():
            # Equal previews are not sent again: traitlets sync changes only.
            self.previews = previews(self.blocks, self.images)
            self.markup = self._picture(live=True)
            self.controls = controls_html(stop=bool(self.stop_by), copy=bool(self.answer))

    def add_block(self, block: Mapping[str, Any]) -> None:
        """Add (or replace) the block dict with `block["index"]`, keeping index order."""
        self.add_blocks([block])

    def add_blocks(self, blocks: Iterable[Mapping[str, Any]]) -> None:
        """Add several block dicts in one update."""
        with self._lock, self.hold_sync():
            known = by_index(self.blocks)
            known.update(by_index(dict(b) for b in blocks))
            self.blocks = [dict(known[i]) for i in sorted(known)]

    def set_edit(self, edit: Mapping[str, Any] | None) -> None:
        """Mark the first changed token (an edit dict), or clear the mark with None."""
        with self.hold_sync():
            self.edit = dict(edit) if edit else None

    def html(self) -> str:
        return self._picture(live=False)

    def text(self) -> str:
        counts = display_counts(self.blocks, self.n_blocks)
        parts = [f"{counts[k]} {label}" for k, (_, label) in DISPLAYS.items() if counts[k]]
        n = max(self.n_blocks, len(self.blocks))
        images = _images_text(self.blocks, self.images)
        return f"{plural(n, 'prompt block')}: {', '.join(parts) or 'none'}{images}"


class BlockMap(_Widget):
    """Every prompt block with its range, words, source, reason, time and records."""

    _behaviour = traitlets.Unicode("map").tag(sync=True)
    blocks = traitlets.List(traitlets.Dict()).tag(sync=True)
    edit = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    block_size = traitlets.Int(0).tag(sync=True)
    prompt_tokens = traitlets.Int(0).tag(sync=True)
    layer_kinds = traitlets.List(traitlets.Unicode()).tag(sync=True)
    # The request's images (`blockinfo.image_dicts`): named and shown on image blocks.
    images = traitlets.List(traitlets.Dict()).tag(sync=True)
    # Block index (a string) -> the details panel showing it; "" -> the panel by default.
    details = traitlets.Dict().tag(sync=True)

    def _picture(self, *, live: bool) -> str:
        return map_html(
            self.blocks,
            block_size=self.block_size,
            prompt_tokens=self.prompt_tokens,
            edit=self.edit,
            layer_kinds=self.layer_kinds,
            images=self.images,
            live=live,
        )

    _drawn_from = ("blocks", "edit", "block_size", "prompt_tokens", "layer_kinds", "images")

    def _redraw(self, change: Any = None) -> None:
        with self.hold_sync():
            self.details = map_details(
                self.blocks, edit=self.edit, layer_kinds=self.layer_kinds, images=self.images
            )
            self.markup = self._picture(live=True)

    def html(self) -> str:
        return self._picture(live=False)

    def text(self) -> str:
        images = _images_text(self.blocks, self.images)
        lines = [f"Block map: {plural(len(self.blocks), 'block')}{images}"]
        if self.edit:
            lines.append(f"first change at token {int(self.edit.get('position', 0)):,}")
        for b in sorted(self.blocks, key=lambda b: int(b["index"])):
            line = (
                f"{int(b['index']):>4} {int(b.get('start', 0)):>7,}-{int(b.get('end', 0)):<7,} "
                f"{b.get('source', ''):<8} {reason_phrase(b, self.edit)}"
            )
            if image_ids(b):
                names = (image_label(i, self.images) for i in image_ids(b))
                line += f" [{', '.join(names)}]"
            lines.append(line)
        return "\n".join(lines)


class StoreView(_Widget):
    """What the block store holds and how requests used it (`engine.cache_view()`)."""

    _behaviour = traitlets.Unicode("store").tag(sync=True)
    view = traitlets.Dict().tag(sync=True)

    _drawn_from = ("view",)

    def _redraw(self, change: Any = None) -> None:
        self.markup = store_html(self.view, live=True)

    def html(self) -> str:
        return store_html(self.view)

    def text(self) -> str:
        v = self.view
        return (
            f"Block store: {int(v.get('blocks_held') or 0):,} blocks held, "
            f"{format_bytes(v.get('bytes_held') or 0)} of "
            f"{format_bytes(v.get('budget_bytes') or 0)} budget, "
            f"{int(v.get('blocks_restored') or 0):,} blocks restored, "
            f"{int(v.get('blocks_computed') or 0):,} computed, "
            f"{int(v.get('blocks_evicted') or 0):,} evicted"
        )
