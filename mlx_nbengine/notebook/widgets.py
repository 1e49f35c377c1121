"""The notebook's widgets: where each prompt block came from, and what the block store holds.

Three anywidget classes; their Python traitlets are the truth and the browser only draws
them (ES module and CSS in the repository's top-level ``widgets/`` folder, shipped in the
package as ``mlx_nbengine/notebook/static/``):

- `BlockStrip`: under every ``%%llm`` answer, one fixed-size cell per prompt block, in
  order, coloured (and lettered) by *kind*: ``memory`` (M, the previous request's live
  cache), ``disk`` (D, records read from the block store), ``computed`` (C, prefilled
  now), ``tail`` (T, the computed block holding the prompt's last token) or ``pending``
  (not known yet). All `n_blocks` cells are laid out from the start, so the strip fills
  in while the prompt streams without moving. A *partly restored* block (a computed block
  whose first tokens were restored: a token-exact restore ended inside it) keeps its kind
  and letter, with its restored share filled from the bottom in the colour of where the
  restore came from (its *part*: the source of the block before it, ``disk`` for the
  first block). It marks the edited block's cell and, unless `show_edit` is False (when a
  block map follows and shows it), the edit's words too. A block holding an image's tokens
  (an *image block*, its dict's ``images``) carries ``data-image`` (the image indices,
  space-separated) and a small picture mark; hovering it names the image (the live strip
  shows its thumbnail, from `images`).
- `BlockMap` (``%%llm --blocks``): per block its token range, first and last words,
  source (with the restored and computed tokens of a partly restored block), *reason*
  (why it was restored or computed) and seconds; the first changed token of an edited
  prompt (the *edit*); which record kinds each block read, against the model's
  `layer_kinds`. It draws no strip of its own: the answer's strip is just above it.
  Hovering or clicking a row shows its block in a details panel (with the thumbnails of
  an image block's images). Every row shows; only
  the live map of more than `TALL_ROWS` blocks scrolls its rows, in a tall box that opens
  at the first computed block.
- `StoreView` (``%llm_cache``): the engine's `cache_view()` dict: blocks and bytes held
  against the budget, the running totals of blocks restored, computed and evicted by
  request (one even step per history point), records by kind and the latest evictions.

Blocks, edits and images are the dicts of `mlx_nbengine.notebook.blockinfo`. Every widget's
display bundle also carries ``text/html``: the same picture as static HTML (a ``<style>``
block, no JavaScript), from the pure functions `strip_html`, `map_html` and
`store_html`, so that a notebook exported without its widget state still shows it. Model
text is always escaped: it is shown as written, never interpreted.
"""

from __future__ import annotations

import html as _html
import math
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import anywidget
import traitlets

