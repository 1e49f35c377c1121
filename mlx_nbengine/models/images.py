"""Images a request is given, read into RGB pictures, with one-line errors.

An *image item* is what a caller may pass in ``Engine.submit(..., images=[...])`` or
``%%llm --image``: a file path (``str`` or `pathlib.Path`), a PIL image, a numpy array
(``H x W x 3`` or ``H x W x 4`` of ``uint8``, or ``H x W`` grey) or the raw bytes of an
encoded image (PNG, JPEG, ...). `load_image` turns each into an RGB `PIL.Image.Image`, or
raises `ImageError` whose message names the image (its position, and its file) and says
what is wrong: no such file, not an image, a wrong array, too many pixels.

No MLX here: this runs on the caller's thread before anything is queued.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from mlx_nbengine.errors import ImageError

__all__ = ["MAX_IMAGE_PIXELS", "describe", "load_image", "load_images", "thumbnail_png"]

# Larger pictures are refused rather than decoded (PIL's own guard against decompression
# bombs is about 179 million pixels; processors resize far below this anyway).
MAX_IMAGE_PIXELS = 64_000_000


def describe(item: Any) -> str:
    """A short name of an image item for messages: its file name or its type."""
    if isinstance(item, str | Path):
        return f"'{item}'"
    name = type(item).__name__
    shape = getattr(item, "shape", None)
    if shape is not None:
        return f"a {name} of shape {tuple(shape)}"
    size = getattr(item, "size", None)
    if isinstance(size, tuple) and len(size) == 2:
        return f"a {size[0]}x{size[1]} {name}"
    if isinstance(item, bytes | bytearray | memoryview):
        return f"{len(item):,} bytes"
    return f"a {name}"


def _too_large(width: int, height: int, label: str) -> ImageError:
    return ImageError(
        f"{label} has {width}x{height} = {width * height:,} pixels, more than the "
        f"{MAX_IMAGE_PIXELS:,} an image may have; resize it first"
    )


def _open(data: Any, label: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(data) as img:
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise _too_large(width, height, label)
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError:
        raise ImageError(
            f"{label} is not an image PIL can read (PNG, JPEG, GIF, WebP, BMP, ...)"
        ) from None
    except Image.DecompressionBombError:
        raise ImageError(f"{label} is too large to decode safely; resize it first") from None
    except OSError as exc:
        raise ImageError(f"{label} could not be read as an image: {exc}") from None


def load_image(item: Any, *, index: int = 0) -> Any:
    """`item` as an RGB PIL image; `index` (0-based) names it in errors ("image 1")."""
    label = f"image {index + 1}"
    if isinstance(item, str | Path):
        path = Path(item).expanduser()
        if not path.exists():
            raise ImageError(f"{label}: no such file '{item}'")
        if path.is_dir():
            raise ImageError(f"{label}: '{item}' is a folder, not an image file")
        return _open(path, f"{label} ('{item}')")
    if isinstance(item, bytes | bytearray | memoryview):
        if not len(item):
            raise ImageError(f"{label} is empty (0 bytes)")
        return _open(io.BytesIO(bytes(item)), f"{label} ({len(item):,} bytes)")
    from PIL import Image

    if isinstance(item, Image.Image):
        width, height = item.size
        if width * height > MAX_IMAGE_PIXELS:
            raise _too_large(width, height, label)
        return item.convert("RGB")
    if type(item).__module__ == "numpy" and hasattr(item, "shape"):
        return _from_array(item, label)
    raise ImageError(
        f"{label} is {describe(item)}; give a file path, a PIL image, a numpy array "
        "(H x W x 3 uint8) or the bytes of an encoded image"
    )


def _from_array(array: Any, label: str) -> Any:
    import numpy as np
    from PIL import Image

    shape = tuple(array.shape)
    ok_shape = len(shape) == 2 or (len(shape) == 3 and shape[2] in (3, 4))
    if array.dtype != np.uint8 or not ok_shape or 0 in shape:
        raise ImageError(
            f"{label} is a numpy array of shape {shape} and dtype {array.dtype}; an image "
            "array must be H x W x 3 (RGB) or H x W x 4 (RGBA) of uint8, or H x W grey"
        )
    height, width = shape[:2]
    if width * height > MAX_IMAGE_PIXELS:
        raise _too_large(width, height, label)
    return Image.fromarray(np.ascontiguousarray(array)).convert("RGB")


def load_images(items: Any) -> list[Any]:
    """Every item of `items` (a list, or one item) as an RGB PIL image."""
    if items is None:
        return []
    if isinstance(items, str | Path | bytes | bytearray) or hasattr(items, "shape"):
        items = [items]
    else:
        from PIL import Image

        if isinstance(items, Image.Image):
            items = [items]
    return [load_image(item, index=i) for i, item in enumerate(items)]


def thumbnail_png(image: Any, *, max_side: int = 96) -> bytes:
    """PNG bytes of `image` (a PIL image) scaled to fit `max_side` pixels, for display."""
    thumb = image.copy()
    thumb.thumbnail((max_side, max_side))
    out = io.BytesIO()
    thumb.save(out, format="PNG")
    return out.getvalue()
