"""Reading records back for one restore (`cache.reader`) on its own, over a real
`BlockStore`: which records a chain needs per kind, the order `touch` leaves them in, one
arena per reading, a gone or unfit record refused, and a signature learned from the
process's own records taking precedence over a first read."""

from __future__ import annotations

import mmap
import resource

import mlx.core as mx
import pytest
from mlx_lm.models import cache as lm_cache

from mlx_nbengine.cache.kinds import extract_block_records
from mlx_nbengine.cache.reader import Arena, RecordReader
from mlx_nbengine.cache.records import RecordError, RecordKey, record_to_bytes
from mlx_nbengine.cache.store import BlockStore

B, W = 16, 24
KINDS = ["kv", "window", "state"]
KEYS = [f"block{j}" for j in range(4)]


def layers() -> list:
    return [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=W), lm_cache.ArraysCache(2)]


def feed(cache: list, n: int, seed: int) -> None:
    """`n` tokens of random keys, values and a state into each layer."""
    mx.random.seed(seed)
    for layer in cache[:2]:
        layer.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    cache[2][0] = mx.random.normal((1, 3, 4))
    cache[2][1] = mx.random.normal((1, 2, 4, 4))


@pytest.fixture
def store(tmp_path):
    with BlockStore(budget_bytes=1 << 26, directory=tmp_path) as s:
        yield s


def reader_of(store) -> RecordReader:
    return RecordReader(
        store=store, block_size=B, layer_kinds=KINDS, windows=[None, W, None], layer_classes=None
    )


def save_chain(store, reader: RecordReader, n_blocks: int = 4, *, learn: bool = True) -> None:
    cache = layers()
    for j in range(n_blocks):
        feed(cache, B, seed=j)
        records = extract_block_records(cache, block=j, block_size=B)
        if learn:
            reader.learn(records)
        for kind, rec in records.items():
            assert store.put(KEYS[j], kind, record_to_bytes(rec))


def test_a_chain_needs_every_kv_block_the_last_windows_and_the_last_state(store):
    reader = reader_of(store)
    needed = reader.needed(KEYS, 4)
    by_kind = {k: [key for key, kind in needed if kind == k] for k in KINDS}
    assert by_kind["kv"] == KEYS  # every block's keys and values
    assert by_kind["window"] == KEYS[2:]  # a 24-token window reaches back into block 2
    assert by_kind["state"] == KEYS[3:]  # the state at the chain's end only
    assert reader.needed(KEYS, 0) == []
    assert reader.max_window == W and reader.kinds == tuple(KINDS)


def test_touch_leaves_the_needed_records_newest_with_the_first_block_last(store, monkeypatch):
    reader = reader_of(store)
    save_chain(store, reader)
    touched: list[list[RecordKey]] = []
    monkeypatch.setattr(store, "touch", touched.append)
    reader.touch(KEYS)
    (order,) = touched
    needed = reader.needed(KEYS, 4)
    # What the whole chain does not need goes first (oldest), then the needed records from
    # the last block to the first: evicting from the oldest end cuts the suffix first.
    assert order[-len(needed) :] == list(reversed(needed))
    assert set(order[: -len(needed)]) == {
        RecordKey(KEYS[j], k) for j in range(4) for k in KINDS
    } - set(needed)


def test_a_reading_reads_into_one_arena_and_checks_each_record(store):
    reader = reader_of(store)
    save_chain(store, reader)
    items = reader.needed(KEYS, 4)
    reading = reader.reading(items, mapped=False)
    assert reading.arena is not None
    assert reading.arena.buffer.size == sum(store.size(key, kind) for key, kind in items)
    for j, key in enumerate(KEYS):
        rec = reading.read(key, j, "kv")
        assert rec.kind == "kv" and rec.meta["block"] == str(j)
    with pytest.raises(RecordError, match="gone"):
        reading.read("never-stored", 0, "kv")


def test_a_record_of_another_block_or_shape_is_refused(store):
    reader = reader_of(store)
    save_chain(store, reader)
    reading = reader.reading(reader.needed(KEYS, 4), mapped=False)
    with pytest.raises(RecordError):
        reading.read(KEYS[1], 2, "kv")  # block 1's record read as block 2's
    wide = layers()
    wide[0].update_and_fetch(mx.zeros((1, 4, B, 8)), mx.zeros((1, 4, B, 8)))  # 4 heads, not 2
    wide[1].update_and_fetch(mx.zeros((1, 2, B, 8)), mx.zeros((1, 2, B, 8)))
    wide[2][0], wide[2][1] = mx.zeros((1, 3, 4)), mx.zeros((1, 2, 4, 4))
    bad = extract_block_records(wide, block=0, block_size=B)["kv"]
    store.delete("odd", "kv")
    assert store.put("odd", "kv", record_to_bytes(bad))
    with pytest.raises(RecordError):
        reader.reading([RecordKey("odd", "kv")], mapped=False).read("odd", 0, "kv")


def test_before_anything_is_learned_the_first_read_of_a_kind_stands_in(store):
    reader = reader_of(store)
    save_chain(store, reader, learn=False)
    reading = reader.reading(reader.needed(KEYS, 4), mapped=False)
    reading.read(KEYS[0], 0, "kv")
    assert set(reading.first_read) == {"kv"} and not reader.signatures
    reader.learn(extract_block_records(_fed(), block=0, block_size=B))
    assert set(reader.signatures) == set(KINDS)


def _fed() -> list:
    cache = layers()
    feed(cache, B, seed=99)
    return cache


def test_an_arena_hands_out_slices_until_it_is_full():
    arena = Arena(10)
    first, second = arena.take(6), arena.take(4)
    assert first is not None and second is not None and (first.size, second.size) == (6, 4)
    assert arena.take(1) is None
    first[:] = 1
    assert arena.buffer[:6].tolist() == [1] * 6  # views of the one buffer


def test_an_arenas_views_outlive_it_and_its_pages_come_mapped_at_once():
    arena = Arena(3 << 20)
    view = arena.take(3 << 20)
    view[:] = 7
    del arena
    assert int(view.sum()) == 7 * (3 << 20)  # the mapping lives while a view does
    if hasattr(mmap, "MAP_POPULATE"):
        # One call mapped every page: writing it all takes no page faults of its own.
        fresh = Arena(8 << 20)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        fresh.buffer[:] = 1
        assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < 64
    assert Arena(0).take(0).size == 0
