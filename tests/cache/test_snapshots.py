"""A layer cache's state as a JSON skeleton plus named arrays (`cache.snapshots`): both
protocols on the libraries' own cache classes (mlx-lm's ``.state``, mlx-vlm's
``prefix_cache_snapshot``), copies rather than shared arrays, and the errors of a record
that does not fit."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models import cache as lm_cache
from mlx_vlm.models import cache as vlm_cache

from mlx_nbengine.cache.records import RecordError
from mlx_nbengine.cache.snapshots import restore_snapshot, skeleton_arrays, take_snapshot


def conv_and_state() -> lm_cache.ArraysCache:
    layer = lm_cache.ArraysCache(size=2)
    layer[0] = mx.arange(6, dtype=mx.float32).reshape(1, 2, 3)
    layer[1] = mx.ones((1, 2, 2, 2))
    return layer


def meta_of(layer, taken: dict) -> dict:
    # What the recurrent kind keeps per layer in a record's metadata: JSON all the way.
    return json.loads(json.dumps({"class": type(layer).__name__, **taken}))


def test_an_mlx_lm_cache_round_trips_through_its_state():
    layer, arrays = conv_and_state(), {}
    taken = take_snapshot(layer, arrays, "7")
    assert taken["protocol"] == "state"
    assert sorted(arrays) == ["7.0", "7.1"]
    assert skeleton_arrays(taken["snapshot"], []) == ["7.0", "7.1"]
    fresh = lm_cache.ArraysCache(size=2)
    restore_snapshot(fresh, meta_of(layer, taken), arrays)
    # Its state is (the arrays, left padding, lengths): None stays None.
    assert fresh.state[1:] == (None, None)
    for got, want in zip(fresh.cache, layer.cache, strict=True):
        assert mx.array_equal(got, want)


def test_the_snapshot_holds_copies_not_the_live_arrays():
    layer, arrays = conv_and_state(), {}
    take_snapshot(layer, arrays, "0")
    assert all(a is not s for a, s in zip(arrays.values(), layer.cache, strict=True))


def test_an_mlx_vlm_cache_uses_its_own_snapshot_protocol():
    layer = vlm_cache.ArraysCache(size=2)
    layer[0] = mx.full((1, 3, 4), 2.0)
    layer[1] = mx.full((1, 2, 4, 4), 3.0)
    arrays: dict[str, mx.array] = {}
    taken = take_snapshot(layer, arrays, "3")
    assert taken["protocol"] == "snapshot"
    assert "$dict" in taken["snapshot"]  # {"state": ..., "meta_state": ...}
    fresh = vlm_cache.ArraysCache(size=2)
    restore_snapshot(fresh, meta_of(layer, taken), arrays)
    assert mx.array_equal(fresh[0], layer[0]) and mx.array_equal(fresh[1], layer[1])


def test_a_record_for_another_class_or_missing_an_array_is_refused():
    layer, arrays = conv_and_state(), {}
    meta = meta_of(layer, take_snapshot(layer, arrays, "0"))
    with pytest.raises(RecordError, match="state record is for ArraysCache"):
        restore_snapshot(lm_cache.KVCache(), meta, arrays)
    with pytest.raises(RecordError, match="record lacks array 0.1"):
        restore_snapshot(lm_cache.ArraysCache(size=2), meta, {"0.0": arrays["0.0"]})


def test_a_layer_that_refuses_the_snapshot_is_a_record_error_not_a_crash():
    layer, arrays = conv_and_state(), {}
    meta = meta_of(layer, take_snapshot(layer, arrays, "0"))
    meta["snapshot"] = {"$dict": {}}  # no "state" in it
    with pytest.raises(RecordError, match="does not fit ArraysCache"):
        restore_snapshot(lm_cache.ArraysCache(size=2), meta, arrays)


def test_a_state_holding_something_else_cannot_be_checkpointed():
    class Odd:
        state = [object()]

    with pytest.raises(RecordError, match="holding object"):
        take_snapshot(Odd(), {}, "0")


@pytest.mark.parametrize(
    "skeleton",
    [{"$array": 3}, {"$dict": []}, {"other": 1}, {"$array": "a", "extra": 1}, b"bytes"],
)
def test_a_malformed_skeleton_is_a_record_error(skeleton):
    with pytest.raises(RecordError, match="malformed"):
        skeleton_arrays(skeleton, [])


def test_skeleton_arrays_finds_names_in_nested_lists_and_dicts():
    skeleton = [{"$dict": {"a": {"$array": "x.0"}, "b": [None, 1, {"$array": "x.1"}]}}, "s"]
    assert skeleton_arrays(skeleton, []) == ["x.0", "x.1"]
