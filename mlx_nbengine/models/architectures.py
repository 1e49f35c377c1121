"""A config's *modality*: ``"vision"`` (mlx-vlm runs it, images in) or ``"text"`` (mlx-lm).

Read by the loader (which library loads the model) and by `sources` (what a listed
model is), so neither imports the other for it.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

__all__ = ["Modality", "model_modality"]

Modality = Literal["text", "vision"]


def _vlm_supports(model_type: str) -> bool:
    # Lazy: mlx-vlm's import takes seconds and text models never need it.
    from mlx_vlm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    return importlib.util.find_spec(f"mlx_vlm.models.{name}") is not None


def model_modality(config: dict) -> Modality:
    """``"vision"`` when the config describes a vision model mlx-vlm runs, else ``"text"``."""
    if config.get("vision_config") and _vlm_supports(config["model_type"]):
        return "vision"
    return "text"
