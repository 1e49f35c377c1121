"""The block pictures as HTML: the strip of cells and the block map, static or live.

Terms:

- *block strip* (`strip_html`): one fixed-size cell per prompt block, coloured and
  lettered by its *display* (`DISPLAYS`: what the cell shows the block as), pending cells
  for blocks not reported yet, a legend with counts; the edit's banner (`show_edit`). A
  *partly restored* cell (see `words`) keeps its display, with its restored share filled
  from the bottom in the colour of its *part* (the source of the block before it, ``disk``
  for the first block). An *image block*
  carries ``data-image`` (its image indices) and a mark.
- *block map* (`map_html`): per block its range, first and last words, source, reason,
  time and the record kinds it read against the model's layer kinds.
- *details panel* (`map_details`): the live map's box that shows the hovered or chosen
  block (by default the edited block), with an image block's thumbnails.
- *preview* (`previews`): the thumbnail the live strip shows over an image block's cell.
- *answer buttons* (`controls_html`): the live strip's Stop (while the answer runs) and
  Copy (once it has text) buttons; never in the static HTML.
- *static* vs *live*: static HTML starts with a ``<style>`` block and needs no
  JavaScript (exported notebooks); live HTML is what a widget sends its ES module, which
  adds the behaviour (hover, scroll) and no words.

Blocks, edits and images are the dicts of `mlx_nbengine.notebook.blockinfo`. Model text
is always escaped: it is shown as written, never interpreted.
"""

from __future__ import annotations

import html as _html
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from mlx_nbengine.notebook.words import (
    partly_restored,
    plural,
    reason_phrase,
    seconds,
    token_split,
)

__all__ = [
    "DISPLAYS",
    "TALL_ROWS",
    "block_text",
    "by_index",
    "controls_html",
    "escape",
    "image_ids",
    "image_label",
    "display_counts",
    "map_details",
    "map_html",
    "previews",
    "record_kinds",
    "static_dir",
    "strip_html",
    "style",
    "stylesheet",
    "view_style",
]

Block = Mapping[str, Any]
Images = Sequence[Mapping[str, Any]]

# Display -> (letter, label), in legend order.
DISPLAYS: dict[str, tuple[str, str]] = {
    "memory": ("M", "memory"),
    "disk": ("D", "disk"),
    "computed": ("C", "computed"),
    "tail": ("T", "tail"),
    "pending": ("", "pending"),
}

# Record kinds in the order the engine joins them in a disk block's reason.
RECORD_ORDER = ("kv", "window", "state")

# Above this many blocks the strip's cells shrink and drop their letters.
DENSE_BLOCKS = 256

# Above this many rows the live map's rows scroll in a tall box that opens at the first
# computed block; up to it, and always in the static HTML, every row shows: the edited
# and tail rows, usually last, are the ones to see.
TALL_ROWS = 40
# A partly restored cell's fill steps (blocks.css has a rule for each); the most images an
# image block's details panel makes room for.
FILL_STEPS = 20
MAX_PANEL_IMAGES = 6


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
def stylesheet(name: str) -> str:
    """The static folder's CSS file `name` for HTML outputs: without comments and runs of
    whitespace (it is repeated in every output). Spaces before ``:`` stay: ``a :is(b)`` is
    not ``a:is(b)``."""
    css = (STATIC / name).read_text(encoding="utf-8")
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    css = re.sub(r"\s+", " ", css)
    return re.sub(r"\s*([{};,>])\s*", r"\1", css).strip()


def style() -> str:
    """The ``<style>`` block that static HTML starts with (the widgets' CSS)."""
    return f"<style>{stylesheet('blocks.css')}</style>"


def view_style() -> str:
    """The ``<style>`` block the plain displays start with (answers, images, tables)."""
    return f"<style>{stylesheet('views.css')}</style>"


def escape(value: Any) -> str:
    """`value` as HTML text or attribute value: model text is shown, never interpreted."""
    return _html.escape(str(value), quote=True)


def record_kinds(layer_kinds: Iterable[str]) -> list[str]:
    """Each record kind once, in the order kv, window, state (others after, as met)."""
    kinds = list(dict.fromkeys(str(k) for k in layer_kinds))
    order = {kind: i for i, kind in enumerate(RECORD_ORDER)}
    return sorted(kinds, key=lambda k: order.get(k, len(order)))


