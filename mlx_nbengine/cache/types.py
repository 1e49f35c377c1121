"""The cache's shared types: what a restore plans, what a cut reads, what the store knows.

A *plan* (`RestorePlan`) restores a prompt's first whole blocks, then maybe a *cut*
(`Cut`): the first tokens of the next block, from a stored *follower* of the block before
it. When a follower shared tokens but no cut is made, the plan says why
(`KeptBoundary`). A reading of a cut's records gives a `CutRead`. `BlockFacts` say what
the store knows of a block a request computes. The planner (`planner`), the reader
(`reader`) and the engine share these; this module imports nothing of the package but
`records`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mlx_nbengine.cache.records import Record, RecordKey, RecordKind

__all__ = ["BlockFacts", "Cut", "CutRead", "KeptBoundary", "RestorePlan"]

KeptBoundary = Literal["state", "window", "block", "evicted"]
"""Why a restore kept to a block boundary although a stored follower shared more tokens."""


@dataclass(frozen=True)
class Cut:
    """Restore the first `tokens` tokens of prompt block `block` from follower `key`,
    reading its `needed` records (see `planner`)."""

    block: int
    key: str
    tokens: int
    needed: tuple[RecordKey, ...]


@dataclass(frozen=True)
class RestorePlan:
    """What to restore for one prompt.

    ``keys`` are the keys of all whole blocks of the prompt (restored or not; the
    engine stores computed blocks under them); ``n_blocks`` whole blocks, i.e. the
    first ``boundary`` tokens, are restored, then ``cut`` (if any) restores the start of
    the next block: ``tokens`` in all. ``needed`` lists the ``(key, kind)`` records
    the chain takes, in block order. ``limit`` and ``allowed`` are the planner's
    constraints (at most ``limit`` blocks; boundaries where ``allowed[n]`` is
    false are never used), kept so `PrefixCache.load` can fall back to a shorter chain.
    ``kept_boundary`` says why there is no cut although a follower shared tokens (a
    `KeptBoundary`), else None. ``spare_cuts`` are the other held followers, best
    first, that `load` tries when the cut's records cannot serve it.
    """

    keys: tuple[str, ...]
    n_blocks: int
    block_size: int
    needed: tuple[RecordKey, ...]
    limit: int
    allowed: tuple[bool, ...] = field(repr=False)
    cut: Cut | None = None
    kept_boundary: KeptBoundary | None = None
    spare_cuts: tuple[Cut, ...] = field(default=(), repr=False)

    @property
    def boundary(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def tokens(self) -> int:
        return self.boundary + (self.cut.tokens if self.cut is not None else 0)


@dataclass(frozen=True)
class CutRead:
    """The cut a reading could serve and its records by kind; None and why it could not
    (``"evicted"`` or ``"window"``, see `reader.Reading.cut`)."""

    cut: Cut | None
    records: dict[RecordKind, Record]
    kept_boundary: KeptBoundary | None = None


@dataclass(frozen=True)
class BlockFacts:
    """What the store knows about prompt block `index` (tokens ``start:end``).

    ``seen``: this very block (same key) was stored once, whether or not it is still
    held; ``held``: its own records are held (its ``"kv"`` record, or for models without
    kv layers the first kind they have); ``chain_held``: so are those of every block
    before it; ``restorable``: every record that restoring the prompt up to the block's
    end needs is held; ``diverges_at``: the absolute position
    where the prompt leaves the closest stored follower of the previous block (None when
    the closest follower agrees with all the block's tokens or the prompt extends it, a
    stored partial block, or none was stored; for block 0 the follower must share at
    least half a block, `PrefixCache.root_min_shared`). A partial tail block has no key:
    it is never seen, held nor restorable. The engine names why each block was computed
    from these (`engine/reasons.py`).
    """

    index: int
    start: int
    end: int
    seen: bool = False
    held: bool = False
    chain_held: bool = False
    restorable: bool = False
    diverges_at: int | None = None
