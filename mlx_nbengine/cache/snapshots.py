"""State snapshots: a layer cache's whole state as a JSON *skeleton* plus named arrays.

A *snapshot* is the layer's own description of itself: mlx-vlm caches offer
``prefix_cache_snapshot()`` (state, meta_state and friends; the *protocol* ``"snapshot"``),
mlx-lm caches carry everything in ``.state`` (the protocol ``"state"``). The *skeleton* is
that snapshot with every array replaced by ``{"$array": name}`` (the array stored under
``name`` in the record) and every dict by ``{"$dict": {...}}``; the recurrent kind
(`kinds.Recurrent`) keeps one per layer in its record's metadata.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_nbengine.cache.records import RecordError

__all__ = ["PROTOCOLS", "restore_snapshot", "skeleton_arrays", "take_snapshot"]

PROTOCOLS = ("snapshot", "state")


def take_snapshot(layer_cache: Any, arrays: dict[str, mx.array], prefix: str) -> dict[str, Any]:
    """The layer's snapshot as ``{"protocol", "snapshot"}`` (the skeleton); its arrays are
    copied into `arrays` under names starting with `prefix`."""
    if hasattr(layer_cache, "prefix_cache_snapshot") and hasattr(
        layer_cache, "prefix_cache_restore"
    ):
        protocol, snapshot = "snapshot", layer_cache.prefix_cache_snapshot()
    else:
        protocol, snapshot = "state", {"state": layer_cache.state}
    return {"protocol": protocol, "snapshot": _encode(snapshot, arrays, prefix)}


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
    """Load one layer's snapshot (its record metadata, the record's MLX arrays) into a
    fresh layer cache of the same class."""
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


def skeleton_arrays(skeleton: Any, out: list[str]) -> list[str]:
    """The array names a skeleton references, appended to `out`; `RecordError` if it is
    malformed."""
    if isinstance(skeleton, list):
        for v in skeleton:
            skeleton_arrays(v, out)
    elif isinstance(skeleton, dict):
        if set(skeleton) == {"$array"} and isinstance(skeleton["$array"], str):
            out.append(skeleton["$array"])
        elif set(skeleton) == {"$dict"} and isinstance(skeleton["$dict"], dict):
            for v in skeleton["$dict"].values():
                skeleton_arrays(v, out)
        else:
            raise RecordError("state snapshot skeleton is malformed")
    elif not (skeleton is None or isinstance(skeleton, bool | int | float | str)):
        raise RecordError("state snapshot skeleton is malformed")
    return out
