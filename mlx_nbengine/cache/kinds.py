"""Record kinds: one class per layer kind, each answering the same questions for its kind.

A live cache is a list with one cache object per model layer (mlx-lm's
``make_prompt_cache``, or mlx-vlm's classes). Each layer has a *kind*, which decides what
a block ``[start, end)`` of ``B`` tokens keeps of it (the kind's *record*, see `records`):

- `FullAttention` (``"kv"``, a ``KVCache``): the block's keys and values.
- `SlidingWindow` (``"window"``, a ``RotatingKVCache`` with ``keep == 0``, window ``W``):
  the block's keys and values from its first token the rotating buffer still holds: the
  whole block after the prefill step that computed it, at least its last ``W`` tokens
  after single-token decode steps. The first token held is the record's *reach*.
- `Recurrent` (``"state"``, everything else: ``ArraysCache`` of linear-attention/SSM
  layers, rotating caches with ``keep > 0``, unknown classes): a snapshot of the whole
  layer (`snapshots`), valid only where a model call ended.

Every kind answers: which layer caches are its own (`claims`); what a layer keeps of a
block (`extract`); whether a record's layer fits the model (`check_layer`); which blocks'
records a restore at *boundary* ``b = n * B`` needs (`restore_blocks`); how a fresh layer
is rebuilt (`assemble`); whether a restore can go on into a block, up to ``p = b + k``
(a *cut*, from a stored *follower* of the same prefix), and from which record
(`cuts_at`, `check_cut`). Its `version` is its part of the record format
(`RECORD_FORMAT`, in a persistent store's identity: a store written under another format
is set aside, see `persist`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx

from mlx_nbengine.cache.assembly import Rebuild, join_tokens, layer_meta, token_count
from mlx_nbengine.cache.records import (
    BLOB_FORMAT,
    TOKEN_AXIS,
    HostArray,
    Record,
    RecordError,
    RecordKind,
    Signature,
    check_signature,
    record_signature,
)
from mlx_nbengine.cache.snapshots import PROTOCOLS, restore_snapshot, skeleton_arrays, take_snapshot
from mlx_nbengine.models import patches

__all__ = [
    "KINDS",
    "RECORD_FORMAT",
    "BlockSpan",
    "CutOutOfReach",
    "FullAttention",
    "LayerKind",
    "LayerPart",
    "Recurrent",
    "SlidingWindow",
    "assemble",
    "check_record",
    "extract_block_records",
    "kind_named",
    "kind_of",
    "layer_kinds",
    "layer_windows",
    "window_blocks",
]


class CutOutOfReach(RecordError):
    """A sound follower record that does not hold the tokens a cut needs (a window record
    whose reach is past them): the record stays, the cut is not made from it."""


@dataclass(frozen=True)
class BlockSpan:
    """Tokens ``[start, end)`` of block `block`: the whole block, or its first tokens."""

    block: int
    block_size: int
    end: int

    @property
    def start(self) -> int:
        return self.block * self.block_size

    @property
    def block_end(self) -> int:
        return self.start + self.block_size


@dataclass(frozen=True)
class LayerPart:
    """What one layer keeps of a block: its metadata (JSON-ready) and its arrays."""

    meta: dict[str, Any]
    arrays: dict[str, mx.array]


class LayerKind(ABC):
    """The questions every kind answers for its layers (see the module docstring)."""

    name: ClassVar[RecordKind]
    version: ClassVar[int]
    token_slices: ClassVar[bool]  # its arrays are (1, heads, tokens, head_dim) slices
    cuts_inside_blocks: ClassVar[bool]  # a cut can end at any token (else: `cuts_at`)

    @abstractmethod
    def claims(self, layer_cache: Any) -> bool:
        """Whether `layer_cache` is a layer of this kind."""

    def window(self, layer_cache: Any) -> int | None:
        """The layer's window (sliding-window layers), else None."""
        return None

    @abstractmethod
    def extract(
        self, layer_cache: Any, i: int, span: BlockSpan, *, seen: int | None
    ) -> LayerPart | None:
        """Layer `i`'s part of `span`'s record, taken from a live cache that has seen `seen`
        tokens; None when it keeps nothing there; `RecordError` when no longer held."""

    @abstractmethod
    def check_layer(
        self, rec: Record, i: int, meta: dict, span: BlockSpan, *, whole: bool, window: int | None
    ) -> list[str]:
        """Raise `RecordError` unless layer `i`'s metadata fits block `span.block` (`whole`:
        ending at the block's end, else inside it); return the arrays it names."""

    @abstractmethod
    def restore_blocks(self, n_blocks: int, *, block_size: int, window: int) -> range:
        """The blocks whose records of this kind a restore at boundary ``n_blocks * B``
        reads (`window`: the model's largest)."""

    @abstractmethod
    def assemble(self, layer_cache: Any, i: int, rebuild: Rebuild) -> None:
        """Fill fresh layer `i` from `rebuild`'s records."""

    def cuts_at(self, tokens: int, *, follower_length: int, block_size: int) -> bool:
        """Whether a cut of `tokens` into a follower of `follower_length` tokens can be
        made from this kind's records (before reading any)."""
        return self.cuts_inside_blocks

    @abstractmethod
    def check_cut(self, rec: Record, *, boundary: int, point: int) -> None:
        """Raise `RecordError` (`CutOutOfReach`: the record is sound) unless follower
        record `rec` (checked) serves a cut from `boundary` to `point`."""

    def signature(self, rec: Record) -> Signature:
        """The shapes and dtypes of `rec`'s arrays, the token axis free for slices."""
        return record_signature(rec, free_token_axis=self.token_slices)


