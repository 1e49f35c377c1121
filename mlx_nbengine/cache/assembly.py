"""Assembly: rebuild a live cache at boundary ``b = n * block_size`` from block records.

The *template* is a fresh cache list from the model (``make_prompt_cache``);
assembly fills its layers in place so that the model continues exactly as if
it had prefilled the first ``b`` tokens itself:

- ``"kv"`` layers get the concatenated slices of blocks ``0..n-1``, offset ``b``, in a
  buffer with room up to the layer's next growth step (``KVCache.step``), zeros after.
- ``"window"`` layers get the last ``min(W, b)`` tokens in temporal order,
  offset ``b`` and write index ``_idx`` at the end of that buffer. This equals a
  freshly prefilled rotating cache for every later update: a multi-token update
  first trims to the last ``W - 1`` tokens, a single-token update trims to the
  last ``W`` and rotates, and both see the same tokens in the same order.
- ``"state"`` layers load the checkpoint taken at ``b`` (block ``n-1``'s record).

A *cut* goes on past ``b`` into block ``n``: its first ``k`` tokens come from the
records of a stored block that followed the same prefix (a *follower*, whole or
partial), found under ``records_by_block[n]``; the cache then holds ``p = b + k``
tokens. ``"kv"`` layers append the follower's first ``k`` tokens; ``"window"`` layers
(window ``W >= B``, so a follower's window record holds its block from the start) take
the last ``min(W, p)`` tokens of the chain's window records followed by the follower's
first ``k``, exactly the tokens a cold prefill to ``p`` would hold. ``"state"`` layers
resume only from a state taken exactly at ``p``: the follower's own ``"state"`` record,
which a partial follower has when it was stored at its end (the planner cuts such models
only at the whole length of such a follower).

Records read from the store hold `HostArray` views of the blobs (see `records`): each
kv/window layer's slices are copied once, from those views into one new MLX array
(through its writable numpy view), with no MLX array per record in between.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx

from mlx_nbengine.cache.records import (
    HostArray,
    Record,
    RecordError,
    RecordKind,
    host_view,
    layer_kinds,
    restore_snapshot,
)

__all__ = ["assemble", "window_blocks"]


def window_blocks(n_blocks: int, *, window: int, block_size: int) -> range:
    """Blocks whose window records a window-``window`` layer needs at boundary ``n*B``."""
    b = n_blocks * block_size
    return range(max(0, b - window) // block_size, n_blocks)


def _layer(rec: Record, i: int) -> dict:
    meta = rec.layers.get(i)
    if meta is None:
        raise RecordError(f"{rec.kind} record of block {rec.block} lacks layer {i}")
    return meta


def assemble(
    records_by_block: Mapping[int, Mapping[RecordKind, Record]],
    *,
    n_blocks: int,
    block_size: int,
    template_cache: list,
    cut_tokens: int = 0,
) -> list:
    """Fill `template_cache` (fresh, empty) to hold ``n_blocks`` restored blocks, then
    `cut_tokens` more from the follower records under block ``n_blocks`` (a cut, see the
    module docstring); return it.

    Raises `RecordError` when a needed record is missing or does not fit the template (or
    the slices of one layer do not join).
    """
    if not 0 <= cut_tokens < block_size:
        raise RecordError(f"a cut restores 0 to {block_size - 1} tokens, not {cut_tokens}")
    if n_blocks <= 0 and cut_tokens == 0:
        return template_cache
    b = n_blocks * block_size
    p = b + cut_tokens
    on_device: dict[int, dict] = {}  # a state record's arrays as MLX arrays, by record

    def record(block: int, kind: RecordKind) -> Record:
        rec = records_by_block.get(block, {}).get(kind)
        if rec is None:
            raise RecordError(f"no {kind} record for block {block}")
        return rec

    for i, (c, kind) in enumerate(zip(template_cache, layer_kinds(template_cache), strict=True)):
        if kind == "kv":
            recs = [record(j, "kv") for j in range(n_blocks)]
            for j, rec in enumerate(recs):
                meta = _layer(rec, i)
                if (meta["start"], meta["end"]) != (j * block_size, (j + 1) * block_size):
                    raise RecordError(f"kv record of block {j} covers the wrong tokens")
            parts_k = [r.arrays[f"L{i}.k"] for r in recs]
            parts_v = [r.arrays[f"L{i}.v"] for r in recs]
            if cut_tokens:
                k, v = _cut(record(n_blocks, "kv"), i, b, cut_tokens)
                parts_k.append(k)
                parts_v.append(v)
            if _tokens(parts_k) != p or _tokens(parts_v) != p:
                raise RecordError(f"kv layer {i} assembles {_tokens(parts_k)} tokens, not {p}")
            # Room up to the layer's next step, as its own growth would leave: the tail's
            # first tokens then go in place instead of into a grown copy.
            step = int(getattr(c, "step", 1) or 1)
            room = -(-p // step) * step
            c.keys, c.values, c.offset = _join(parts_k, i, room), _join(parts_v, i, room), p
        elif kind == "window":
            window = int(c.max_size)
            lo = max(0, p - window)
            parts_k, parts_v, covered = [], [], None
            if cut_tokens and window < block_size:
                raise RecordError(f"window layer {i} (W={window}) cannot be cut inside a block")
            for j in window_blocks(n_blocks, window=window, block_size=block_size):
                rec = record(j, "window")
                meta = _layer(rec, i)
                if meta["max_size"] != window:
                    raise RecordError(f"window record of layer {i} is for W={meta['max_size']}")
                if covered is None:
                    if meta["start"] > lo:
                        raise RecordError(f"window record of block {j} starts after {lo}")
                    covered = meta["start"]
                elif meta["start"] != covered:
                    raise RecordError(f"window records of layer {i} leave a gap at {covered}")
                if meta["end"] > lo:  # only the tokens from `lo` on are kept: copy no more
                    skip = max(0, lo - meta["start"])
                    parts_k.append(rec.arrays[f"L{i}.k"][..., skip:, :])
                    parts_v.append(rec.arrays[f"L{i}.v"][..., skip:, :])
                covered = meta["end"]
            if cut_tokens and covered in (None, b):
                k, v = _cut(record(n_blocks, "window"), i, b, cut_tokens)
                parts_k.append(k[..., max(0, lo - b) :, :])
                parts_v.append(v[..., max(0, lo - b) :, :])
                covered = p
            if covered != p:
                raise RecordError(f"window records of layer {i} end at {covered}, expected {p}")
            if _tokens(parts_k) != p - lo or _tokens(parts_v) != p - lo:
                raise RecordError(f"window layer {i} assembles {_tokens(parts_k)} tokens")
            keys, values = _join(parts_k, i), _join(parts_v, i)
            c.keys, c.values, c.offset, c._idx = keys, values, p, keys.shape[2]
        else:
            # A cut resumes from the follower's own state, taken at its end (= p).
            rec = record(n_blocks, "state") if cut_tokens else record(n_blocks - 1, "state")
            meta = _layer(rec, i)
            if meta.get("offset") != p:
                raise RecordError(f"state record of layer {i} is for offset {meta.get('offset')}")
            if id(rec) not in on_device:
                on_device[id(rec)] = {
                    n: a.to_mx() if isinstance(a, HostArray) else a for n, a in rec.arrays.items()
                }
            restore_snapshot(c, meta, on_device[id(rec)])
    return template_cache


def _tokens(parts: list) -> int:
    return sum(int(a.shape[2]) for a in parts if a.ndim == 4)


def _join(parts: list, i: int, room: int = 0) -> mx.array:
    """Layer `i`'s token slices (MLX arrays or `HostArray` views of the blobs read) in one
    MLX array of at least `room` tokens (zeros after the parts); `RecordError` when their
    shapes disagree (`PrefixCache.load` checks records against the model first: this is a
    last guard).

    Slices read from the store are copied once, from the blob straight into the new array
    through its numpy view; only MLX slices with no room asked for are concatenated."""
    if not parts:
        raise RecordError(f"no records for layer {i}")
    if room <= _tokens(parts) and all(isinstance(a, mx.array) for a in parts):
        try:
            return mx.concatenate(parts, axis=2)
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
    tokens = _tokens(parts)
    storage = mx.uint16 if first.dtype == mx.bfloat16 else first.dtype
    out = mx.zeros((*first.shape[:2], max(tokens, room), first.shape[3]), dtype=storage)
    view = host_view(out)
    at = 0
    for a in parts:
        n = a.shape[2]
        view[:, :, at : at + n, :] = a.data if isinstance(a, HostArray) else host_view(a)
        at += n
    return out.view(first.dtype) if storage != first.dtype else out


def _cut(rec: Record, i: int, start: int, k: int) -> tuple[mx.array, mx.array]:
    """Layer `i`'s first `k` tokens of a follower record, which must start at `start`."""
    meta = _layer(rec, i)
    if rec.kind == "window" and meta["max_size"] < rec.block_size:
        raise RecordError(f"window record of layer {i} does not hold its block from the start")
    if meta["start"] != start or meta["end"] - start < k:
        raise RecordError(
            f"{rec.kind} record of layer {i} covers [{meta['start']}, {meta['end']}), "
            f"a cut needs [{start}, {start + k})"
        )
    return rec.arrays[f"L{i}.k"][..., :k, :], rec.arrays[f"L{i}.v"][..., :k, :]
