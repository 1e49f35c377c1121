"""Test fakes built from the engine's real types: blocks and reports as the engine makes them.

`block_report` is a `BlockReport` (the stream's `BlockEvent`) with the fields the engine
fills for its source (a memory block is ``"hot"`` and restored whole, a disk block reads
its records and is restored whole, a computed block is ``"new"`` and restores nothing);
`block` is the widgets' block dict of one, through the notebook's own `block_dict`, with
its words given.
"""

from __future__ import annotations

from typing import Any

from mlx_nbengine.engine.events import disk_reason
from mlx_nbengine.engine.results import BlockReport, BlockSource
from mlx_nbengine.notebook.blockinfo import block_dict

BLOCK = 16  # the fakes' block size


def block_report(
    index: int,
    source: BlockSource = "disk",
    *,
    start: int | None = None,
    end: int | None = None,
    reason: str | None = None,
    records: tuple[str, ...] | None = None,
    restored: int | None = None,
    seconds: float = 0.004,
    edit_at: int | None = None,
    images: tuple[int, ...] = (),
    size: int = BLOCK,
) -> BlockReport:
    """Block `index` (tokens ``index * size`` on, unless `start`/`end` say) from `source`."""
    start = index * size if start is None else start
    end = start + size if end is None else end
    if records is None:
        records = ("kv",) if source == "disk" else ()
    if reason is None:
        reason = {"memory": "hot", "disk": disk_reason(records)}.get(source, "new")
    if restored is None:
        restored = end - start if source in ("memory", "disk") else 0
    return BlockReport(
        index=index, start=start, end=end, source=source, seconds=seconds, reason=reason,
        records=tuple(records), edit_at=edit_at, restored=restored, images=tuple(images),
    )  # fmt: skip


def block(
    index: int,
    source: BlockSource = "disk",
    *,
    display: str | None = None,
    head: str | None = None,
    last: str | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The block dict of `block_report(index, source, **fields)`, with words given (`head`,
    `last`: "first words 3", "last words 3" unless given). `display`, when given, must be
    the one `block_dict` finds (the tail's is ``"tail"`` by its reason)."""
    out = block_dict(block_report(index, source, **fields))
    assert display is None or out["display"] == display, (display, out["display"])
    out["head"] = f"first words {index}" if head is None else head
    out["last"] = f"last words {index}" if last is None else last
    return out
