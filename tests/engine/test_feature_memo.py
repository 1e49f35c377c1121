"""The vision feature memo (`engine.vision.FeatureMemo`): its byte budget and LRU order,
with real MLX arrays of image-feature rows (float32, a few KiB each)."""

from __future__ import annotations

import mlx.core as mx

from mlx_nbengine.engine.vision import DEFAULT_MEMO_BYTES, FeatureMemo, VisionRunner

HIDDEN = 64  # a row: 64 float32 = 256 bytes


def rows(n: int, value: float = 1.0) -> mx.array:
    """`n` evaluated feature rows (as `VisionRunner` puts them: contiguous, evaluated)."""
    out = mx.full((n, HIDDEN), value, dtype=mx.float32)
    mx.eval(out)
    return out


def held(memo: FeatureMemo) -> list[str]:
    """The digests held, least recently used first (read without touching the order)."""
    return list(memo._rows)


def test_the_default_budget_is_256_mib_and_the_runner_uses_it():
    import inspect

    assert DEFAULT_MEMO_BYTES == 256 * 1024**2
    assert FeatureMemo().budget_bytes == DEFAULT_MEMO_BYTES
    default = inspect.signature(VisionRunner).parameters["memo_bytes"].default
    assert default == DEFAULT_MEMO_BYTES


def test_filling_past_the_budget_drops_the_least_recently_used_first():
    image = rows(16).nbytes  # 4 KiB
    memo = FeatureMemo(budget_bytes=4 * image)
    for i in range(4):
        memo.put(f"img{i}", rows(16, i))
    assert held(memo) == ["img0", "img1", "img2", "img3"]
    assert memo.nbytes == 4 * image == memo.budget_bytes  # full, nothing dropped yet

    memo.put("img4", rows(16, 4))
    assert held(memo) == ["img1", "img2", "img3", "img4"]
    assert memo.get("img0") is None
    # A larger image drops as many of the oldest as it needs, no more.
    memo.put("big", rows(40, 5))  # 2.5 images' worth
    assert held(memo) == ["img4", "big"]
    assert memo.nbytes == image + rows(40).nbytes <= memo.budget_bytes


def test_the_byte_count_is_the_held_arrays_and_stays_within_the_budget():
    budget = 10_000  # not a multiple of any row count below
    memo = FeatureMemo(budget_bytes=budget)
    for i, n in enumerate([3, 9, 1, 7, 4, 12, 2, 8, 5, 6, 11, 3]):
        memo.put(f"img{i}", rows(n, i))
        assert memo.nbytes == sum(memo._rows[d].nbytes for d in held(memo))
        assert 0 < memo.nbytes <= budget
    memo.clear()
    assert memo.nbytes == 0 and len(memo) == 0


def test_a_get_refreshes_recency_and_counts_a_hit():
    memo = FeatureMemo(budget_bytes=3 * rows(8).nbytes)
    for name in ("a", "b", "c"):
        memo.put(name, rows(8))
    found = memo.get("a")
    assert found is not None and mx.array_equal(found, rows(8)).item()
    assert memo.hits == 1
    assert memo.get("missing") is None and memo.hits == 1  # a miss is no hit
    memo.put("d", rows(8))
    assert held(memo) == ["c", "a", "d"]  # b, not a, was the least recently used


def test_a_put_of_a_held_digest_refreshes_it_and_keeps_its_rows():
    memo = FeatureMemo(budget_bytes=2 * rows(8).nbytes)
    first = rows(8, 1.0)
    memo.put("a", first)
    memo.put("b", rows(8, 2.0))
    memo.put("a", rows(8, 9.0))  # the same image encoded again (another image missed)
    assert memo.nbytes == 2 * first.nbytes and len(memo) == 2
    memo.put("c", rows(8, 3.0))
    assert held(memo) == ["a", "c"]
    assert mx.array_equal(memo.get("a"), first).item()


def test_rows_larger_than_the_whole_budget_are_not_kept_and_evict_nothing():
    memo = FeatureMemo(budget_bytes=4 * rows(8).nbytes)
    memo.put("a", rows(8))
    memo.put("b", rows(8))
    memo.put("huge", rows(33))  # one row more than the budget
    assert memo.get("huge") is None
    assert held(memo) == ["a", "b"] and memo.nbytes == 2 * rows(8).nbytes
    memo.put("exact", rows(32))  # exactly the budget: kept, alone
    assert held(memo) == ["exact"] and memo.nbytes == memo.budget_bytes
