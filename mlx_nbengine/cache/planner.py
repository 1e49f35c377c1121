"""Restore planning: the longest prefix of a prompt that the store can rebuild.

A *chain* is the list of block keys of a prompt (`block_keys`). Restoring ``n``
blocks (boundary ``b = n*B``) *needs*:

- the ``"kv"`` record of every block ``0..n-1`` (if the model has kv layers),
- the ``"window"`` records of the blocks overlapping ``[b - W, b)`` for the
  largest window ``W`` (if it has window layers),
- the ``"state"`` record of block ``n-1`` (if it has state layers).

The *plan* is the largest ``n`` whose needed records all exist, with
``b <= len(tokens) - 1`` (the last prompt token is always computed, since its
logits start generation) and, for models that attend bidirectionally within an
image, ``b`` not strictly inside an image's tokens.

*Cut* (token-exact restore, ``plan(..., to_token=True)``): past the plan's boundary
``b = n*B`` the prompt's block ``n`` may still share its first tokens with a stored
*follower* of block ``n-1`` (a block, whole or partial, stored after the same prefix:
the `FollowerIndex` knows their token ids, so no blob is read to choose). The follower
sharing the most tokens whose records are held gives the cut: its first ``k`` tokens
are restored too, up to ``p = b + k`` (at most the prompt's last token but one; into
block 0 only when ``k`` is half a block or every prompt token but the last, as for the
hot cache). A cut needs the follower's ``"kv"`` and ``"window"`` records (the chain's
window records already cover ``[p - W, b)``). Layers that cannot be cut keep the
boundary, and the plan says why (`RestorePlan.kept_boundary`, one of
`BOUNDARY_REASONS`): ``"state"`` (recurrent layers resume only at a stored
checkpoint: a model with them is cut only at the whole length of a partial follower
the prompt holds entirely, whose ``"state"`` record was taken at its end, e.g. where an
image ends or a finished request's cache ended), ``"window"`` (a sliding window
narrower than a block: a window record then lacks the block's first tokens),
``"block"`` (whole blocks were asked for), ``"evicted"`` (the follower's records are
gone).

`PrefixCache` ties keys, records, the `BlockStore`, the planner and assembly
together for one model. It is not thread-safe: the engine calls it from its
cache-I/O thread (plan/load/save/touch) and the generation thread (assemble).

*Facts*: for the blocks a request computes, `PrefixCache.block_facts` says what the
store knows of each (stored once? its own records held? restorable up to its end? where
does it leave the closest stored continuation of its prefix?), so the engine can say why
a block was computed. They rest on the `FollowerIndex` (`followers`), which `save` fills
when given a block's parent and tokens.

*Checks*: every record read back is checked before it is served (`records.check_record`):
its metadata must fit the block and the model's layer layout (the template's layer kinds,
classes and windows), its arrays must be those the metadata names with its token counts,
and each array must fit the model's cache. The expected shapes and dtypes are learned
from the records this process extracted itself: `save` merges each record it is given
into a per-kind signature (`records.record_signature`: kv/window arrays
``(1, heads, *, head_dim)`` and their dtype, state arrays as they were), and the engine
`learn`s from a one-token probe of the model when it loads, before any record is read
back (the template cache is empty, so it cannot tell; a persistent store holds records of
earlier processes). A kind nothing was saved of yet (a foreign blob under a key
before any save) is held to the first record of that kind the same `load` read, so a
chain never mixes shapes. A record that does not fit is a `RecordError`: deleted, and the
plan falls back (a miss, never an error).

*Recency*: the store evicts the least recently touched record first. Touching
a chain puts, oldest first, the records not needed at its boundary (earlier
boundaries' state checkpoints, window slices that fell out of the window),
then the needed records from the last block back to the first; so a flood of
other prompts evicts suffixes before prefixes, and a prefix shared by many
prompts stays longest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from mlx_nbengine.cache.assembly import assemble, window_blocks
from mlx_nbengine.cache.blocks import ImageSpan, block_keys, match_ids
from mlx_nbengine.cache.followers import ROOT, FollowerIndex
from mlx_nbengine.cache.records import (
    KINDS,
    Record,
    RecordError,
    RecordKind,
    Signature,
    check_record,
    layer_kinds,
    layer_windows,
    merge_signatures,
    record_from_buffer,
    record_signature,
    record_to_bytes,
)

__all__ = ["BOUNDARY_REASONS", "BlockFacts", "Cut", "PrefixCache", "RestorePlan", "prefill_steps"]

BOUNDARY_REASONS = ("state", "window", "block", "evicted")
"""Why a restore kept to a block boundary although a stored follower shared more tokens."""


@dataclass(frozen=True)
class Cut:
    """Restore the first `tokens` tokens of prompt block `block` from follower `key`,
    reading its `needed` records (see the module docstring)."""

    block: int
    key: str
    tokens: int
    needed: tuple[tuple[str, RecordKind], ...]


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
    ``kept_boundary`` says why there is no cut although a follower shared tokens (one of
    `BOUNDARY_REASONS`), else None.
    """

    keys: tuple[str, ...]
    n_blocks: int
    block_size: int
    needed: tuple[tuple[str, RecordKind], ...]
    limit: int
    allowed: tuple[bool, ...] = field(repr=False)
    cut: Cut | None = None
    kept_boundary: str | None = None

    @property
    def boundary(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def tokens(self) -> int:
        return self.boundary + (self.cut.tokens if self.cut is not None else 0)


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


class _Arena:
    """One buffer for every blob one `load` reads, handed out in slices: one allocation
    (huge pages where the system gives them) in place of one per blob, whose page faults
    cost more than the reads (36 MB of Gemma 3 270M records: 20 vs 31 ms on 2 cores). The
    records' arrays are views of it; it is freed with the last of them."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = np.empty(nbytes, dtype=np.uint8)
        self.used = 0

    def take(self, nbytes: int) -> np.ndarray | None:
        """The next `nbytes` bytes, or None when the buffer has no room left."""
        if self.used + nbytes > self.buffer.size:
            return None
        out = self.buffer[self.used : self.used + nbytes]
        self.used += nbytes
        return out


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
        # The class of each layer cache (None: not checked), and per kind the shapes and
        # dtypes of the records this process saved (see *Checks* in the module docstring).
        self.layer_classes = list(layer_classes) if layer_classes is not None else None
        self.signatures: dict[RecordKind, Signature] = {}
        self.block_size = block_size
        self.store = store
        self.kinds: tuple[RecordKind, ...] = tuple(k for k in KINDS if k in self.layer_kinds)
        present = [w for w, k in zip(self.windows, self.layer_kinds, strict=True) if k == "window"]
        if any(w is None or w <= 0 for w in present):
            raise ValueError("every window layer needs a positive window size")
        self.max_window = max(present, default=0)
        self.followers = FollowerIndex()
        # Unrelated prompts share their first tokens: BOS, a chat template's header (some
        # 30 tokens with a default system message), often a system prompt. So a stored
        # first block counts as the same prompt edited only when it shares half a block.
        self.root_min_shared = max(1, block_size // 2)
        # What stops a cut inside a block (None: every layer can be cut to the token).
        self.cut_blocker: str | None = None
        if "state" in self.kinds:
            self.cut_blocker = "state"
        elif any(w is not None and w < block_size for w in self.windows):
            self.cut_blocker = "window"

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

    def needed(self, keys: Sequence[str], n_blocks: int) -> list[tuple[str, RecordKind]]:
        """The records restoring the first `n_blocks` blocks of chain `keys` needs."""
        if n_blocks <= 0:
            return []
        out: list[tuple[str, RecordKind]] = []
        windowed = (
            set(window_blocks(n_blocks, window=self.max_window, block_size=self.block_size))
            if "window" in self.kinds
            else set()
        )
        for j in range(n_blocks):
            if "kv" in self.kinds:
                out.append((keys[j], "kv"))
            if j in windowed:
                out.append((keys[j], "window"))
        if "state" in self.kinds:
            out.append((keys[n_blocks - 1], "state"))
        return out

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

    def _with_cut(
        self,
        plan: RestorePlan,
        tokens: Sequence[int],
        *,
        to_token: bool,
        inside_image: Callable[[int], bool],
    ) -> RestorePlan:
        """`plan` with the best cut into its next block, or the reason it keeps the boundary."""
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
        why = None if to_token else "block"
        why = why or self.cut_blocker
        if why == "state":
            # A recurrent state resumes only where it was taken: the end of a partial
            # follower the prompt holds whole (an image's end, a finished request's end).
            exact = [c for c in candidates if c[1] == c[2] < B]
            if not exact:
                return replace(plan, kept_boundary="state")
            candidates, why = exact, None
        if why is not None:
            return replace(plan, kept_boundary=why)
        kinds = [k for k in KINDS if k in self.kinds]
        for key, k, _ in candidates:
            needed = tuple((key, kind) for kind in kinds)
            if all(self.store.has(*item) for item in needed):
                return replace(plan, cut=Cut(block=n, key=key, tokens=k, needed=needed))
        return replace(plan, kept_boundary="evicted")

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
        tokens = match_ids(tokens, images)
        B = self.block_size
        own = self.kinds[0] if self.kinds else None
        has = self.store.has
        chain = own is not None and all(has(k, own) for k in keys[:first])
        out = []
        for j in range(first, -(-len(tokens) // B)):
            start, end = j * B, min((j + 1) * B, len(tokens))
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
                    diverges_at=self._diverges_at(parent, tokens[start:end], start),
                )
            )
        return out

    def _diverges_at(self, parent: str, tokens: Sequence[int], start: int) -> int | None:
        ranked = self.followers.ranked(parent, tokens)
        if not ranked:
            return None
        _, shared, length = ranked[0]
        # The prompt leaves the follower only where both go on and differ: a prompt block
        # that is a prefix of the follower, or one that extends a (partial) follower, does
        # not change anything stored.
        if shared >= min(len(tokens), length):
            return None
        if parent == ROOT and shared < self.root_min_shared:
            return None
        return start + shared

    # --- load, assemble ----------------------------------------------------------------------

    def _check(
        self,
        rec: Record,
        block: int,
        kind: RecordKind,
        *,
        whole: bool = True,
        first_read: dict[RecordKind, Signature] | None = None,
    ) -> None:
        """Raise `RecordError` unless `rec` fits block `block`'s `kind` layers of this model
        (`whole`: a chain's whole block; else a cut's follower, whose first tokens serve).

        Arrays are held to the signature learned by `save`; for a kind with none yet, to
        the first record of that kind read into `first_read` (one `load`'s records)."""
        signature = self.signatures.get(kind)
        if signature is None and first_read is not None:
            signature = first_read.get(kind)
        check_record(
            rec,
            block=block,
            kind=kind,
            block_size=self.block_size,
            layer_kinds=self.layer_kinds,
            windows=self.windows,
            classes=self.layer_classes,
            whole=whole,
            signature=signature,
        )
        if signature is None and first_read is not None:
            first_read[kind] = record_signature(rec)

    def _read(
        self,
        key: str,
        block: int,
        kind: RecordKind,
        *,
        whole: bool = True,
        first_read: dict[RecordKind, Signature] | None = None,
        arena: _Arena | None = None,
        mapped: bool = False,
    ) -> Record:
        """Record `(key, kind)` decoded and checked; `RecordError` when gone or unfit. Its
        arrays are views of the bytes read (into `arena` when it has room), or of the
        store's file with `mapped` (see `load`)."""
        size = self.store.size(key, kind) if arena is not None else None
        into = arena.take(size) if arena is not None and size else None
        data = self.store.get_buffer(key, kind, into, mapped=mapped)
        if data is None:
            raise RecordError("record is gone")
        rec = record_from_buffer(data)
        self._check(rec, block, kind, whole=whole, first_read=first_read)
        return rec

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
        served under block ``n_blocks``; if one of its records is gone or damaged it is
        deleted and the plan keeps the boundary (``kept_boundary="evicted"``).
        """
        cut, n_wanted = plan.cut, plan.n_blocks
        loaded: dict[tuple[str, RecordKind], Record] = {}
        first_read: dict[RecordKind, Signature] = {}
        arena = None
        if not (mapped and self.store.mappable):
            items = [*plan.needed, *(cut.needed if cut is not None else ())]
            arena = _Arena(sum(self.store.size(key, kind) or 0 for key, kind in items))
        while plan.n_blocks > 0:
            bad = None
            for block, (key, kind) in self._blocks_of(plan):
                if (key, kind) in loaded:
                    continue
                try:
                    rec = self._read(
                        key, block, kind, first_read=first_read, arena=arena, mapped=mapped
                    )
                except RecordError:
                    bad = (key, kind)
                    break
                loaded[(key, kind)] = rec
            if bad is None:
                break
            self.store.delete(*bad)
            plan = self._plan(plan.keys, limit=plan.n_blocks, allowed=plan.allowed)
        by_block: dict[int, dict[RecordKind, Record]] = {}
        for block, (key, kind) in self._blocks_of(plan):
            by_block.setdefault(block, {})[kind] = loaded[(key, kind)]
        if plan.n_blocks:
            self.touch(plan.keys[: plan.n_blocks])
        if cut is not None and plan.n_blocks == n_wanted:
            records = self._load_cut(cut, first_read, arena, mapped)
            if records is None:
                plan = replace(plan, cut=None, kept_boundary="evicted")
            else:
                plan = replace(plan, cut=cut)
                by_block[cut.block] = records
        return plan, by_block

    def _load_cut(
        self,
        cut: Cut,
        first_read: dict[RecordKind, Signature] | None = None,
        arena: _Arena | None = None,
        mapped: bool = False,
    ) -> dict[RecordKind, Record] | None:
        """The cut's records, or None (a bad one deleted) when one is gone or damaged."""
        out: dict[RecordKind, Record] = {}
        for key, kind in cut.needed:
            try:
                rec = self._read(
                    key,
                    cut.block,
                    kind,
                    whole=False,
                    first_read=first_read,
                    arena=arena,
                    mapped=mapped,
                )
                p = cut.block * self.block_size + cut.tokens
                if kind == "state":
                    if any(m.get("offset") != p for m in rec.layers.values()):
                        raise RecordError("the follower's state was taken elsewhere")
                elif min(m["end"] for m in rec.layers.values()) < p:
                    raise RecordError("the follower is shorter than the cut")
            except RecordError:
                self.store.delete(key, kind)
                return None
            out[kind] = rec
        return out

    def _blocks_of(self, plan: RestorePlan) -> list[tuple[int, tuple[str, RecordKind]]]:
        index = {k: j for j, k in enumerate(plan.keys[: plan.n_blocks])}
        return [(index[key], (key, kind)) for key, kind in plan.needed]

    def assemble(
        self,
        records_by_block: dict[int, dict[RecordKind, Record]],
        *,
        n_blocks: int,
        template_cache: list,
        cut_tokens: int = 0,
    ) -> list:
        """Fill a fresh model cache with `n_blocks` restored blocks and `cut_tokens` of the
        next one (see `assembly.assemble`)."""
        return assemble(
            records_by_block,
            n_blocks=n_blocks,
            block_size=self.block_size,
            template_cache=template_cache,
            cut_tokens=cut_tokens,
        )

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
        to `followers`; so is one saved with no records at all (a partial block whose
        records a model that cannot be cut does not keep: its tokens still tell where a
        later prompt is edited). Call `touch` with the chain afterwards so the recency
        order is right.
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
        """Merge records this process extracted from the model itself into `signatures`
        (`save` does it for every record; the engine also learns from a one-token probe
        when the model loads, so records stored by an earlier process are checked too)."""
        for kind, rec in records.items():
            learned = self.signatures.get(kind)
            own = record_signature(rec)
            self.signatures[kind] = own if learned is None else merge_signatures(learned, own)

    def touch(self, keys: Sequence[str]) -> None:
        """Mark chain `keys` (a prompt's first blocks) as just used, suffix-first.

        Oldest first: records not needed to restore the whole chain (state
        checkpoints of earlier boundaries, window slices outside the final
        window), then the needed ones from the last block to the first.
        """
        n = len(keys)
        needed = self.needed(keys, n)
        needed_set = set(needed)
        others = [
            (keys[j], kind)
            for j in range(n - 1, -1, -1)
            for kind in self.kinds
            if (keys[j], kind) not in needed_set
        ]
        order = [item for item in others if self.store.has(*item)]
        order += [item for item in reversed(needed) if self.store.has(*item)]
        if order:
            self.store.touch(order)
