"""Records: layer kinds, extraction, bytes round trip, and rebuilding live caches.

The caches here are driven directly with random keys/values (no model), for
both mlx-lm's and mlx-vlm's cache classes, so every layer kind and both
RotatingKVCache update paths (multi-token concat, single-token in place) are
covered in milliseconds.
"""

from __future__ import annotations

import io
import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from kernelsets import needs_kernels  # tests/ is on sys.path
from mlx_lm.models import cache as lm_cache
from mlx_vlm.models import cache as vlm_cache

from mlx_nbengine.cache import assembly
from mlx_nbengine.cache.kinds import (
    CutOutOfReach,
    SlidingWindow,
    assemble,
    extract_block_records,
    layer_kinds,
    layer_windows,
)
from mlx_nbengine.cache.records import (
    HostArray,
    RecordError,
    record_from_buffer,
    record_from_bytes,
    record_to_bytes,
)

B = 16  # block size: small so windows both smaller and larger than a block fit in a test


def make_layers(lib, *, window: int = 24):
    """A cache with one layer of every kind: kv, window (keep 0), state (arrays, keep > 0)."""
    return [
        lib.KVCache(),
        lib.RotatingKVCache(max_size=window),
        lib.ArraysCache(size=2),
        lib.RotatingKVCache(max_size=window, keep=4),
    ]


def feed(layers, n: int, *, seed: int) -> list:
    """Advance every layer by `n` tokens of random data; returns what the attention layers saw."""
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    keys = mx.random.normal((1, 2, n, 8), key=k1)
    values = mx.random.normal((1, 2, n, 8), key=k2)
    seen = []
    for c in layers:
        if type(c).__name__ == "ArraysCache":
            # A recurrent layer: its new state depends on the old one and the input.
            old = c[1] if c[1] is not None else mx.zeros((1, 4))
            c[0] = mx.random.normal((1, 3, 4), key=k3)
            c[1] = old * 0.5 + keys.sum(axis=(1, 2))[:, :4]
            seen.append((c[0], c[1]))
        else:
            seen.append(c.update_and_fetch(keys, values))
    mx.eval(seen)
    return seen


def run(layers, steps, *, seed: int = 0):
    out = []
    for i, n in enumerate(steps):
        out = feed(layers, n, seed=seed + i)
    return out


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            assert u.shape == v.shape
            assert mx.array_equal(u, v).item()


def test_layer_kinds_by_class_for_mlx_lm_and_mlx_vlm_caches():
    for lib in (lm_cache, vlm_cache):
        layers = make_layers(lib, window=24)
        assert layer_kinds(layers) == ["kv", "window", "state", "state"]
        assert layer_windows(layers) == [None, 24, None, None]


def test_unknown_cache_class_is_checkpointed_as_state():
    class Custom:
        def __init__(self):
            self.state = [mx.zeros((2,)), 3]

    assert layer_kinds([Custom()]) == ["state"]


@pytest.mark.parametrize("lib", [lm_cache, vlm_cache], ids=["mlx_lm", "mlx_vlm"])
def test_each_record_kind_round_trips_through_bytes(lib):
    layers = make_layers(lib)
    run(layers, [B, B])
    records = extract_block_records(layers, block=1, block_size=B)
    assert set(records) == {"kv", "window", "state"}
    for kind, rec in records.items():
        back = record_from_bytes(record_to_bytes(rec))
        assert back.kind == kind and back.block == 1 and back.block_size == B
        assert back.meta == rec.meta
        assert set(back.arrays) == set(rec.arrays)
        for name, arr in rec.arrays.items():
            assert back.arrays[name].dtype == arr.dtype
            assert mx.array_equal(back.arrays[name], arr).item()


def test_kv_and_window_records_hold_the_block_slice_in_temporal_order():
    layers = make_layers(lm_cache, window=24)
    seen = run(layers, [B, B, B])  # 48 tokens; the window layer holds 23 + 16 of them
    recs = extract_block_records(layers, block=2, block_size=B)
    full_k = seen[0][0]  # the kv layer returns all 48 keys in order
    assert mx.array_equal(recs["kv"].arrays["L0.k"], full_k[..., 2 * B : 3 * B, :]).item()
    # W=24 > B: the whole block [32, 48) is in the window record.
    assert recs["window"].layers[1]["start"] == 2 * B
    assert mx.array_equal(recs["window"].arrays["L1.k"], full_k[..., 2 * B : 3 * B, :]).item()


