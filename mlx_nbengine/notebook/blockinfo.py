"""Block dicts: what the widgets draw for each prompt block, as JSON-ready dicts.

The engine describes each prompt block with a `BlockReport` (the stream's `BlockEvent` is
the same class, and the finished report keeps it). The widgets get
plain dicts instead, so that they sync to the browser, save with the notebook and render
to static HTML without the engine at hand.

Terms:

- *block dict* (`block_dict`): ``{"index", "start", "end", "source", "display", "reason",
  "records", "restored", "seconds", "head", "last"}``. `source` is where the block's
  cache came from (``"memory"``, ``"disk"``, ``"computed"``). `display` is what the strip
  colours: the source, except ``"tail"`` for the computed block that holds the prompt's
  last token (its logits start the answer, so it is always computed). `reason` says why
  (see `mlx_nbengine.engine.events`); `records` are the record kinds read for it
  (``"kv"``, ``"window"``, ``"state"``). `restored` is how many of its tokens were
  restored: all of them for a memory or disk block, none for a computed one, except the
  *partly restored* block, a computed block whose first tokens were restored (a
  token-exact restore ended inside it, at an edit or before the tail). `head` and `last`
  are the first and last words of the block's text (``""`` when no tokenizer is at
  hand); an image's run of tokens reads as one *picture label* there,
  ``[picture 1: 1,024 image tokens]``, never as its placeholder tokens. `images` are the
  0-based indices of the request's images whose tokens overlap the block (``[]`` for a
  text block, and from engines without images).
- *special tokens* (`special`): token ids the caller marks special (a tokenizer's
  ``all_special_ids``: ``<bos>``, ``<|im_start|>``...). They are dropped before decoding,
  so the words shown are the prompt's text, never its chat template's markers, whatever
  `decode` keeps.
- *image dict* (`image_dicts`): ``{"index", "name", "width", "height", "src"}`` per
  image of a request: its name (file or variable), original size and a small PNG
  thumbnail as a ``data:`` URI, for the widgets' marks on image blocks.
- *edit dict* (`edit_dict`): ``{"position", "block", "before", "after"}``: the first
  prompt token that differs from the stored continuation, the block holding it, and the
  words just before and from it.

Blocks are the engine's own `BlockReport`s (`mlx_nbengine.engine.results`): their fields,
and their one rule for the tail and for the restored count, are read as they are, with no
guess for engines of other versions.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from mlx_nbengine.engine.results import BlockReport

__all__ = [
    "block_dict",
    "block_dicts",
    "edit_dict",
    "first_words",
    "image_dicts",
    "image_spans",
    "last_words",
    "picture_label",
    "report_edit",
]

Decode = Callable[[list[int]], str]

# Words shown at each end of a block: enough to recognise the passage, short enough for a row.
WORDS = 4
# Tokens decoded on each side of an edit: a few words' worth at any tokenizer's granularity.
EDIT_TOKENS = 12
# A "word" longer than this (code, URLs, text without spaces) is cut with an ellipsis.
MAX_WORD = 24


def _clean(text: str) -> str:
    # Decoding a slice may split a multi-byte character; its halves decode to U+FFFD.
    return text.strip("\ufffd")


def _cut(word: str, *, from_end: bool = False) -> str:
    if len(word) <= MAX_WORD:
        return word
    return "…" + word[-MAX_WORD:] if from_end else word[:MAX_WORD] + "…"


def first_words(text: str, n: int = WORDS) -> str:
    """The first `n` whitespace-separated words of `text`, joined by single spaces."""
    words = _clean(text).split()[:n]
    if len(words) == 1:
        return _cut(words[0])
    return " ".join(words)


def last_words(text: str, n: int = WORDS) -> str:
    """The last `n` whitespace-separated words of `text`, joined by single spaces."""
    words = _clean(text).split()[-n:] if n else []
    if len(words) == 1:
        return _cut(words[0], from_end=True)
    return " ".join(words)


def _decode(
    decode: Decode | None,
    tokens: Sequence[int] | None,
    start: int,
    end: int,
    special: frozenset[int] = frozenset(),
) -> str:
    if decode is None or tokens is None or start >= end:
        return ""
    ids = [int(t) for t in tokens[start:end] if int(t) not in special]
    if not ids:
        return ""
    try:
        return decode(ids)
    except Exception:  # noqa: BLE001 - a label must never break the answer it labels
        return ""


def picture_label(index: int, n_tokens: int) -> str:
    """How a block's words show the run of image `index` (0-based): "[picture 1: 64 image
    tokens]"."""
    return f"[picture {index + 1}: {n_tokens:,} image token{'' if n_tokens == 1 else 's'}]"


# A word of a block's text; `whole` for a picture label (never split or cut).
Word = tuple[str, bool]


def _words(
    decode: Decode | None,
    tokens: Sequence[int] | None,
    start: int,
    end: int,
    special: frozenset[int],
    spans: Sequence[tuple[int, int]],
) -> list[Word]:
    """The words of tokens ``start:end``, each image's run (`spans`) as its picture label."""
    if decode is None or tokens is None:
        return []
    runs = sorted((s, e, i) for i, (s, e) in enumerate(spans) if s < end and e > start)
    words: list[Word] = []
    pos = start
    for s, e, i in runs:
        words += [(w, False) for w in _clean(_decode(decode, tokens, pos, s, special)).split()]
        words.append((picture_label(i, e - s), True))
        pos = max(pos, e)
    words += [(w, False) for w in _clean(_decode(decode, tokens, pos, end, special)).split()]
    return words


