"""States taken inside a long prefill step (issue 35): a hybrid model's routed layers hand
over their recurrent states at the block boundaries inside a step (`deltaroute.tapping`), the
runner files them per boundary and layer (`runner._tapped_states`), and the checkpoints make
each the block's ``state`` record (`extract_block_records(..., states=)`)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mlx_nbengine.cache import extract_block_records
from mlx_nbengine.engine.runner import _tapped_states
from mlx_nbengine.models import deltaroute


def arrays_cache(value: float) -> ArraysCache:
    cache = ArraysCache(size=2)
    cache[0], cache[1] = mx.full((1, 3, 8), value), mx.full((1, 2, 4, 4), value)
    return cache


def test_tapping_is_seen_inside_its_block_only():
    assert deltaroute._TAPS.get() is None
    with deltaroute.tapping((16, 32)) as taps:
        assert deltaroute._TAPS.get() is taps and taps.at == (16, 32)
        with deltaroute.tapping((8,)) as inner:
            assert deltaroute._TAPS.get() is inner
        assert deltaroute._TAPS.get() is taps
    assert deltaroute._TAPS.get() is None


def test_tapped_states_map_each_boundary_to_every_recurrent_layer():
    cache = [arrays_cache(0.0), KVCache(), arrays_cache(0.0)]
    taps = deltaroute.Taps(at=(16, 32))
    for i in (0, 2):
        taps.found[id(cache[i])] = [
            [mx.full((1, 3, 8), float(n + i)), mx.full((1, 2, 4, 4), float(n + i))] for n in taps.at
        ]
    states = _tapped_states(cache, taps, start=64)
    assert sorted(states) == [80, 96]  # the step began at token 64
    assert sorted(states[80]) == [0, 2]
    stand_in = states[96][2]
    assert isinstance(stand_in, ArraysCache) and stand_in[1][0, 0, 0, 0].item() == 34.0


def test_a_boundary_some_recurrent_layer_did_not_give_is_left_out():
    cache = [arrays_cache(0.0), arrays_cache(0.0)]
    taps = deltaroute.Taps(at=(16,))
    taps.found[id(cache[0])] = [[mx.zeros((1, 3, 8)), mx.zeros((1, 2, 4, 4))]]
    assert _tapped_states(cache, taps, start=0) == {}


def test_a_state_taken_inside_a_step_becomes_its_blocks_state_record():
    # The live cache has seen 32 tokens; block 0 ends at 16, inside the step.
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, 32, 4)), mx.zeros((1, 1, 32, 4)))
    cache = [arrays_cache(9.0), kv]
    without = extract_block_records(cache, block=0, block_size=16)
    assert set(without) == {"kv"}  # no state: the cache is past the block's end
    records = extract_block_records(cache, block=0, block_size=16, states={0: arrays_cache(1.0)})
    assert set(records) == {"kv", "state"}
    arrays = list(records["state"].arrays.values())
    assert all(mx.all(a == 1.0).item() for a in arrays)  # the stand-in's, not the live 9s