def test_window_record_after_single_token_steps_uses_the_rotated_buffer():
    layers = make_layers(lm_cache, window=8)  # W=8 < B: the record is the block's last 8 tokens
    seen = None
    keys = []
    run(layers, [B])
    for i in range(B):  # single-token decode steps rotate the buffer
        seen = feed(layers, 1, seed=100 + i)
        keys.append(seen[0][0][..., -1:, :])
    recs = extract_block_records(layers, block=1, block_size=B)
    want = mx.concatenate(keys, axis=2)[..., -8:, :]
    assert recs["window"].layers[1]["start"] == 2 * B - 8
    assert mx.array_equal(recs["window"].arrays["L1.k"], want).item()


def test_state_record_only_exactly_at_the_boundary():
    layers = make_layers(lm_cache)
    run(layers, [B, 5])
    assert "state" not in extract_block_records(layers, block=0, block_size=B)


def test_window_record_raises_once_the_window_dropped_the_block():
    layers = make_layers(lm_cache, window=8)
    run(layers, [B, B, 1, 1])  # window now holds only tokens [26, 34)
    with pytest.raises(RecordError, match="window layer 1"):
        extract_block_records(layers, block=0, block_size=B)


def test_records_do_not_change_when_the_live_cache_is_updated_in_place():
    layers = make_layers(lm_cache, window=24)
    run(layers, [B, B])
    recs = extract_block_records(layers, block=1, block_size=B)
    before = {k: record_to_bytes(r) for k, r in recs.items()}
    run(layers, [1, 1, B, 1], seed=50)
    assert {k: record_to_bytes(r) for k, r in recs.items()} == before


def test_garbage_bytes_raise_record_error():
    with pytest.raises(RecordError):
        record_from_bytes(b"not a safetensors blob")
    foreign = io.BytesIO()
    mx.save_safetensors(foreign, {"x": mx.zeros((2,))}, metadata={"kind": "kv"})
    with pytest.raises(RecordError, match="not an mlx_nbengine record"):
        record_from_bytes(foreign.getvalue())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.int32, mx.uint8])
def test_a_blob_decodes_to_views_of_the_buffer_it_was_read_into(dtype):
    live = make_layers(lm_cache)
    run(live, [B])
    rec = extract_block_records(live, block=0, block_size=B)["kv"]
    rec.arrays = {n: (a * 7).astype(dtype) for n, a in rec.arrays.items()}
    buf = np.frombuffer(record_to_bytes(rec), dtype=np.uint8)
    back = record_from_buffer(buf)
    assert (back.kind, back.meta) == (rec.kind, {**rec.meta, "kind": "kv"})
    for name, a in rec.arrays.items():
        view = back.arrays[name]
        assert isinstance(view, HostArray) and np.shares_memory(view.data, buf)  # no copy
        assert (view.dtype, view.shape, view.nbytes) == (dtype, tuple(a.shape), a.nbytes)
        assert mx.array_equal(view.to_mx(), a).item() and view.to_mx().dtype == dtype
        assert mx.array_equal(view[..., 3:5, :].to_mx(), a[..., 3:5, :]).item()


def _blob(header: dict, data: bytes = b"\0" * 16, *, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x05\0\0\0\0\0\0\0abc",  # a header longer than the blob
        struct.pack("<Q", 2**40) + b"{}",
        struct.pack("<Q", 3) + b"{x}",  # not JSON
        _blob([1, 2]),  # not an object
        _blob({"__metadata__": {"kind": 3}}),  # metadata that is not text
        _blob({"a": {"dtype": "F8", "shape": [2], "data_offsets": [0, 2]}}),
        _blob({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}),
        _blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}),  # 8 bytes
        _blob({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}),  # past the end
        _blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [12, 4]}}),
        _blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, True]}}),
        _blob({"a": "F32"}),
    ],
)
def test_a_malformed_blob_raises_record_error_not_a_crash(blob):
    with pytest.raises(RecordError, match="does not decode"):
        record_from_buffer(blob)


