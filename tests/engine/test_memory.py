"""Giving memory back (`engine.memory`): MLX's pool and the C heap, and when the pool is
left alone (a process with an MLX distributed group, outside the steps' pauses)."""

from __future__ import annotations

import resource
import time

import mlx.core as mx
import numpy as np
import pytest

from mlx_nbengine.engine import memory


def fill_pool() -> None:
    x = mx.ones((1 << 20,)) * 2  # 4 MiB, freed into MLX's pool
    mx.eval(x)
    del x
    assert mx.get_cache_memory() > 0


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_collectives", False)


def test_give_back_memory_empties_mlxs_pool(collectives):
    fill_pool()
    memory.give_back_memory()
    assert mx.get_cache_memory() == 0


def test_with_a_distributed_group_the_pool_is_emptied_only_between_steps(collectives):
    memory.collectives_formed()
    fill_pool()
    memory.give_back_memory()  # any thread: a collective may be in flight
    assert mx.get_cache_memory() > 0
    memory.give_back_memory(between_steps=True)
    assert mx.get_cache_memory() == 0


def idle_give_backs(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When the generation thread gives memory back (`Runner.idle`), with
    `GIVE_BACK_AFTER_S` at 1 s."""
    from mlx_nbengine.engine import generation
    from mlx_nbengine.engine.runner import Runner

    monkeypatch.setattr(generation, "GIVE_BACK_AFTER_S", 1.0)
    calls: list[float] = []
    idle = Runner.idle

    def counted(self) -> None:
        calls.append(time.monotonic())
        idle(self)

    monkeypatch.setattr(Runner, "idle", counted)
    return calls


def test_an_idle_engine_gives_memory_back_after_a_pause_not_between_requests(
    tiny_model_dir, tmp_path, monkeypatch
):
    # Back-to-back requests keep MLX's buffers (the next request does not fault them in
    # again); once no work came for GIVE_BACK_AFTER_S, the engine gives its memory back.
    from mlx_nbengine.engine import Engine

    calls = idle_give_backs(monkeypatch)
    with Engine.load(str(tiny_model_dir("llama")), cache_dir=tmp_path) as engine:
        wait_until(lambda: calls)  # idle after the load
        before = len(calls)
        for prompt in ("one two three", "four five six", "seven eight nine"):
            engine.submit(prompt, max_tokens=4).result()
        assert len(calls) == before, "memory given back between back-to-back requests"
        done = time.monotonic()
        wait_until(lambda: len(calls) > before)
        assert calls[-1] - done >= 0.5


def test_the_store_thread_leaves_giving_back_to_the_idle_engine(
    tiny_model_dir, tmp_path, monkeypatch
):
    # The cache-I/O thread's queue empties after each request's saves; giving memory back
    # there at once emptied MLX's pool and the heap between back-to-back requests. It tells
    # the generation thread instead, which gives back once it has been idle a while.
    from mlx_nbengine.engine import Engine, cacheio

    calls = idle_give_backs(monkeypatch)
    from_io: list[float] = []
    monkeypatch.setattr(cacheio, "give_back_memory", lambda: from_io.append(time.monotonic()))
    words = " ".join(f"w{i}" for i in range(80))
    with Engine.load(str(tiny_model_dir("llama")), cache_dir=tmp_path, block_size=16) as engine:
        wait_until(lambda: calls)  # idle after the load
        before = len(calls)
        for n in range(3):
            engine.submit(f"{n} {words}", max_tokens=4).result()
        engine.wait_for_saves(timeout=30)
        assert engine.stats()["stored"] > 0
        drained = time.monotonic()
        assert len(calls) == before and not from_io
        wait_until(lambda: len(calls) > before)  # given back once idle, after the saves
        assert calls[-1] - drained >= 0.5 and not from_io


glibc = pytest.mark.skipif(
    memory._MALLOPT is None, reason="glibc's mallopt is not here (not Linux/glibc)"
)


def page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def touched(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes, np.uint8)
    a.fill(1)  # every page written, as a step writes its buffers
    return a


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@glibc
def test_a_steps_freed_buffer_comes_back_without_page_faults():
    # 8 MiB: a prefill step's activations. Under the pinned mmap threshold it comes from an
    # arena, whose pages the next step's buffer of the size reuses; with glibc's threshold
    # pinned at 128 KiB each was a mapping of its own, faulted in at every use (516 page
    # faults here, in numpy's huge pages; up to 2,048 in small ones).
    memory.keep_large_buffers_mapped()
    nbytes = 8 << 20
    first = touched(nbytes)
    del first
    before = page_faults()
    touched(nbytes)
    assert page_faults() - before < (nbytes >> 12) // 8


@glibc  # glibc is Linux's: /proc/self/statm is there too
def test_a_buffer_over_the_threshold_leaves_rss_when_freed():
    memory.keep_large_buffers_mapped()
    nbytes = 2 * memory._MMAP_THRESHOLD_BYTES  # a long prompt's attention scores
    big = touched(nbytes)
    held = resident_bytes()
    del big
    assert held - resident_bytes() > nbytes * 0.9


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
