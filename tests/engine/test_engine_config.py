"""`EngineConfig`: every engine option in one frozen object, validated once, in one line."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest

from mlx_nbengine.engine import Engine, EngineConfig, InvalidRequestError


def test_defaults_and_normalisation(tmp_path):
    config = EngineConfig.of(tmp_path / "model", persist_dir="~/store", cache_dir=tmp_path)
    assert config.model == os.fspath(tmp_path / "model") and config.name == "model"
    assert config.persist_dir == os.path.expanduser("~/store")
    assert config.cache_dir == os.fspath(tmp_path)
    assert (config.parallel, config.block_size, config.restore) == (4, 256, "token")
    assert not config.sharded
    assert EngineConfig.of("a/b", ranks=2, hosts=None).sharded
    assert EngineConfig.of("x", hosts=["h1", "h2"]).hosts == ("h1", "h2")


def test_it_is_frozen():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.parallel = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"parallel": 0}, "parallel must be an integer >= 1, got 0"),
        ({"block_size": "16"}, "block_size must be an integer >= 1"),
        ({"max_prefill_step": True}, "max_prefill_step must be an integer >= 1"),
        ({"restore": "tail"}, "restore must be one of 'token', 'block'"),
        ({"disk_budget": -1}, "disk_budget must be bytes >= 0"),
        ({"cache_dir": "/no/such/folder"}, "cache_dir '/no/such/folder' is not a directory"),
        ({"persist_dir": "p", "store": False}, "persist_dir keeps the block store on disk"),
        ({"persist_dir": "p", "disk_budget": 0}, "persist_dir keeps the block store on disk"),
        ({"ranks": 1}, "ranks must be an integer >= 2"),
        ({"hosts": ["only-one"]}, "hosts needs at least two hosts"),
        ({"ranks": 2, "persist_dir": "p"}, "persist_dir is not supported with ranks"),
        ({"shard": "tensor"}, "shard goes with ranks or hosts"),
        ({"paralel": 2}, "unknown engine option 'paralel'"),
    ],
)
def test_bad_options_are_one_line(options, says):
    with pytest.raises(InvalidRequestError, match="^" + says.replace("(", r"\(")) as info:
        EngineConfig.of("m", **options)
    assert "\n" not in str(info.value)


def test_engine_load_checks_its_options_before_loading_anything(tmp_path):
    with pytest.raises(InvalidRequestError, match="parallel"):
        Engine.load(tmp_path / "no-model-here", parallel=0)


def test_every_option_is_a_field_and_load_takes_only_model_and_progress():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert fields >= {"parallel", "block_size", "persist_dir", "ranks", "hosts", "shard"}
    params = inspect.signature(Engine.load).parameters
    assert list(params) == ["model", "progress", "options"]


def test_the_config_crosses_to_a_worker_in_its_load_plan(tmp_path):
    """Rank 0 sends each worker the one config (`plans.Load`) on the control channel."""
    import socket

    from mlx_nbengine.engine.ranks import plans
    from mlx_nbengine.engine.ranks.channel import Link

    config = EngineConfig.of("org/model", ranks=2, block_size=64, cache_dir=tmp_path, dtype="f16")
    a, b = socket.socketpair()
    sender, receiver = Link(a), Link(b)
    try:
        sender.send(plans.Load(model="org/model", config=config, shard="tensor"))
        plan = receiver.receive(timeout=5)
    finally:
        sender.close()
        receiver.close()
    assert isinstance(plan, plans.Load) and plan.config == config
    assert plan.config.store_options() == config.store_options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config.block_size = 16  # type: ignore[misc]
    assert dataclasses.replace(plan.config, cache_dir=None).cache_dir is None
