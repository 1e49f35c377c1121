"""The hot cache: the layer caches of the last sequence that finished, kept in memory.

A later prompt sharing its start is restored from it (source ``memory``) when the shared
prefix covers a whole block or every prompt token but the last (a shared BOS alone is no
restore), and the cache can be cut back to that prefix: it is used as is when its tokens
are a prefix of the prompt, trimmed only when every layer is trimmable (a sliding window
that has rotated, or a recurrent state, is never trimmed). Owned by the generation thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_nbengine.cache.blocks import match_ids
from mlx_nbengine.cache.followers import common_prefix


@dataclass
class HotCache:
    """A finished sequence's cache, exactly the tokens it holds and the spans of the
    images among them."""

    tokens: list[int]
    cache: list[Any]
    images: tuple[Any, ...] = ()
    match: Any = field(init=False, repr=False)  # compared with every new prompt

    def __post_init__(self) -> None:
        self.match = match_ids(self.tokens, self.images)

    def servable_tokens(
        self, prompt: Any, *, block_size: int, bidirectional: tuple[Any, ...] = ()
    ) -> int:
        """How many leading prompt tokens this cache can serve (0 if it is not worth it).

        `prompt` is the prompt's `match_ids` (images told apart); `bidirectional` the
        prompt's image spans that must not be cut (models whose images attend both ways).
        """
        limit = min(len(self.tokens), len(prompt) - 1)
        n = common_prefix(self.match[:limit], prompt[:limit])
        for span in bidirectional:
            if span.cuts(n):
                n = span.start
        if n < block_size and n < len(prompt) - 1:
            return 0
        if n == len(self.tokens):
            return n
        trimmable = all(hasattr(c, "trim") and c.is_trimmable() for c in self.cache)
        return n if trimmable else 0

    def take(self, n: int) -> list[Any]:
        """The cache cut back to `n` tokens (consumes the hot cache)."""
        excess = len(self.tokens) - n
        if excess:
            for c in self.cache:
                c.trim(excess)
        return self.cache