def test_a_restored_kv_layer_has_room_to_its_next_step():
    """Up to `KVCache.step` as its own growth leaves it: the tail's first tokens go in
    place, not into a grown copy of every cached token."""
    _, restored = restore_at(lm_cache, [B, B, B], n_blocks=3, window=24)
    kv = restored[0]
    assert kv.offset == 3 * B and kv.keys.shape[2] == kv.step >= 3 * B + 5
    before = kv.keys
    feed(restored, 5, seed=3)
    assert kv.keys is before and kv.offset == 3 * B + 5


@needs_kernels
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_a_layers_slices_join_on_the_kernels_as_they_join_in_numpy(dtype, monkeypatch):
    """`kernels.join_tokens` (one copy into memory nothing wrote first) gives the numpy
    path's array: the blocks' slices, a cut's first tokens (a strided view), zeros after."""
    held = np.uint16 if dtype == mx.bfloat16 else np.dtype(str(dtype).rsplit(".", 1)[-1])
    rng = np.random.default_rng(7)
    whole = [rng.integers(0, 1 << 15, size=(1, 2, B, 8)).astype(held) for _ in range(2)]
    cut = rng.integers(0, 1 << 15, size=(1, 2, B, 8)).astype(held)[:, :, :5, :]
    parts = [HostArray(a, dtype) for a in (*whole, cut)]
    fast = assembly.join_tokens(parts, 0, room=3 * B)
    assert assembly._joined_on_kernels(parts, 3 * B, dtype) is not None  # the kernels joined
    monkeypatch.setattr(assembly, "_joined_on_kernels", lambda *_: None)
    slow = assembly.join_tokens(parts, 0, room=3 * B)
    assert fast.dtype == slow.dtype == dtype and fast.shape == slow.shape == (1, 2, 3 * B, 8)
    assert mx.array_equal(fast.view(mx.uint8), slow.view(mx.uint8)).item()


def restore_at(
    layers_lib, history: list[int], n_blocks: int, *, window: int, decode=record_from_buffer
):
    """Records of every block taken during `history` (steps ending on boundaries), through
    bytes and back (`decode`: as the store's reads, views of the blob; or MLX arrays),
    assembled."""
    live = make_layers(layers_lib, window=window)
    records: dict[int, dict] = {}
    pos = 0
    for i, n in enumerate(history):
        feed(live, n, seed=i)
        pos += n
        if pos % B == 0:
            records[pos // B - 1] = {
                k: decode(record_to_bytes(r))
                for k, r in extract_block_records(live, block=pos // B - 1, block_size=B).items()
            }
    restored = assemble(
        records,
        n_blocks=n_blocks,
        block_size=B,
        template_cache=make_layers(layers_lib, window=window),
    )
    return live, restored


@pytest.mark.parametrize("lib", [lm_cache, vlm_cache], ids=["mlx_lm", "mlx_vlm"])
@pytest.mark.parametrize("window", [8, 16, 24, 100])
@pytest.mark.parametrize("next_steps", [[B], [1, 1, 1], [5, 1, B], [1, B]])
@pytest.mark.parametrize("decode", [record_from_buffer, record_from_bytes])
def test_restored_cache_continues_exactly_like_the_live_one(lib, window, next_steps, decode):
    history = [B, B, B, B]
    live, restored = restore_at(lib, history, n_blocks=4, window=window, decode=decode)
    for i, n in enumerate(next_steps):
        assert_same(feed(live, n, seed=1000 + i), feed(restored, n, seed=1000 + i))
    assert [c.offset for c in (restored[0], restored[1])] == [4 * B + sum(next_steps)] * 2


def test_assembly_at_an_earlier_boundary_than_the_live_cache_reached():
    live, _ = restore_at(lm_cache, [B, B, B], n_blocks=0, window=24)
    reference = make_layers(lm_cache, window=24)
    run(reference, [B, B])
    _, restored = restore_at(lm_cache, [B, B, B], n_blocks=2, window=24)
    assert_same(feed(reference, 7, seed=9), feed(restored, 7, seed=9))


# --- partial records and cuts ----------------------------------------------------------------


def test_a_partial_record_holds_the_blocks_first_tokens_and_the_state_at_its_end():
    layers = make_layers(lm_cache, window=24)
    seen = run(layers, [B, 5])  # 21 tokens: block 1 holds 5
    recs = extract_block_records(layers, block=1, block_size=B, end=B + 5)
    # The state was taken where the model call ended: it resumes a prompt holding all 21.
    assert set(recs) == {"kv", "window", "state"}
    assert recs["state"].layers[2]["offset"] == B + 5
    # Ending elsewhere than where the cache stands, there is no state to take.
    assert set(extract_block_records(layers, block=1, block_size=B, end=B + 3)) == {
        "kv",
        "window",
    }
    assert recs["kv"].layers[0] == {"class": "KVCache", "start": B, "end": B + 5}
    assert mx.array_equal(recs["kv"].arrays["L0.k"], seen[0][0][..., B : B + 5, :]).item()
    assert recs["window"].layers[1]["start"] == B
    with pytest.raises(RecordError, match="cannot end"):
        extract_block_records(layers, block=1, block_size=B, end=B)


def attention_layers(window: int) -> list:
    return [lm_cache.KVCache(), lm_cache.RotatingKVCache(max_size=window)]


def step_data(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, 2, n, 8), key=k1), mx.random.normal((1, 2, n, 8), key=k2)


