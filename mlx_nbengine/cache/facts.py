"""Block facts: what the store knows of each prompt block a request computes.

For a block the plan does not restore: was this very block (its key) stored once (*seen*)?
Are its own records still *held* (its ``"kv"`` record, or the first kind a model without
kv layers has), and those of every block before it (*chain held*)? Is everything a
restore up to its end needs held (*restorable*)? Where does the prompt leave the closest
stored continuation of its prefix (*diverges at*, from the `FollowerIndex`)? The engine
names why each block was computed from these (`engine/reasons.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mlx_nbengine.cache.followers import ROOT

if TYPE_CHECKING:  # the planner imports this module
    from mlx_nbengine.cache.planner import PrefixCache

__all__ = ["BlockFacts", "block_facts"]


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
    it is never seen, held nor restorable.
    """

    index: int
    start: int
    end: int
    seen: bool = False
    held: bool = False
    chain_held: bool = False
    restorable: bool = False
    diverges_at: int | None = None


def block_facts(
    prefix: PrefixCache, tokens: np.ndarray, keys: Sequence[str], *, first: int = 0
) -> list[BlockFacts]:
    """The `BlockFacts` of prompt blocks `first` .. last (the partial tail included);
    `tokens` are the prompt's `blocks.match_ids`, `keys` its whole-block keys."""
    B = prefix.block_size
    own = prefix.kinds[0] if prefix.kinds else None
    has = prefix.store.has
    chain = own is not None and all(has(k, own) for k in keys[:first])
    out = []
    for j in range(first, -(-len(tokens) // B)):
        start, end = j * B, min((j + 1) * B, len(tokens))
        key = keys[j] if j < len(keys) else None
        held = key is not None and own is not None and has(key, own)
        chain = chain and held
        seen = key is not None and (held or key in prefix.followers)
        restorable = held and all(has(k, kind) for k, kind in prefix.needed(keys, j + 1))
        parent = keys[j - 1] if j > 0 else ROOT
        out.append(
            BlockFacts(
                index=j,
                start=start,
                end=end,
                seen=seen,
                held=held,
                chain_held=chain,
                restorable=restorable,
                diverges_at=_diverges_at(prefix, parent, tokens[start:end], start),
            )
        )
    return out


def _diverges_at(prefix: PrefixCache, parent: str, tokens: np.ndarray, start: int) -> int | None:
    ranked = prefix.followers.ranked(parent, tokens)
    if not ranked:
        return None
    _, shared, length = ranked[0]
    # The prompt leaves the follower only where both go on and differ: a prompt block
    # that is a prefix of the follower, or one that extends a (partial) follower, does
    # not change anything stored.
    if shared >= min(len(tokens), length):
        return None
    if parent == ROOT and shared < prefix.root_min_shared:
        return None
    return start + shared
