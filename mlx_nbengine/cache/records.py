"""Records: what one block contributes to a restorable cache, per layer kind.

A live cache is a list with one cache object per model layer (mlx-lm's
``make_prompt_cache``, or mlx-vlm's cache classes). Each layer has a *layer
kind*, which decides what a block must keep so the cache can be rebuilt later:

- ``"kv"`` -- a full-attention layer (``KVCache``). The record holds the
  block's key/value slice ``[start, end)``; restoring ``n`` blocks concatenates
  the slices of blocks ``0..n-1``.
- ``"window"`` -- a sliding-window layer (``RotatingKVCache`` with ``keep == 0``
  and window ``W = max_size``). The record holds the tokens
  ``[max(start, end - W), end)`` of the block in temporal order, taken while the
  rotating buffer still holds them; restoring at boundary ``b`` needs only the
  blocks overlapping ``[b - W, b)``.
- ``"state"`` -- everything else (``ArraysCache`` of linear-attention/SSM
  layers, rotating caches with ``keep > 0``, unknown classes). The record is a
  checkpoint of the whole layer state and is valid only at the boundary where
  a model call ended, so it exists only when the cache offset equals ``end``.

A *partial record* holds only the first ``m < B`` tokens of its block, ``[start,
start + m)`` (a stored partial block, see `blocks.partial_key`): ``"kv"`` and
``"window"`` kinds, and ``"state"`` when it was taken right after a model call that
ended at ``start + m``.

A *record* bundles all layers of one kind for one block: arrays named
``L<layer>.<name>`` plus string metadata (kind, block, block size, and per
layer the class name, token range and scalars as JSON). Records travel as
safetensors blobs (`record_to_bytes` / `record_from_bytes`).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx

__all__ = [
    "KINDS",
    "Record",
    "RecordError",
    "RecordKind",
    "extract_block_records",
    "layer_kind",
    "layer_kinds",
    "layer_windows",
    "record_from_bytes",
    "record_to_bytes",
    "restore_snapshot",
]

RecordKind = Literal["kv", "window", "state"]
KINDS: tuple[RecordKind, ...] = ("kv", "window", "state")

_FORMAT = "mlx_nbengine.record.v1"


class RecordError(ValueError):
    """A record is malformed or does not fit the cache it should rebuild."""


@dataclass
class Record:
    """All layers of one kind for one block: arrays ``L<i>.<name>`` and string metadata."""

    kind: RecordKind
    arrays: dict[str, mx.array]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def block(self) -> int:
        return int(self.meta["block"])

    @property
    def block_size(self) -> int:
        return int(self.meta["block_size"])

    @property
    def layers(self) -> dict[int, dict[str, Any]]:
        """Per-layer metadata keyed by layer index."""
        return {int(k): v for k, v in json.loads(self.meta["layers"]).items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def layer_kind(layer_cache: Any) -> RecordKind:
    """The record kind of one layer cache, by class name and the attributes it needs."""
    name = type(layer_cache).__name__
    if name == "KVCache" and all(hasattr(layer_cache, a) for a in ("keys", "values", "offset")):
        return "kv"
    if (
        name == "RotatingKVCache"
        and getattr(layer_cache, "keep", None) == 0
        and hasattr(layer_cache, "_temporal_order")
        and all(hasattr(layer_cache, a) for a in ("keys", "values", "offset", "max_size", "_idx"))
    ):
        return "window"
    return "state"


def layer_kinds(cache: list) -> list[RecordKind]:
    """One record kind per layer of a live cache."""
    return [layer_kind(c) for c in cache]


def layer_windows(cache: list) -> list[int | None]:
    """The window size of each ``"window"`` layer, None for the other layers."""
    return [int(c.max_size) if layer_kind(c) == "window" else None for c in cache]


def _cache_offset(cache: list) -> int | None:
    """Tokens seen so far, read from the layers that count them; None if none do."""
    offsets = {int(c.offset) for c in cache if isinstance(getattr(c, "offset", None), int)}
    if len(offsets) > 1:
        raise RecordError(f"layers disagree on the cache offset: {sorted(offsets)}")
    return offsets.pop() if offsets else None


# --- state snapshots -------------------------------------------------------------------------
# A snapshot is the layer's own description of itself: mlx-vlm caches offer
# `prefix_cache_snapshot()` (state, meta_state and friends), mlx-lm 0.32 caches carry
# everything in `.state`. The snapshot becomes a JSON skeleton with arrays replaced by
# references into the record's arrays.


def _take_snapshot(layer_cache: Any) -> tuple[str, Any]:
    if hasattr(layer_cache, "prefix_cache_snapshot") and hasattr(
        layer_cache, "prefix_cache_restore"
    ):
        return "snapshot", layer_cache.prefix_cache_snapshot()
    return "state", {"state": layer_cache.state}


def _encode(value: Any, arrays: dict[str, mx.array], prefix: str) -> Any:
    if isinstance(value, mx.array):
        name = f"{prefix}.{len(arrays)}"
        # A copy: the live cache may later write into this very array object in place.
        arrays[name] = mx.array(value)
        return {"$array": name}
    if isinstance(value, list | tuple):
        return [_encode(v, arrays, prefix) for v in value]
    if isinstance(value, dict):
        return {"$dict": {str(k): _encode(v, arrays, prefix) for k, v in value.items()}}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise RecordError(f"cannot checkpoint a cache state holding {type(value).__name__}")


def _decode(skeleton: Any, arrays: dict[str, mx.array]) -> Any:
    if isinstance(skeleton, list):
        return [_decode(v, arrays) for v in skeleton]
    if isinstance(skeleton, dict):
        if "$array" in skeleton:
            name = skeleton["$array"]
            if name not in arrays:
                raise RecordError(f"record lacks array {name}")
            return arrays[name]
        return {k: _decode(v, arrays) for k, v in skeleton["$dict"].items()}
    return skeleton


def restore_snapshot(layer_cache: Any, layer_meta: dict[str, Any], arrays: dict) -> None:
    """Load a ``"state"`` record's layer into a fresh layer cache of the same class."""
    if layer_meta["class"] != type(layer_cache).__name__:
        raise RecordError(
            f"state record is for {layer_meta['class']}, cache layer is "
            f"{type(layer_cache).__name__}"
        )
    snapshot = _decode(layer_meta["snapshot"], arrays)
    if layer_meta["protocol"] == "snapshot":
        layer_cache.prefix_cache_restore(snapshot)
    else:
        layer_cache.state = snapshot["state"]