def _join(words: list[Word], *, from_end: bool = False) -> str:
    if len(words) == 1 and not words[0][1]:
        return _cut(words[0][0], from_end=from_end)
    return " ".join(w for w, _ in words)


def _head_last(words: list[Word]) -> tuple[str, str]:
    if len(words) <= 2 * WORDS:
        # Short block: its head shows all of it, so the last words would repeat it.
        half = (len(words) + 1) // 2
        return _join(words[:half]), _join(words[half:], from_end=True)
    return _join(words[:WORDS]), _join(words[-WORDS:], from_end=True)


def block_dict(
    block: BlockReport,
    *,
    decode: Decode | None = None,
    tokens: Sequence[int] | None = None,
    special: Collection[int] = frozenset(),
    spans: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """The block dict of an engine `BlockReport` (a `BlockEvent` is one).

    `tokens` are the prompt's token ids and `decode` turns ids into text (the tokenizer's
    ``decode``); with both, `head`/`last` hold the block's first and last words (without
    the `special` token ids; the tokens of image *i*, ``spans[i]`` = (start, end), as its
    picture label). `display` and `restored` follow the engine's one rule for each
    (`BlockReport.is_tail`, `BlockReport.split`).
    """
    start, end = int(block.start), int(block.end)
    restored, _ = block.split()
    display = "tail" if block.is_tail(None if tokens is None else len(tokens)) else block.source
    head, last = _head_last(_words(decode, tokens, start, end, frozenset(special), spans))
    return {
        "index": int(block.index),
        "start": start,
        "end": end,
        "source": str(block.source),
        "display": display,
        "reason": str(block.reason),
        "records": [str(r) for r in block.records],
        "restored": restored,
        "seconds": float(block.seconds),
        "head": head,
        "last": last,
        "images": sorted({int(i) for i in block.images}),
    }


def block_dicts(
    blocks: Iterable[BlockReport],
    *,
    decode: Decode | None = None,
    tokens: Sequence[int] | None = None,
    special: Collection[int] = frozenset(),
    spans: Sequence[tuple[int, int]] = (),
) -> list[dict[str, Any]]:
    """`block_dict` of each block (e.g. ``report.blocks``), in index order."""
    special = frozenset(special)
    out = [
        block_dict(b, decode=decode, tokens=tokens, special=special, spans=spans) for b in blocks
    ]
    return sorted(out, key=lambda b: b["index"])


def image_spans(report: Any) -> list[tuple[int, int]]:
    """(start, end) of each image's tokens in a finished report (its `images` spans)."""
    return [(int(s.start), int(s.end)) for s in getattr(report, "images", None) or ()]


# Longest side of the thumbnails the widgets show on an image block.
THUMB_SIDE = 64


def thumbnail_uri(image: Any, *, max_side: int = THUMB_SIDE) -> str:
    """A ``data:image/png;base64,...`` URI of `image` (a PIL image) scaled to `max_side`."""
    # Lazy: only thumbnails need the models package.
    from mlx_nbengine.models.images import thumbnail_png

    data = base64.b64encode(thumbnail_png(image, max_side=max_side)).decode("ascii")
    return f"data:image/png;base64,{data}"


def image_dicts(images: Iterable[Any], *, max_side: int = THUMB_SIDE) -> list[dict[str, Any]]:
    """The image dicts of a request's `images` (each with `name` and a PIL `image`, as
    `mlx_nbengine.notebook.prompting.ImageInput`), in order."""
    out = []
    for index, item in enumerate(images):
        width, height = item.image.size
        out.append(
            {
                "index": index,
                "name": str(item.name),
                "width": int(width),
                "height": int(height),
                "src": thumbnail_uri(item.image, max_side=max_side),
            }
        )
    return out


def edit_dict(
    position: int,
    tokens: Sequence[int],
    *,
    decode: Decode | None,
    block_size: int,
    special: Collection[int] = frozenset(),
) -> dict[str, Any]:
    """The edit dict for a prompt whose first changed token is at `position`.

    `before` is the last words before the change, `after` the first words from it on
    (both ``""`` without `decode`; `special` token ids are left out of both).
    """
    position = int(position)
    special = frozenset(special)
    before = _decode(decode, tokens, max(0, position - EDIT_TOKENS), position, special)
    after = _decode(decode, tokens, position, min(len(tokens), position + EDIT_TOKENS), special)
    return {
        "position": position,
        "block": position // max(1, int(block_size)),
        "before": last_words(before, WORDS + 1),
        "after": first_words(after, WORDS + 1),
    }


def report_edit(
    report: Any,
    tokens: Sequence[int],
    *,
    decode: Decode | None,
    block_size: int,
    special: Collection[int] = frozenset(),
) -> dict[str, Any] | None:
    """The edit dict of a finished report (its `edit_at`), or None when nothing changed."""
    position = getattr(report, "edit_at", None)
    if position is None:
        return None
    return edit_dict(position, tokens, decode=decode, block_size=block_size, special=special)
