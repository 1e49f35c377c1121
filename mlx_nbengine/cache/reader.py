"""Reading records back from the store for one restore, each checked before it is served.

A *reading* is one `PrefixCache.load`. The blobs it reads go into one *arena* (a buffer
handed out in slices: one allocation instead of one per blob, whose page faults cost more
than the reads) or, *mapped*, stay in the scratch file's own pages; the records' arrays
are views of those bytes (`records.record_from_buffer`).

Every record is checked (`kinds.check_record`) against the model's layer layout and its
kind's *signature*: the shapes and dtypes of the records this process extracted itself
(`RecordReader.learn`; the engine also learns from a one-token probe at load, before any
record is read back). For a kind nothing was learned of yet, the first record of that
kind the same reading read stands in (its *first read*), so a chain never mixes shapes.
A record that is gone or does not fit is a `RecordError`: deleted, and the chain falls
back to a shorter one, or the cut to the boundary (a miss, never an error).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlx_nbengine.cache.kinds import KINDS, CutOutOfReach, LayerKind, check_record, kind_named
from mlx_nbengine.cache.records import (
    Record,
    RecordError,
    RecordKey,
    RecordKind,
    Signature,
    merge_signatures,
    record_from_buffer,
)
from mlx_nbengine.cache.types import Cut, CutRead, KeptBoundary, RestorePlan

__all__ = ["Arena", "Reading", "RecordReader"]

RecordsByBlock = dict[int, dict[RecordKind, Record]]


class Arena:
    """One buffer for every blob a reading reads, handed out in slices. The records' arrays
    are views of it; it is freed with the last of them.

    Where the system can (Linux: ``MAP_POPULATE``), the buffer is an anonymous mapping whose
    pages all come in the one call that maps it, and which leaves RSS at once when freed. A
    NumPy array instead (what other systems get) is marked for huge pages, and the reads
    that fault them in took 50-160 ms to read a 5,503-token restore's 24 MB of records from
    the page cache, against 11-12 ms into a populated mapping (Intel Xeon, 2 cores)."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = _populated(nbytes)
        self.used = 0

    def take(self, nbytes: int) -> np.ndarray | None:
        """The next `nbytes` bytes, or None when the buffer has no room left."""
        if self.used + nbytes > self.buffer.size:
            return None
        out = self.buffer[self.used : self.used + nbytes]
        self.used += nbytes
        return out


def _populated(nbytes: int) -> np.ndarray:
    """`nbytes` of uint8, their pages present (see `Arena`)."""
    flags = getattr(mmap, "MAP_POPULATE", None)
    if flags is None or nbytes == 0:
        return np.empty(nbytes, dtype=np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return np.frombuffer(mapping, dtype=np.uint8)  # the array holds the mapping


class RecordReader:
    """Reads and checks records of one model's layout (see the module docstring)."""

    def __init__(
        self,
        *,
        store: Any,
        block_size: int,
        layer_kinds: list[RecordKind],
        windows: list[int | None],
        layer_classes: list[str] | None,
    ) -> None:
        self.store = store
        self.block_size = block_size
        self.layer_kinds = layer_kinds
        self.windows = windows
        self.layer_classes = layer_classes  # None: classes are not checked
        self.signatures: dict[RecordKind, Signature] = {}
        # The kinds of the model's layers, in record order, and their names.
        self.model_kinds: tuple[LayerKind, ...] = tuple(k for k in KINDS if k.name in layer_kinds)
        self.kinds: tuple[RecordKind, ...] = tuple(k.name for k in self.model_kinds)
        windows_of = [w for w, k in zip(windows, layer_kinds, strict=True) if k == "window"]
        self.max_window = max((w for w in windows_of if w), default=0)

    def needed(self, keys: Sequence[str], n_blocks: int) -> list[RecordKey]:
        """The records restoring the first `n_blocks` blocks of chain `keys` needs: by
        block, each in record order (`kinds`)."""
        if n_blocks <= 0:
            return []
        B, W = self.block_size, self.max_window
        reads = [
            (kind.name, set(kind.restore_blocks(n_blocks, block_size=B, window=W)))
            for kind in self.model_kinds
        ]
        return [
            RecordKey(keys[j], name)
            for j in range(n_blocks)
            for name, blocks in reads
            if j in blocks
        ]

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
            RecordKey(keys[j], kind)
            for j in range(n - 1, -1, -1)
            for kind in self.kinds
            if (keys[j], kind) not in needed_set
        ]
        order = [item for item in others if self.store.has(*item)]
        order += [item for item in reversed(needed) if self.store.has(*item)]
        if order:
            self.store.touch(order)

    def learn(self, records: dict[RecordKind, Record]) -> None:
        """Merge records this process extracted from the model itself into `signatures`."""
        for kind, rec in records.items():
            learned = self.signatures.get(kind)
            own = kind_named(kind).signature(rec)
            self.signatures[kind] = own if learned is None else merge_signatures(learned, own)

    def reading(self, items: Iterable[RecordKey], *, mapped: bool) -> Reading:
        """A reading of (at least) `items`: into one arena sized for them, or `mapped`
        where the store maps its blobs."""
        arena = None
        if not (mapped and self.store.mappable):
            arena = Arena(sum(self.store.size(key, kind) or 0 for key, kind in items))
        return Reading(self, arena=arena, mapped=mapped)

    def check(
        self,
        rec: Record,
        block: int,
        kind: RecordKind,
        *,
        whole: bool,
        first_read: dict[RecordKind, Signature],
    ) -> None:
        """Raise `RecordError` unless `rec` fits block `block`'s `kind` layers (`whole`: a
        chain's whole block; else a cut's follower, whose first tokens serve)."""
        signature = self.signatures.get(kind)
        if signature is None:
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
        if kind not in self.signatures and kind not in first_read:
            first_read[kind] = kind_named(kind).signature(rec)


