"""BlobFile: one unlinked scratch file, offset table, first-fit free list, tail truncation."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import signal
import sys
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_nbengine.cache import blobfile as blobfile_module
from mlx_nbengine.cache.blobfile import BlobFile, CorruptBlobError
from mlx_nbengine.errors import CacheError


def blob(n: int, seed: int = 1) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


def open_fds_under(directory) -> int:
    """Descriptors of this process that point into `directory` (Linux: /proc/self/fd)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            count += 1
    return count


@pytest.fixture
def bf(tmp_path):
    f = BlobFile(directory=tmp_path)
    yield f
    f.close()


def size_on_disk(f: BlobFile) -> int:
    return os.fstat(f.fileno()).st_size


def test_round_trip_of_blobs_of_many_sizes(bf):
    blobs = {("k", i): blob(n, i) for i, n in enumerate([1, 7, 4096, 100_000, 3])}
    for key, data in blobs.items():
        bf.write(key, data)
    for key, data in blobs.items():
        assert bf.read(key) == data
    assert bf.file_size == size_on_disk(bf) == sum(map(len, blobs.values()))
    assert bf.bytes_held == bf.file_size and bf.free_bytes == 0
    bf.check_invariants()


def test_write_returns_offset_and_length_in_write_order(bf):
    assert bf.write("a", blob(10)) == (0, 10)
    assert bf.write("b", blob(20)) == (10, 20)
    assert bf.entry("b").offset == 10 and bf.entry("b").length == 20


def test_writing_a_present_key_replaces_its_blob(bf):
    bf.write("a", blob(100, 1))
    bf.write("a", blob(40, 2))
    assert bf.read("a") == blob(40, 2)
    assert len(bf) == 1 and bf.file_size == 40
    bf.check_invariants()


@pytest.mark.skipif(os.name != "posix", reason="unlinked files and modes are POSIX")
def test_scratch_file_is_unlinked_private_and_alone_in_its_folder(bf, tmp_path):
    bf.write("a", blob(1000))
    st_ = os.fstat(bf.fileno())
    assert st_.st_nlink == 0
    assert st_.st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == []


def test_freed_space_is_reused_first_fit(bf):
    bf.write("a", blob(100))
    bf.write("b", blob(200))
    bf.write("c", blob(300))
    bf.delete("b")
    assert bf.free_extents() == [(100, 200)]
    assert bf.write("d", blob(150)) == (100, 150)
    assert bf.free_extents() == [(250, 50)]
    assert size_on_disk(bf) == 600
    bf.check_invariants()


def test_neighbouring_free_extents_are_coalesced(bf):
    for key in "abcd":
        bf.write(key, blob(100))
    bf.delete("b")
    bf.delete("c")
    assert bf.free_extents() == [(100, 200)]
    bf.delete("a")
    assert bf.free_extents() == [(0, 300)]
    assert bf.write("big", blob(300)) == (0, 300)
    assert size_on_disk(bf) == 400
    bf.check_invariants()


def test_free_space_reaching_the_end_truncates_the_file(bf):
    for key in "abcd":
        bf.write(key, blob(100))
    bf.delete("b")
    assert size_on_disk(bf) == 400
    bf.delete("d")
    assert size_on_disk(bf) == 300 and bf.free_extents() == [(100, 100)]
    bf.delete("c")  # joins the hole at 100, which now reaches the end
    assert size_on_disk(bf) == 100 and bf.free_extents() == []
    bf.delete("a")
    assert size_on_disk(bf) == 0 == bf.file_size
    bf.check_invariants()


