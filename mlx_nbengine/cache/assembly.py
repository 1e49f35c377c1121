"""Assembly: what one rebuild of a live cache reads, and the copying of token slices.

A *rebuild* fills a *template* (a fresh cache list from the model, ``make_prompt_cache``)
in place so that the model continues exactly as if it had prefilled the first ``p``
tokens itself: ``n`` whole blocks (the *boundary* ``b = n * B``), then, for a *cut*, the
first ``k`` tokens of block ``n`` (``p = b + k``) from the records of a stored block that
followed the same prefix (a *follower*), found under block ``n``. `Rebuild` holds the
records read and answers which one a layer needs; each layer kind rebuilds its layers
(`kinds`, whose `assemble` runs the rebuild over a template's layers).

Records read from the store hold `HostArray` views of the blobs (see `records`): a
layer's token slices are copied once, from those views into one new MLX array
(`join_tokens`, through the array's writable numpy view), with no MLX array per record
in between.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_nbengine.cache.records import (
    TOKEN_AXIS,
    HostArray,
    Record,
    RecordError,
    RecordKind,
    host_view,
)

__all__ = ["Rebuild", "join_tokens", "layer_meta", "token_count"]


@dataclass
class Rebuild:
    """`n_blocks` whole blocks, then `cut_tokens` of block `n_blocks` from the follower's
    records stored under it; `records` by block and kind (see the module docstring)."""

    records: Mapping[int, Mapping[RecordKind, Record]]
    n_blocks: int
    block_size: int
    cut_tokens: int = 0
    # A state record's arrays as MLX arrays, by id of the record: converted once for all
    # the layers it holds.
    on_device: dict[int, dict] = field(default_factory=dict)

    @property
    def boundary(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def point(self) -> int:
        """The tokens the rebuilt cache holds: the boundary plus the cut."""
        return self.boundary + self.cut_tokens

    def record(self, block: int, kind: RecordKind) -> Record:
        rec = self.records.get(block, {}).get(kind)
        if rec is None:
            raise RecordError(f"no {kind} record for block {block}")
        return rec

    def chain(self, kind: RecordKind, blocks: Iterable[int]) -> list[Record]:
        """The `kind` records of `blocks` (of the restored chain), in order."""
        return [self.record(j, kind) for j in blocks]

    def cut(self, kind: RecordKind) -> Record:
        """The follower's `kind` record that the cut reads its first tokens from."""
        return self.record(self.n_blocks, kind)


def layer_meta(rec: Record, i: int) -> dict:
    """Layer `i`'s metadata in `rec`; `RecordError` when the record lacks it."""
    meta = rec.layers.get(i)
    if meta is None:
        raise RecordError(f"{rec.kind} record of block {rec.block} lacks layer {i}")
    return meta


def token_count(parts: list) -> int:
    return sum(int(a.shape[TOKEN_AXIS]) for a in parts if a.ndim == 4)


def join_tokens(parts: list, i: int, room: int = 0) -> mx.array:
    """Layer `i`'s token slices (MLX arrays or `HostArray` views of the blobs read) in one
    MLX array of at least `room` tokens (zeros after the parts); `RecordError` when their
    shapes disagree (`PrefixCache.load` checks records against the model first: this is a
    last guard).

    Slices read from the store are copied once, from the blob straight into the new array
    through its numpy view; only MLX slices with no room asked for are concatenated."""
    if not parts:
        raise RecordError(f"no records for layer {i}")
    if room <= token_count(parts) and all(isinstance(a, mx.array) for a in parts):
        try:
            return mx.concatenate(parts, axis=TOKEN_AXIS)
        except ValueError as e:
            raise RecordError(f"the records of layer {i} do not join: {e}") from e
    first = parts[0]
    if any(
        a.ndim != 4
        or a.dtype != first.dtype
        or (a.shape[:2], a.shape[3]) != (first.shape[:2], first.shape[3])
        for a in parts
    ):
        raise RecordError(f"the records of layer {i} do not join: shapes or dtypes differ")
    tokens = token_count(parts)
    joined = _joined_on_kernels(parts, max(tokens, room), first.dtype)
    if joined is not None:
        return joined
    storage = mx.uint16 if first.dtype == mx.bfloat16 else first.dtype
    out = mx.zeros((*first.shape[:2], max(tokens, room), first.shape[3]), dtype=storage)
    view = host_view(out)
    at = 0
    for a in parts:
        n = a.shape[TOKEN_AXIS]
        view[:, :, at : at + n, :] = a.data if isinstance(a, HostArray) else host_view(a)
        at += n
    return out.view(first.dtype) if storage != first.dtype else out


def _joined_on_kernels(parts: list, tokens: int, dtype: mx.Dtype) -> mx.array | None:
    """`parts` joined by `kernels.join_tokens` (one copy, nothing written before it), or None
    where the CPU kernels are not active or a part's layout does not suit them (the numpy
    path above then joins them)."""
    from mlx_nbengine import kernels

    if mx.default_device() != mx.cpu or not kernels.status().active:
        return None
    views = [a.data if isinstance(a, HostArray) else host_view(a) for a in parts]
    try:
        return kernels.join_tokens(views, tokens, dtype)
    except ValueError:
        return None
