"""Which families mlx-lm can shard, and how: ``tensor`` (the model's ``shard``) or
``pipeline`` (its inner model's ``pipeline``, mlx-lm's `PipelineMixin`).

Asked of mlx-lm's own model classes (nothing is loaded): a family is shardable when its
``Model`` class defines ``shard``, or when the module's inner model class has ``pipeline``.
`shard_fn` gives what `models.load(shard=...)` applies to the lazily loaded model.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pkgutil
from collections.abc import Callable
from functools import cache
from typing import Any

from mlx_nbengine.errors import ModelError

SHARD_MODES = ("tensor", "pipeline")


class NotShardableError(ModelError):
    """A family mlx-lm cannot shard (or not the way asked)."""


def _module(model_type: str) -> Any | None:
    # A few mlx-lm modules print and exit when an optional package is missing (olmo).
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return importlib.import_module(f"mlx_lm.models.{model_type}")
    except (Exception, SystemExit):  # noqa: BLE001 - any module that does not import: no family
        return None


def modes_of(model_type: str) -> tuple[str, ...]:
    """The shard modes mlx-lm's `model_type` module supports, tensor first."""
    module = _module(model_type)
    if module is None or not hasattr(module, "Model"):
        return ()
    modes = []
    if hasattr(getattr(module, "Model", None), "shard"):
        modes.append("tensor")
    classes = [v for v in vars(module).values() if isinstance(v, type)]
    if any(c.__module__ == module.__name__ and hasattr(c, "pipeline") for c in classes):
        modes.append("pipeline")
    return tuple(modes)


@cache
def shardable_families() -> dict[str, tuple[str, ...]]:
    """Every mlx-lm family that can be sharded, with its modes (imports mlx-lm's models)."""
    import mlx_lm.models as models

    out = {}
    for info in pkgutil.iter_modules(models.__path__):
        modes = modes_of(info.name)
        if modes:
            out[info.name] = modes
    return out


def choose_mode(model_type: str, asked: str | None) -> str:
    """The shard mode for `model_type`: `asked`, else the first it supports; raises
    `NotShardableError` in one line naming the family and the families that can."""
    if asked is not None and asked not in SHARD_MODES:
        raise NotShardableError(f"shard must be one of {', '.join(SHARD_MODES)}, got {asked!r}")
    modes = modes_of(model_type)
    if not modes:
        families = ", ".join(sorted(shardable_families()))
        raise NotShardableError(
            f"mlx-lm cannot shard the {model_type} family over ranks; families it can shard: "
            f"{families}"
        )
    if asked is not None and asked not in modes:
        able = ", ".join(sorted(f for f, k in shardable_families().items() if asked in k))
        raise NotShardableError(
            f"mlx-lm shards {model_type} by {' or '.join(modes)}, not {asked}; families with "
            f"{asked} sharding: {able}"
        )
    return asked or modes[0]


def pipelined_part(model: Any) -> Any:
    """The inner model that has mlx-lm's ``pipeline`` (``model.model``, or a wrapper's
    ``language_model.model``)."""
    for path in (("model",), ("language_model", "model")):
        part = model
        for name in path:
            part = getattr(part, name, None)
        if part is not None and hasattr(part, "pipeline"):
            return part
    raise NotShardableError(f"{type(model).__module__} has no pipelined part")


def shard_fn(mode: str, group: Any) -> Callable[[Any], None]:
    """What `models.load(shard=...)` applies: this rank's part of the model over `group`."""

    def apply(model: Any) -> None:
        if mode == "tensor":
            model.shard(group)
        else:
            pipelined_part(model).pipeline(group)

    return apply