ops = st.lists(
    st.tuples(st.sampled_from(["write", "delete"]), st.integers(0, 7), st.integers(1, 3000)),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_writes_and_deletes_keep_the_invariants(sequence):
    f = BlobFile()
    model: dict[int, bytes] = {}
    try:
        for step, (op, key, n) in enumerate(sequence):
            if op == "write":
                model[key] = blob(n, step)
                f.write(key, model[key])
            else:
                assert f.delete(key) == (key in model)
                model.pop(key, None)
            f.check_invariants()
        assert {k: f.read(k) for k in f.keys()} == model
        assert f.bytes_held == sum(map(len, model.values()))
    finally:
        f.close()


def failing_pwrite(real_pwrite, *, after_bytes: int):
    """A pwrite that writes `after_bytes` in all, then fails as a full disk does."""
    budget = {"left": after_bytes}

    def limited(fd, data, offset):
        if budget["left"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = real_pwrite(fd, bytes(data)[: budget["left"]], offset)
        budget["left"] -= written
        return written

    return limited


def test_failed_append_leaves_no_entry_and_truncates_the_file_back(bf, monkeypatch):
    bf.write("a", blob(1000))
    bf.write("b", blob(1000))
    monkeypatch.setattr(blobfile_module.os, "pwrite", failing_pwrite(os.pwrite, after_bytes=300))
    with pytest.raises(OSError) as info:
        bf.write("c", blob(5000))
    assert info.value.errno == errno.ENOSPC
    assert "c" not in bf
    assert size_on_disk(bf) == bf.file_size == 2000
    bf.check_invariants()
    monkeypatch.undo()
    assert bf.read("a") == blob(1000) and bf.read("b") == blob(1000)
    bf.write("c", blob(5000))
    assert bf.read("c") == blob(5000)


def test_failed_write_into_a_hole_returns_the_hole(bf, monkeypatch):
    for key in "abc":
        bf.write(key, blob(1000))
    bf.delete("b")
    monkeypatch.setattr(blobfile_module.os, "pwrite", failing_pwrite(os.pwrite, after_bytes=0))
    with pytest.raises(OSError):
        bf.write("d", blob(400))
    assert bf.free_extents() == [(1000, 1000)] and "d" not in bf
    bf.check_invariants()


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE behaviour checked on Linux")
def test_a_real_file_size_limit_is_a_clean_write_error(bf):
    resource = pytest.importorskip("resource")
    bf.write("a", blob(600_000))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, hard))
    try:
        with pytest.raises(OSError) as info:
            bf.write("b", blob(600_000, 2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert info.value.errno == errno.EFBIG
    assert "b" not in bf and size_on_disk(bf) == 600_000
    bf.check_invariants()


def test_corrupted_bytes_are_detected_on_read(bf):
    bf.write("a", blob(5000))
    entry = bf.entry("a")
    os.pwrite(bf.fileno(), b"\xff" * 16, entry.offset + 2000)
    with pytest.raises(CorruptBlobError):
        bf.read("a")


def test_a_blob_cut_short_behind_our_back_is_detected(bf):
    bf.write("a", blob(5000))
    os.ftruncate(bf.fileno(), 3000)
    with pytest.raises(CorruptBlobError):
        bf.read("a")


def test_clear_empties_the_table_and_the_file(bf):
    for key in "abc":
        bf.write(key, blob(1000))
    bf.delete("b")
    bf.clear()
    assert len(bf) == 0 and bf.free_extents() == [] and size_on_disk(bf) == 0
    bf.check_invariants()


def test_close_is_idempotent_and_later_use_fails_plainly(tmp_path):
    f = BlobFile(directory=tmp_path)
    f.write("a", blob(10))
    f.close()
    f.close()
    assert f.closed
    with pytest.raises(ValueError, match="closed"):
        f.write("b", blob(10))
    with pytest.raises(ValueError, match="closed"):
        f.read("a")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to see open files")
def test_close_and_garbage_collection_leave_no_file(tmp_path):
    f = BlobFile(directory=tmp_path)
    f.write("a", blob(10_000))
    assert open_fds_under(tmp_path) == 1
    f.close()
    assert open_fds_under(tmp_path) == 0 and os.listdir(tmp_path) == []

    g = BlobFile(directory=tmp_path)
    g.write("a", blob(10_000))
    del g
    gc.collect()
    assert open_fds_under(tmp_path) == 0 and os.listdir(tmp_path) == []


def test_a_missing_directory_is_a_cache_error_that_says_what_to_do(tmp_path):
    with pytest.raises(CacheError, match="create it"):
        BlobFile(directory=tmp_path / "nope")


def test_empty_blobs_are_refused(bf):
    with pytest.raises(ValueError):
        bf.write("a", b"")


def test_without_xxhash_crc32_guards_the_blobs(bf, monkeypatch):
    monkeypatch.setattr(blobfile_module, "xxhash", None)
    bf.write("a", blob(5000))
    assert bf.entry("a").checksum == zlib.crc32(blob(5000))
    assert bf.read("a") == blob(5000)
    os.pwrite(bf.fileno(), b"\x00\x01", bf.entry("a").offset)
    with pytest.raises(CorruptBlobError):
        bf.read("a")


def _owner(array):
    """What finally holds an array's memory (a numpy array's own buffer, or an mmap)."""
    while True:
        if isinstance(array, memoryview):
            array = array.obj
        elif getattr(array, "base", None) is not None:
            array = array.base
        else:
            return array


def test_a_mapped_read_is_a_checked_view_of_the_files_own_pages(bf):
    """No copy: the view shares the file's pages (a write there shows through it), and its
    checksum is verified like a read's."""
    for i, n in enumerate([1, 4095, 4096, 70_000]):
        bf.write(i, blob(n, seed=i))
    for i, n in enumerate([1, 4095, 4096, 70_000]):
        view = bf.read_mapped(i)
        assert bytes(view) == blob(n, seed=i) and not view.flags.writeable
        assert isinstance(_owner(view), mmap.mmap)
    view = bf.read_mapped(3)
    os.pwrite(bf.fileno(), b"\xff", bf.entry(3).offset + 10)
    assert view[10] == 0xFF  # the file's page itself
    with pytest.raises(CorruptBlobError, match="checksum"):
        bf.read_mapped(3)
    with pytest.raises(KeyError):
        bf.read_mapped("absent")


def test_a_mapped_read_of_a_blob_cut_short_is_an_error_not_a_fault(bf):
    bf.write("a", blob(50_000))
    os.ftruncate(bf.fileno(), 20_000)
    with pytest.raises(CorruptBlobError, match="short"):
        bf.read_mapped("a")


def test_a_named_file_is_read_not_mapped(tmp_path):
    """A file that outlives the process (the persistent store's) may be changed by others
    under a mapping: it is read into memory instead."""
    named = BlobFile(path=tmp_path / "data")
    try:
        named.write("a", blob(9000))
        assert not named.mappable
        view = named.read_mapped("a")
        assert bytes(view) == blob(9000) and not isinstance(_owner(view), mmap.mmap)
    finally:
        named.close()