def _display(block: Block) -> str:
    return str(block.get("display") or block.get("source"))


def _letter(display: str) -> str:
    return DISPLAYS.get(display, ("?", display))[0]


def _part(block: Block | None, before: Block | None) -> str | None:
    """Where a partly restored block's restored tokens came from (None for another block).

    The engine restores one prefix from one source, so it is the source of the block
    before; a prompt's first block has none before it and is restored from disk.
    """
    if not partly_restored(block):
        return None
    source = before.get("source") if before else None
    return str(source) if source in ("memory", "disk") else "disk"


def _split_words(block: Block) -> str:
    restored, computed = token_split(block)
    return f"{restored:,} restored + {computed:,} computed"


def block_text(block: Block) -> str:
    """The block's first and last words, quoted ("" without words)."""
    head, last = block.get("head") or "", block.get("last") or ""
    if head and last:
        return f"“{head} … {last}”"
    return f"“{head or last}”" if head or last else ""


def _tip(block: Block, edit: Block | None, images: Images) -> str:
    """The one-line description a strip cell shows on hover (a `title`)."""
    source = str(block.get("source", ""))
    if partly_restored(block):
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
    parts.append(seconds(float(block.get("seconds") or 0.0)))
    text = block_text(block)
    if text:
        parts.append(text)
    if image_ids(block):
        parts.append(_image_tip(block, images))
    return " · ".join(parts)


# --- images ---------------------------------------------------------------------------------


def image_ids(block: Block | None) -> list[int]:
    """The indices of the images whose tokens overlap `block` (its dict's ``images``)."""
    if block is None:
        return []
    return sorted({int(i) for i in block.get("images") or ()})


def _image_attr(block: Block | None) -> str:
    """The ``data-image`` attribute of an image block ("" for any other block)."""
    ids = image_ids(block)
    return f' data-image="{" ".join(map(str, ids))}"' if ids else ""


def _image_of(index: int, images: Images) -> Mapping[str, Any] | None:
    return next((im for i, im in enumerate(images) if int(im.get("index", i)) == index), None)


def image_label(index: int, images: Images) -> str:
    """ "image 1: cat.png" (or "image 1" where the image's name is not known)."""
    name = str((_image_of(index, images) or {}).get("name") or "")
    return f"image {index + 1}: {name}" if name else f"image {index + 1}"


def _image_tip(block: Block, images: Images) -> str:
    return ", ".join(image_label(i, images) for i in image_ids(block))


def _image_key(blocks: Iterable[Block]) -> str:
    """The legend's key for image blocks, when there are."""
    n = sum(1 for b in blocks if image_ids(b))
    if not n:
        return ""
    return (
        f'<span class="mnb-key" data-images="true" data-count="{n}">'
        '<span class="mnb-img-mark" aria-hidden="true"></span>'
        f'image blocks <b class="mnb-count">{n:,}</b></span>'
    )


def _image_chips(block: Block, images: Images) -> str:
    """A map row's marks of the images its block holds: "image 1"... (name on hover)."""
    return "".join(
        f'<span class="mnb-img-chip" data-image-index="{i}" '
        f'title="{escape(image_label(i, images))}">'
        f'<span class="mnb-img-mark" aria-hidden="true"></span>image {i + 1}</span> '
        for i in image_ids(block)
    )


