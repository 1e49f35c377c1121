"""How the notebook face writes numbers and why a block came from where it did.

Terms:

- *reason phrase* (`reason_phrase`): a block's *reason* (``"hot"``, ``"kv+window"``,
  ``"edited"``... see `mlx_nbengine.engine.events`) in words. The phrases themselves are
  `events.REASONS`; a disk block's record kinds read as "read kv + window".
- *kept boundary* (`kept_boundary_phrase`): why a restore stopped at a block boundary
  short of a stored continuation (`events.KEPT_BOUNDARY`).
- *token split* (`token_split`): a block's (restored, computed) tokens; a *partly
  restored* block is a computed block whose first tokens were restored.

The phrases live in `events` only; the summary line, the static pictures and the live
widgets read them through this module (the widgets' ES module holds no words at all).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_nbengine.engine.events import KEPT_BOUNDARY, REASONS

__all__ = [
    "format_bytes",
    "kept_boundary_phrase",
    "partly_restored",
    "plural",
    "reason_phrase",
    "seconds",
    "token_split",
]


def format_bytes(n: int | float | None) -> str:
    """Human-readable byte count, binary units: 1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def seconds(s: float) -> str:
    """A duration: "4.0 ms", "1.25 s", "2 min 5 s"."""
    if s < 0.01:
        return f"{s * 1000:.1f} ms"
    if s < 59.995:
        return f"{s:.2f} s"
    minutes, rest = divmod(round(s), 60)
    return f"{minutes} min {rest} s"


def plural(n: int, word: str) -> str:
    """ "1 block", "1,024 blocks"."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def kept_boundary_phrase(kept: str) -> str:
    """Why a restore kept to a block boundary, in words (the name itself if unknown)."""
    return KEPT_BOUNDARY.get(kept, kept)


def token_split(block: Mapping[str, Any]) -> tuple[int, int]:
    """(restored, computed) tokens of a block dict: its ``restored``, as `block_dict` wrote
    it from the engine's one count (`BlockReport.split`), and the rest of its tokens."""
    length = int(block["end"]) - int(block["start"])
    restored = int(block["restored"])
    return restored, length - restored


def partly_restored(block: Mapping[str, Any] | None) -> int:
    """Tokens restored of a partly restored block; 0 for any other block."""
    if block is None or block.get("source") in ("memory", "disk"):
        return 0
    restored, computed = token_split(block)
    return restored if computed else 0


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
    elif reason in REASONS:
        phrase = REASONS[reason]
    elif block.get("source") == "disk" and reason:
        phrase = "read " + " + ".join(reason.split("+"))
    else:
        phrase = reason
    restored = partly_restored(block) if partly else 0
    if restored:
        first = "first token" if restored == 1 else f"first {restored:,} tokens"
        phrase = f"{phrase} ({first} restored)" if phrase else f"{first} restored"
    return phrase
