"""Giving memory back (`engine.memory`): MLX's pool and the C heap, and when the pool is
left alone (a process with an MLX distributed group, outside the steps' pauses)."""

from __future__ import annotations

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