# --- extraction -----------------------------------------------------------------------------


def _meta(kind: RecordKind, block: int, block_size: int, layers: dict) -> dict[str, str]:
    return {
        "format": _FORMAT,
        "kind": kind,
        "block": str(block),
        "block_size": str(block_size),
        "layers": json.dumps(layers, sort_keys=True),
    }


def extract_block_records(
    cache: list,
    *,
    block: int,
    block_size: int,
    offset: int | None = None,
    end: int | None = None,
) -> dict[RecordKind, Record]:
    """The records of block `block` from a live single-sequence cache.

    ``"kv"`` and ``"window"`` records can be taken any time the cache still
    holds the block's tokens (a window layer must still hold
    ``[max(start, end - W), end)``; otherwise `RecordError`). The ``"state"``
    record is included only when the cache has seen exactly ``end`` tokens,
    i.e. right after a model call that ended on the boundary. `offset` (tokens
    seen) is read from the cache unless given; give it for caches where no
    layer counts tokens. Arrays are evaluated, so records may cross threads.

    `end` (inside the block) takes a *partial block*'s records instead: the tokens
    ``[start, end)``, and the ``"state"`` there when the cache has seen exactly `end`
    tokens (it resumes a prompt that holds all of them: an image's end, a finished
    request's end).
    """
    start = block * block_size
    if end is None:
        end = start + block_size
    if not start < end <= start + block_size:
        raise RecordError(f"block {block} of size {block_size} cannot end at {end}")
    seen = _cache_offset(cache) if offset is None else offset
    kinds = layer_kinds(cache)
    layers: dict[RecordKind, dict[str, Any]] = {k: {} for k in KINDS}
    arrays: dict[RecordKind, dict[str, mx.array]] = {k: {} for k in KINDS}
    for i, (c, kind) in enumerate(zip(cache, kinds, strict=True)):
        name = type(c).__name__
        if kind == "kv":
            if c.keys is None or c.offset < end:
                raise RecordError(f"layer {i} has {c.offset} tokens, block {block} ends at {end}")
            arrays[kind][f"L{i}.k"] = mx.contiguous(c.keys[..., start:end, :])
            arrays[kind][f"L{i}.v"] = mx.contiguous(c.values[..., start:end, :])
            layers[kind][str(i)] = {"class": name, "start": start, "end": end}
        elif kind == "window":
            lo = max(start, end - c.max_size)
            # The layer's own temporal ordering: after a multi-token step the buffer holds up
            # to max_size - 1 + S tokens in order, after single-token steps it is rotated.
            keys = c._temporal_order(c.keys) if c.keys is not None else None
            held = 0 if keys is None else keys.shape[2]
            first = c.offset - held
            if keys is None or c.offset < end or first > lo:
                raise RecordError(
                    f"window layer {i} holds tokens [{first}, {c.offset}); block {block} "
                    f"needs [{lo}, {end}) still held"
                )
            values = c._temporal_order(c.values)
            arrays[kind][f"L{i}.k"] = mx.contiguous(keys[..., lo - first : end - first, :])
            arrays[kind][f"L{i}.v"] = mx.contiguous(values[..., lo - first : end - first, :])
            layers[kind][str(i)] = {
                "class": name,
                "start": lo,
                "end": end,
                "max_size": int(c.max_size),
            }
        elif seen == end:
            protocol, snapshot = _take_snapshot(c)
            skeleton = _encode(snapshot, arrays[kind], f"L{i}")
            layers[kind][str(i)] = {
                "class": name,
                "protocol": protocol,
                "snapshot": skeleton,
                "offset": end,
            }
    records = {
        kind: Record(kind, arrays[kind], _meta(kind, block, block_size, layers[kind]))
        for kind in KINDS
        if layers[kind]
    }
    mx.eval([r.arrays for r in records.values()])
    return records