def _ints(meta: dict, i: int, *names: str) -> list[int]:
    values = [meta.get(n) for n in names]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise RecordError(f"layer {i} metadata lacks integer {', '.join(names)}")
    return values


def _check_end(kind: str, i: int, end: int, span: BlockSpan, *, whole: bool) -> None:
    if not (end == span.block_end if whole else span.start < end <= span.block_end):
        raise RecordError(f"{kind} record of layer {i} ends at {end}, not in block {span.block}")


def _check_slices(rec: Record, i: int, start: int, end: int) -> list[str]:
    """The layer's keys and values must be ``(1, heads, end - start, head_dim)``."""
    names = [f"L{i}.k", f"L{i}.v"]
    for name in names:
        a = rec.arrays.get(name)
        if a is None:
            raise RecordError(f"{rec.kind} record of block {rec.block} lacks {name}")
        if a.ndim != 4 or a.shape[0] != 1 or a.shape[TOKEN_AXIS] != end - start:
            raise RecordError(
                f"{rec.kind} record of block {rec.block}: {name} has shape {tuple(a.shape)}, "
                f"expected (1, heads, {end - start}, head_dim)"
            )
    return names


def _slices(rec: Record, i: int, lo: int, hi: int) -> tuple[Any, Any]:
    """Layer `i`'s keys and values of tokens ``[lo, hi)`` (absolute positions)."""
    start = layer_meta(rec, i)["start"]
    return (
        rec.arrays[f"L{i}.k"][..., lo - start : hi - start, :],
        rec.arrays[f"L{i}.v"][..., lo - start : hi - start, :],
    )


