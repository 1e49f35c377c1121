"""Assembly: rebuild a live cache at boundary ``b = n * block_size`` from block records.

The *template* is a fresh cache list from the model (``make_prompt_cache``);
assembly fills its layers in place so that the model continues exactly as if
it had prefilled the first ``b`` tokens itself:

- ``"kv"`` layers get the concatenated slices of blocks ``0..n-1``, offset ``b``.
- ``"window"`` layers get the last ``min(W, b)`` tokens in temporal order,
  offset ``b`` and write index ``_idx`` at the end of that buffer. This equals a
  freshly prefilled rotating cache for every later update: a multi-token update
  first trims to the last ``W - 1`` tokens, a single-token update trims to the
  last ``W`` and rotates, and both see the same tokens in the same order.
- ``"state"`` layers load the checkpoint taken at ``b`` (block ``n-1``'s record).
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx

from mlx_nbengine.cache.records import (
    Record,
    RecordError,
    RecordKind,
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
) -> list:
    """Fill `template_cache` (fresh, empty) to hold ``n_blocks`` restored blocks; return it.

    Raises `RecordError` when a needed record is missing or does not fit the template.
    """
    if n_blocks <= 0:
        return template_cache
    b = n_blocks * block_size

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
            keys = mx.concatenate([r.arrays[f"L{i}.k"] for r in recs], axis=2)
            values = mx.concatenate([r.arrays[f"L{i}.v"] for r in recs], axis=2)
            if keys.shape[2] != b or values.shape[2] != b:
                raise RecordError(f"kv layer {i} assembles {keys.shape[2]} tokens, expected {b}")
            c.keys, c.values, c.offset = keys, values, b
        elif kind == "window":
            window = int(c.max_size)
            lo = max(0, b - window)
            parts_k, parts_v, covered = [], [], None
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
                parts_k.append(rec.arrays[f"L{i}.k"])
                parts_v.append(rec.arrays[f"L{i}.v"])
                covered = meta["end"]
            if covered != b:
                raise RecordError(f"window records of layer {i} end at {covered}, expected {b}")
            keys = mx.concatenate(parts_k, axis=2)[..., -(b - lo) :, :]
            values = mx.concatenate(parts_v, axis=2)[..., -(b - lo) :, :]
            c.keys, c.values, c.offset, c._idx = keys, values, b, keys.shape[2]
        else:
            rec = record(n_blocks - 1, "state")
            meta = _layer(rec, i)
            if meta.get("offset") != b:
                raise RecordError(f"state record of layer {i} is for offset {meta.get('offset')}")
            restore_snapshot(c, meta, rec.arrays)
    return template_cache
