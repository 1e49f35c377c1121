"""BlockStore: LRU of record blobs under a byte budget, on disk or in memory only."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import threading

import pytest

from mlx_nbengine.cache import backends as backends_module
from mlx_nbengine.cache import blobfile as blobfile_module
from mlx_nbengine.cache.store import BlockStore, StoreStats, default_budget_bytes
from mlx_nbengine.errors import CacheError

KB = 1000


def blob(n: int, seed: int = 1) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, int]] = []

    def __call__(self, name: str, key: str, kind: str, nbytes: int) -> None:
        self.events.append((name, key, kind, nbytes))

    def evicted(self) -> list[tuple[str, str]]:
        return [(key, kind) for name, key, kind, _ in self.events if name == "evicted"]


@pytest.fixture
def rec():
    return Recorder()


@pytest.fixture
def store(tmp_path, rec):
    s = BlockStore(budget_bytes=10 * KB, directory=tmp_path, on_event=rec)
    yield s
    s.close()


def test_round_trip_counts_hits_misses_and_stored(store):
    assert store.put("k0", "kv", blob(KB))
    assert store.put("k0", "state", blob(2 * KB, 2))
    assert store.get("k0", "kv") == blob(KB)
    assert store.get("k0", "state") == blob(2 * KB, 2)
    assert store.get("k1", "kv") is None
    s = store.stats()
    assert (s.records, s.bytes_held, s.hits, s.misses, s.stored) == (2, 3 * KB, 2, 1, 2)
    assert s.file_size == 3 * KB and s.free_bytes == 0


def test_stats_is_a_dataclass_with_a_plain_dict_form(store):
    store.put("k0", "kv", blob(KB))
    d = store.stats().as_dict()
    assert isinstance(store.stats(), StoreStats)
    assert d["records"] == 1 and d["bytes_held"] == KB and d["budget_bytes"] == 10 * KB
    assert set(d) >= {"file_size", "free_bytes", "hits", "misses", "stored", "evicted"}


def test_description_names_no_path(store, tmp_path):
    assert str(tmp_path) not in store.stats().description
    assert "scratch file" in store.stats().description


def test_budget_is_never_exceeded(store):
    for i in range(40):
        assert store.put(f"k{i}", "kv", blob(KB + 37 * (i % 5), i))
        assert store.stats().bytes_held <= 10 * KB
    s = store.stats()
    assert s.evicted == s.stored - s.records > 0
    store.blobfile.check_invariants()


def test_least_recently_used_is_evicted_first_and_get_refreshes(store, rec):
    for i in range(10):
        store.put(f"k{i}", "kv", blob(KB, i))
    assert store.get("k0", "kv") is not None
    store.put("new", "kv", blob(KB))
    assert rec.evicted() == [("k1", "kv")]
    assert store.has("k0", "kv")


def test_eviction_order_follows_touch_order_so_suffix_blocks_go_first(store, rec):
    chain = [(f"c{i}", "kv") for i in range(5)]
    for key, kind in chain:
        store.put(key, kind, blob(KB))
    store.touch(reversed(chain))  # suffix first: c0 ends up most recent
    for i in range(5):
        store.put(f"other{i}", "kv", blob(KB))  # fills the budget, nothing evicted yet
    for i in range(5):
        store.put(f"more{i}", "kv", blob(KB))
    assert rec.evicted() == [("c4", "kv"), ("c3", "kv"), ("c2", "kv"), ("c1", "kv"), ("c0", "kv")]


def test_touch_ignores_items_not_held(store):
    store.put("a", "kv", blob(KB))
    store.touch([("missing", "kv"), ("a", "kv")])
    assert store.items() == [("a", "kv")]


def flood(store: BlockStore, chain: list[tuple[str, str]], *, touch: bool) -> None:
    for round_ in range(50):
        for j in range(3):
            store.put(f"unrelated-{round_}-{j}", "kv", blob(KB, j))
        if touch and all(store.has(key, kind) for key, kind in chain):
            store.touch(reversed(chain))


def test_a_chain_touched_on_each_use_survives_a_flood_of_unrelated_puts(store):
    chain = [(f"c{i}", kind) for i in range(3) for kind in ("kv", "state")]
    for key, kind in chain:
        store.put(key, kind, blob(KB))
    flood(store, chain, touch=True)
    assert all(store.get(key, kind) == blob(KB) for key, kind in chain)
    assert store.stats().evicted > 100


def test_an_untouched_chain_is_flooded_out(store):
    chain = [(f"c{i}", "kv") for i in range(3)]
    for key, kind in chain:
        store.put(key, kind, blob(KB))
    flood(store, chain, touch=False)
    assert not any(store.has(key, kind) for key, kind in chain)


def test_a_blob_larger_than_the_budget_is_rejected_without_evicting(store, rec):
    store.put("a", "kv", blob(KB))
    assert store.put("huge", "kv", blob(11 * KB)) is False
    assert store.has("a", "kv") and not store.has("huge", "kv")
    assert rec.evicted() == [] and store.stats().rejected == 1


def test_putting_a_held_item_refreshes_it_without_writing(store):
    store.put("a", "kv", blob(KB))
    store.put("b", "kv", blob(KB))
    assert store.put("a", "kv", blob(KB))
    assert store.items() == [("b", "kv"), ("a", "kv")]
    assert store.stats().stored == 2


def test_events_report_stored_and_evicted_with_sizes(tmp_path, rec):
    with BlockStore(budget_bytes=2 * KB, directory=tmp_path, on_event=rec) as s:
        s.put("a", "kv", blob(KB))
        s.put("b", "window", blob(KB))
        s.put("c", "state", blob(KB))
        s.delete("b", "window")
    assert rec.events == [
        ("stored", "a", "kv", KB),
        ("stored", "b", "window", KB),
        ("evicted", "a", "kv", KB),
        ("stored", "c", "state", KB),
        ("evicted", "b", "window", KB),
    ]


def test_a_full_disk_is_a_miss_and_leaves_the_store_consistent(store, monkeypatch, rec):
    store.put("a", "kv", blob(KB))
    before = os.fstat(store.blobfile.fileno()).st_size

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(blobfile_module.os, "pwrite", full_disk)
    assert store.put("b", "kv", blob(3 * KB)) is False
    assert not store.has("b", "kv") and store.get("b", "kv") is None
    assert os.fstat(store.blobfile.fileno()).st_size == before
    s = store.stats()
    assert (s.records, s.bytes_held, s.rejected, s.stored) == (1, KB, 1, 1)
    store.blobfile.check_invariants()
    assert [e[0] for e in rec.events] == ["stored"]

    # Saving is off after a full disk: later puts are refused at once, gets still work.
    assert not store.saving and "off" in store.saving_error
    assert store.stats().saving is False and store.stats().saving_error
    monkeypatch.undo()
    assert store.put("b", "kv", blob(3 * KB)) is False
    assert store.get("a", "kv") == blob(KB)
    store.resume_saving()
    assert store.put("b", "kv", blob(3 * KB))
    assert store.get("b", "kv") == blob(3 * KB)


def test_a_corrupted_blob_is_detected_evicted_and_never_returned(store, rec):
    store.put("a", "kv", blob(4 * KB))
    store.put("b", "kv", blob(KB, 2))
    entry = store.blobfile.entry(("a", "kv"))
    os.pwrite(store.blobfile.fileno(), b"garbage!", entry.offset + 100)
    assert store.get("a", "kv") is None
    assert not store.has("a", "kv")
    assert store.get("a", "kv") is None
    assert rec.evicted() == [("a", "kv")]
    s = store.stats()
    assert (s.records, s.misses, s.hits, s.evicted) == (1, 2, 0, 1)
    assert store.get("b", "kv") == blob(KB, 2)
    store.blobfile.check_invariants()


def test_budget_zero_keeps_blobs_in_memory_only(tmp_path, rec):
    with BlockStore(
        budget_bytes=0, directory=tmp_path, on_event=rec, memory_budget_bytes=3 * KB
    ) as s:
        assert s.blobfile is None
        for i in range(5):
            assert s.put(f"k{i}", "kv", blob(KB, i))
        assert s.get("k4", "kv") == blob(KB, 4) and s.get("k0", "kv") is None
        stats = s.stats()
        assert (stats.records, stats.bytes_held, stats.file_size, stats.budget_bytes) == (
            3,
            3 * KB,
            0,
            3 * KB,
        )
        assert "memory only" in stats.description
        assert os.listdir(tmp_path) == []
    assert rec.evicted() == [("k0", "kv"), ("k1", "kv")]


def test_clear_evicts_everything_and_empties_the_file(store, rec):
    for i in range(4):
        store.put(f"k{i}", "kv", blob(KB))
    store.clear()
    s = store.stats()
    assert (s.records, s.bytes_held, s.file_size, s.evicted) == (0, 0, 0, 4)
    assert os.fstat(store.blobfile.fileno()).st_size == 0
    assert len(rec.evicted()) == 4
    assert store.put("again", "kv", blob(KB))


def test_close_leaves_no_file_and_is_idempotent(tmp_path):
    before = set(os.listdir(tmp_path))
    s = BlockStore(budget_bytes=10 * KB, directory=tmp_path)
    s.put("a", "kv", blob(KB))
    fd = s.blobfile.fileno()
    s.close()
    s.close()
    assert s.closed and set(os.listdir(tmp_path)) == before
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ValueError, match="closed"):
        s.put("b", "kv", blob(KB))


def test_default_budget_is_a_quarter_of_free_space_capped_at_8_gib(monkeypatch, tmp_path):
    def disk_with(free):
        return lambda path: type("Usage", (), {"free": free})()

    monkeypatch.setattr(backends_module.shutil, "disk_usage", disk_with(100 << 30))
    assert default_budget_bytes(tmp_path) == 8 << 30
    monkeypatch.setattr(backends_module.shutil, "disk_usage", disk_with(4 << 30))
    assert default_budget_bytes(tmp_path) == 1 << 30
    with BlockStore(directory=tmp_path) as s:
        assert s.stats().budget_bytes == 1 << 30


def test_a_negative_budget_is_a_cache_error(tmp_path):
    with pytest.raises(CacheError, match="memory only"):
        BlockStore(budget_bytes=-1, directory=tmp_path)


def test_stats_read_from_another_thread_are_consistent_snapshots(store):
    snapshots: list[StoreStats] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            snapshots.append(store.stats())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(300):
            store.put(f"k{i}", "kv", blob(KB + (i % 7) * 100, i))
            if i % 3 == 0:
                store.delete(f"k{i - 1}", "kv")
    finally:
        done.set()
        watcher.join()
    assert snapshots
    for s in snapshots:
        assert s.file_size == s.bytes_held + s.free_bytes
        assert s.bytes_held <= s.budget_bytes


def fds_into(directory) -> int:
    """How many of this process's descriptors point into `directory` (Linux /proc)."""
    links = []
    for name in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            continue
    return sum(link.startswith(str(directory)) for link in links)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to see open files")
def test_a_garbage_collected_store_leaves_no_file(tmp_path):
    s = BlockStore(budget_bytes=10 * KB, directory=tmp_path)
    s.put("a", "kv", blob(KB))
    assert fds_into(tmp_path) == 1
    del s
    gc.collect()
    assert fds_into(tmp_path) == 0 and os.listdir(tmp_path) == []


def test_a_process_that_exits_without_close_leaves_no_file(tmp_path):
    script = (
        "import os, sys\n"
        "from mlx_nbengine.cache.store import BlockStore\n"
        "s = BlockStore(budget_bytes=1 << 20, directory=sys.argv[1])\n"
        "assert s.put('a', 'kv', b'x' * 1000)\n"
        "print(len(os.listdir(sys.argv[1])), flush=True)\n"
        "os._exit(0)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
    assert os.listdir(tmp_path) == []
