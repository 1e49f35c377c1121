"""The registry of tiny families: each one's name, its group and how its directory is written.

A family registers once, with the function that writes its model directory; `make_tiny_model`
looks the name up here, so a new family is one registration, not another branch. The groups:

- ``core`` (`FAMILIES`): the three cache layouts the store must restore (plain KV, sliding
  window, hybrid recurrent);
- ``extra`` (`EXTRA_FAMILIES`): other text families the GGUF import and the kernels cover;
- ``vision`` (`VISION_FAMILIES`): mlx-vlm models with an image processor.

Text families live in `testing.text`, vision ones in `testing.vision`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GROUPS = ("core", "extra", "vision")


@dataclass(frozen=True)
class Options:
    """What a caller may choose of a tiny model besides its family."""

    sliding_window: int = 64  # the sliding-window families' window
    num_layers: int | None = None  # a text family's depth; None: the family's own
    kv_heads: int | None = None  # a text family's key/value heads (and as many query heads)
    seed: int = 0  # fixes the weights
    dtype: str = "float32"  # the dtype the weights are stored in


@dataclass(frozen=True)
class Family:
    """One tiny family: `write(directory, options)` writes its model directory and returns it;
    `gguf_arch` is the GGUF architecture `make_tiny_gguf` writes it as, where it has one."""

    name: str
    group: str
    write: Callable[[Path, Options], Path]
    gguf_arch: str | None = None


REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` to the registry (a name registers once)."""
    if family.group not in GROUPS:
        raise ValueError(f"unknown family group {family.group!r}; choose one of {GROUPS}")
    if family.name in REGISTRY:
        raise ValueError(f"tiny model family {family.name!r} is registered already")
    REGISTRY[family.name] = family
    return family


def names(group: str) -> tuple[str, ...]:
    """The families of `group`, in the order they registered."""
    return tuple(name for name, family in REGISTRY.items() if family.group == group)


def lookup(name: str) -> Family:
    """The family named `name`, or a ValueError naming every family there is."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown tiny model family {name!r}; choose one of {tuple(REGISTRY)}"
        ) from None


def make_tiny_model(
    family: str,
    directory: str | Path,
    *,
    sliding_window: int = 64,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: str = "float32",
    kv_heads: int | None = None,
) -> Path:
    """Write a random-weight model directory of `family` into `directory` and return it.

    `sliding_window` only matters for ``gemma3_text``, ``gemma4_text`` and ``gemma4``;
    `num_layers` overrides the depth of a text family (llama 2, gemma4_text 6, the others
    4, so every layer kind exists); `seed` fixes the weights; `dtype` is the dtype the
    weights are stored in; `kv_heads` (a text family) sets the key/value heads (default 1)
    and as many query heads, at least 2: tensor parallelism over N ranks splits both, so it
    needs N of each. A vision family's depth and heads are its own.
    """
    options = Options(sliding_window, num_layers, kv_heads, seed, dtype)
    return lookup(family).write(Path(directory), options)


def make_tiny_quantized_model(
    family: str,
    directory: str | Path,
    *,
    bits: int = 4,
    group_size: int = 32,
    seed: int = 0,
    kv_heads: int | None = None,
) -> Path:
    """A tiny text model of `family` quantized by mlx-lm (MLX's affine format, as the
    mlx-community checkpoints are), written into `directory` (which must not exist);
    `kv_heads` as in `make_tiny_model`."""
    from mlx_lm import convert

    directory = Path(directory)
    with tempfile.TemporaryDirectory() as tmp:
        source = make_tiny_model(family, Path(tmp) / "float32", seed=seed, kv_heads=kv_heads)
        convert(str(source), str(directory), quantize=True, q_group_size=group_size, q_bits=bits)
    return directory
