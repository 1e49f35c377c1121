"""The decode batch: sequences that generate one token per step, together.

A *layer cache list* is what mlx-lm models take as ``cache=``: one cache object per
layer. A single sequence uses plain caches (`KVCache`, `RotatingKVCache`,
`ArraysCache`); several sequences use the batched forms mlx-lm builds with
``merge`` (`BatchKVCache`, `BatchRotatingKVCache`, a batched `ArraysCache`), which
left-pad shorter sequences. `DecodeBatch` keeps this invariant: with one member its
caches are plain (a request alone runs unbatched, at single-sequence speed and with
single-sequence numerics); with several they are batched, row ``i`` belonging to
member ``i``. Joining merges (or extends; members prefilled together join as a group
with their batched caches), leaving filters (or extracts back to plain caches when one
member is left). Owned by the generation thread.

*Pending tokens*: the decode steps are pipelined (see `decoding`), so the batch may
hold the sampled tokens of a step whose graph is built and running but whose values
were not read yet (`pending`, row ``i`` = member ``i``); its caches then already include
that step. Leaving members drop their pending rows; a member joins only when nothing
is pending.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def merge_caches(singles: list[list[Any]]) -> list[Any]:
    """Batched layer caches from single-sequence ones (row i = singles[i])."""
    return [layer[0].merge(list(layer)) for layer in zip(*singles, strict=True)]


def owned_copy(cache: list[Any]) -> list[Any]:
    """Make `cache`'s arrays own their buffers (copies of views), evaluated; returns it."""
    # `mx.contiguous` of an evaluated slice smaller than its buffer copies it; an array
    # that already owns its whole buffer is shared as is, at no cost.
    for c in cache:
        for name in ("keys", "values"):
            x = getattr(c, name, None)
            if isinstance(x, mx.array):
                setattr(c, name, mx.contiguous(x))
        arrays = getattr(c, "cache", None)
        if isinstance(arrays, list):
            c.cache = [mx.contiguous(x) if isinstance(x, mx.array) else x for x in arrays]
    mx.eval([c.state for c in cache])
    return cache


class DecodeBatch:
    """Members decoding together and their layer caches (see the module docstring)."""

    def __init__(self) -> None:
        self.members: list[Any] = []
        self.caches: list[Any] | None = None
        self.pending: Any = None  # lazy tokens (mx.array) or a sampling.HostDraw

    def __len__(self) -> int:
        return len(self.members)

    @property
    def batched(self) -> bool:
        return len(self.members) > 1

    def add(self, member: Any, cache: list[Any]) -> None:
        """Let `member` join with its single-sequence `cache` (consumed)."""
        assert self.pending is None, "settle the step in flight before a member joins"
        if not self.members:
            self.caches = cache
        elif len(self.members) == 1:
            self.caches = merge_caches([self.caches, cache])
        else:
            for batched, single in zip(self.caches, cache, strict=True):
                batched.extend(single.merge([single]))
        self.members.append(member)

    def add_group(self, members: list[Any], caches: list[Any]) -> None:
        """Let several `members` join at once with their batched `caches` (row i = member i).

        `caches` are batched layer caches (``merge`` of the members' single ones, then
        prefilled together); they are consumed.
        """
        assert self.pending is None, "settle the step in flight before members join"
        assert len(members) > 1, "a lone member joins with `add`"
        if not self.members:
            self.caches = caches
        else:
            if len(self.members) == 1:
                self.caches = merge_caches([self.caches])
            for batched, group in zip(self.caches, caches, strict=True):
                batched.extend(group)
        self.members.extend(members)

    def single_cache(self, index: int) -> list[Any]:
        """A single-sequence copy of member `index`'s caches (the caches themselves if alone).

        The copy is evaluated and owns its buffers: mlx-lm's ``extract`` returns lazy
        copies (whose graphs hold the batched arrays) or plain slices (views that share
        the batched buffers), and either would keep every member's rows in RAM for as
        long as the copy lives, e.g. as the hot cache after the whole batch has ended.
        """
        if not self.batched:
            return self.caches
        return owned_copy([c.extract(index) for c in self.caches])

    def remove(self, indices: list[int]) -> None:
        """Drop the members at `indices`; the rest keep their rows (or go back to plain)."""
        drop = set(indices)
        keep = [i for i in range(len(self.members)) if i not in drop]
        if not keep:
            self.members, self.caches, self.pending = [], None, None
            return
        if self.pending is not None and len(keep) < len(self.members):
            self.pending = self.pending[mx.array(keep)]
        if len(keep) == 1:
            self.caches = [c.extract(keep[0]) for c in self.caches] if self.batched else self.caches
        elif len(keep) < len(self.members):
            for c in self.caches:
                c.filter(keep)
        self.members = [self.members[i] for i in keep]

    def clear(self) -> None:
        self.members, self.caches, self.pending = [], None, None

    def forward(self, model, tokens: list[int] | mx.array) -> mx.array:
        """One decode step: feed ``tokens[i]`` to member i; return last logits (B, vocab).

        `tokens` may be the (lazy) sampled tokens of the previous step: no round trip
        through Python.
        """
        if not isinstance(tokens, mx.array):
            tokens = mx.array(tokens, dtype=mx.uint32)
        return model(tokens[:, None], cache=self.caches)[:, -1, :]