# --- bytes ---------------------------------------------------------------------------------


def record_to_bytes(rec: Record) -> bytes:
    """A safetensors blob holding the record's arrays and metadata."""
    buf = io.BytesIO()
    mx.save_safetensors(buf, rec.arrays, metadata={**rec.meta, "kind": rec.kind})
    return buf.getvalue()


def record_from_bytes(data: bytes) -> Record:
    """Decode a blob from `record_to_bytes`; arrays are evaluated. Raises `RecordError`."""
    buf = io.BytesIO(data)
    buf.name = "record.safetensors"  # mx.load picks the format from the name
    try:
        arrays, meta = mx.load(buf, return_metadata=True)
        mx.eval(arrays)
    except Exception as e:  # mlx raises plain RuntimeError/ValueError on bad headers
        raise RecordError(f"record blob does not decode: {e}") from e
    if meta.get("format") != _FORMAT or meta.get("kind") not in KINDS:
        raise RecordError("blob is not an mlx_nbengine record")
    try:
        rec = Record(meta["kind"], dict(arrays), dict(meta))
        _ = (rec.block, rec.block_size, rec.layers)  # parse now, so a bad blob fails here
    except (KeyError, ValueError) as e:
        raise RecordError(f"record metadata is malformed: {e}") from e
    return rec