__all__ = [
    "KINDS",
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

# Kind -> (letter, label), in legend order.
KINDS: dict[str, tuple[str, str]] = {
    "memory": ("M", "memory"),
    "disk": ("D", "disk"),
    "computed": ("C", "computed"),
    "tail": ("T", "tail"),
    "pending": ("", "pending"),
}

# Why a block was restored or computed, in words (the engine's reason names as keys).
REASON_PHRASES: dict[str, str] = {
    "hot": "kept in memory from the previous request",
    "new": "never seen",
    "edited": "edited",
    "evicted": "evicted from the store",
    "store_off": "no block store",
    "after_miss": "after a computed block",
    "tail": "last tokens, computed to start the answer",
    "window": "window or state records dropped",
    "none": "nothing to read",
}

# Record kinds in the order the engine joins them in a disk block's reason.
RECORD_ORDER = ("kv", "window", "state")

# Above this many blocks the strip's cells shrink and drop their letters.
DENSE_BLOCKS = 256

# Above this many rows the live map's rows scroll in a tall box that opens at the first
# computed block (the ES module's TALL_ROWS); up to it, and always in the static HTML,
# every row shows: the edited and tail rows, usually last, are the ones to see.
TALL_ROWS = 40


def static_dir() -> Path:
    """The folder holding the widgets' ES module and CSS.

    An installed package has it as ``static/`` next to this module; a source checkout
    (including an editable install, whose modules stay in the repository) reads the
    repository's top-level ``widgets/`` folder, the files' source of truth.
    """
    here = Path(__file__).resolve().parent
    packaged = here / "static"
    if (packaged / "blocks.js").is_file():
        return packaged
    source = here.parents[1] / "widgets"
    if (source / "blocks.js").is_file():
        return source
    raise FileNotFoundError(
        f"the widgets' files are missing: neither {packaged} nor {source} holds blocks.js; "
        "reinstall mlx_nbengine"
    )


STATIC = static_dir()


@cache
def _css() -> str:
    """The widgets' CSS for static HTML: without comments and runs of whitespace (it is
    repeated in every output). Spaces before ``:`` stay: ``a :is(b)`` is not ``a:is(b)``."""
    css = (STATIC / "blocks.css").read_text(encoding="utf-8")
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    css = re.sub(r"\s+", " ", css)
    return re.sub(r"\s*([{};,>])\s*", r"\1", css).strip()


# --- formatting ---------------------------------------------------------------------------


def _e(value: Any) -> str:
    return _html.escape(str(value), quote=True)


def _bytes(n: int | float | None) -> str:
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _seconds(s: float) -> str:
    if s < 0.01:
        return f"{s * 1000:.1f} ms"
    if s < 59.995:
        return f"{s:.2f} s"
    minutes, rest = divmod(round(s), 60)
    return f"{minutes} min {rest} s"


def _fixed(v: float, digits: int) -> str:
    """`v` with `digits` decimals, halves rounded up: as the ES module writes it, so that
    the static and live pictures match (Python's format and JavaScript's ``toFixed``
    round some halves apart)."""
    scale = 10**digits
    return f"{math.floor(v * scale + 0.5) / scale:.{digits}f}"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def record_kinds(layer_kinds: Iterable[str]) -> list[str]:
    """Each record kind once, in the order kv, window, state (others after, as met)."""
    kinds = list(dict.fromkeys(str(k) for k in layer_kinds))
    order = {kind: i for i, kind in enumerate(RECORD_ORDER)}
    return sorted(kinds, key=lambda k: order.get(k, len(order)))


def token_split(block: Mapping[str, Any]) -> tuple[int, int]:
    """(restored, computed) tokens of `block`; a memory or disk block without a count (a
    dict saved before token-exact restore) is restored whole."""
    length = max(0, int(block.get("end", 0)) - int(block.get("start", 0)))
    restored = block.get("restored")
    if not restored:
        restored = length if block.get("source") in ("memory", "disk") else 0
    restored = min(length, max(0, int(restored)))
    return restored, length - restored


def _partly(block: Mapping[str, Any] | None) -> int:
    """Tokens restored of a partly restored block; 0 for any other block."""
    if block is None or block.get("source") in ("memory", "disk"):
        return 0
    restored, computed = token_split(block)
    return restored if computed else 0


def _part(block: Mapping[str, Any] | None, before: Mapping[str, Any] | None) -> str | None:
    """Where a partly restored block's restored tokens came from (None for another block).

    The engine restores one prefix from one source, so it is the source of the block
    before; a prompt's first block has none before it and is restored from disk.
    """
    if not _partly(block):
        return None
    source = before.get("source") if before else None
    return str(source) if source in ("memory", "disk") else "disk"


def _split_words(block: Mapping[str, Any]) -> str:
    restored, computed = token_split(block)
    return f"{restored:,} restored + {computed:,} computed"


def reason_phrase(
    block: Mapping[str, Any], edit: Mapping[str, Any] | None = None, *, partly: bool = True
) -> str:
    """Why `block` came from where it did, in words (``"read kv + window"``...).

    A partly restored block's phrase says how many of its first tokens were restored,
    unless `partly` is False (where the words around it say so already).
    """
    reason = str(block.get("reason") or "")
    if reason == "edited" and edit and edit.get("block") == block.get("index"):
        phrase = f"edited at token {int(edit['position']):,}"
    elif reason in REASON_PHRASES:
        phrase = REASON_PHRASES[reason]
    elif block.get("source") == "disk" and reason:
        phrase = "read " + " + ".join(reason.split("+"))
    else:
        phrase = reason
    restored = _partly(block) if partly else 0
    if restored:
        first = "first token" if restored == 1 else f"first {restored:,} tokens"
        phrase = f"{phrase} ({first} restored)" if phrase else f"{first} restored"
    return phrase


def _tip(block: Mapping[str, Any], edit: Mapping[str, Any] | None) -> str:
    """The one-line description a block shows on hover (a `title`)."""
    source = str(block.get("source", ""))
    restored = _partly(block)
    if restored:
        restored, computed = token_split(block)
        source = f"{restored:,} of {restored + computed:,} tokens restored, {computed:,} computed"
    parts = [
        f"block {block.get('index', 0)}",
        f"tokens {block.get('start', 0):,}–{block.get('end', 0):,}",
        source,
    ]
    phrase = reason_phrase(block, edit, partly=False)
    if phrase:
        parts.append(phrase)
    parts.append(_seconds(float(block.get("seconds") or 0.0)))
    text = _words(block)
    if text:
        parts.append(text)
    return " · ".join(parts)


def _words(block: Mapping[str, Any]) -> str:
    head, last = block.get("head") or "", block.get("last") or ""
    if head and last:
        return f"“{head} … {last}”"
    return f"“{head or last}”" if head or last else ""


def _image_ids(block: Mapping[str, Any] | None) -> list[int]:
    """The indices of the images whose tokens overlap `block` (its dict's ``images``)."""
    if block is None:
        return []
    return sorted({int(i) for i in block.get("images") or ()})


def _image_attr(block: Mapping[str, Any] | None) -> str:
    """The ``data-image`` attribute of an image block ("" for any other block)."""
    ids = _image_ids(block)
    return f' data-image="{" ".join(map(str, ids))}"' if ids else ""


def _image_label(index: int, images: Sequence[Mapping[str, Any]]) -> str:
    """ "image 1: cat.png" (or "image 1" where the image's name is not known)."""
    known = {int(im.get("index", i)): im for i, im in enumerate(images)}
    name = str(known.get(index, {}).get("name") or "")
    return f"image {index + 1}: {name}" if name else f"image {index + 1}"


def _image_tip(block: Mapping[str, Any], images: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(_image_label(i, images) for i in _image_ids(block))


def _image_key(blocks: Iterable[Mapping[str, Any]]) -> str:
    """The legend's key for image blocks, when there are."""
    n = sum(1 for b in blocks if _image_ids(b))
    if not n:
        return ""
    return (
        f'<span class="mnb-key" data-images="true" data-count="{n}">'
        '<span class="mnb-img-mark" aria-hidden="true"></span>'
        f'image blocks <b class="mnb-count">{n:,}</b></span>'
    )


def _image_chips(block: Mapping[str, Any], images: Sequence[Mapping[str, Any]]) -> str:
    """A map row's marks of the images its block holds: "image 1"... (name on hover)."""
    return "".join(
        f'<span class="mnb-img-chip" data-image-index="{i}" title="{_e(_image_label(i, images))}">'
        f'<span class="mnb-img-mark" aria-hidden="true"></span>image {i + 1}</span> '
        for i in _image_ids(block)
    )


def _by_index(blocks: Iterable[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    return {int(b["index"]): b for b in blocks}


def _kind_counts(blocks: Iterable[Mapping[str, Any]], n_blocks: int) -> Counter[str]:
    counts = Counter(str(b.get("kind") or b.get("source")) for b in blocks)
    counts["pending"] = max(0, n_blocks - sum(counts.values()))
    return counts


def _fill(block: Mapping[str, Any]) -> str:
    """A partly restored block's restored share: a fill from the bottom of its cell."""
    restored, computed = token_split(block)
    share = restored / max(1, restored + computed)
    return f'<span class="mnb-fill" style="--mnb-share: {_fixed(share, 3)}"></span>'


def _legend(counts: Mapping[str, int], parts: Sequence[str] = (), image_key: str = "") -> str:
    """One key per kind with its count; a key for the partly restored blocks when there
    are (`parts`: each one's part), its swatch filled like theirs; then `image_key`."""
    items = []
    for kind, (letter, label) in KINDS.items():
        n = counts.get(kind, 0)
        items.append(
            f'<span class="mnb-key" data-kind="{kind}" data-count="{n}">'
            f'<span class="mnb-swatch" data-kind="{kind}">{letter}</span>'
            f'{label} <b class="mnb-count">{n:,}</b></span>'
        )
    if parts:
        part = _e(parts[0])
        items.append(
            f'<span class="mnb-key" data-part="{part}" data-count="{len(parts)}">'
            f'<span class="mnb-swatch" data-kind="computed" data-part="{part}">'
            '<span class="mnb-fill" style="--mnb-share: 0.5"></span></span>'
            f'partly restored <b class="mnb-count">{len(parts):,}</b></span>'
        )
    return f'<div class="mnb-legend">{"".join(items)}{image_key}</div>'


def _edit_html(edit: Mapping[str, Any] | None) -> str:
    if not edit:
        return ""
    position = int(edit.get("position", 0))
    before, after = edit.get("before") or "", edit.get("after") or ""
    block = _e(edit.get("block", ""))
    return (
        f'<div class="mnb-edit" data-position="{position}" data-block="{block}">'
        f'<span class="mnb-edit-label">first change at token {position:,} (block {block})</span> '
        f'<span class="mnb-edit-words">…<span class="mnb-before">{_e(before)}</span>'
        f'<span class="mnb-caret" aria-label="changed here">▍</span>'
        f'<span class="mnb-after">{_e(after)}</span>…</span> '
        f'<span class="mnb-edit-note">blocks from here on were recomputed</span></div>'
    )


def _restored_attrs(block: Mapping[str, Any], part: str | None) -> str:
    """The ``data-restored`` (and, partly restored, ``data-part``) attributes of a block."""
    out = f' data-restored="{token_split(block)[0]}"'
    return out + f' data-part="{_e(part)}"' if part else out


def _cell(
    i: int,
    block: Mapping[str, Any] | None,
    edit: Mapping[str, Any] | None,
    before: Mapping[str, Any] | None,
    images: Sequence[Mapping[str, Any]] = (),
) -> str:
    if block is None:
        return (
            f'<div class="mnb-block" data-index="{i}" data-kind="pending" data-reason="" '
            f'title="block {i} · pending"></div>'
        )
    kind = str(block.get("kind") or block.get("source"))
    letter = KINDS.get(kind, ("?", kind))[0]
    edited = ' data-edit="true"' if edit and edit.get("block") == i else ""
    part = _part(block, before)
    tip = _tip(block, edit)
    if _image_ids(block):
        tip += " · " + _image_tip(block, images)
    return (
        f'<div class="mnb-block" data-index="{i}" data-kind="{_e(kind)}" '
        f'data-reason="{_e(block.get("reason", ""))}"{edited}{_restored_attrs(block, part)}'
        f'{_image_attr(block)} title="{_e(tip)}">{_fill(block) if part else ""}{letter}</div>'
    )


def _cells(
    n_blocks: int,
    blocks: Sequence[Mapping[str, Any]],
    edit: Mapping[str, Any] | None,
    images: Sequence[Mapping[str, Any]] = (),
) -> str:
    known = _by_index(blocks)
    n = max(n_blocks, max(known, default=-1) + 1)
    dense = " mnb-dense" if n > DENSE_BLOCKS else ""
    cells = "".join(_cell(i, known.get(i), edit, known.get(i - 1), images) for i in range(n))
    # The inline style keeps the cells in rows where a sanitizer drops the <style> block.
    return f'<div class="mnb-cells{dense}" style="display: flex; flex-wrap: wrap">{cells}</div>'


def _style() -> str:
    return f"<style>{_css()}</style>"


# --- static HTML ----------------------------------------------------------------------------


def strip_html(
    blocks: Sequence[Mapping[str, Any]],
    *,
    n_blocks: int = 0,
    block_size: int = 0,
    prompt_tokens: int = 0,
    edit: Mapping[str, Any] | None = None,
    show_edit: bool = True,
    images: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The block strip as static HTML: one ``div.mnb-block`` cell per block, a legend.

    The edited block's cell is always marked; `show_edit` False leaves out the edit's
    banner (its words), for a strip that a block map, which shows it, follows. An image
    block's cell has ``data-image`` and a mark, and names its `images` on hover.
    """
    counts = _kind_counts(blocks, n_blocks)
    known = _by_index(blocks)
    parts = [p for i, b in sorted(known.items()) if (p := _part(b, known.get(i - 1)))]
    n = max(n_blocks, len(known))
    caption = f"{_plural(n, 'block')}"
    if block_size:
        caption += f" of {block_size:,} tokens"
    if prompt_tokens:
        caption += f" · {_plural(prompt_tokens, 'prompt token')}"
    return (
        f'{_style()}<div class="mnb-root mnb-strip" data-n-blocks="{n}">'
        f"{_cells(n_blocks, blocks, edit, images)}"
        f'<div class="mnb-foot">{_legend(counts, parts, _image_key(blocks))}'
        f'<span class="mnb-caption">{caption}</span></div>'
        f"{_edit_html(edit) if show_edit else ''}</div>"
    )


def _records_html(block: Mapping[str, Any], layer_kinds: Sequence[str]) -> str:
    records = [str(r) for r in block.get("records") or ()]
    if block.get("source") != "disk":
        # Computed blocks make all their records; a hot restore reads none.
        return '<span class="mnb-dim">—</span>'
    kinds = list(layer_kinds) or records
    chips = []
    for kind in kinds:
        read = kind in records
        chips.append(
            f'<span class="mnb-rec" data-record="{_e(kind)}" data-read="{str(read).lower()}" '
            f'title="{_e(kind)} records {"read" if read else "not needed"}">{_e(kind)}</span>'
        )
    return "".join(chips)


def _row(
    block: Mapping[str, Any],
    edit: Mapping[str, Any] | None,
    layer_kinds: Sequence[str],
    before: Mapping[str, Any] | None,
    images: Sequence[Mapping[str, Any]] = (),
) -> str:
    i = int(block["index"])
    kind = str(block.get("kind") or block.get("source"))
    letter = KINDS.get(kind, ("?", kind))[0]
    start, end = int(block.get("start", 0)), int(block.get("end", 0))
    head, last = block.get("head") or "", block.get("last") or ""
    text = _image_chips(block, images)
    text += f'<q class="mnb-head">{_e(head)}</q>' if head else ""
    if last:
        # A no-break space: a wrapped row breaks after the ellipsis, never before it.
        text += f'\u00a0<span class="mnb-dim">…</span> <q class="mnb-last">{_e(last)}</q>'
    edited = ' data-edit="true"' if edit and edit.get("block") == i else ""
    part = _part(block, before)
    # A partly restored block's source says how its tokens split.
    source = _split_words(block) if part else _e(block.get("source", ""))
    part_attr = f' data-part="{_e(part)}"' if part else ""
    return (
        f'<tr class="mnb-block" data-index="{i}" data-kind="{_e(kind)}" '
        f'data-reason="{_e(block.get("reason", ""))}"{edited}{_restored_attrs(block, part)}'
        f'{_image_attr(block)}><td class="mnb-num">{i}</td>'
        f'<td class="mnb-num mnb-range">{start:,}–{end:,}</td>'
        f'<td class="mnb-text">{text}</td>'
        f'<td class="mnb-source"><span class="mnb-swatch" data-kind="{_e(kind)}"{part_attr}>'
        f"{_fill(block) if part else ''}{letter}</span> {source}</td>"
        f'<td class="mnb-reason">{_e(reason_phrase(block, edit))}</td>'
        f'<td class="mnb-num">{_seconds(float(block.get("seconds") or 0.0))}</td>'
        f'<td class="mnb-records">{_records_html(block, layer_kinds)}</td></tr>'
    )


def map_html(
    blocks: Sequence[Mapping[str, Any]],
    *,
    block_size: int = 0,
    prompt_tokens: int = 0,
    edit: Mapping[str, Any] | None = None,
    layer_kinds: Sequence[str] = (),
    images: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The block map as static HTML: its title, the edit, one row per block.

    No strip of cells: the answer's strip is drawn just above the map. `layer_kinds` are
    the model's record kinds, one per layer or each once. An image block's row has
    ``data-image`` and, before its words, a mark per image (named by `images` on hover).
    """
    blocks = sorted(blocks, key=lambda b: int(b["index"]))
    layer_kinds = record_kinds(layer_kinds)
    n = len(blocks)
    head = f"Block map · {_plural(n, 'block')}"
    if block_size:
        head += f" of {block_size:,} tokens"
    if prompt_tokens:
        head += f" · {_plural(prompt_tokens, 'prompt token')}"
    if layer_kinds:
        head += " · layer kinds: " + " + ".join(_e(k) for k in layer_kinds)
    known = _by_index(blocks)
    rows = "".join(
        _row(b, edit, layer_kinds, known.get(int(b["index"]) - 1), images) for b in blocks
    )
    table = (
        '<div class="mnb-scroll"><table class="mnb-table"><thead><tr>'
        '<th class="mnb-num">block</th><th class="mnb-num">tokens</th><th>text</th>'
        '<th>source</th><th>reason</th><th class="mnb-num">time</th><th>records</th>'
        f"</tr></thead><tbody>{rows}</tbody></table></div>"
    )
    return (
        f'{_style()}<div class="mnb-root mnb-map" data-n-blocks="{n}">'
        f'<div class="mnb-title">{head}</div>{_edit_html(edit)}{table}</div>'
    )


# Store view figures: (data-name, label). Labels are words, never the dict's keys.
FIGURES: tuple[tuple[str, str], ...] = (
    ("blocks_held", "blocks held"),
    ("bytes_held", "bytes held"),
    ("file_size", "scratch file"),
    ("blocks_restored", "blocks restored"),
    ("blocks_computed", "blocks computed"),
    ("blocks_evicted", "blocks evicted"),
    ("requests", "requests"),
)

CHART_W, CHART_H = 480, 146
# The request axis labels every request up to ALL_TICKS of them, else about AXIS_TICKS.
ALL_TICKS = 12
AXIS_TICKS = 6
# Series of the chart: (history key, label, colour variable, SVG dash pattern). The dash
# patterns tell the lines apart without colour; the legend draws the same ones.
SERIES = (
    ("restored", "restored", "--mnb-disk", ""),
    ("computed", "computed", "--mnb-computed", "7 3"),
    ("evicted", "evicted", "--mnb-evicted", "2 2"),
)


def _figure_value(name: str, view: Mapping[str, Any]) -> tuple[str, str]:
    """(value, detail) of one store figure."""
    get = view.get
    if name == "bytes_held":
        budget = int(get("budget_bytes") or 0)
        detail = f"of {_bytes(budget)} budget" if budget else "no disk budget"
        return _bytes(get("bytes_held")), detail
    if name == "file_size":
        # free_bytes: free extents inside the scratch file, which later writes reuse first.
        return _bytes(get("file_size")), f"{_bytes(get('free_bytes'))} free for reuse"
    if name == "blocks_restored":
        return (
            f"{int(get('blocks_restored') or 0):,}",
            f"{int(get('tokens_restored') or 0):,} tokens",
        )
    if name == "blocks_computed":
        return (
            f"{int(get('blocks_computed') or 0):,}",
            f"{int(get('tokens_computed') or 0):,} tokens",
        )
    if name == "blocks_evicted":
        return f"{int(get('blocks_evicted') or 0):,}", _plural(
            int(get("records_evicted") or 0), "record"
        )
    if name == "blocks_held":
        return f"{int(get('blocks_held') or 0):,}", _plural(int(get("records") or 0), "record")
    return f"{int(get(name) or 0):,}", ""


def _f(v: float) -> str:
    """A chart coordinate, with one decimal."""
    return _fixed(v, 1)


def request_ticks(n: int) -> list[int]:
    """The requests (numbered from 1) that the chart's x axis labels, of `n`.

    Every one up to `ALL_TICKS`; beyond, the first, the last and the multiples of a round
    step between them: the smallest step (1, 2, 2.5 or 5 times a power of ten, a whole
    number) that makes at most ``AXIS_TICKS + 1`` labels. A multiple within half a step
    of the first or the last is left out, so that no two labels crowd each other.
    """
    if n <= ALL_TICKS:
        return list(range(1, n + 1))
    scale = 1
    while True:
        for m in (1, 2, 2.5, 5):
            step = m * scale
            if step != int(step):
                continue
            inner = [r for r in range(int(step), n, int(step)) if r - 1 > step / 2]
            ticks = [1, *(r for r in inner if n - r > step / 2), n]
            if len(ticks) <= AXIS_TICKS + 1:
                return ticks
        scale *= 10


def _chart(history: Sequence[Mapping[str, Any]]) -> str:
    """The history as step lines: x is the request (each history point gets an equal
    band, in order), y the running total of blocks restored, computed and evicted.

    Not seconds since load: loading the model takes most of that time, which would
    squeeze every request into the right edge. Each band draws its point's totals across
    its whole width, so a single request is a visible line, not a lone corner.
    """
    w, h, left, bottom, top, right = CHART_W, CHART_H, 44, 34, 8, 10
    points = [p for p in history if isinstance(p, Mapping)]
    label = 'role="img" aria-label="blocks restored, computed and evicted, by request"'
    if not points:
        # A one-line chart: no empty plot area before the first request.
        return (
            f'<svg class="mnb-chart" data-empty="true" viewBox="0 0 {w} 24" {label}>'
            '<text class="mnb-axis" x="0" y="16">no requests yet</text></svg>'
        )
    n = len(points)
    parts = [
        f'<svg class="mnb-chart" data-x="requests" data-points="{n}" viewBox="0 0 {w} {h}" {label}>'
    ]
    y_max = max(max(int(p.get(k) or 0) for k, *_ in SERIES) for p in points) or 1
    plot_w, plot_h = w - left - right, h - top - bottom

    def x(i: float) -> float:
        return left + plot_w * i / n

    def y(v: float) -> float:
        return top + plot_h * (1 - v / y_max)

    # Each label under the middle of its request's band; the axis title on a line below.
    tick_y = top + plot_h + 13
    ticks = "".join(
        f'<text class="mnb-axis mnb-tick" data-request="{r}" x="{_f(x(r - 0.5))}" '
        f'y="{tick_y}" text-anchor="middle">{r:,}</text>'
        for r in request_ticks(n)
    )
    parts.append(
        f'<line class="mnb-grid" x1="{left}" y1="{_f(y(0))}" x2="{w - right}" y2="{_f(y(0))}"/>'
        f'<line class="mnb-grid" x1="{left}" y1="{_f(y(y_max))}" x2="{w - right}" '
        f'y2="{_f(y(y_max))}"/>'
        f'<text class="mnb-axis" x="{left - 6}" y="{_f(y(0) + 4)}" text-anchor="end">0</text>'
        f'<text class="mnb-axis" x="{left - 6}" y="{_f(y(y_max) + 4)}" text-anchor="end">'
        f"{y_max:,}</text>"
        f'<text class="mnb-axis" x="{left - 6}" y="{_f(y(y_max) + 15)}" text-anchor="end">'
        f"blocks</text>{ticks}"
        f'<text class="mnb-axis mnb-axis-title" x="{_f(left + plot_w / 2)}" y="{h - 4}" '
        'text-anchor="middle">requests</text>'
    )
    for i, p in enumerate(points):
        # One hover target per request: its totals in words.
        totals = " · ".join(f"{int(p.get(k) or 0):,} {lbl}" for k, lbl, *_ in SERIES)
        parts.append(
            f'<rect class="mnb-band" x="{_f(x(i))}" y="{top}" width="{_f(x(i + 1) - x(i))}" '
            f'height="{plot_h}" fill="transparent"><title>request {i + 1}: {totals}</title></rect>'
        )
    for key, label, colour, dash in SERIES:
        coords = []
        for i, p in enumerate(points):
            v = y(int(p.get(key) or 0))
            coords += [f"{_f(x(i))},{_f(v)}", f"{_f(x(i + 1))},{_f(v)}"]
        last = int(points[-1].get(key) or 0)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<polyline class="mnb-series" data-series="{key}" fill="none" '
            f'style="stroke: var({colour})" stroke-width="2"{dashes} points="{" ".join(coords)}">'
            f"<title>{label}: {last:,} blocks</title></polyline>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _chart_legend() -> str:
    # Each key draws a piece of its series' line: the same colour and dash pattern.
    items = []
    for key, label, colour, dash in SERIES:
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        items.append(
            f'<span class="mnb-key" data-series="{key}"><svg class="mnb-line" '
            f'viewBox="0 0 20 4" aria-hidden="true"><line x1="0" y1="2" x2="20" y2="2" '
            f'style="stroke: var({colour})" stroke-width="2"{dashes}/></svg>{label}</span>'
        )
    return f'<div class="mnb-legend">{"".join(items)}</div>'


def store_html(view: Mapping[str, Any]) -> str:
    """The store view as static HTML: figures, the budget bar, chart, kinds, evictions."""
    view = view or {}
    title = "Block store"
    if view.get("model"):
        title += f" · {_e(view['model'])}"
    if view.get("block_size"):
        title += f" · blocks of {int(view['block_size']):,} tokens"
    backend = str(view.get("backend") or "")
    if backend == "off":
        backend = "no block store: every block is computed"
    sub = f'<div class="mnb-sub">{_e(backend)}</div>' if backend else ""
    figures = []
    for name, label in FIGURES:
        value, detail = _figure_value(name, view)
        detail_html = f'<span class="mnb-detail">{_e(detail)}</span>' if detail else ""
        figures.append(
            f'<div class="mnb-figure" data-name="{name}"><span class="mnb-label">{label}</span>'
            f'<span class="mnb-value">{_e(value)}</span>{detail_html}</div>'
        )
    held, budget = int(view.get("bytes_held") or 0), int(view.get("budget_bytes") or 0)
    share = min(1.0, held / budget) if budget else 0.0
    bar = (
        f'<div class="mnb-bar" data-share="{share:.4f}" title="bytes held: {_bytes(held)} of '
        f'{_bytes(budget)}"><span class="mnb-bar-fill" style="width: {share * 100:.1f}%"></span>'
        f'</div><div class="mnb-bar-label">{_bytes(held)} held of {_bytes(budget)} budget '
        f"({share * 100:.1f} %)</div>"
        if budget
        else ""
    )
    by_kind = view.get("by_kind") or {}
    kind_rows = "".join(
        f'<tr data-record="{_e(k)}"><td>{_e(k)}</td><td class="mnb-num">'
        f"{int(v.get('records') or 0):,}</td>"
        f'<td class="mnb-num">{_bytes(v.get("bytes"))}</td></tr>'
        for k, v in by_kind.items()
        if isinstance(v, Mapping) and (v.get("records") or v.get("bytes"))
    )
    kinds = (
        '<table class="mnb-table mnb-kinds"><thead><tr><th>record kind</th>'
        f'<th class="mnb-num">records</th><th class="mnb-num">bytes</th></tr></thead>'
        f"<tbody>{kind_rows}</tbody></table>"
        if kind_rows
        else '<p class="mnb-empty">no records held</p>'
    )
    history = [p for p in view.get("history") or () if isinstance(p, Mapping)]
    evictions = [e for e in view.get("recent_evictions") or () if isinstance(e, Mapping)]
    items = "".join(
        f'<li data-record="{_e(e.get("kind", ""))}"><span class="mnb-num mnb-time">'
        f"{_seconds(float(e.get('t') or 0.0))}</span>"
        f'<span class="mnb-rec" data-read="true">{_e(e.get("kind", ""))}</span>'
        f'<span class="mnb-num">{_bytes(e.get("bytes"))}</span>'
        f'<q class="mnb-head">{_e(e.get("text") or "")}</q></li>'
        for e in evictions
    )
    evicted = (
        f'<ul class="mnb-evictions">{items}</ul>'
        if items
        else '<p class="mnb-empty">no evictions yet</p>'
    )
    return (
        f'{_style()}<div class="mnb-root mnb-store"><div class="mnb-title">{title}</div>{sub}'
        f'<div class="mnb-figures">{"".join(figures)}</div>{bar}'
        f'<div class="mnb-panels"><div class="mnb-panel"><div class="mnb-subtitle">'
        f"blocks by request (running totals)</div>{_chart(history)}"
        f"{_chart_legend() if history else ''}</div>"
        f'<div class="mnb-panel"><div class="mnb-subtitle">records by kind</div>{kinds}'
        f'<div class="mnb-subtitle">latest evictions</div>{evicted}</div></div></div>'
    )


# --- widgets --------------------------------------------------------------------------------


class _Widget(anywidget.AnyWidget):
    """What the three widgets share: the ES module and CSS, the display bundle."""

    _esm = STATIC / "blocks.js"
    _css = STATIC / "blocks.css"
    # Which picture the shared ES module draws.
    _kind = traitlets.Unicode("").tag(sync=True)

    def html(self) -> str:
        """The widget's picture as static HTML (no JavaScript)."""
        raise NotImplementedError

    def text(self) -> str:
        """A one-line description for ``text/plain``."""
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict]:
        data, metadata = super()._repr_mimebundle_(**kwargs)
        return {**data, "text/plain": self.text(), "text/html": self.html()}, metadata


class BlockStrip(_Widget):
    """One cell per prompt block, filled in as the blocks' sources become known.

    `add_block` may be called from the thread that follows the request: it reassigns
    `blocks` (traitlets only sync on assignment) under a lock, so no block is lost.
    `show_edit` False keeps the edited cell's mark but drops the edit's banner, for
    when a `BlockMap` (which shows the banner) follows.
    """

    _kind = traitlets.Unicode("strip").tag(sync=True)
    n_blocks = traitlets.Int(0).tag(sync=True)
    block_size = traitlets.Int(0).tag(sync=True)
    prompt_tokens = traitlets.Int(0).tag(sync=True)
    blocks = traitlets.List(traitlets.Dict()).tag(sync=True)
    edit = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    show_edit = traitlets.Bool(True).tag(sync=True)
    # The request's images (`blockinfo.image_dicts`): named and shown on image blocks.
    images = traitlets.List(traitlets.Dict()).tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        super().__init__(**kwargs)

    def add_block(self, block: Mapping[str, Any]) -> None:
        """Add (or replace) the block dict with `block["index"]`, keeping index order."""
        self.add_blocks([block])

    def add_blocks(self, blocks: Iterable[Mapping[str, Any]]) -> None:
        """Add several block dicts in one update."""
        with self._lock:
            known = _by_index(self.blocks)
            known.update(_by_index(dict(b) for b in blocks))
            self.blocks = [dict(known[i]) for i in sorted(known)]

    def set_edit(self, edit: Mapping[str, Any] | None) -> None:
        """Mark the first changed token (an edit dict), or clear the mark with None."""
        self.edit = dict(edit) if edit else None

    def html(self) -> str:
        return strip_html(
            self.blocks,
            n_blocks=self.n_blocks,
            block_size=self.block_size,
            prompt_tokens=self.prompt_tokens,
            edit=self.edit,
            show_edit=self.show_edit,
            images=self.images,
        )

    def text(self) -> str:
        counts = _kind_counts(self.blocks, self.n_blocks)
        parts = [f"{counts[k]} {label}" for k, (_, label) in KINDS.items() if counts[k]]
        n = max(self.n_blocks, len(self.blocks))
        return f"{_plural(n, 'prompt block')}: {', '.join(parts) or 'none'}{_images_text(self)}"


class BlockMap(_Widget):
    """Every prompt block with its range, words, source, reason, time and records."""

    _kind = traitlets.Unicode("map").tag(sync=True)
    blocks = traitlets.List(traitlets.Dict()).tag(sync=True)
    edit = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    block_size = traitlets.Int(0).tag(sync=True)
    prompt_tokens = traitlets.Int(0).tag(sync=True)
    layer_kinds = traitlets.List(traitlets.Unicode()).tag(sync=True)
    # The request's images (`blockinfo.image_dicts`): named and shown on image blocks.
    images = traitlets.List(traitlets.Dict()).tag(sync=True)

    def html(self) -> str:
        return map_html(
            self.blocks,
            block_size=self.block_size,
            prompt_tokens=self.prompt_tokens,
            edit=self.edit,
            layer_kinds=self.layer_kinds,
            images=self.images,
        )

    def text(self) -> str:
        lines = [f"Block map: {_plural(len(self.blocks), 'block')}{_images_text(self)}"]
        if self.edit:
            lines.append(f"first change at token {int(self.edit.get('position', 0)):,}")
        for b in sorted(self.blocks, key=lambda b: int(b["index"])):
            line = (
                f"{int(b['index']):>4} {int(b.get('start', 0)):>7,}-{int(b.get('end', 0)):<7,} "
                f"{b.get('source', ''):<8} {reason_phrase(b, self.edit)}"
            )
            if _image_ids(b):
                line += f" [{_image_tip(b, self.images)}]"
            lines.append(line)
        return "\n".join(lines)


def _images_text(widget: BlockStrip | BlockMap) -> str:
    """ "; 2 image blocks (image 1: cat.png)" for a widget with image blocks, else ""."""
    blocks = [b for b in widget.blocks if _image_ids(b)]
    if not blocks:
        return ""
    ids = sorted({i for b in blocks for i in _image_ids(b)})
    names = ", ".join(_image_label(i, widget.images) for i in ids)
    return f"; {_plural(len(blocks), 'image block')} ({names})"


class StoreView(_Widget):
    """What the block store holds and how requests used it (`engine.cache_view()`)."""

    _kind = traitlets.Unicode("store").tag(sync=True)
    view = traitlets.Dict().tag(sync=True)

    def html(self) -> str:
        return store_html(self.view)

    def text(self) -> str:
        v = self.view
        return (
            f"Block store: {int(v.get('blocks_held') or 0):,} blocks held, "
            f"{_bytes(v.get('bytes_held'))} of {_bytes(v.get('budget_bytes'))} budget, "
            f"{int(v.get('blocks_restored') or 0):,} blocks restored, "
            f"{int(v.get('blocks_computed') or 0):,} computed, "
            f"{int(v.get('blocks_evicted') or 0):,} evicted"
        )