def feed_data(layers, keys, values) -> list:
    seen = [c.update_and_fetch(keys, values) for c in layers]
    mx.eval(seen)
    return seen


@pytest.mark.parametrize("window", [8, 16, 24, 100])
@pytest.mark.parametrize("next_steps", [[B], [1, 1, 1], [11, 1, B]])
def test_a_cut_cache_continues_exactly_like_a_live_one(window, next_steps):
    # Stored: blocks 0..2 of one run. Live: the same first 2 blocks and 5 tokens of block
    # 2, then something else. The cut cache (2 blocks + 5 tokens of the stored block 2)
    # must hold and continue exactly like the live one.
    steps = [step_data(B, seed=i) for i in range(3)]
    stored = attention_layers(window)
    records = {}
    for j, (k, v) in enumerate(steps):
        feed_data(stored, k, v)
        records[j] = {
            kind: record_from_bytes(record_to_bytes(r))
            for kind, r in extract_block_records(stored, block=j, block_size=B).items()
        }
    live = attention_layers(window)
    for k, v in steps[:2]:
        feed_data(live, k, v)
    feed_data(live, steps[2][0][..., :5, :], steps[2][1][..., :5, :])
    cut = assemble(
        records, n_blocks=2, block_size=B, template_cache=attention_layers(window), cut_tokens=5
    )
    assert [c.offset for c in cut] == [2 * B + 5] * 2
    for i, n in enumerate(next_steps):
        k, v = step_data(n, seed=100 + i)
        assert_same(feed_data(live, k, v), feed_data(cut, k, v))


def test_a_window_narrower_than_a_block_keeps_the_whole_block_a_prefill_step_computed():
    layers = attention_layers(8)
    seen = feed_data(layers, *step_data(2 * B, seed=0))  # one step: the buffer holds 7 + 32
    window = extract_block_records(layers, block=1, block_size=B)["window"]
    assert (window.layers[1]["start"], window.layers[1]["end"]) == (B, 2 * B)
    assert mx.array_equal(window.arrays["L1.k"], seen[0][0][..., B : 2 * B, :]).item()


def test_a_window_record_that_lacks_its_blocks_start_cannot_serve_a_cut():
    layers = attention_layers(8)
    for i in range(B):  # decode steps: the buffer holds the last 8 tokens only
        feed_data(layers, *step_data(1, seed=i))
    records = {0: extract_block_records(layers, block=0, block_size=B)}
    assert records[0]["window"].layers[1]["start"] == B - 8
    with pytest.raises(CutOutOfReach, match="needs it from 0"):
        SlidingWindow().check_cut(records[0]["window"], boundary=0, point=5)
    with pytest.raises(RecordError, match="gap"):
        assemble(
            records, n_blocks=0, block_size=B, template_cache=attention_layers(8), cut_tokens=5
        )
