"""The persistent store's index log (`cache.indexlog`) on its own: entries round-trip,
replay keeps the live puts oldest first and stops at a torn or damaged tail, the header
refuses foreign files, and the log file appends, rewrites and cuts back as it says."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest

from mlx_nbengine.cache import indexlog
from mlx_nbengine.cache.blobfile import Entry
from mlx_nbengine.cache.indexlog import (
    INDEX_FILE,
    Delete,
    Follower,
    IndexLog,
    Put,
    StoreFormatError,
    decode_header,
    encode_entry,
    encode_header,
    read_index,
)

STORE_ID = "ab" * 16
IDENTITY = {"model": "tiny", "fingerprint": "f"}


def ids(*tokens: int) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def new_log(tmp_path: Path, entries: list) -> IndexLog:
    log = IndexLog(tmp_path, store_id=STORE_ID, identity=IDENTITY)
    log.rewrite(entries)
    return log


def test_each_entry_kind_round_trips():
    for entry in (
        Put("key-ü", "kv", offset=16, length=4096, checksum=7),
        Delete("key", "window"),
        Follower("child", "parent", ids(1, -2, 3)),
    ):
        frame = encode_entry(entry)
        ((got, end),) = list(indexlog.iter_entries(frame, 0))
        assert got == entry and end == len(frame)


def test_a_key_longer_than_the_format_allows_is_refused():
    with pytest.raises(ValueError, match="too long for the store index"):
        encode_entry(Delete("k" * 70_000, "kv"))


def test_replay_keeps_the_live_puts_oldest_first_and_the_latest_followers(tmp_path):
    entries = [
        Put("a", "kv", 16, 10, 1),
        Put("b", "kv", 26, 10, 2),
        Put("a", "kv", 36, 10, 3),  # a again: now the newest, at its new place
        Delete("b", "kv"),
        Put("c", "state", 46, 5, 4),
        Follower("f1", "a", ids(5)),
        Follower("f2", "a", ids(6)),
        Follower("f3", "c", ids(7)),
    ]
    new_log(tmp_path, entries).close()
    data = (tmp_path / INDEX_FILE).read_bytes()
    state = indexlog.replay(data, *decode_header(data), followers=2)
    assert list(state.puts) == [("a", "kv"), ("c", "state")]
    assert state.puts[("a", "kv")] == Entry(36, 10, 3)
    assert list(state.followers) == ["f2", "f3"]  # the oldest went past the capacity
    assert state.entries == len(entries) and state.end == state.size


def test_replay_stops_at_a_torn_or_damaged_entry(tmp_path):
    new_log(tmp_path, [Put("a", "kv", 16, 10, 1), Put("b", "kv", 26, 10, 2)]).close()
    path = tmp_path / INDEX_FILE
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # the last entry torn
    torn = read_index(path)
    assert list(torn.puts) == [("a", "kv")] and torn.end < torn.size
    damaged = bytearray(whole)
    damaged[-1] ^= 0xFF  # the last entry fails its checksum
    path.write_bytes(bytes(damaged))
    assert list(read_index(path).puts) == [("a", "kv")]


def test_attach_cuts_a_torn_tail_before_appending(tmp_path):
    new_log(tmp_path, [Put("a", "kv", 16, 10, 1)]).close()
    path = tmp_path / INDEX_FILE
    path.write_bytes(path.read_bytes() + b"\x05\x00garbage")
    state = read_index(path)
    log = IndexLog(tmp_path, store_id=STORE_ID, identity=IDENTITY)
    log.attach(state)
    log.append([Put("b", "kv", 26, 10, 2)])
    log.close()
    assert list(read_index(path).puts) == [("a", "kv"), ("b", "kv")]


def test_the_header_carries_the_identity_and_refuses_foreign_files(tmp_path):
    header, start = decode_header(encode_header(store_id=STORE_ID, identity=IDENTITY))
    assert header["identity"] == IDENTITY and header["store_id"] == STORE_ID and start > 16
    good = encode_header(store_id=STORE_ID, identity=IDENTITY)
    for data, why in (
        (b"PK\x03\x04 a zip file", "no MNBINDEX header"),
        (good[:12], "truncated"),
        (good[:8] + struct.pack("<I", 99) + good[12:], "store format 99"),
        (good[:-1] + bytes([good[-1] ^ 1]), "fails its checksum"),
        (encode_header(store_id="not hex!" * 4, identity={}), "not hex"),
        (encode_header(store_id="ab", identity={}), "lacks its fields"),
    ):
        with pytest.raises(StoreFormatError, match=why):
            decode_header(data)


def test_an_index_that_is_a_symlink_or_a_folder_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    new_log(real, []).close()
    link = tmp_path / "link.log"
    link.symlink_to(real / INDEX_FILE)
    with pytest.raises(StoreFormatError, match="is a symlink"):
        read_index(link)
    with pytest.raises(StoreFormatError, match="not a regular file"):
        read_index(real)


def test_rewrite_replaces_the_log_whole_and_leaves_no_temp_file(tmp_path):
    log = new_log(tmp_path, [Put("a", "kv", 16, 10, 1), Delete("a", "kv")])
    log.rewrite([Put("b", "kv", 16, 4, 2)])
    log.close()
    state = read_index(tmp_path / INDEX_FILE)
    assert list(state.puts) == [("b", "kv")] and state.entries == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [INDEX_FILE]
    assert (tmp_path / INDEX_FILE).stat().st_mode & 0o777 == 0o600


def test_clear_cuts_the_log_back_to_its_header(tmp_path):
    log = new_log(tmp_path, [Put("a", "kv", 16, 10, 1)])
    log.clear()
    log.close()
    state = read_index(tmp_path / INDEX_FILE)
    assert state.entries == 0 and not state.puts and state.size == state.start


def test_a_failed_append_cuts_the_log_back_and_raises(tmp_path, monkeypatch):
    log = new_log(tmp_path, [Put("a", "kv", 16, 10, 1)])
    end = log.end

    pwrite = os.pwrite

    def full(fd, data, offset):
        pwrite(fd, bytes(data)[:5], offset)  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        log.append([Put("b", "kv", 26, 10, 2)])
    monkeypatch.undo()
    assert log.end == end and log.broken is None
    log.close()
    assert (tmp_path / INDEX_FILE).stat().st_size == end
    assert list(read_index(tmp_path / INDEX_FILE).puts) == [("a", "kv")]


def test_a_log_that_cannot_be_cut_back_is_broken_and_appends_nothing_more(tmp_path, monkeypatch):
    log = new_log(tmp_path, [])

    def failing(*_args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", failing)
    monkeypatch.setattr(os, "ftruncate", failing)
    with pytest.raises(OSError):
        log.append([Put("b", "kv", 26, 10, 2)])
    monkeypatch.undo()
    assert log.broken == "Input/output error"
    with pytest.raises(OSError, match="cannot be written"):
        log.append([Put("c", "kv", 36, 10, 3)])
    log.close()
