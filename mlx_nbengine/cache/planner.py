"""Restore planning: the longest prefix of a prompt that the store can rebuild.

A *chain* is the list of block keys of a prompt (`block_keys`). Restoring ``n`` blocks
(*boundary* ``b = n*B``) *needs* the records each of the model's kinds reads there
(`kinds.LayerKind.restore_blocks`: every block's ``"kv"``, the ``"window"`` records of the
blocks overlapping ``[b - W, b)`` for the largest window ``W``, block ``n-1``'s
``"state"``). The *plan* is the largest ``n`` whose needed records all exist, with
``b <= len(tokens) - 1`` (the last prompt token is always computed: its logits start
generation) and, for models whose images attend both ways, ``b`` not inside an image.

*Cut* (``plan(..., to_token=True)``): block ``n`` of the prompt may share its first ``k``
tokens with a stored *follower* of block ``n-1`` (a block, whole or partial, stored after
the same prefix; the `FollowerIndex` knows their tokens, so no blob is read to choose).
The follower sharing the most, where every kind can be cut there (`LayerKind.cuts_at`)
and whose records are held, gives its first ``k`` tokens too, up to ``p = b + k`` (at most
the prompt's last token but one; into block 0 only past half a block or every prompt
token but the last, as for the hot cache). `load` checks that its records serve the cut
(`LayerKind.check_cut`) and reads on to the next follower when not. Without a cut the
plan says why (`RestorePlan.kept_boundary`, a `types.KeptBoundary`): ``"state"``
(recurrent layers resume only where a state was taken: the whole length of a partial
follower the prompt holds entirely), ``"window"`` (the followers' window records do not
reach back to ``max(b, p - W)``: blocks decoded one token at a time keep only their last
``W`` tokens), ``"block"`` (whole blocks were asked for), ``"evicted"`` (the follower's
records are gone).

`PrefixCache` ties keys, records, the `BlockStore`, the planner and assembly together
for one model. It is not thread-safe: the engine calls it on its cache-I/O thread only
(plan, load, assemble in the same job, save, touch).

*Facts*: for the blocks a request computes, `PrefixCache.block_facts` says what the
store knows of each (`types.BlockFacts`), so the engine can say why a block was computed.

*Checks*: every record read back is checked before it is served, and a bad one makes the
plan fall back (`reader`).

*Recency*: the store evicts the least recently touched record first. Touching a chain
puts, oldest first, the records not needed at its boundary (earlier boundaries' state
checkpoints, window slices that fell out of the window), then the needed records from the
last block back to the first; so other prompts evict suffixes before prefixes, and a
prefix shared by many prompts stays longest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from mlx_nbengine.cache.blocks import block_keys, match_ids
from mlx_nbengine.cache.followers import ROOT, FollowerIndex
from mlx_nbengine.cache.kinds import LayerKind, assemble, layer_kinds, layer_windows
from mlx_nbengine.cache.reader import RecordReader
from mlx_nbengine.cache.records import (
    Record,
    RecordKey,
    RecordKind,
    Signature,
    record_to_bytes,
)
from mlx_nbengine.cache.types import BlockFacts, Cut, RestorePlan
from mlx_nbengine.models.vision import ImageSpan

__all__ = ["PrefixCache", "prefill_steps"]


def prefill_steps(start: int, end: int, *, block_size: int, max_step: int) -> list[tuple[int, int]]:
    """Split prefill of tokens ``[start, end)`` into model calls that end on block boundaries.

    `start` must be a boundary. Every step but the last spans a multiple of
    `block_size` tokens (the largest not above `max_step`, at least one block);
    the last ends at `end`, and no step crosses the last boundary before `end`.
    Every step end is a boundary (or `end`), where the state checkpoint of the
    block before it can be taken; with ``max_step == block_size`` every
    boundary gets one.
    """
    if start % block_size:
        raise ValueError(f"prefill must start on a block boundary, got {start}")
    if end < start:
        raise ValueError(f"empty or negative range {start}..{end}")
    step = max(block_size, max_step // block_size * block_size)
    last_boundary = end // block_size * block_size
    steps = []
    pos = start
    while pos < end:
        # Whole-block steps up to the last boundary, then one partial step to `end`.
        nxt = min(pos + step, last_boundary) if pos < last_boundary else end
        steps.append((pos, nxt))
        pos = nxt
    return steps


def _cuttable(
    candidates: list[tuple[str, int, int]], kinds: Sequence[LayerKind], *, block_size: int
) -> tuple[list[tuple[str, int]], str | None]:
    """The ``(key, tokens)`` of the candidate cuts ``(key, tokens, follower length)`` every
    kind can make, and the first kind that refused one."""
    cuttable, refused_by = [], None
    for key, k, length in candidates:
        refusing = [
            kind.name
            for kind in kinds
            if not kind.cuts_at(k, follower_length=length, block_size=block_size)
        ]
        if refusing:
            refused_by = refused_by or refusing[0]
        else:
            cuttable.append((key, k))
    return cuttable, refused_by


class PrefixCache:
    """Keys, records, store, planner and assembly for one model (see the module docstring)."""

    def __init__(
        self,
        *,
        fingerprint: str,
        layer_kinds: Sequence[RecordKind],
        windows: Sequence[int | None],
        block_size: int = 256,
        store: Any,
        layer_classes: Sequence[str] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if len(windows) != len(layer_kinds):
            raise ValueError("windows needs one entry per layer")
        if layer_classes is not None and len(layer_classes) != len(layer_kinds):
            raise ValueError("layer_classes needs one entry per layer")
        self.fingerprint = fingerprint
        self.layer_kinds = list(layer_kinds)
        self.windows = list(windows)
        self.layer_classes = list(layer_classes) if layer_classes is not None else None
        self.block_size = block_size
        self.store = store
        self.reader = RecordReader(
            store=store,
            block_size=block_size,
            layer_kinds=self.layer_kinds,
            windows=self.windows,
            layer_classes=self.layer_classes,
        )
        present = [w for w, k in zip(self.windows, self.layer_kinds, strict=True) if k == "window"]
        if any(w is None or w <= 0 for w in present):
            raise ValueError("every window layer needs a positive window size")
        self.model_kinds = self.reader.model_kinds  # in record order; their names; widest
        self.kinds = self.reader.kinds
        self.max_window = self.reader.max_window
        self.followers = FollowerIndex()
        # Unrelated prompts share their first tokens: BOS, a chat template's header (some
        # 30 tokens with a default system message), often a system prompt. So a stored
        # first block counts as the same prompt edited only when it shares half a block.
        self.root_min_shared = max(1, block_size // 2)
        # What stops a cut inside a block (None: every layer can be cut to the token).
        self.uncuttable_kind: str | None = next(
            (k.name for k in self.model_kinds if not k.cuts_inside_blocks), None
        )
        # A window narrower than a block forgets a partial block's first tokens while the
        # request decodes: the engine takes the prompt's partial block where prefill ends.
        self.window_narrower_than_block = 0 < min(present, default=0) < block_size

    @classmethod
    def for_cache(
        cls, template_cache: list, *, fingerprint: str, store: Any, block_size: int = 256
    ) -> PrefixCache:
        """A PrefixCache for the layer layout of `template_cache` (a fresh model cache)."""
        return cls(
            fingerprint=fingerprint,
            layer_kinds=layer_kinds(template_cache),
            windows=layer_windows(template_cache),
            block_size=block_size,
            store=store,
            layer_classes=[type(c).__name__ for c in template_cache],
        )

    # --- keys and plans ----------------------------------------------------------------------

    def keys(self, tokens: Sequence[int], images: Iterable[ImageSpan] = ()) -> list[str]:
        return block_keys(
            tokens, fingerprint=self.fingerprint, block_size=self.block_size, images=images
        )

    def needed(self, keys: Sequence[str], n_blocks: int) -> list[RecordKey]:
        """`RecordReader.needed`: the records restoring the first `n_blocks` blocks needs."""
        return self.reader.needed(keys, n_blocks)

    def plan(
        self,
        tokens: Sequence[int],
        images: Iterable[ImageSpan] = (),
        *,
        bidirectional_images: bool = False,
        to_token: bool = False,
    ) -> RestorePlan:
        """The longest restorable prefix of `tokens` given what the store holds now.

        Whole blocks, then with `to_token` a cut into the next block where one can be
        made (see the module docstring); without it, a plan that could have cut says
        ``kept_boundary="block"``.
        """
        images = tuple(images)
        keys = tuple(self.keys(tokens, images))
        limit = min(len(keys), max(0, len(tokens) - 1) // self.block_size)
        allowed = tuple(
            not (bidirectional_images and any(s.cuts(n * self.block_size) for s in images))
            for n in range(limit + 1)
        )
        plan = self._plan(keys, limit=limit, allowed=allowed)
        return self._with_cut(
            plan,
            match_ids(tokens, images),
            to_token=to_token,
            inside_image=lambda p: bidirectional_images and any(s.cuts(p) for s in images),
        )

    def _plan(self, keys: tuple[str, ...], *, limit: int, allowed: tuple[bool, ...]) -> RestorePlan:
        has = self.store.has
        # kv slices must form an unbroken prefix, so only n up to the first gap qualify.
        top = limit
        if "kv" in self.kinds:
            top = next((j for j in range(limit) if not has(keys[j], "kv")), limit)
        n = 0
        for cand in range(top, 0, -1):
            if allowed[cand] and all(has(k, kind) for k, kind in self.needed(keys, cand)):
                n = cand
                break
        return RestorePlan(
            keys=keys,
            n_blocks=n,
            block_size=self.block_size,
            needed=tuple(self.needed(keys, n)),
            limit=limit,
            allowed=allowed,
        )

    def _with_cut(
        self,
        plan: RestorePlan,
        tokens: Sequence[int],
        *,
        to_token: bool,
        inside_image: Callable[[int], bool],
    ) -> RestorePlan:
        """`plan` with the best cut into its next block (of `followers`, see the module
        docstring), or the reason it keeps the boundary."""
        B, n = self.block_size, plan.n_blocks
        start = n * B
        room = min(B - 1, len(tokens) - 1 - start)  # the last prompt token is computed
        if room <= 0:
            return plan
        own = tokens[start : start + B]
        # Into block 0 only past what unrelated prompts share (the hot cache's rule).
        least = min(self.root_min_shared, len(own) - 1) if n == 0 else 1
        parent = plan.keys[n - 1] if n else ROOT
        candidates = [
            (key, min(shared, room), length)
            for key, shared, length in self.followers.ranked(parent, own)
            if shared >= least and not inside_image(start + min(shared, room))
        ]
        if not candidates:
            return plan
        if not to_token:
            return replace(plan, kept_boundary="block")
        cuttable, refused_by = _cuttable(candidates, self.model_kinds, block_size=B)
        if not cuttable:
            return replace(plan, kept_boundary=refused_by)
        # Every held one, best first: `load` reads on past one that cannot serve the cut.
        cuts = tuple(
            Cut(
                block=n,
                key=key,
                tokens=k,
                needed=tuple(RecordKey(key, kind) for kind in self.kinds),
            )
            for key, k in cuttable
            if all(self.store.has(key, kind) for kind in self.kinds)
        )
        if not cuts:
            return replace(plan, kept_boundary="evicted")
        return replace(plan, cut=cuts[0], spare_cuts=cuts[1:])

    def block_facts(
        self,
        tokens: Sequence[int],
        keys: Sequence[str],
        *,
        first: int = 0,
        images: Iterable[ImageSpan] = (),
    ) -> list[BlockFacts]:
        """The `BlockFacts` of prompt blocks `first` .. last (the partial tail included).

        `keys` are the prompt's whole-block keys (`RestorePlan.keys`), `images` its spans.
        """
        ids = match_ids(tokens, images)
        B = self.block_size
        own = self.kinds[0] if self.kinds else None
        has = self.store.has
        chain = own is not None and all(has(k, own) for k in keys[:first])
        out = []
        for j in range(first, -(-len(ids) // B)):
            start, end = j * B, min((j + 1) * B, len(ids))
            key = keys[j] if j < len(keys) else None
            held = key is not None and own is not None and has(key, own)
            chain = chain and held
            seen = key is not None and (held or key in self.followers)
            restorable = held and all(has(k, kind) for k, kind in self.needed(keys, j + 1))
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
                    diverges_at=self.followers.diverges_at(
                        parent, ids[start:end], start, root_min=self.root_min_shared
                    ),
                )
            )
        return out

    # --- load, assemble ----------------------------------------------------------------------

    def load(
        self, plan: RestorePlan, *, mapped: bool = False
    ) -> tuple[RestorePlan, dict[int, dict[RecordKind, Record]]]:
        """Read and decode the plan's records (their arrays: `HostArray` views of the bytes
        read, see `records`).

        With `mapped` the views are of the scratch file's own pages where the store maps
        them (`BlockStore.get_buffer`): no copy at all, but they are valid only until the
        store's next change, so the caller must assemble before anything else uses the
        store (the engine's cache-I/O thread does it in the same job).

        A record that is gone or does not decode is deleted from the store and
        the plan falls back to the longest shorter chain still complete (or to
        nothing). Returns the plan actually served and its records by block.
        On success the chain is touched (see `touch`). The plan's cut is read too and
        served under block ``n_blocks``: the first of it and its spares whose records
        serve it; else the plan keeps the boundary, ``kept_boundary="evicted"`` (a record
        gone or damaged: deleted) or ``"window"`` (window records that do not reach back).
        """
        cut, spare_cuts, n_wanted = plan.cut, plan.spare_cuts, plan.n_blocks
        reading = self.reader.reading(
            [*plan.needed, *(cut.needed if cut is not None else ())], mapped=mapped
        )
        plan, by_block = reading.chain(plan, replan=self._plan)
        if plan.n_blocks:
            self.touch(plan.keys[: plan.n_blocks])
        if cut is not None and plan.n_blocks == n_wanted:
            read = reading.cut((cut, *spare_cuts))
            if read.cut is None:
                plan = replace(plan, cut=None, spare_cuts=(), kept_boundary=read.kept_boundary)
            else:
                plan = replace(plan, cut=read.cut, spare_cuts=())
                by_block[read.cut.block] = read.records
        return plan, by_block

    def assemble(self, records_by_block: dict[int, dict[RecordKind, Record]], **how: Any) -> list:
        """Fill a fresh model cache with restored blocks: `assembly.assemble` (`n_blocks`,
        `template_cache`, `cut_tokens`) at this cache's block size."""
        return assemble(records_by_block, block_size=self.block_size, **how)

    # --- store -------------------------------------------------------------------------------

    def save(
        self,
        key: str,
        records: dict[RecordKind, Record],
        *,
        parent: str | None = None,
        tokens: Sequence[int] | None = None,
    ) -> bool:
        """Store one block's records under its key; False when any was not stored.

        Records already held are kept as they are (equal keys mean equal prefixes).
        Every record given is merged into its kind's signature (`signatures`), which
        `load` holds the records it reads to.
        With `parent` (the previous block's key, `ROOT` for block 0) and the block's
        `tokens` (`blocks.match_ids` where it overlaps images), a block now held is added
        to `followers`; so is one saved with no records at all (a partial block of an
        engine restoring whole blocks: its tokens still tell where a later prompt is
        edited). Call `touch` with the chain afterwards so the recency order is right.
        """
        ok = True
        self.learn(records)
        for kind, rec in records.items():
            if self.store.has(key, kind):
                continue
            ok = self.store.put(key, kind, record_to_bytes(rec)) and ok
        if parent is not None and tokens is not None:
            if not records or any(self.store.has(key, kind) for kind in records):
                self.followers.add(key, parent, tokens)
        return ok

    def learn(self, records: dict[RecordKind, Record]) -> None:
        """`RecordReader.learn` (the engine also learns from a one-token probe at load)."""
        self.reader.learn(records)

    @property
    def signatures(self) -> dict[RecordKind, Signature]:
        """Per kind, the shapes and dtypes records read back must have (see `reader`)."""
        return self.reader.signatures

    def touch(self, keys: Sequence[str]) -> None:
        """`RecordReader.touch`: mark chain `keys` as just used, suffix-first."""
        self.reader.touch(keys)
