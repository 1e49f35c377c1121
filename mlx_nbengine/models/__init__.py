"""The models layer: load text (mlx-lm) and vision (mlx-vlm) models, import GGUF files,
resolve the embedded default model, find models by id in the Hugging Face hub cache and
LM Studio's folder (or download them), and list the models already on this machine.

`load(path_or_name)` returns a `LoadedModel`; every failure a user can cause is a
`ModelError` (see `mlx_nbengine.errors`) whose message says what to do.
"""

from __future__ import annotations

from mlx_nbengine._blas import ensure_fast_blas

# Before the loaders import MLX (a no-op if mlx_nbengine/__init__ already did it).
ensure_fast_blas()

from mlx_nbengine.errors import ModelError  # noqa: E402
from mlx_nbengine.models.architectures import Modality, model_modality  # noqa: E402
from mlx_nbengine.models.loaded import LoadedModel  # noqa: E402
from mlx_nbengine.models.loader import fingerprint_directory, load, resolve  # noqa: E402
from mlx_nbengine.models.sources import LocalModel, list_local_models  # noqa: E402

__all__ = [
    "LoadedModel",
    "LocalModel",
    "Modality",
    "ModelError",
    "fingerprint_directory",
    "list_local_models",
    "load",
    "model_modality",
    "resolve",
]
