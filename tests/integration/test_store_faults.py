"""The persistent block store under faults: kill -9, damaged and foreign files, two processes
on one directory, full disks, a flood of prompts, permissions.

Every check reads records back through the store and compares them byte for byte with what
was written (each blob is derived from its key, so a wrong record can never pass): a
*wrong hit* is a `get` that returns other bytes, a *lost record* one that a writer knew
was durable but the next open does not serve. Both must stay zero.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from mlx_nbengine.cache import blobfile as blobfile_module
from mlx_nbengine.cache import persist
from mlx_nbengine.cache.store import BlockStore

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = {"fingerprint": "f" * 64, "block_size": 16, "record_format": "test"}
KINDS = ("kv", "window", "state")

pytestmark = pytest.mark.skipif(persist.fcntl is None, reason="needs POSIX file locks")


def expected(key: str, kind: str) -> bytes:
    """The one blob ever stored under (key, kind): 32 to ~4 KB derived from the name."""
    seed = hashlib.sha256(f"{key}/{kind}".encode()).digest()
    return seed * (1 + seed[0] % 128)


def open_store(store_dir, **kwargs) -> BlockStore:
    kwargs.setdefault("budget_bytes", 64 << 20)
    kwargs.setdefault("identity", IDENTITY)
    return BlockStore(persist_dir=store_dir, **kwargs)


def audit(store: BlockStore) -> tuple[int, int]:
    """(wrong hits, served records) over everything the store says it holds."""
    wrong = served = 0
    for key, kind in store.items():
        data = store.get(key, kind)
        if data is None:
            continue  # a damaged record is a miss (and evicted), never a hit
        served += 1
        wrong += data != expected(key, kind)
    return wrong, served


def fill(store: BlockStore, n: int, prefix: str = "k") -> list[tuple[str, str]]:
    items = [(f"{prefix}{i}", KINDS[i % 3]) for i in range(n)]
    for key, kind in items:
        assert store.put(key, kind, expected(key, kind))
    return items


def files(directory: Path) -> set[str]:
    return set(os.listdir(directory))


# -- kill -9 ---------------------------------------------------------------------------------

# A zygote imports the store once and forks one writer per run, so 50 runs do not pay 50
# interpreter start-ups. A writer puts records as fast as it can (deleting some itself, so
# the log holds deletes and reused space; compaction at 64 entries, so kills land inside
# compactions too) and appends "D key kind" to its claims file after each put returned
# (the put's index entry is synced by then), "X key kind" before each delete.
ZYGOTE = r"""
import os, random, sys
sys.path.insert(0, sys.argv[1])
from mlx_nbengine.cache.store import BlockStore
IDENTITY = __import__("json").loads(sys.argv[2])
KINDS = ("kv", "window", "state")
import hashlib

def expected(key, kind):
    seed = hashlib.sha256(f"{key}/{kind}".encode()).digest()
    return seed * (1 + seed[0] % 128)

