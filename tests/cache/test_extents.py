"""The scratch file's offset table and free list (`cache.extents`), without a file: the
first fit, coalescing, truncating free space at the end, adopting a table, and the
invariant (`Extents.problems`) after random work."""

from __future__ import annotations

import random

import pytest

from mlx_nbengine.cache.extents import Entry, Extents

RESERVED = 16


class File:
    """The real file's size as `truncate` leaves it; `refuse` makes truncating fail."""

    def __init__(self, size: int = RESERVED) -> None:
        self.size = size
        self.refuse = False

    def truncate(self, size: int) -> None:
        if self.refuse:
            raise OSError("read-only file system")
        self.size = size


def write(extents: Extents, file: File, key: str, length: int) -> Entry:
    entry = Entry(extents.allocate(length), length, checksum=0)
    extents.add(key, entry)
    file.size = max(file.size, entry.offset + length)  # the write grows the real file
    return entry


def fresh() -> tuple[Extents, File]:
    file = File()
    return Extents(reserved=RESERVED, size=RESERVED, truncate=file.truncate), file


def test_blobs_go_after_the_reserved_header_one_after_another():
    extents, file = fresh()
    a, b = write(extents, file, "a", 10), write(extents, file, "b", 5)
    assert (a.offset, b.offset) == (RESERVED, RESERVED + 10)
    assert extents.size == file.size == RESERVED + 15 and extents.held == 15
    assert extents.problems(file.size) == []


def test_a_freed_hole_is_reused_first_fit_and_split():
    extents, file = fresh()
    for key, n in (("a", 10), ("b", 10), ("c", 10)):
        write(extents, file, key, n)
    extents.drop("a")
    assert extents.free == [(RESERVED, 10)]
    small = write(extents, file, "d", 4)
    assert small.offset == RESERVED and extents.free == [(RESERVED + 4, 6)]
    big = write(extents, file, "e", 7)  # too big for the hole: the end of the file
    assert big.offset == RESERVED + 30
    assert extents.problems(file.size) == []


def test_neighbouring_free_extents_are_coalesced():
    extents, file = fresh()
    for key in "abcd":
        write(extents, file, key, 10)
    extents.drop("a")
    extents.drop("c")
    extents.drop("b")  # joins the holes on both sides
    assert extents.free == [(RESERVED, 30)]
    assert extents.problems(file.size) == []


def test_free_space_that_reaches_the_end_is_truncated():
    extents, file = fresh()
    write(extents, file, "a", 10)
    write(extents, file, "b", 10)
    extents.drop("b")
    assert file.size == extents.size == RESERVED + 10 and extents.free == []
    extents.drop("a")
    assert file.size == extents.size == RESERVED


def test_a_file_that_cannot_shrink_keeps_its_tail_as_free_space():
    extents, file = fresh()
    write(extents, file, "a", 10)
    file.refuse = True
    extents.drop("a")
    assert extents.free == [(RESERVED, 10)] and extents.size == RESERVED + 10
    assert extents.problems(file.size) == [
        "free space reaches the end of the file but was not truncated"
    ]


def test_adopt_takes_sound_entries_and_refuses_the_rest():
    file = File(size=RESERVED + 100)
    extents = Extents(reserved=RESERVED, size=file.size, truncate=file.truncate)
    refused = extents.adopt(
        [
            ("a", Entry(RESERVED, 10, 1)),
            ("overlap", Entry(RESERVED + 5, 10, 2)),
            ("header", Entry(0, 4, 3)),
            ("past end", Entry(RESERVED + 95, 10, 4)),
            ("empty", Entry(RESERVED + 40, 0, 5)),
            ("b", Entry(RESERVED + 30, 20, 6)),
        ],
        real=file.size,
    )
    assert refused == ["overlap", "header", "past end", "empty"]
    assert set(extents.table) == {"a", "b"} and extents.held == 30
    # The gap between them is free; the space after the last is cut off.
    assert extents.free == [(RESERVED + 10, 20)]
    assert file.size == extents.size == RESERVED + 50
    assert extents.problems(file.size) == []


def test_adopt_needs_an_empty_table():
    extents, file = fresh()
    write(extents, file, "a", 10)
    with pytest.raises(ValueError, match="empty table"):
        extents.adopt([], real=file.size)


def test_problems_names_an_overlap_and_a_wrong_held_count():
    extents, file = fresh()
    write(extents, file, "a", 10)
    extents.table["b"] = Entry(RESERVED + 5, 10, 0)  # over a, past the end
    problems = extents.problems(file.size)
    assert f"blob extent at {RESERVED + 5}, expected {RESERVED + 10}" in problems
    assert "bytes_held disagrees with the table" in problems


@pytest.mark.parametrize("seed", range(5))
def test_random_work_keeps_the_invariant(seed):
    rng = random.Random(seed)
    extents, file = fresh()
    live: list[str] = []
    for step in range(400):
        if live and rng.random() < 0.45:
            key = live.pop(rng.randrange(len(live)))
            extents.drop(key)
        else:
            key = f"k{step}"
            write(extents, file, key, rng.randint(1, 64))
            live.append(key)
        assert extents.problems(file.size) == [], step
    for key in live:
        extents.drop(key)
    assert extents.size == file.size == RESERVED and extents.free == []
    extents.reset()
    assert extents.table == {} and extents.held == 0
