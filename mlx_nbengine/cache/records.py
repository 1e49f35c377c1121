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
safetensors blobs (`record_to_bytes`; `record_from_buffer` reads one back without copying
its arrays: `HostArray` views of the blob, which assembly copies once into the cache it
rebuilds; `record_from_bytes` copies them into MLX arrays).

Before a record read back from the store reaches a model it is checked
(`check_record`): its metadata fits the block and the model's layer layout (layer
set, classes, token ranges, windows, a well-formed snapshot skeleton), it holds
exactly the arrays that metadata names, each of the record's own token count, and each
array fits the *signature* of that layer: the shapes (the token axis of kv/window
arrays left free) and dtypes of the records the engine itself extracted for this model
(`record_signature`, merged over every record it saved with `merge_signatures`).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
import numpy as np

__all__ = [
    "KINDS",
    "ArraySpec",
    "HostArray",
    "Record",
    "RecordError",
    "RecordKind",
    "Signature",
    "check_record",
    "check_signature",
    "extract_block_records",
    "host_view",
    "layer_kind",
    "layer_kinds",
    "layer_windows",
    "merge_signatures",
    "record_from_buffer",
    "record_from_bytes",
    "record_signature",
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
    arrays: dict[str, Any]  # mx.array, or `HostArray` views of a blob read from the store
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
    try:
        if layer_meta["protocol"] == "snapshot":
            layer_cache.prefix_cache_restore(snapshot)
        else:
            layer_cache.state = snapshot["state"]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        # The layer's own code refused the snapshot: a record that does not fit, not a crash.
        raise RecordError(f"state record does not fit {type(layer_cache).__name__}: {e}") from e


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


# safetensors dtype -> (MLX dtype, the numpy dtype its bytes are held as: bfloat16 as uint16)
_DTYPES: dict[str, tuple[mx.Dtype, Any]] = {
    "F32": (mx.float32, np.float32),
    "F16": (mx.float16, np.float16),
    "BF16": (mx.bfloat16, np.uint16),
    "F64": (mx.float64, np.float64),
    "BOOL": (mx.bool_, np.bool_),
    **{  # I8 ... U64
        f"{tag}{bits}": (getattr(mx, f"{name}{bits}"), getattr(np, f"{name}{bits}"))
        for tag, name in (("I", "int"), ("U", "uint"))
        for bits in (8, 16, 32, 64)
    },
}
_MAX_HEADER = 16 << 20  # a record's header is a few KiB; more is not a record


@dataclass(frozen=True)
class HostArray:
    """A record array still in the bytes it was read into: a numpy view of the blob (a
    bfloat16 array's bytes as uint16) with its MLX dtype. Restoring copies it once, into
    the cache it rebuilds (`assembly`); `to_mx` copies it into an MLX array instead."""

    data: np.ndarray
    dtype: mx.Dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def __getitem__(self, index: Any) -> HostArray:
        return HostArray(self.data[index], self.dtype)

    def to_mx(self) -> mx.array:
        a = mx.array(np.ascontiguousarray(self.data))
        return a.view(self.dtype) if a.dtype != self.dtype else a


def host_view(a: mx.array) -> np.ndarray:
    """An evaluated MLX array's memory as numpy (writable; bfloat16 as uint16)."""
    mx.eval(a)
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
    return np.array(a, copy=False)


def _parse_header(buf: np.ndarray) -> tuple[dict[str, Any], dict[str, str], int]:
    if buf.ndim != 1 or buf.dtype != np.uint8 or buf.size < 8:
        raise RecordError("record blob does not decode: too short for a header")
    n = int.from_bytes(buf[:8].tobytes(), "little")
    if n > min(_MAX_HEADER, buf.size - 8):
        raise RecordError("record blob does not decode: header length out of range")
    try:
        header = json.loads(buf[8 : 8 + n].tobytes())
    except (UnicodeDecodeError, ValueError) as e:
        raise RecordError(f"record blob does not decode: {e}") from e
    if not isinstance(header, dict):
        raise RecordError("record blob does not decode: header is not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise RecordError("record blob does not decode: metadata is not text")
    return header, meta, 8 + n


def _host_array(buf: np.ndarray, name: str, info: Any, data_start: int) -> HostArray:
    bad = f"record blob does not decode: array {name!r}"
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise RecordError(f"{bad} has no known dtype")
    mx_dtype, np_dtype = _DTYPES[info["dtype"]]
    shape, span = info.get("shape"), info.get("data_offsets")
    if not (
        isinstance(shape, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        and isinstance(span, list)
        and len(span) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in span)
    ):
        raise RecordError(f"{bad} has a malformed shape or offsets")
    count = 1
    for d in shape:
        count *= d
    begin, end = span
    itemsize = np.dtype(np_dtype).itemsize
    if not 0 <= begin <= end <= buf.size - data_start or end - begin != count * itemsize:
        raise RecordError(f"{bad} lies outside the blob or has the wrong size")
    data = np.frombuffer(buf, dtype=np_dtype, count=count, offset=data_start + begin)
    return HostArray(data.reshape(shape), mx_dtype)


def record_from_buffer(buf: np.ndarray | bytes) -> Record:
    """Decode a blob from `record_to_bytes` without copying its arrays: the record's arrays
    are `HostArray` views of `buf` (keep `buf` unchanged while they live). Raises
    `RecordError` for anything that is not a well-formed record blob."""
    if not isinstance(buf, np.ndarray):
        buf = np.frombuffer(buf, dtype=np.uint8)
    header, meta, data_start = _parse_header(buf)
    arrays = {name: _host_array(buf, name, info, data_start) for name, info in header.items()}
    if meta.get("format") != _FORMAT or meta.get("kind") not in KINDS:
        raise RecordError("blob is not an mlx_nbengine record")
    try:
        rec = Record(meta["kind"], arrays, dict(meta))
        _ = (rec.block, rec.block_size, rec.layers)  # parse now, so a bad blob fails here
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise RecordError(f"record metadata is malformed: {e}") from e
    return rec


def record_from_bytes(data: bytes) -> Record:
    """Decode a blob from `record_to_bytes` into MLX arrays (evaluated). Raises
    `RecordError`."""
    rec = record_from_buffer(data)
    arrays = {name: a.to_mx() for name, a in rec.arrays.items()}
    mx.eval(arrays)
    return Record(rec.kind, arrays, rec.meta)


# --- checks before a record reaches the model -------------------------------------------------


@dataclass(frozen=True)
class ArraySpec:
    """What one record array may look like: its dtypes and shape, None where a dimension
    may vary (the token axis of kv/window arrays; any dimension two saved records
    disagreed on)."""

    dtypes: frozenset
    shape: tuple[int | None, ...]

    def accepts(self, a: mx.array) -> bool:
        if a.dtype not in self.dtypes or a.ndim != len(self.shape):
            return False
        return all(w is None or w == d for w, d in zip(self.shape, a.shape, strict=True))

    def describe(self) -> str:
        dims = ", ".join("*" if d is None else str(d) for d in self.shape)
        return f"({dims}) {'/'.join(sorted(str(d).rsplit('.', 1)[-1] for d in self.dtypes))}"


Signature = dict[str, ArraySpec | None]
"""Array name -> its `ArraySpec` (None: saved records disagreed on its rank: any array)."""

_TOKEN_AXIS = 2  # keys/values are (batch, heads, tokens, head_dim)


def record_signature(rec: Record) -> Signature:
    """The shapes and dtypes of `rec`'s arrays, the token axis of kv/window arrays free."""
    out: Signature = {}
    for name, a in rec.arrays.items():
        shape: list[int | None] = list(a.shape)
        if rec.kind != "state" and a.ndim > _TOKEN_AXIS:
            shape[_TOKEN_AXIS] = None
        out[name] = ArraySpec(frozenset([a.dtype]), tuple(shape))
    return out


def merge_signatures(old: Signature, new: Signature) -> Signature:
    """A signature accepting the arrays of both: dtypes joined, differing dimensions freed."""
    out = dict(old)
    for name, spec in new.items():
        if name not in out:
            out[name] = spec
            continue
        have = out[name]
        if have is None or spec is None or len(have.shape) != len(spec.shape):
            out[name] = None
        else:
            dims = zip(have.shape, spec.shape, strict=True)
            out[name] = ArraySpec(
                have.dtypes | spec.dtypes, tuple(a if a == b else None for a, b in dims)
            )
    return out


def check_signature(rec: Record, signature: Signature) -> None:
    """Raise `RecordError` unless every array of `rec` fits `signature`."""
    for name, a in rec.arrays.items():
        if name not in signature:
            raise RecordError(f"{rec.kind} record of block {rec.block} holds an unknown {name}")
        spec = signature[name]
        if spec is not None and not spec.accepts(a):
            got = ArraySpec(frozenset([a.dtype]), tuple(a.shape)).describe()
            raise RecordError(
                f"{rec.kind} record of block {rec.block}: {name} is {got}, "
                f"the model's cache holds {spec.describe()}"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(meta: dict, i: int, *names: str) -> list[int]:
    values = [meta.get(n) for n in names]
    if not all(_is_int(v) for v in values):
        raise RecordError(f"layer {i} metadata lacks integer {', '.join(names)}")
    return values


def _skeleton_arrays(skeleton: Any, out: list[str]) -> list[str]:
    """The array names a snapshot skeleton references; `RecordError` if it is malformed."""
    if isinstance(skeleton, list):
        for v in skeleton:
            _skeleton_arrays(v, out)
    elif isinstance(skeleton, dict):
        if set(skeleton) == {"$array"} and isinstance(skeleton["$array"], str):
            out.append(skeleton["$array"])
        elif set(skeleton) == {"$dict"} and isinstance(skeleton["$dict"], dict):
            for v in skeleton["$dict"].values():
                _skeleton_arrays(v, out)
        else:
            raise RecordError("state snapshot skeleton is malformed")
    elif not (skeleton is None or isinstance(skeleton, bool | int | float | str)):
        raise RecordError("state snapshot skeleton is malformed")
    return out


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

    The metadata must fit: the kind, block and block size; exactly the model's layers of
    that kind, of the template's classes (when `classes` is given); the token range of
    each kv/window layer (the whole block with `whole`, else its first tokens: a cut's
    follower), the window size, a state's offset (the block's end with `whole`) and a
    well-formed snapshot skeleton. The arrays must be exactly those the metadata names;
    kv/window arrays are ``(1, heads, tokens, head_dim)`` with the layer's token count.
    With `signature` every array must also fit it (`check_signature`).
    """
    if rec.kind != kind or rec.block != block or rec.block_size != block_size:
        raise RecordError(f"record under block {block} {kind} is another block's")
    layers = rec.layers
    want = {i for i, k in enumerate(layer_kinds) if k == kind}
    if set(layers) != want:
        raise RecordError(f"{kind} record of block {block} has layers {sorted(layers)}")
    first, last = block * block_size, (block + 1) * block_size
    names: list[str] = []
    for i in sorted(want):
        meta = layers[i]
        if not isinstance(meta, dict):
            raise RecordError(f"layer {i} metadata is malformed")
        if classes is not None and meta.get("class") != classes[i]:
            raise RecordError(f"{kind} record of layer {i} is for {meta.get('class')!r}")
        if kind == "state":
            (offset,) = _ints(meta, i, "offset")
            if not (offset == last if whole else first < offset <= last):
                raise RecordError(f"state record of layer {i} is for offset {offset}")
            if meta.get("protocol") not in ("snapshot", "state"):
                raise RecordError(f"state record of layer {i} has no known protocol")
            skeleton = meta.get("snapshot")
            own = _skeleton_arrays(skeleton, [])
            if meta["protocol"] == "state" and not (
                isinstance(skeleton, dict) and "state" in skeleton.get("$dict", {})
            ):
                raise RecordError(f"state record of layer {i} holds no state")
            if any(not n.startswith(f"L{i}.") for n in own):
                raise RecordError(f"state record of layer {i} refers to another layer's arrays")
            names += own
            continue
        start, end = _ints(meta, i, "start", "end")
        if not (end == last if whole else first < end <= last):
            raise RecordError(f"{kind} record of layer {i} ends at {end}, not in block {block}")
        if kind == "window":
            (size,) = _ints(meta, i, "max_size")
            if size != windows[i]:
                raise RecordError(f"window record of layer {i} is for W={size}")
            lo = max(first, end - size)
        else:
            lo = first
        if start != lo:
            raise RecordError(f"{kind} record of layer {i} starts at {start}, not {lo}")
        for name in (f"L{i}.k", f"L{i}.v"):
            a = rec.arrays.get(name)
            if a is None:
                raise RecordError(f"{kind} record of block {block} lacks {name}")
            if a.ndim != 4 or a.shape[0] != 1 or a.shape[_TOKEN_AXIS] != end - start:
                raise RecordError(
                    f"{kind} record of block {block}: {name} has shape {tuple(a.shape)}, "
                    f"expected (1, heads, {end - start}, head_dim)"
                )
            names.append(name)
    if sorted(rec.arrays) != sorted(set(names)):
        extra = sorted(set(rec.arrays) - set(names))
        raise RecordError(f"{kind} record of block {block} holds arrays {extra or 'missing'}")
    if signature is not None:
        check_signature(rec, signature)
