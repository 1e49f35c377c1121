"""Checkpoints: what the generation thread sends to the block store, and restores it asks for.

A *checkpoint* is one block's records (`cache.extract_block_records`), taken when a
sequence's cache reaches the block's end: after a prefill step (*block* checkpoints),
after the decode step that feeds a block's last generated token (*decode* checkpoints,
from a single-sequence copy of a batched member's rows), and when a sequence finishes
(the *partial block*: the tokens after its cache's last boundary, with records only where
cuts are made). Models with recurrent layers also end a prefill step at each image's end
on a token-exact engine and store a partial block there (an *image-end checkpoint*, with
the state taken there). Records are evaluated here and queued on the cache-I/O thread
(`cacheio`), which stores them under the block's key and touches the chain.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from mlx_nbengine.cache import ROOT, RecordError, block_keys, extract_block_records, partial_key
from mlx_nbengine.cache.blocks import match_ids
from mlx_nbengine.engine.cacheio import CacheIO
from mlx_nbengine.engine.sequence import Sequence


class Checkpoints:
    """The engine's link to its block store (see the module docstring)."""

    def __init__(
        self,
        io: CacheIO,
        *,
        fingerprint: str,
        block_size: int,
        to_token: bool,
        uncuttable_kind: str | None,
        recurrent: bool,
        store_off: bool,
        vision: bool,
        bidirectional: bool,
    ) -> None:
        self._io = io
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.to_token = to_token  # else "block": whole blocks from disk only
        self.recurrent = recurrent  # a state checkpoint is due at every boundary
        self.store_off = store_off  # a store with a zero budget
        self.bidirectional = bidirectional
        # Partial blocks keep records where cuts can use them: every model (recurrent
        # states are cut only at a partial block's end, where its state record was taken).
        self.partial_records = to_token and uncuttable_kind in (None, "state")
        self.image_ends = vision and to_token and uncuttable_kind == "state"
        # A window narrower than a block forgets a partial block's first tokens while the
        # request decodes: the prompt's partial block is stored where its prefill ends.
        self.prompt_partials = to_token and io.prefix.window_narrower_than_block

    def keys(self, tokens: list[int], images: tuple[Any, ...] = ()) -> list[str]:
        return block_keys(
            tokens, fingerprint=self.fingerprint, block_size=self.block_size, images=images
        )

    def restore(self, seq: Sequence, *, other_source_tokens: int, make_cache: Any) -> Future:
        """Ask the cache-I/O thread for `seq`'s prefix (a `cacheio.RestoreResult`)."""
        return self._io.restore(
            seq.prompt,
            other_source_tokens=other_source_tokens,
            make_cache=make_cache,
            to_token=self.to_token,
            images=seq.images,
            bidirectional_images=self.bidirectional,
        )

    def after_prefill(self, seq: Sequence, start: int, end: int) -> None:
        """Store the blocks prefill step ``start:end`` of `seq` completed, its image-end
        checkpoint when the step ends where an image does, and the prompt's partial block
        where its prefill ends (`prompt_partials`)."""
        bs = self.block_size
        if seq.prompt_keys is not None:
            done = range(start // bs, end // bs)  # the blocks whose end lies in (start, end]
            for block in done:
                chain = seq.prompt_keys[: block + 1] if block == done[-1] else None
                states = seq.step_states.get((block + 1) * bs)  # a boundary inside the step
                self._save_block(
                    seq.prompt_keys, seq.prompt_match, seq.cache, block, chain=chain, states=states
                )
            seq.step_states = {}
        if self.image_ends and end % bs and any(s.end == end for s in seq.images):
            self.partial(seq.prompt[:end], seq.cache, images=seq.images)
        if self.prompt_partials and end % bs and end >= len(seq.prompt) - 1:
            self.partial(seq.prompt[:end], seq.cache, images=seq.images)

    def after_decode(self, seq: Sequence, cache: list[Any]) -> None:
        """Store the block a decode step just completed in `seq`'s `cache` (its own)."""
        block = len(seq.cache_tokens) // self.block_size - 1
        chain = self.keys(seq.cache_tokens, seq.images)
        match = seq.match(seq.cache_tokens)
        self._save_block(chain, match, cache, block, chain=chain[: block + 1])

    def _save_block(
        self,
        keys: list[str],
        tokens: Any,
        cache: list[Any],
        block: int,
        *,
        chain: Any,
        states: dict[int, Any] | None = None,
    ) -> None:
        """Send block `block` of `tokens` (chain `keys`; `match_ids` where images are) from
        `cache` to the store, its recurrent layers' `states` taken at its end inside a step
        where given; `chain` (when given) is touched after."""
        bs = self.block_size
        records = extract_block_records(cache, block=block, block_size=bs, states=states)
        if records:
            self._io.save(
                keys[block],
                records,
                chain=chain,
                parent=keys[block - 1] if block else ROOT,
                tokens=list(tokens[block * bs : (block + 1) * bs]),
            )

    def partial(self, tokens: list[int], cache: list[Any], *, images: tuple[Any, ...] = ()) -> None:
        """Store the partial last block of `cache`, which holds `tokens`: its records
        where cuts are made (`partial_records`), else only its tokens, so a later edit
        there is still reported."""
        bs, n = self.block_size, len(tokens)
        if n % bs == 0:
            return
        block = n // bs
        records: dict[str, Any] = {}
        if self.partial_records:
            try:
                records = extract_block_records(cache, block=block, block_size=bs, end=n)
            except RecordError:
                return  # a cache no longer holding the block's start: a future miss, no error
        if self.bidirectional and any(s.cuts(n) for s in images):
            return  # its end lies inside an image: never a restore point
        keys = self.keys(tokens[: block * bs], images)
        key = partial_key(tokens, fingerprint=self.fingerprint, block_size=bs, images=images)
        # Touching the chain after it leaves the partial block older than every block of
        # its chain: the suffix evicts first.
        self._io.save(
            key,
            records,
            parent=keys[-1] if keys else ROOT,
            tokens=match_ids(tokens, images)[block * bs :],
            chain=keys or None,
        )