@dataclass
class Reading:
    """One load's reads: its arena (or mapped views) and its first reads per kind."""

    reader: RecordReader
    arena: Arena | None
    mapped: bool
    first_read: dict[RecordKind, Signature] = field(default_factory=dict)

    def read(self, key: str, block: int, kind: RecordKind, *, whole: bool = True) -> Record:
        """Record `(key, kind)` decoded and checked; `RecordError` when gone or unfit."""
        store = self.reader.store
        size = store.size(key, kind) if self.arena is not None else None
        into = self.arena.take(size) if self.arena is not None and size else None
        data = store.get_buffer(key, kind, into, mapped=self.mapped)
        if data is None:
            raise RecordError("record is gone")
        rec = record_from_buffer(data)
        self.reader.check(rec, block, kind, whole=whole, first_read=self.first_read)
        return rec

    def chain(
        self, plan: RestorePlan, *, replan: Callable[..., RestorePlan]
    ) -> tuple[RestorePlan, RecordsByBlock]:
        """The plan's chain records by block; a bad one is deleted and the chain falls back
        to `replan(keys, limit=, allowed=)`, the longest shorter one still complete."""
        loaded: dict[RecordKey, Record] = {}
        while plan.n_blocks > 0:
            bad = None
            for block, (key, kind) in _blocks_of(plan):
                if (key, kind) in loaded:
                    continue
                try:
                    loaded[(key, kind)] = self.read(key, block, kind)
                except RecordError:
                    bad = (key, kind)
                    break
            if bad is None:
                break
            self.reader.store.delete(*bad)
            plan = replan(plan.keys, limit=plan.n_blocks, allowed=plan.allowed)
        by_block: RecordsByBlock = {}
        for block, (key, kind) in _blocks_of(plan):
            by_block.setdefault(block, {})[kind] = loaded[(key, kind)]
        return plan, by_block

    def cut(self, cuts: tuple[Cut, ...]) -> CutRead:
        """The first of `cuts` whose records serve it, with them; else None and why:
        ``"evicted"`` (a record gone or damaged: deleted) or ``"window"`` (sound window
        records that do not reach back to what the cut needs: kept)."""
        why: KeptBoundary = "evicted"
        for cut in cuts:
            boundary = cut.block * self.reader.block_size
            records: dict[RecordKind, Record] = {}
            try:
                for key, kind in cut.needed:
                    rec = self.read(key, cut.block, kind, whole=False)
                    kind_named(kind).check_cut(rec, boundary=boundary, point=boundary + cut.tokens)
                    records[kind] = rec
            except CutOutOfReach:
                why = "window"
                continue
            except RecordError:
                self.reader.store.delete(key, kind)
                return CutRead(None, {}, "evicted")
            return CutRead(cut, records)
        return CutRead(None, {}, why)


def _blocks_of(plan: RestorePlan) -> list[tuple[int, RecordKey]]:
    """Each record the plan's chain needs, with the block it is for."""
    index = {k: j for j, k in enumerate(plan.keys[: plan.n_blocks])}
    return [(index[item.key], item) for item in plan.needed]
