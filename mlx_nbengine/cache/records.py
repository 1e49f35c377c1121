"""Records: what one block keeps of one layer kind, and how it travels as bytes.

A *record* bundles all layers of one *record kind* for one block: arrays named
``L<layer>.<name>`` plus string metadata (the blob format, the kind and its version, the
block, the block size, and per layer the class name, token range and scalars as JSON).
The kinds themselves (``"kv"``, ``"window"``, ``"state"``: what each keeps, checks and
rebuilds) are classes in `kinds`. A *partial record* holds only the first tokens of its
block (a stored partial block, see `blocks.partial_key`).

Records travel as safetensors blobs (`record_to_bytes`; `record_from_buffer` reads one back
without copying its arrays: `HostArray` views of the blob, which assembly copies once into
the cache it rebuilds; `record_from_bytes` copies them into MLX arrays).

A *signature* is what the arrays of one kind's records may look like (`ArraySpec`: dtypes
and a shape with free dimensions), learned from the records the engine itself extracted
(`record_signature`, merged over every record it saved with `merge_signatures`); a record
read back must fit it (`check_signature`) before it reaches a model.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import mlx.core as mx
import numpy as np

__all__ = [
    "BLOB_FORMAT",
    "KIND_NAMES",
    "TOKEN_AXIS",
    "ArraySpec",
    "HostArray",
    "Record",
    "RecordError",
    "RecordKey",
    "RecordKind",
    "Signature",
    "check_signature",
    "host_view",
    "merge_signatures",
    "record_from_buffer",
    "record_from_bytes",
    "record_signature",
    "record_to_bytes",
]

RecordKind = Literal["kv", "window", "state"]
KIND_NAMES: tuple[RecordKind, ...] = ("kv", "window", "state")

BLOB_FORMAT = "mlx_nbengine.record.v2"
"""The blob's layout (v2: each record names its kind's version, ``kind_version``)."""

TOKEN_AXIS = 2  # keys/values are (batch, heads, tokens, head_dim)


class RecordKey(NamedTuple):
    """Where the store holds one record: its block's key and its kind."""

    key: str
    kind: RecordKind


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
    if meta.get("format") != BLOB_FORMAT or meta.get("kind") not in KIND_NAMES:
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
    may vary (the token axis of token slices; any dimension two saved records
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


def record_signature(rec: Record, *, free_token_axis: bool) -> Signature:
    """The shapes and dtypes of `rec`'s arrays; with `free_token_axis` the token axis of
    every array that has one is left free (records of token slices)."""
    out: Signature = {}
    for name, a in rec.arrays.items():
        shape: list[int | None] = list(a.shape)
        if free_token_axis and a.ndim > TOKEN_AXIS:
            shape[TOKEN_AXIS] = None
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
