"""What a `%%llm` cell shows around its answer: the answer view, the block strip under it,
the block map after it (``--blocks``) and the store's one-time saving warning.

No IPython here: every function shows through a session `Output` (`notebook.session`).
Where the widgets cannot load (anywidget or their files missing) the cell shows text only.
"""

from __future__ import annotations

import math
from typing import Any

from mlx_nbengine.notebook.answerview import AnswerView, TerminalView
from mlx_nbengine.notebook.blockinfo import block_dicts, edit_dict, image_dicts, image_spans
from mlx_nbengine.notebook.stripfeed import StripFeed

__all__ = ["answer_view", "image_thumbs", "show_block_map", "strip_feed", "warn_saving", "widgets"]


def widgets() -> Any:
    """The widgets module, or None where it cannot load (then the magics show text only)."""
    try:
        from mlx_nbengine.notebook import widgets as module
    except (ImportError, OSError):  # anywidget missing, or the widgets' files
        return None
    return module


def decoder(engine: Any) -> Any:
    """The loaded model's ``decode`` (token ids -> text), for block words; None without one."""
    tokenizer = getattr(getattr(engine, "model", None), "tokenizer", None)
    decode = getattr(tokenizer, "decode", None)
    return decode if callable(decode) else None


def special_ids(engine: Any) -> frozenset[int]:
    """The tokenizer's special token ids (``<bos>``...), left out of block words."""
    tokenizer = getattr(getattr(engine, "model", None), "tokenizer", None)
    ids = getattr(tokenizer, "all_special_ids", None)
    return frozenset(int(t) for t in ids) if ids else frozenset()


def image_thumbs(images: list[Any]) -> list[dict]:
    """The widgets' image dicts (64-px thumbnails); [] where they cannot be drawn."""
    if widgets() is None:
        return []
    return image_dicts(images)


def answer_view(args: Any, engine: Any, request: Any, thumbs: list[dict], out: Any) -> Any:
    """The answer's view (widgets in a front end, text in a terminal), shown."""
    if out.live:
        view = AnswerView(
            title=args.chat or "",
            markdown=args.markdown,
            strip=strip_feed(engine, request, show_edit=not args.blocks, images=thumbs),
        )
    else:
        view = TerminalView(title=args.chat or "")
    if view.strip is not None and not args.bg:
        # The main thread follows this answer: the front end's Stop interrupts the kernel.
        view.strip.stoppable("interrupt", request.cancel)
    view.show()
    return view


def strip_feed(
    engine: Any, request: Any, *, show_edit: bool, images: list[dict] | None = None
) -> StripFeed | None:
    """The block strip for `request`, all its blocks pending; None without widgets.
    With `show_edit` false (a block map follows, with its own) it marks no edit banner;
    `images` are the request's image dicts (`blockinfo.image_dicts`)."""
    block_size = getattr(engine, "block_size", None)
    tokens = getattr(request, "prompt_tokens", None)
    module = widgets()
    if module is None or not isinstance(block_size, int) or tokens is None:
        return None
    strip = module.BlockStrip(
        n_blocks=math.ceil(len(tokens) / block_size),
        block_size=block_size,
        prompt_tokens=len(tokens),
        show_edit=show_edit,
        images=list(images or []),
    )
    return StripFeed(
        strip,
        tokens=tokens,
        decode=decoder(engine),
        special=special_ids(engine),
        block_size=block_size,
    )


def show_block_map(
    engine: Any,
    completion: Any,
    layer_kinds: list[str],
    *,
    images: list[dict] | None = None,
    out: Any,
) -> None:
    """`--blocks`: every prompt block of `completion`, its words, source and reason
    (and, with `images`, which blocks hold which image)."""
    module = widgets()
    if module is None:
        return
    report, tokens = completion.report, completion.prompt_tokens
    block_size = int(getattr(engine, "block_size", 0) or 0)
    decode, special = decoder(engine), special_ids(engine)
    edit_at = getattr(report, "edit_at", None)
    block_map = module.BlockMap(
        blocks=block_dicts(
            report.blocks, decode=decode, tokens=tokens, special=special, spans=image_spans(report)
        ),
        edit=(
            None
            if edit_at is None
            else edit_dict(edit_at, tokens, decode=decode, block_size=block_size, special=special)
        ),
        block_size=block_size,
        prompt_tokens=len(tokens),
        layer_kinds=layer_kinds,
        images=list(images or []),
    )
    if out.live:
        out.show(block_map)
    else:
        out.line(block_map.text())


def warn_saving(engine: Any, out: Any) -> None:
    """Once, in the first cell to finish after saving to the store turned off: say so."""
    warning = getattr(engine, "store_warning", None)
    line = warning() if callable(warning) else None
    if isinstance(line, str) and line:
        out.line(f"warning: {line}")
