"""Followers: which stored blocks came after a given prefix, and what their tokens were.

A block's *parent* is the key of the block before it (`ROOT` for block 0); since a key
names its whole prefix, the blocks stored under one parent are every continuation of
that prefix the store has seen. They are that parent's *followers*. The
`FollowerIndex` remembers, per stored block key, its parent and its token ids, so that:

- a prompt block that is not in the store can be compared with its *siblings* (the
  followers of its own parent): the one sharing the longest common prefix tells where
  the prompt leaves what was stored before (an edit), and whose records can restore the
  prompt's unchanged tokens of that block (`ranked`: every follower with its shared
  length, best first, found from the token ids alone, without reading a blob);
- a key can be recognised as *stored once* after its records were evicted;
- an evicted block's tokens can still be shown (decoded by the caller).

A follower may be a *partial block* (fewer than `block_size` tokens: the tail of a
finished request, stored under its own key, see `blocks.partial_key`); its tokens say
how long it is. Entries outlive their records on purpose (an evicted block was still
seen); whoever wants to restore from a follower (token-exact restore of a partial block)
checks the store first. The index is bounded: at most `capacity` blocks, and `per_parent`
under one parent, the least recently added dropped first. Token ids are kept as packed
int64 bytes (8 bytes a token: `blocks.match_ids`, so images are told apart). Not
thread-safe: the engine uses it on its cache-I/O thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from mlx_nbengine.cache.blocks import token_ids

__all__ = ["ROOT", "FollowerIndex", "common_prefix"]

ROOT = "root"
"""The parent of block 0 (no block key is ever this string: keys are hex digests)."""


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many leading token ids `a` and `b` share."""
    x, y = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(x.size, y.size)
    differ = np.flatnonzero(x[:n] != y[:n])
    return int(differ[0]) if differ.size else n


class FollowerIndex:
    """Stored block keys by parent, with their token ids (see the module docstring)."""

    def __init__(self, *, capacity: int = 4096, per_parent: int = 64) -> None:
        if capacity < 1 or per_parent < 1:
            raise ValueError("capacity and per_parent must be at least 1")
        self.capacity = capacity
        self.per_parent = per_parent
        self._blocks: OrderedDict[str, tuple[str, bytes]] = OrderedDict()  # key -> (parent, ids)
        self._by_parent: dict[str, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        """Whether block `key` was stored once (and is still remembered)."""
        return key in self._blocks

    def add(self, key: str, parent: str, tokens: Sequence[int]) -> None:
        """Remember that block `key` (token ids `tokens`, as `blocks.match_ids` when it
        overlaps images) was stored after `parent`."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            self._by_parent[parent].move_to_end(key)
            return
        self._blocks[key] = (parent, np.asarray(tokens, dtype=np.int64).tobytes())
        siblings = self._by_parent.setdefault(parent, OrderedDict())
        siblings[key] = None
        if len(siblings) > self.per_parent:
            self._drop(next(iter(siblings)))
        if len(self._blocks) > self.capacity:
            self._drop(next(iter(self._blocks)))

    def _drop(self, key: str) -> None:
        parent, _ = self._blocks.pop(key)
        siblings = self._by_parent[parent]
        del siblings[key]
        if not siblings:
            del self._by_parent[parent]

    def tokens(self, key: str) -> list[int] | None:
        """The token ids of block `key`, None if it is not remembered."""
        entry = self._blocks.get(key)
        return None if entry is None else [int(t) for t in token_ids(_ids(entry[1]))]

    def followers(self, parent: str) -> list[str]:
        """Keys of the remembered blocks stored after `parent`, most recent first."""
        return list(reversed(self._by_parent.get(parent, ())))

    def diverges_at(
        self, parent: str, tokens: Sequence[int], start: int, *, root_min: int
    ) -> int | None:
        """Where the prompt's block `tokens` (from `start`) leaves the closest stored
        follower of `parent` (see `BlockFacts.diverges_at`); a first block (`parent` is
        `ROOT`) counts only when it shares at least `root_min` tokens."""
        ranked = self.ranked(parent, tokens)
        if not ranked:
            return None
        _, shared, length = ranked[0]
        # The prompt leaves the follower only where both go on and differ: a prompt block
        # that is a prefix of the follower, or one that extends a (partial) follower, does
        # not change anything stored.
        if shared >= min(len(tokens), length):
            return None
        if parent == ROOT and shared < root_min:
            return None
        return start + shared

    def ranked(self, parent: str, tokens: Sequence[int]) -> list[tuple[str, int, int]]:
        """Every follower of `parent` as ``(key, shared, length)``: the leading tokens it
        shares with `tokens` and its own token count; longest shared first, the most
        recent first on a tie."""
        ids = np.asarray(tokens, dtype=np.int64)
        out = []
        for key in self.followers(parent):
            stored = _ids(self._blocks[key][1])
            out.append((key, common_prefix(ids, stored), int(stored.size)))
        out.sort(key=lambda item: -item[1])  # stable: recency order kept on ties
        return out


def _ids(packed: bytes) -> np.ndarray:
    return np.frombuffer(packed, dtype=np.int64)
