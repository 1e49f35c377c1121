"""Giving memory back (`engine.memory`): MLX's pool and the C heap, and when the pool is
left alone (a process with an MLX distributed group, outside the steps' pauses)."""

from __future__ import annotations

import time

import mlx.core as mx
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


def test_an_idle_engine_gives_memory_back_after_a_pause_not_between_requests(
    tiny_model_dir, tmp_path, monkeypatch
):
    # Back-to-back requests keep MLX's buffers (the next request does not fault them in
    # again); once no work came for GIVE_BACK_AFTER_S, the engine gives its memory back.
    from mlx_nbengine.engine import Engine, generation
    from mlx_nbengine.engine.runner import Runner

    monkeypatch.setattr(generation, "GIVE_BACK_AFTER_S", 1.0)
    calls: list[float] = []
    idle = Runner.idle

    def counted(self) -> None:
        calls.append(time.monotonic())
        idle(self)

    monkeypatch.setattr(Runner, "idle", counted)
    with Engine.load(str(tiny_model_dir("llama")), cache_dir=tmp_path) as engine:
        wait_until(lambda: calls)  # idle after the load
        before = len(calls)
        for prompt in ("one two three", "four five six", "seven eight nine"):
            engine.submit(prompt, max_tokens=4).result()
        assert len(calls) == before, "memory given back between back-to-back requests"
        done = time.monotonic()
        wait_until(lambda: len(calls) > before)
        assert calls[-1] - done >= 0.5


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
