"""The cache home: the one folder where the package keeps what it builds and converts.

``$MLX_NBENGINE_HOME`` if set, else ``~/.cache/mlx_nbengine``. Under it: ``blas/`` (the BLAS
shim or renamed copy and the guard's verdicts, `_blaslib`), ``kernels/`` (the kernels'
extension module, `kernels.build`) and ``gguf/`` (converted GGUF models, `models.gguf`).
This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["home"]


def home() -> Path:
    """The cache home (see the module docstring)."""
    return Path(os.environ.get("MLX_NBENGINE_HOME") or Path.home() / ".cache" / "mlx_nbengine")