def _thumb(index: int, images: Images) -> str:
    """A thumbnail with its caption ("cat.png · 640x480"); the caption alone without one."""
    image = _image_of(index, images)
    label = image_label(index, images)
    caption = label
    picture = ""
    if image is not None:
        name = image.get("name") or f"image {index + 1}"
        caption = f"{name} · {int(image.get('width') or 0):,}x{int(image.get('height') or 0):,}"
        src = str(image.get("src") or "")
        if src.startswith("data:image/"):
            picture = f'<img src="{escape(src)}" alt="{escape(label)}" title="{escape(label)}">'
    return (
        f'<figure class="mnb-thumb" data-image-index="{index}">{picture}'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


def previews(blocks: Iterable[Block], images: Images) -> dict[str, str]:
    """The live strip's hover thumbnails: image index (a string) -> its figure's HTML."""
    ids = {int(im.get("index", i)) for i, im in enumerate(images)}
    ids |= {i for b in blocks for i in image_ids(b)}
    return {str(i): _thumb(i, images) for i in sorted(ids)}


# --- cells ----------------------------------------------------------------------------------


def by_index(blocks: Iterable[Block]) -> dict[int, Block]:
    """Block dicts by their index."""
    return {int(b["index"]): b for b in blocks}


def display_counts(blocks: Iterable[Block], n_blocks: int) -> Counter[str]:
    """How many blocks of each display, the blocks not reported yet counted as pending."""
    counts = Counter(_display(b) for b in blocks)
    counts["pending"] = max(0, n_blocks - sum(counts.values()))
    return counts


def _fill(block: Block) -> str:
    """A partly restored block's restored share: a fill from the bottom of its cell."""
    restored, computed = token_split(block)
    return f'<span class="mnb-fill" data-share="{fill_twentieths(restored, computed)}"></span>'


def fill_twentieths(restored: int, computed: int) -> int:
    """A partly restored block's restored share in twentieths (1-19: never empty or full,
    so a part still looks partial): ``data-share``, which the CSS turns into a height."""
    share = restored / max(1, restored + computed)
    return min(FILL_STEPS - 1, max(1, round(share * FILL_STEPS)))


def _swatch(block: Block, part: str | None) -> str:
    display = _display(block)
    part_attr = f' data-part="{escape(part)}"' if part else ""
    return (
        f'<span class="mnb-swatch" data-display="{escape(display)}"{part_attr}>'
        f"{_fill(block) if part else ''}{_letter(display)}</span>"
    )


def _legend(
    counts: Mapping[str, int],
    partial: Sequence[tuple[Block, str]] = (),
    image_key: str = "",
    *,
    edited: Block | None = None,
) -> str:
    """One key per display with its count; a key for the partly restored blocks when there
    are (`partial`: each one with its part), its swatch drawn like the first of them (display,
    letter, fill); a key for the ring of the `edited` block's cell; then `image_key`."""
    items = []
    for display, (letter, label) in DISPLAYS.items():
        n = counts.get(display, 0)
        items.append(
            f'<span class="mnb-key" data-display="{display}" data-count="{n}">'
            f'<span class="mnb-swatch" data-display="{display}">{letter}</span>'
            f'{label} <b class="mnb-count">{n:,}</b></span>'
        )
    if partial:
        first, part = partial[0]
        display = escape(_display(first))
        items.append(
            f'<span class="mnb-key" data-part="{escape(part)}" data-count="{len(partial)}">'
            f'<span class="mnb-swatch" data-display="{display}" data-part="{escape(part)}">'
            f"{_fill(first)}{_letter(_display(first))}</span>"
            f'partly restored <b class="mnb-count">{len(partial):,}</b></span>'
        )
    if edited is not None:
        display = escape(_display(edited))
        items.append(
            f'<span class="mnb-key" data-edit="true">'
            f'<span class="mnb-swatch" data-display="{display}" data-edit="true">'
            f"{_letter(_display(edited))}</span>first change</span>"
        )
    return f'<div class="mnb-legend">{"".join(items)}{image_key}</div>'


def _edit_html(edit: Block | None) -> str:
    if not edit:
        return ""
    position = int(edit.get("position", 0))
    before, after = edit.get("before") or "", edit.get("after") or ""
    block = escape(edit.get("block", ""))
    return (
        f'<div class="mnb-edit" data-position="{position}" data-block="{block}">'
        f'<span class="mnb-edit-label">first change at token {position:,} (block {block})</span> '
        f'<span class="mnb-edit-words">…<span class="mnb-before">{escape(before)}</span>'
        f'<span class="mnb-caret" aria-label="changed here">▍</span>'
        f'<span class="mnb-after">{escape(after)}</span>…</span> '
        f'<span class="mnb-edit-note">blocks from here on were recomputed</span></div>'
    )


def _block_attrs(block: Block, edit: Block | None, part: str | None) -> str:
    """The attributes a strip cell and a map row share: index, display, reason, edit,
    restored tokens, part and images."""
    i = int(block["index"])
    edited = ' data-edit="true"' if edit and edit.get("block") == i else ""
    part_attr = f' data-part="{escape(part)}"' if part else ""
    return (
        f'data-index="{i}" data-display="{escape(_display(block))}" '
        f'data-reason="{escape(block.get("reason", ""))}"{edited} '
        f'data-restored="{token_split(block)[0]}"{part_attr}{_image_attr(block)}'
    )


def _cell(i: int, block: Block | None, edit: Block | None, before: Block | None, images) -> str:
    if block is None:
        return (
            f'<div class="mnb-block" data-index="{i}" data-display="pending" data-reason="" '
            f'title="block {i} · pending"></div>'
        )
    part = _part(block, before)
    return (
        f'<div class="mnb-block" {_block_attrs(block, edit, part)} '
        f'title="{escape(_tip(block, edit, images))}">'
        f"{_fill(block) if part else ''}{_letter(_display(block))}</div>"
    )


def _cells(n: int, known: Mapping[int, Block], edit: Block | None, images: Images) -> str:
    dense = " mnb-dense" if n > DENSE_BLOCKS else ""
    cells = "".join(_cell(i, known.get(i), edit, known.get(i - 1), images) for i in range(n))
    return f'<div class="mnb-cells{dense}">{cells}</div>'


def _sizes(n: int, block_size: int, prompt_tokens: int) -> str:
    """ "6 blocks of 16 tokens · 85 prompt tokens"."""
    words = plural(n, "block")
    if block_size:
        words += f" of {block_size:,} tokens"
    if prompt_tokens:
        words += f" · {plural(prompt_tokens, 'prompt token')}"
    return words


def strip_html(
    blocks: Sequence[Block],
    *,
    n_blocks: int = 0,
    block_size: int = 0,
    prompt_tokens: int = 0,
    edit: Block | None = None,
    show_edit: bool = True,
    images: Images = (),
    live: bool = False,
) -> str:
    """The block strip: one ``div.mnb-block`` cell per block, a legend.

    The edited block's cell is always marked; `show_edit` False leaves out the edit's
    banner (its words), for a strip that a block map, which shows it, follows. An image
    block's cell has ``data-image`` and a mark, and names its `images` on hover. `live`
    leaves out the ``<style>`` block (a widget has its CSS).
    """
    known = by_index(blocks)
    partial = [(b, p) for i, b in sorted(known.items()) if (p := _part(b, known.get(i - 1)))]
    n = max(n_blocks, max(known, default=-1) + 1)
    edited = known.get(int(edit["block"])) if edit and "block" in edit else None
    legend = _legend(display_counts(blocks, n), partial, _image_key(blocks), edited=edited)
    return (
        f'{"" if live else style()}<div class="mnb-root mnb-strip" data-n-blocks="{n}">'
        f"{_cells(n, known, edit, images)}"
        f'<div class="mnb-foot">{legend}'
        f'<span class="mnb-caption">{_sizes(n, block_size, prompt_tokens)}</span></div>'
        f"{_edit_html(edit) if show_edit else ''}</div>"
    )


# The answer buttons' words, and what the Copy button says once it has copied.
STOP_LABEL, STOP_TITLE = "Stop", "stop this answer; what it wrote so far stays"
COPY_LABEL, COPY_TITLE, COPIED = "Copy", "copy the answer as the model wrote it", "Copied"


def controls_html(*, stop: bool, copy: bool) -> str:
    """The live strip's answer buttons: Stop while the answer runs, Copy once it has text
    ("" for neither)."""
    buttons = []
    if stop:
        buttons.append(
            f'<button type="button" class="mnb-button" data-action="stop" '
            f'title="{STOP_TITLE}">{STOP_LABEL}</button>'
        )
    if copy:
        buttons.append(
            f'<button type="button" class="mnb-button" data-action="copy" '
            f'data-done="{COPIED}" title="{COPY_TITLE}">{COPY_LABEL}</button>'
        )
    return f'<div class="mnb-controls">{"".join(buttons)}</div>' if buttons else ""


# --- the block map --------------------------------------------------------------------------


def _records_html(block: Block, layer_kinds: Sequence[str]) -> str:
    records = [str(r) for r in block.get("records") or ()]
    if block.get("source") != "disk":
        # Computed blocks make all their records; a hot restore reads none.
        return '<span class="mnb-dim">—</span>'
    chips = []
    for kind in list(layer_kinds) or records:
        read = kind in records
        name = escape(kind)
        chips.append(
            f'<span class="mnb-rec" data-record="{name}" data-read="{str(read).lower()}" '
            f'title="{name} records {"read" if read else "not needed"}">{name}</span>'
        )
    return "".join(chips)


def _text_cell(block: Block, images: Images) -> str:
    head, last = block.get("head") or "", block.get("last") or ""
    text = _image_chips(block, images)
    text += f'<q class="mnb-head">{escape(head)}</q>' if head else ""
    if last:
        # A no-break space: a wrapped row breaks after the ellipsis, never before it.
        text += f'\u00a0<span class="mnb-dim">…</span> <q class="mnb-last">{escape(last)}</q>'
    return text


@dataclass(frozen=True)
class _MapFacts:
    """What every row of one map needs."""

    edit: Block | None
    layer_kinds: list[str]  # each once, in order (`record_kinds`)
    images: Images
    live: bool
    opens_at: int | None  # the row a tall live map opens at: its first computed block

    @classmethod
    def of(cls, blocks: Sequence[Block], edit, layer_kinds, images, live) -> _MapFacts:
        first = next((int(b["index"]) for b in blocks if b.get("source") == "computed"), None)
        tall = live and len(blocks) > TALL_ROWS
        return cls(edit, record_kinds(layer_kinds), images, live, first if tall else None)


def _row(block: Block, before: Block | None, facts: _MapFacts) -> str:
    start, end = int(block.get("start", 0)), int(block.get("end", 0))
    part = _part(block, before)
    # A partly restored block's source says how its tokens split.
    source = _split_words(block) if part else escape(block.get("source", ""))
    # Live rows are the way in to the details panel, by keyboard as well.
    live = ' tabindex="0"' if facts.live else ""
    opens = ' data-open="true"' if int(block["index"]) == facts.opens_at else ""
    return (
        f'<tr class="mnb-block" {_block_attrs(block, facts.edit, part)}{live}{opens}>'
        f'<td class="mnb-num">{int(block["index"])}</td>'
        f'<td class="mnb-num mnb-range">{start:,}–{end:,}</td>'
        f'<td class="mnb-text">{_text_cell(block, facts.images)}</td>'
        f'<td class="mnb-source">{_swatch(block, part)} {source}</td>'
        f'<td class="mnb-reason">{escape(reason_phrase(block, facts.edit))}</td>'
        f'<td class="mnb-num">{seconds(float(block.get("seconds") or 0.0))}</td>'
        f'<td class="mnb-records">{_records_html(block, facts.layer_kinds)}</td></tr>'
    )


def map_html(
    blocks: Sequence[Block],
    *,
    block_size: int = 0,
    prompt_tokens: int = 0,
    edit: Block | None = None,
    layer_kinds: Sequence[str] = (),
    images: Images = (),
    live: bool = False,
) -> str:
    """The block map: its title, the edit, one row per block.

    No strip of cells: the answer's strip is drawn just above the map. `layer_kinds` are
    the model's record kinds, one per layer or each once. An image block's row has
    ``data-image`` and, before its words, a mark per image (named by `images` on hover).
    `live` adds the details panel and, above `TALL_ROWS` rows, the tall box
    (``data-tall``) and the row it opens at (``data-open``), and leaves out the style.
    """
    blocks = sorted(blocks, key=lambda b: int(b["index"]))
    facts = _MapFacts.of(blocks, edit, layer_kinds, images, live)
    head = f"Block map · {_sizes(len(blocks), block_size, prompt_tokens)}"
    if facts.layer_kinds:
        head += " · layer kinds: " + " + ".join(escape(k) for k in facts.layer_kinds)
    known = by_index(blocks)
    rows = "".join(_row(b, known.get(int(b["index"]) - 1), facts) for b in blocks)
    tall = ' data-tall="true"' if live and len(blocks) > TALL_ROWS else ""
    table = (
        f'<div class="mnb-scroll"{tall}><table class="mnb-table"><thead><tr>'
        '<th class="mnb-num">block</th><th class="mnb-num">tokens</th><th>text</th>'
        '<th>source</th><th>reason</th><th class="mnb-num">time</th><th>records</th>'
        f"</tr></thead><tbody>{rows}</tbody></table></div>"
    )
    panel = _default_details(known, edit, facts.layer_kinds, images) if live else ""
    return (
        f'{"" if live else style()}<div class="mnb-root mnb-map" data-n-blocks="{len(blocks)}">'
        f'<div class="mnb-title">{head}</div>{_edit_html(edit)}{panel}'
        f"{table}</div>"
    )


# --- the details panel ----------------------------------------------------------------------


def _records_words(block: Block, layer_kinds: Sequence[str], part: str | None) -> str:
    """What a block's records were: read, not needed, reused or made now."""
    read = [str(r) for r in block.get("records") or ()]
    restored, computed = token_split(block)
    if block.get("source") == "disk":
        kinds = list(layer_kinds) or read
        return ", ".join(f"{k} {'read' if k in read else 'not needed'}" for k in kinds)
    if block.get("source") == "memory":
        return "none read: the live cache was reused"
    if part == "memory":
        return (
            f"the live cache's first {plural(restored, 'token')} reused, "
            f"the other {computed:,} made now"
        )
    if part:
        return (
            f"read for the first {plural(restored, 'token')}, made now for the other {computed:,}"
        )
    return "all made now"


def _details_items(block: Block, edit, layer_kinds, part, images) -> list[tuple[str, str]]:
    # Pairs per row (the list is laid out in two columns): range and time, source and
    # reason, first and last words, then the records and images.
    restored, computed = token_split(block)
    length = restored + computed
    count = f"{length:,} tokens: {_split_words(block)}" if part else plural(length, "token")
    items = [
        ("tokens", f"{int(block.get('start', 0)):,}–{int(block.get('end', 0)):,} ({count})"),
        ("time", seconds(float(block.get("seconds") or 0.0))),
        ("source", str(block.get("source") or "")),
        ("reason", reason_phrase(block, edit) or "—"),
        ("first words", block.get("head") or "—"),
        ("last words", block.get("last") or "—"),
    ]
    if layer_kinds or block.get("records"):
        items.append(("records", _records_words(block, layer_kinds, part)))
    if image_ids(block):
        items.append(("images", _image_tip(block, images)))
    return items


def _details(block: Block | None, before: Block | None, edit, layer_kinds, images) -> str:
    """The details panel (the element itself) showing `block`."""
    if block is None:
        hint = "Hover or click a block to see where it came from."
        return (
            f'<div class="mnb-details" aria-live="polite"><span class="mnb-dim">{hint}</span></div>'
        )
    part = _part(block, before)
    items = _details_items(block, edit, layer_kinds, part, images)
    terms = "".join(f"<dt>{escape(t)}</dt><dd>{escape(v)}</dd>" for t, v in items)
    ids = image_ids(block)
    # An image block's thumbnails sit on the panel's right: room for them.
    shown = min(len(ids), MAX_PANEL_IMAGES)
    room = f' data-image="{" ".join(map(str, ids))}" data-images="{shown}"'
    thumbs = "".join(_thumb(i, images) for i in ids)
    if thumbs:
        thumbs = f'<div class="mnb-details-images">{thumbs}</div>'
    return (
        f'<div class="mnb-details" aria-live="polite"{room if ids else ""}>'
        f'<div class="mnb-details-title">{_swatch(block, part)} block {int(block["index"])}</div>'
        f"<dl>{terms}</dl>{thumbs}</div>"
    )


def map_details(
    blocks: Sequence[Block],
    *,
    edit: Block | None = None,
    layer_kinds: Sequence[str] = (),
    images: Images = (),
) -> dict[str, str]:
    """The live map's details panel per block index (a string), and under ``""`` what it
    shows with no block hovered or chosen: the edited block, else a hint."""
    kinds = record_kinds(layer_kinds)
    known = by_index(blocks)
    out = {str(i): _details(b, known.get(i - 1), edit, kinds, images) for i, b in known.items()}
    out[""] = _default_details(known, edit, kinds, images)
    return out


def _default_details(known: Mapping[int, Block], edit, kinds, images) -> str:
    """The panel with no block hovered or chosen: the edited block, else a hint."""
    index = int(edit["block"]) if edit and edit.get("block") is not None else None
    block = known.get(index) if index is not None else None
    before = known.get(index - 1) if index is not None else None
    return _details(block, before, edit, kinds, images)
