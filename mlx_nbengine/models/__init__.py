"""The models layer: load text (mlx-lm) and vision (mlx-vlm) models, import GGUF files,
resolve the embedded default model.

`load(path_or_name)` returns a `LoadedModel`; every failure a user can cause is a
`ModelError` (see `mlx_nbengine.errors`) whose message says what to do.
"""

from __future__ import annotations

from mlx_nbengine._blas import ensure_fast_blas

# Before the loaders import MLX (a no-op if mlx_nbengine/__init__ already did it).
ensure_fast_blas()

from mlx_nbengine.errors import ModelError  # noqa: E402
from mlx_nbengine.models.loaded import LoadedModel  # noqa: E402
from mlx_nbengine.models.loader import (  # noqa: E402
    fingerprint_directory,
    load,
    model_kind,
    resolve,
)

__all__ = ["LoadedModel", "ModelError", "fingerprint_directory", "load", "model_kind", "resolve"]