def writer(directory, claims, seed):
    rng = random.Random(seed)
    out = os.open(claims, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    s = BlockStore(budget_bytes=64 << 20, persist_dir=directory, identity=IDENTITY)
    if s.persistence is None:
        os.write(out, b"NOSTORE\n")
        os._exit(3)
    s.persistence.compact_min = 64
    os.write(out, b"READY\n")
    i = 0
    while True:
        held = s.items()
        if len(held) > 150 and rng.random() < 0.5:
            key, kind = held[rng.randrange(len(held))]
            os.write(out, f"X {key} {kind}\n".encode())
            s.delete(key, kind)
        key, kind = f"r{seed}-{i}", KINDS[rng.randrange(3)]
        i += 1
        if s.put(key, kind, expected(key, kind)):
            os.write(out, f"D {key} {kind}\n".encode())
        if held and rng.random() < 0.1:
            s.get(*held[rng.randrange(len(held))])

for line in sys.stdin:
    directory, claims, seed = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            writer(directory, claims, int(seed))
        finally:
            os._exit(1)
    sys.stdout.write(f"PID {pid}\n")
    sys.stdout.flush()
    _, status = os.waitpid(pid, 0)
    sys.stdout.write(f"EXIT {status}\n")
    sys.stdout.flush()
"""


def test_kill_9_at_random_points_never_serves_a_wrong_record_nor_loses_a_durable_one(tmp_path):
    runs = 60
    rng = random.Random(1234)
    store_dir = tmp_path / "store"
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, str(ROOT), json.dumps(IDENTITY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    durable: set[tuple[str, str]] = set()  # claimed durable, not deleted since
    totals = {"runs": 0, "before_ready": 0, "puts_claimed": 0, "wrong": 0, "lost": 0}
    try:
        for run in range(runs):
            claims = tmp_path / f"claims-{run}.txt"
            zygote.stdin.write(f"{store_dir} {claims} {run}\n")
            zygote.stdin.flush()
            line = zygote.stdout.readline().split()
            assert line[0] == "PID", line
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(int(line[1]), signal.SIGKILL)
            status = zygote.stdout.readline().split()
            assert status[0] == "EXIT", status
            text = claims.read_text() if claims.exists() else ""
            assert "NOSTORE" not in text
            totals["before_ready"] += "READY" not in text
            maybe_gone: set[tuple[str, str]] = set()
            for entry in text.splitlines():
                tag, *rest = entry.split()
                if tag == "D":
                    durable.add((rest[0], rest[1]))
                    totals["puts_claimed"] += 1
                elif tag == "X":
                    durable.discard((rest[0], rest[1]))
                    maybe_gone.add((rest[0], rest[1]))

            with open_store(store_dir) as store:
                store.blobfile.check_invariants()
                wrong, _ = audit(store)
                lost = [item for item in durable if store.get(*item) != expected(*item)]
                totals["wrong"] += wrong
                totals["lost"] += len(lost)
                assert wrong == 0, f"run {run}: {wrong} wrong hits"
                assert not lost, f"run {run}: lost {lost[:5]}"
                # What it holds now is durable once close() compacts: the next run's base.
                durable = set(store.items())
            totals["runs"] += 1
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
    print("\nkill -9 fault table:", totals)
    assert totals["runs"] >= 50 and totals["puts_claimed"] > 0


# -- damaged, truncated and foreign files ----------------------------------------------------


@pytest.fixture
def written(tmp_path):
    """A closed store of 30 records (plus deletes and followers in its log)."""
    directory = tmp_path / "store"
    with open_store(directory) as store:
        store.persistence.compact_min = 10**9  # keep the log as written, deletes included
        items = fill(store, 30)
        store.delete(*items[3])
        store.remember("k1", "root", [1, 2, 3])
        # Close compacts; write a longer log again by hand below where a test needs one.
    return directory, [item for i, item in enumerate(items) if i != 3]


def reopen_and_audit(directory) -> tuple[BlockStore, int, int]:
    store = open_store(directory)
    store.blobfile.check_invariants()
    wrong, served = audit(store)
    return store, wrong, served


def copy_of(directory: Path, name: str) -> Path:
    target = directory.parent / name
    shutil.copytree(directory, target)
    return target


def test_an_index_truncated_anywhere_opens_and_serves_only_correct_records(written):
    directory, items = written
    whole = (directory / persist.INDEX_FILE).read_bytes()
    header_end = persist.decode_header(whole)[1]
    cuts = sorted({*range(0, len(whole), max(1, len(whole) // 40)), header_end, len(whole) - 1})
    for cut in cuts:
        trial = copy_of(directory, f"cut-{cut}")
        (trial / persist.INDEX_FILE).write_bytes(whole[:cut])
        store, wrong, served = reopen_and_audit(trial)
        assert wrong == 0 and served <= len(items)
        if cut < header_end:
            assert "set aside" in store.note and served == 0
        store.close()
    store, wrong, served = reopen_and_audit(directory)
    assert (wrong, served) == (0, len(items))
    store.close()


def test_flipped_bits_in_the_index_cut_the_log_there_and_nothing_wrong_is_served(written):
    directory, items = written
    whole = (directory / persist.INDEX_FILE).read_bytes()
    start = persist.decode_header(whole)[1]
    rng = random.Random(7)
    for trial_no in range(25):
        trial = copy_of(directory, f"flip-{trial_no}")
        damaged = bytearray(whole)
        damaged[rng.randrange(start, len(whole))] ^= 1 << rng.randrange(8)
        (trial / persist.INDEX_FILE).write_bytes(bytes(damaged))
        store, wrong, served = reopen_and_audit(trial)
        assert wrong == 0 and served < len(items)
        assert "torn index tail" in store.note
        store.close()
        with open_store(trial) as again:  # the cut log is whole again
            assert again.note == "" and audit(again) == (0, served)


def test_crafted_entries_with_absurd_extents_are_dropped(written):
    directory, items = written
    index = directory / persist.INDEX_FILE
    crafted = [
        persist.Put("evil-beyond", "kv", 1 << 40, 100, 0),
        persist.Put("evil-header", "kv", 0, 100, 0),
        persist.Put("evil-empty", "kv", 8192, 0, 0),
        persist.Put(items[0][0], "window", 4096, 1 << 20, 0),  # overlaps everything
    ]
    with open(index, "ab") as f:
        for entry in crafted:
            f.write(persist.encode_entry(entry))
        # A frame claiming 4 GiB, then garbage.
        f.write(struct.pack("<IQ", 0xFFFFFFFF, 0) + os.urandom(64))
    store, wrong, served = reopen_and_audit(directory)
    assert wrong == 0
    assert not any(key.startswith("evil") for key, _ in store.items())
    assert "incomplete or damaged" in store.note
    store.close()


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x80\x04\x95pickle-looking bytes\x94.",
        json.dumps({"format": 1, "store_id": "0" * 32}).encode(),
        persist.INDEX_MAGIC + struct.pack("<II", 1, 10**9),
        persist.INDEX_MAGIC + struct.pack("<II", 99, 2) + b"{}" + b"\0" * 4,
        os.urandom(4096),
    ],
    ids=["empty", "pickle", "json", "huge-header", "future-format", "random"],
)
def test_a_foreign_or_damaged_index_is_set_aside_with_a_clear_note(written, content):
    directory, _ = written
    (directory / persist.INDEX_FILE).write_bytes(content)
    store = open_store(directory)
    assert "set aside" in store.note and store.persistent
    assert store.items() == [] and store.put("fresh", "kv", expected("fresh", "kv"))
    store.close()
    aside = [n for n in os.listdir(directory) if n.startswith(persist.SET_ASIDE_PREFIX)]
    assert len(aside) == 1
    assert (directory / aside[0] / persist.INDEX_FILE).read_bytes() == content
    assert stat.S_IMODE(os.stat(directory / aside[0]).st_mode) == 0o700
    with open_store(directory) as again:
        assert again.note == "" and again.get("fresh", "kv") == expected("fresh", "kv")


def test_a_store_of_another_identity_is_set_aside_never_read(written):
    directory, _ = written
    for change in ({"fingerprint": "0" * 64}, {"block_size": 32}, {"record_format": "v2"}):
        other = {**IDENTITY, **change}
        with open_store(directory, identity=other) as store:
            assert "set aside" in store.note and "another model or format" in store.note
            assert store.items() == []
            store.put("theirs", "kv", expected("theirs", "kv"))
    with open_store(directory) as store:  # the original identity: its store was set aside too
        assert "set aside" in store.note and store.items() == []


def test_damaged_record_bytes_are_a_miss_and_evicted_and_the_rest_served(written):
    directory, items = written
    with open_store(directory) as store:
        entry = store.blobfile.entry(items[5])
    with open(directory / persist.DATA_FILE, "r+b") as f:
        f.seek(entry.offset + 10)
        f.write(b"\xde\xad\xbe\xef")
    store, wrong, served = reopen_and_audit(directory)
    assert wrong == 0 and served == len(items) - 1
    assert not store.has(*items[5])
    store.close()
    with open_store(directory) as store:  # the eviction was logged
        assert not store.has(*items[5]) and len(store.items()) == len(items) - 1


def test_a_truncated_data_file_drops_the_records_past_its_end_and_reclaims(written):
    directory, items = written
    data = directory / persist.DATA_FILE
    size = data.stat().st_size
    os.truncate(data, persist.DATA_HEADER_BYTES + (size - persist.DATA_HEADER_BYTES) // 2)
    store, wrong, served = reopen_and_audit(directory)
    assert wrong == 0 and 0 < served < len(items)
    assert "incomplete or damaged" in store.note
    assert store.stats().file_size <= data.stat().st_size
    store.close()


def test_a_missing_data_file_drops_every_record(written):
    directory, _ = written
    os.unlink(directory / persist.DATA_FILE)
    store, wrong, served = reopen_and_audit(directory)
    assert (wrong, served) == (0, 0) and "data file was missing" in store.note
    store.close()


def test_a_foreign_or_other_stores_data_file_is_set_aside(written, tmp_path):
    directory, _ = written
    other = tmp_path / "other"
    with open_store(other) as store:
        fill(store, 5, prefix="o")
    for replacement in (os.urandom(10000), (other / persist.DATA_FILE).read_bytes()):
        (directory / persist.DATA_FILE).write_bytes(replacement)
        store = open_store(directory)
        assert "set aside" in store.note and store.items() == []
        store.close()


def test_symlinked_store_files_are_never_followed(written, tmp_path):
    directory, _ = written
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    os.unlink(directory / persist.INDEX_FILE)
    os.symlink(target, directory / persist.INDEX_FILE)
    store = open_store(directory)
    assert "set aside" in store.note and "symlink" in store.note
    store.put("x", "kv", expected("x", "kv"))
    store.close()
    assert target.read_bytes() == b"precious"


def test_a_half_written_record_and_an_interrupted_compaction_are_reclaimed_on_open(written):
    directory, items = written
    data = directory / persist.DATA_FILE
    before = data.stat().st_size
    with open(data, "ab") as f:
        f.write(os.urandom(50_000))  # a record whose index entry never made it
    (directory / (persist.INDEX_FILE + persist.TEMP_SUFFIX)).write_bytes(b"half a compaction")
    store, wrong, served = reopen_and_audit(directory)
    assert (wrong, served) == (0, len(items))
    assert data.stat().st_size == before and store.stats().file_size == before
    assert persist.INDEX_FILE + persist.TEMP_SUFFIX not in files(directory)
    store.close()


def test_a_deeply_nested_header_is_set_aside_not_a_crash(written):
    directory, _ = written
    body = b"[" * 30000 + b"]" * 30000
    raw = persist.INDEX_MAGIC + struct.pack("<II", 1, len(body)) + body
    (directory / persist.INDEX_FILE).write_bytes(raw + struct.pack("<I", zlib.crc32(body)))
    with open_store(directory) as store:
        assert "set aside" in store.note and store.persistent


def test_a_crafted_record_with_a_valid_checksum_is_rejected_by_the_record_decoder(tmp_path):
    from mlx_nbengine.cache.records import RecordError, record_from_bytes

    header = json.dumps({"a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 64]}})
    crafted = struct.pack("<Q", len(header)) + header.encode() + bytes(64)
    with open_store(tmp_path / "s") as store:
        store.put("crafted", "kv", crafted)
    with open_store(tmp_path / "s") as store:
        with pytest.raises(RecordError):
            record_from_bytes(store.get("crafted", "kv"))


# -- two processes ----------------------------------------------------------------------------

HOLDER = r"""
import sys, json
sys.path.insert(0, sys.argv[1])
from mlx_nbengine.cache.store import BlockStore
s = BlockStore(budget_bytes=1 << 20, persist_dir=sys.argv[2], identity=json.loads(sys.argv[3]))
s.put("theirs", "kv", b"x" * 1000)
print("persistent" if s.persistent else s.note, flush=True)
sys.stdin.readline()
s.close()
"""


def test_a_second_process_on_the_same_dir_runs_ephemeral_and_says_so(tmp_path):
    directory = tmp_path / "store"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(ROOT), str(directory), json.dumps(IDENTITY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "persistent"
        listing = files(directory)
        with open_store(directory, directory=tmp_path) as store:
            assert not store.persistent
            assert f"in use by another process (pid {holder.pid})" in store.note
            assert "temporary store" in store.note and "\n" not in store.note
            assert store.put("mine", "kv", expected("mine", "kv"))
            assert store.get("mine", "kv") == expected("mine", "kv")
            assert not store.has("theirs", "kv")
        assert files(directory) == listing
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=30)
    with open_store(directory) as store:
        assert store.persistent and store.has("theirs", "kv") and not store.has("mine", "kv")


def test_two_stores_in_one_process_do_not_share_a_dir(tmp_path):
    with open_store(tmp_path / "s") as first, open_store(tmp_path / "s") as second:
        assert first.persistent and not second.persistent and "in use" in second.note


# -- disk full and I/O errors --------------------------------------------------------------


def failing(err: int, real, *, when=lambda fd: True):
    def call(fd, *args):
        if when(fd):
            raise OSError(err, os.strerror(err))
        return real(fd, *args)

    return call


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_an_injected_write_error_turns_saving_off_and_reads_go_on(tmp_path, monkeypatch, err):
    directory = tmp_path / "store"
    store = open_store(directory)
    items = fill(store, 10)
    monkeypatch.setattr(blobfile_module.os, "pwrite", failing(err, os.pwrite))
    assert store.put("new", "kv", expected("new", "kv")) is False
    assert not store.saving and os.strerror(err) in store.saving_error
    assert "\n" not in store.saving_error
    monkeypatch.undo()
    assert store.put("later", "kv", expected("later", "kv")) is False  # refused at once
    assert all(store.get(*item) == expected(*item) for item in items)
    s = store.stats()
    assert (s.saving, s.rejected, s.records) == (False, 2, 10)
    store.close()
    store, wrong, served = reopen_and_audit(directory)
    assert (wrong, served) == (0, 10) and store.saving
    store.close()


# The name in `os` of the sync a store's data file gets, and that function.
DATA_SYNC = ("fdatasync", os.fdatasync) if hasattr(os, "fdatasync") else ("fsync", os.fsync)


def synced_store(directory: Path, n: int) -> tuple[BlockStore, list, int]:
    """A store holding `n` records, their syncs done; the records, its data file's fd."""
    store = open_store(directory)
    items = fill(store, n)
    store.persistence.synced()
    return store, items, store.blobfile.fileno()


def test_an_fsync_error_turns_saving_off_and_a_full_index_loses_only_that_record(
    tmp_path, monkeypatch
):
    directory = tmp_path / "store"
    store, items, data_fd = synced_store(directory, 10)
    name, sync = DATA_SYNC
    monkeypatch.setattr(os, name, failing(errno.EIO, sync, when=lambda fd: fd == data_fd))
    # The put returns before its sync, which fails on the store's own thread; the next put
    # raises that failure, which turns saving off.
    assert store.put("a", "kv", expected("a", "kv")) is True
    store.persistence.synced()
    monkeypatch.undo()
    assert store.put("b", "kv", expected("b", "kv")) is False and not store.saving
    assert "Input/output error" in store.saving_error
    store.resume_saving()
    # Now the index append fails (the data write went through).
    monkeypatch.setattr(
        os, "pwrite", failing(errno.ENOSPC, os.pwrite, when=lambda fd: fd != data_fd)
    )
    assert store.put("c", "kv", expected("c", "kv")) is False and not store.saving
    monkeypatch.undo()
    assert all(store.get(*item) == expected(*item) for item in items)
    store.blobfile.check_invariants()
    # No clean close: a crash right now. The record whose sync failed is served where its
    # bytes are whole (they are: the page cache wrote them), as its checksum decides.
    store.persistence._release_lock()
    store2, wrong, served = reopen_and_audit(directory)
    assert (wrong, served) == (0, 11)
    assert store2.has("a", "kv") and not store2.has("b", "kv") and not store2.has("c", "kv")
    store2.close()


def test_a_put_and_a_read_never_wait_for_the_disk(tmp_path, monkeypatch):
    """The data file's sync is held up; a put still returns, and its record and every other
    are read, while it is; close waits for it and leaves the record durable."""
    directory = tmp_path / "store"
    store, items, data_fd = synced_store(directory, 3)
    name, sync = DATA_SYNC
    entered, release = threading.Event(), threading.Event()
    synced_fds = []

    def held(fd):
        if fd == data_fd:
            entered.set()
            assert release.wait(30), "the test never released the sync"
        synced_fds.append(fd)
        return sync(fd)

    monkeypatch.setattr(os, name, held)
    assert store.put("a", "kv", expected("a", "kv")) is True
    assert entered.wait(30), "no sync ran after the put"
    # The sync is in progress now and cannot finish until released.
    assert store.put("b", "kv", expected("b", "kv")) is True
    assert store.get("a", "kv") == expected("a", "kv")
    assert all(store.get(*item) == expected(*item) for item in items)
    assert data_fd not in synced_fds  # still held
    release.set()
    store.close()
    assert synced_fds.count(data_fd) >= 2  # a's sync, and b's (or close's)
    monkeypatch.undo()
    store2, wrong, served = reopen_and_audit(directory)
    assert (wrong, served) == (0, 5)
    store2.close()


FSIZE_CHILD = r"""
import json, os, resource, signal, sys
sys.path.insert(0, sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us at the limit
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from mlx_nbengine.cache.store import BlockStore
s = BlockStore(budget_bytes=1 << 30, persist_dir=sys.argv[2], identity=json.loads(sys.argv[4]))
stored = []
for i in range(1000):
    key = f"k{i}"
    blob = (key.encode() * 8000)[:8000]
    if not s.put(key, "kv", blob):
        break
    stored.append(key)
ok = all(s.get(k, "kv") == (k.encode() * 8000)[:8000] for k in stored)
print(json.dumps({"stored": stored, "saving": s.saving, "error": s.saving_error, "reads": ok}))
sys.stdout.flush()
os._exit(0)  # no close: as if the kernel died here
"""


def test_a_real_file_size_limit_turns_saving_off_and_keeps_every_stored_record(tmp_path):
    directory = tmp_path / "store"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            FSIZE_CHILD,
            str(ROOT),
            str(directory),
            str(200_000),
            json.dumps(IDENTITY),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["saving"] is False and out["reads"] is True
    assert "File too large" in out["error"] or "No space" in out["error"]
    assert 10 < len(out["stored"]) < 30
    with open_store(directory) as store:
        for key in out["stored"]:
            assert store.get(key, "kv") == (key.encode() * 8000)[:8000]
        assert store.saving


def test_clear_needs_no_free_space_and_turns_saving_back_on(tmp_path, monkeypatch):
    directory = tmp_path / "store"
    store = open_store(directory)
    fill(store, 5)
    monkeypatch.setattr(blobfile_module.os, "pwrite", failing(errno.ENOSPC, os.pwrite))
    assert store.put("x", "kv", expected("x", "kv")) is False and not store.saving
    store.clear()  # every write still fails here
    assert store.saving and store.items() == []
    monkeypatch.undo()
    assert store.put("y", "kv", expected("y", "kv"))
    store.close()
    with open_store(directory) as again:
        assert again.items() == [("y", "kv")] and audit(again) == (0, 1)


def test_follower_metadata_survives_a_restart_in_order(tmp_path):
    directory = tmp_path / "store"
    with open_store(directory) as store:
        store.remember("b0", "root", [1, 2, 3])
        store.remember("b1", "b0", [-5, 2**40, 7])  # image tokens are negative ids
        store.remember("b0", "root", [1, 2, 3])  # again: most recent now
    with open_store(directory) as store:
        assert store.remembered() == [("b1", "b0", [-5, 2**40, 7]), ("b0", "root", [1, 2, 3])]
    with BlockStore(budget_bytes=1 << 20, directory=tmp_path) as scratch:
        scratch.remember("b0", "root", [1])
        assert scratch.remembered() == []


# -- budget -----------------------------------------------------------------------------------


def test_the_budget_holds_under_a_flood_of_a_thousand_distinct_prompts(tmp_path):
    directory = tmp_path / "store"
    budget = 300_000
    rng = random.Random(3)
    store = open_store(directory, budget_bytes=budget)
    peak_file = peak_log = 0
    for prompt in range(1000):
        # A prompt of 1-4 blocks, each with a kv record and sometimes a window one.
        for block in range(rng.randint(1, 4)):
            key = f"p{prompt}-b{block}"
            for kind in ("kv", "window") if block % 2 else ("kv",):
                store.put(key, kind, expected(key, kind))
                assert store.stats().bytes_held <= budget
        peak_file = max(peak_file, (directory / persist.DATA_FILE).stat().st_size)
        peak_log = max(peak_log, store.persistence.log_size)
    s = store.stats()
    assert s.evicted > 1000 and s.bytes_held <= budget
    # The files stay bounded too: the data file by the budget plus interior free space
    # (blobs here vary 16x in size), the log by compaction.
    assert peak_file <= persist.DATA_HEADER_BYTES + 2 * budget
    assert peak_log <= 64 * 4096 * 2
    store.close()
    store, wrong, served = reopen_and_audit(directory)
    assert wrong == 0 and served == s.records and store.stats().bytes_held <= budget
    store.close()
    with open_store(directory, budget_bytes=budget // 3) as smaller:
        assert smaller.stats().bytes_held <= budget // 3 and smaller.stats().records > 0


# -- permissions and formats -------------------------------------------------------------------


def test_the_directory_is_0700_and_its_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        loose = tmp_path / "loose"
        loose.mkdir(mode=0o777)
        os.chmod(loose, 0o777)
        for directory in (tmp_path / "new" / "nested", loose):
            with open_store(directory) as store:
                fill(store, 3)
            assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
            for name in os.listdir(directory):
                assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o600, name
    finally:
        os.umask(old)


def test_an_unusable_dir_falls_back_to_a_temporary_store_with_a_note(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with open_store(blocker / "store", directory=tmp_path) as store:
        assert not store.persistent and "cannot use the block store" in store.note
        assert store.put("a", "kv", b"x" * 100)
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_the_store_code_never_imports_pickle():
    for module in (persist, blobfile_module, sys.modules[BlockStore.__module__]):
        names: set[str] = set()
        for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add((node.module or "").split(".")[0])
        assert not names & {"pickle", "marshal", "shelve", "dill", "cloudpickle"}, module
