"""Every reach into mlx-lm's and mlx-vlm's private parts, where they offer no public way.

Each function says why it reaches. tests/models/test_patches.py checks each against the installed
libraries, so a change underneath fails there, by name, not somewhere in a restore.

- *window cache*: mlx-lm's `RotatingKVCache`, a buffer of the last ``max_size`` tokens that
  single-token steps write in rotation (``_idx`` is where the next one goes).
- *instance subclass*: one module object given a subclass of its own class, so a method
  override applies to it alone, without rebuilding the model's module tree.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "is_window_cache",
    "model_classes",
    "set_window_state",
    "subclass_instance",
    "unsubclass_instance",
    "window_in_token_order",
]

TOKEN_AXIS = 2
_WINDOW_FIELDS = ("keys", "values", "offset", "keep", "max_size", "_idx", "_temporal_order")


def model_classes(config: dict) -> tuple[type, type]:
    """``(Model, ModelArgs)`` of `config`'s architecture; ValueError when mlx-lm has none."""
    # Lazy: mlx_lm.utils imports transformers (seconds), which the cache layer never needs.
    from mlx_lm.utils import _get_classes

    # mlx-lm's only way to name an architecture's classes without loading weights.
    return _get_classes(config)


def is_window_cache(layer_cache: Any) -> bool:
    """Whether `layer_cache` is a window cache with no kept prefix (``keep == 0``)."""
    return (
        type(layer_cache).__name__ == "RotatingKVCache"
        and getattr(layer_cache, "keep", None) == 0
        and all(hasattr(layer_cache, a) for a in _WINDOW_FIELDS)
    )


def window_in_token_order(layer_cache: Any, buffer: Any) -> Any:
    """`buffer` (the cache's keys or values) with its tokens in order, oldest first."""
    # mlx-lm keeps the rule for unrotating its buffer private (RotatingKVCache._temporal_order).
    return layer_cache._temporal_order(buffer)


def set_window_state(layer_cache: Any, keys: Any, values: Any, offset: int) -> None:
    """Fill a window cache with `keys` and `values` (in token order) ending at `offset`;
    keep and max_size stay, and the next token goes after the last one given."""
    c, write_at = layer_cache, keys.shape[TOKEN_AXIS]
    meta = getattr(type(c), "meta_state", None)
    if isinstance(meta, property) and meta.fset is not None:
        # mlx-vlm's: the write pointer (_idx) travels in meta_state, as strings.
        c.state = (keys, values)
        c.meta_state = tuple(map(str, (c.keep, c.max_size, offset, write_at)))
    else:
        # mlx-lm's has no meta_state: its 6-field state is the only setter of _idx.
        c.state = (keys, values, offset, c.keep, c.max_size, write_at)


def subclass_instance(instance: Any, subclass: type) -> None:
    """Give `instance` the behaviour of `subclass` (a subclass of its class) in place."""
    # MLX modules have no per-instance hook for __call__ or a model's private mask builder;
    # swapping the class keeps the module tree, its weights and every reference to it.
    if not issubclass(subclass, type(instance)):
        raise TypeError(f"{subclass.__name__} does not subclass {type(instance).__name__}")
    instance.__class__ = subclass


def unsubclass_instance(instance: Any, cls: type) -> None:
    """Give `instance` its class `cls` back (a superclass of its own, `subclass_instance`)."""
    if not issubclass(type(instance), cls):
        raise TypeError(f"{type(instance).__name__} does not subclass {cls.__name__}")
    instance.__class__ = cls