class FullAttention(LayerKind):
    """``"kv"``: every block's slice; a restore reads every block of the chain."""

    name = "kv"
    version = 1
    token_slices = True
    cuts_inside_blocks = True

    def claims(self, layer_cache: Any) -> bool:
        return type(layer_cache).__name__ == "KVCache" and all(
            hasattr(layer_cache, a) for a in ("keys", "values", "offset")
        )

    def extract(self, layer_cache, i, span, *, seen):
        c, start, end = layer_cache, span.start, span.end
        if c.keys is None or c.offset < end:
            raise RecordError(f"layer {i} has {c.offset} tokens, block {span.block} ends at {end}")
        arrays = {
            f"L{i}.k": mx.contiguous(c.keys[..., start:end, :]),
            f"L{i}.v": mx.contiguous(c.values[..., start:end, :]),
        }
        return LayerPart({"class": type(c).__name__, "start": start, "end": end}, arrays)

    def check_layer(self, rec, i, meta, span, *, whole, window):
        start, end = _ints(meta, i, "start", "end")
        _check_end(self.name, i, end, span, whole=whole)
        if start != span.start:
            raise RecordError(f"kv record of layer {i} starts at {start}, not {span.start}")
        return _check_slices(rec, i, start, end)

    def restore_blocks(self, n_blocks, *, block_size, window):
        return range(n_blocks)

    def assemble(self, layer_cache, i, rebuild):
        B, b, p = rebuild.block_size, rebuild.boundary, rebuild.point
        parts = []
        for j, rec in enumerate(rebuild.chain(self.name, range(rebuild.n_blocks))):
            meta = layer_meta(rec, i)
            if (meta["start"], meta["end"]) != (j * B, (j + 1) * B):
                raise RecordError(f"kv record of block {j} covers the wrong tokens")
            parts.append(_slices(rec, i, j * B, (j + 1) * B))
        if rebuild.cut_tokens:
            rec = rebuild.cut(self.name)
            meta = layer_meta(rec, i)
            if meta["start"] != b or meta["end"] < p:
                raise RecordError(
                    f"kv record of layer {i} covers [{meta['start']}, {meta['end']}), "
                    f"a cut needs [{b}, {p})"
                )
            parts.append(_slices(rec, i, b, p))
        keys, values = [k for k, _ in parts], [v for _, v in parts]
        if token_count(keys) != p or token_count(values) != p:
            raise RecordError(f"kv layer {i} assembles {token_count(keys)} tokens, not {p}")
        # Room up to the layer's next step, as its own growth would leave: the tail's
        # first tokens then go in place instead of into a grown copy.
        step = int(getattr(layer_cache, "step", 1) or 1)
        room = -(-p // step) * step
        layer_cache.keys = join_tokens(keys, i, room)
        layer_cache.values = join_tokens(values, i, room)
        layer_cache.offset = p

    def check_cut(self, rec, *, boundary, point):
        if min(m["end"] for m in rec.layers.values()) < point:
            raise RecordError("the follower is shorter than the cut")


def window_blocks(n_blocks: int, *, window: int, block_size: int) -> range:
    """Blocks whose window records a window-``window`` layer needs at boundary ``n*B``."""
    b = n_blocks * block_size
    return range(max(0, b - window) // block_size, n_blocks)


class SlidingWindow(LayerKind):
    """``"window"``: a block's slice from its reach; a restore at ``b`` (or a cut to ``p``)
    needs the last ``min(W, p)`` tokens, so it reads the blocks overlapping ``[b - W, b)``.

    The rebuilt layer holds those tokens in temporal order, offset ``p`` and write index
    at the end of its buffer: equal to a freshly prefilled rotating cache for every later
    update (a multi-token update first trims to the last ``W - 1`` tokens, a single-token
    update trims to the last ``W`` and rotates; both see the same tokens in order)."""

    name = "window"
    version = 2  # 2: a record holds its block from its reach, not only its last W tokens
    token_slices = True
    cuts_inside_blocks = True

    def claims(self, layer_cache: Any) -> bool:
        return patches.is_window_cache(layer_cache)

    def window(self, layer_cache: Any) -> int:
        return int(layer_cache.max_size)

    @staticmethod
    def latest_reach(span: BlockSpan, window: int) -> int:
        """The latest first token a record of `span` may have: it holds at least the last
        `window` tokens (all of them for a shorter span)."""
        return max(span.start, span.end - window)

    def extract(self, layer_cache, i, span, *, seen):
        c, end = layer_cache, span.end
        # The layer's own temporal ordering: after a multi-token step the buffer holds up
        # to max_size - 1 + S tokens in order, after single-token steps it is rotated.
        keys = patches.window_in_token_order(c, c.keys) if c.keys is not None else None
        held = 0 if keys is None else keys.shape[TOKEN_AXIS]
        first = c.offset - held
        reach = max(span.start, first)
        latest = self.latest_reach(span, int(c.max_size))
        if keys is None or c.offset < end or reach > latest:
            raise RecordError(
                f"window layer {i} holds tokens [{first}, {c.offset}); block {span.block} "
                f"needs [{latest}, {end}) still held"
            )
        values = patches.window_in_token_order(c, c.values)
        arrays = {
            f"L{i}.k": mx.contiguous(keys[..., reach - first : end - first, :]),
            f"L{i}.v": mx.contiguous(values[..., reach - first : end - first, :]),
        }
        meta = {"class": type(c).__name__, "start": reach, "end": end, "max_size": int(c.max_size)}
        return LayerPart(meta, arrays)

    def check_layer(self, rec, i, meta, span, *, whole, window):
        start, end, size = _ints(meta, i, "start", "end", "max_size")
        _check_end(self.name, i, end, span, whole=whole)
        if size != window:
            raise RecordError(f"window record of layer {i} is for W={size}")
        latest = self.latest_reach(BlockSpan(span.block, span.block_size, end), size)
        if not span.start <= start <= latest:
            raise RecordError(
                f"window record of layer {i} starts at {start}, not in [{span.start}, {latest}]"
            )
        return _check_slices(rec, i, start, end)

    def restore_blocks(self, n_blocks, *, block_size, window):
        return window_blocks(n_blocks, window=window, block_size=block_size)

    def assemble(self, layer_cache, i, rebuild):
        window, p = int(layer_cache.max_size), rebuild.point
        blocks = window_blocks(rebuild.n_blocks, window=window, block_size=rebuild.block_size)
        sources = rebuild.chain(self.name, blocks)
        if rebuild.cut_tokens:
            sources.append(rebuild.cut(self.name))
        keys, values = [], []
        covered = max(0, p - window)  # the tokens from here on are kept: copy no more
        for rec in sources:
            meta = layer_meta(rec, i)
            if meta["max_size"] != window:
                raise RecordError(f"window record of layer {i} is for W={meta['max_size']}")
            hi = min(meta["end"], p)
            if hi <= covered:
                continue
            if meta["start"] > covered:
                raise RecordError(f"window records of layer {i} leave a gap at {covered}")
            k, v = _slices(rec, i, covered, hi)
            keys.append(k)
            values.append(v)
            covered = hi
        if covered != p:
            raise RecordError(f"window records of layer {i} end at {covered}, expected {p}")
        keys, values = join_tokens(keys, i), join_tokens(values, i)
        patches.set_window_state(layer_cache, keys, values, p)

    def check_cut(self, rec, *, boundary, point):
        for i, meta in rec.layers.items():
            if meta["end"] < point:
                raise RecordError("the follower is shorter than the cut")
            if meta["start"] > max(boundary, point - meta["max_size"]):
                raise CutOutOfReach(
                    f"the follower's window record of layer {i} starts at {meta['start']}: "
                    f"a cut to {point} needs it from {max(boundary, point - meta['max_size'])}"
                )


class Recurrent(LayerKind):
    """``"state"``: the whole layer where a model call ended; a restore at ``b`` reads the
    state of block ``n-1`` (taken at ``b``), a cut the follower's state taken at ``p``."""

    name = "state"
    version = 1
    token_slices = False
    cuts_inside_blocks = False

    def claims(self, layer_cache: Any) -> bool:
        return True  # whatever the other kinds do not take is checkpointed whole

    def extract(self, layer_cache, i, span, *, seen):
        if seen != span.end:
            return None
        arrays: dict[str, mx.array] = {}
        snapshot = take_snapshot(layer_cache, arrays, f"L{i}")
        meta = {"class": type(layer_cache).__name__, **snapshot, "offset": span.end}
        return LayerPart(meta, arrays)

    def check_layer(self, rec, i, meta, span, *, whole, window):
        (offset,) = _ints(meta, i, "offset")
        if not (offset == span.block_end if whole else span.start < offset <= span.block_end):
            raise RecordError(f"state record of layer {i} is for offset {offset}")
        if meta.get("protocol") not in PROTOCOLS:
            raise RecordError(f"state record of layer {i} has no known protocol")
        skeleton = meta.get("snapshot")
        own = skeleton_arrays(skeleton, [])
        if meta["protocol"] == "state" and not (
            isinstance(skeleton, dict) and "state" in skeleton.get("$dict", {})
        ):
            raise RecordError(f"state record of layer {i} holds no state")
        if any(not n.startswith(f"L{i}.") for n in own):
            raise RecordError(f"state record of layer {i} refers to another layer's arrays")
        return own

    def restore_blocks(self, n_blocks, *, block_size, window):
        return range(n_blocks - 1, n_blocks) if n_blocks > 0 else range(0)

    def assemble(self, layer_cache, i, rebuild):
        # A cut resumes from the follower's own state, taken at its end (= p).
        if rebuild.cut_tokens:
            rec = rebuild.cut(self.name)
        else:
            rec = rebuild.record(rebuild.n_blocks - 1, self.name)
        meta = layer_meta(rec, i)
        if meta.get("offset") != rebuild.point:
            raise RecordError(f"state record of layer {i} is for offset {meta.get('offset')}")
        if id(rec) not in rebuild.on_device:
            rebuild.on_device[id(rec)] = {
                n: a.to_mx() if isinstance(a, HostArray) else a for n, a in rec.arrays.items()
            }
        restore_snapshot(layer_cache, meta, rebuild.on_device[id(rec)])

    def cuts_at(self, tokens, *, follower_length, block_size):
        # A state resumes only where it was taken: the end of a partial follower the
        # prompt holds whole (an image's end, a finished request's end).
        return tokens == follower_length < block_size

    def check_cut(self, rec, *, boundary, point):
        if any(m.get("offset") != point for m in rec.layers.values()):
            raise RecordError("the follower's state was taken elsewhere")


KINDS: tuple[LayerKind, ...] = (FullAttention(), SlidingWindow(), Recurrent())
"""Every kind, in record order; the first that claims a layer cache is its kind."""

_BY_NAME: dict[str, LayerKind] = {k.name: k for k in KINDS}

RECORD_FORMAT = " ".join([BLOB_FORMAT, *(f"{k.name}.{k.version}" for k in KINDS)])
"""The record format a persistent store's identity names: the blob layout and each
kind's version."""


def kind_named(name: str) -> LayerKind:
    kind = _BY_NAME.get(name)
    if kind is None:
        raise RecordError(f"no record kind {name!r}")
    return kind


def kind_of(layer_cache: Any) -> LayerKind:
    """The kind of one layer cache."""
    return next(k for k in KINDS if k.claims(layer_cache))


def layer_kinds(cache: list) -> list[RecordKind]:
    """One record kind per layer of a live cache."""
    return [kind_of(c).name for c in cache]


def layer_windows(cache: list) -> list[int | None]:
    """The window size of each ``"window"`` layer, None for the other layers."""
    return [kind_of(c).window(c) for c in cache]


def _cache_offset(cache: list) -> int | None:
    """Tokens seen so far, read from the layers that count them; None if none do."""
    offsets = {int(c.offset) for c in cache if isinstance(getattr(c, "offset", None), int)}
    if len(offsets) > 1:
        raise RecordError(f"layers disagree on the cache offset: {sorted(offsets)}")
    return offsets.pop() if offsets else None


def extract_block_records(
    cache: list,
    *,
    block: int,
    block_size: int,
    offset: int | None = None,
    end: int | None = None,
    states: dict[int, Any] | None = None,
) -> dict[RecordKind, Record]:
    """The records of block `block` from a live single-sequence cache, one per kind.

    Slices (``"kv"``, ``"window"``) can be taken any time the cache still holds the block's
    tokens (a window layer at least its last ``W``; otherwise `RecordError`). The
    ``"state"`` record is included only when the cache has seen exactly the block's end
    tokens, i.e. right after a model call that ended there. `offset` (tokens seen) is read
    from the cache unless given; give it for caches where no layer counts tokens. Arrays
    are evaluated, so records may cross threads.

    `end` (inside the block) takes a *partial block*'s records instead: the tokens
    ``[start, end)``, and the ``"state"`` there when the cache has seen exactly `end`.
    `states` (layer index -> a cache of that layer as it stood at the block's end, taken
    inside a longer model call) stand in for those layers' own caches.
    """
    span = BlockSpan(block, block_size, (block + 1) * block_size if end is None else end)
    if not span.start < span.end <= span.block_end:
        raise RecordError(f"block {block} of size {block_size} cannot end at {span.end}")
    seen = _cache_offset(cache) if offset is None else offset
    layers: dict[RecordKind, dict[str, Any]] = {k.name: {} for k in KINDS}
    arrays: dict[RecordKind, dict[str, mx.array]] = {k.name: {} for k in KINDS}
    for i, c in enumerate(cache):
        kind = kind_of(c)
        if states and i in states:
            part = kind.extract(states[i], i, span, seen=span.end)
        else:
            part = kind.extract(c, i, span, seen=seen)
        if part is not None:
            layers[kind.name][str(i)] = part.meta
            arrays[kind.name].update(part.arrays)
    records = {
        k.name: Record(k.name, arrays[k.name], _meta(k, span, layers[k.name]))
        for k in KINDS
        if layers[k.name]
    }
    mx.eval([r.arrays for r in records.values()])
    return records


def _meta(kind: LayerKind, span: BlockSpan, layers: dict) -> dict[str, str]:
    return {
        "format": BLOB_FORMAT,
        "kind": kind.name,
        "kind_version": str(kind.version),
        "block": str(span.block),
        "block_size": str(span.block_size),
        "layers": json.dumps(layers, sort_keys=True),
    }


def check_record(
    rec: Record,
    *,
    block: int,
    kind: RecordKind,
    block_size: int,
    layer_kinds: list[RecordKind],
    windows: list[int | None],
    classes: list[str] | None = None,
    whole: bool = True,
    signature: Signature | None = None,
) -> None:
    """Raise `RecordError` unless `rec` can rebuild block `block`'s `kind` layers of a model
    with this layout (one entry per layer in `layer_kinds`, `windows`, `classes`).

    The metadata must fit: the kind and its version, the block and block size; exactly the
    model's layers of that kind, of the template's classes (when `classes` is given); each
    layer as its kind checks it (`LayerKind.check_layer`; `whole`: the whole block, else
    its first tokens: a cut's follower). The arrays must be exactly those the metadata
    names. With `signature` every array must also fit it (`check_signature`).
    """
    spec = kind_named(kind)
    if rec.kind != kind or rec.block != block or rec.block_size != block_size:
        raise RecordError(f"record under block {block} {kind} is another block's")
    if rec.meta.get("kind_version") != str(spec.version):
        raise RecordError(f"{kind} record of block {block} is of another format version")
    layers = rec.layers
    want = {i for i, k in enumerate(layer_kinds) if k == kind}
    if set(layers) != want:
        raise RecordError(f"{kind} record of block {block} has layers {sorted(layers)}")
    span = BlockSpan(block, block_size, (block + 1) * block_size)
    names: list[str] = []
    for i in sorted(want):
        meta = layers[i]
        if not isinstance(meta, dict):
            raise RecordError(f"layer {i} metadata is malformed")
        if classes is not None and meta.get("class") != classes[i]:
            raise RecordError(f"{kind} record of layer {i} is for {meta.get('class')!r}")
        names += spec.check_layer(rec, i, meta, span, whole=whole, window=windows[i])
    if sorted(rec.arrays) != sorted(set(names)):
        extra = sorted(set(rec.arrays) - set(names))
        raise RecordError(f"{kind} record of block {block} holds arrays {extra or 'missing'}")
    if signature is not None:
        check_signature(rec, signature)


def assemble(
    records_by_block: Mapping[int, Mapping[RecordKind, Record]],
    *,
    n_blocks: int,
    block_size: int,
    template_cache: list,
    cut_tokens: int = 0,
) -> list:
    """Fill `template_cache` (fresh, empty) to hold ``n_blocks`` restored blocks, then
    `cut_tokens` more from the follower records under block ``n_blocks`` (a cut, see
    `assembly`), each layer by its kind; return it.

    Raises `RecordError` when a needed record is missing or does not fit the template (or
    the slices of one layer do not join).
    """
    if not 0 <= cut_tokens < block_size:
        raise RecordError(f"a cut restores 0 to {block_size - 1} tokens, not {cut_tokens}")
    if n_blocks <= 0 and cut_tokens == 0:
        return template_cache
    rebuild = Rebuild(records_by_block, n_blocks, block_size, cut_tokens)
    for i, c in enumerate(template_cache):
        kind_of(c).assemble(c, i, rebuild)
    return template_cache
