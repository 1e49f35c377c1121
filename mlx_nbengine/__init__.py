"""mlx_nbengine: local LLM/VLM inference on MLX for Jupyter, with a block-level prefix cache.

`%load_ext mlx_nbengine` registers the notebook magics; `Engine` is the plain-Python face.
"""

from __future__ import annotations

import os

from mlx_nbengine._blas import ensure_fast_blas

# transformers (imported by mlx-lm's tokenizers) prints "PyTorch was not found..." into the
# cell of every kernel without torch; MLX never needs torch, so that advice is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Before anything imports MLX: on Linux CPU this binds MLX's matmuls to OpenBLAS.
ensure_fast_blas()

__version__ = "0.1.0"
__all__ = ["Engine", "load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str):
    # Lazy, so `import mlx_nbengine` stays cheap and importing MLX waits for the BLAS set-up.
    if name == "Engine":
        from mlx_nbengine.engine import Engine

        return Engine
    raise AttributeError(name)


def load_ipython_extension(ipython) -> None:
    # Lazy: only a kernel loading the extension needs IPython and the notebook face.
    from mlx_nbengine.notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython) -> None:
    # Lazy, as above.
    from mlx_nbengine.notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)
