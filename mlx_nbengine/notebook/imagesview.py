"""The *image display* (`images_bundle`): with ``%%llm --image``, one display right above
the answer: a thumbnail per image (``figure.mnb-image``) captioned with its name (file or
variable) and original size; ``text/plain`` "[image 1: cat.png, 640x480]".
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from mlx_nbengine.notebook.blockinfo import thumbnail_uri
from mlx_nbengine.notebook.pictures import view_style
from mlx_nbengine.notebook.render import Bundle

__all__ = [
    "IMAGE_THUMB_SIDE",
    "images_bundle",
    "images_text",
]


# The thumbnails' longest side in the answer's image display.
IMAGE_THUMB_SIDE = 96


def images_text(images: Sequence[Any]) -> str:
    """One line per image: "[image 1: cat.png, 640x480]"."""
    return "\n".join(
        f"[image {i + 1}: {item.name}, {item.width}x{item.height}]" for i, item in enumerate(images)
    )


def images_bundle(images: Sequence[Any], *, max_side: int = IMAGE_THUMB_SIDE) -> Bundle:
    """The display shown above an answer: a captioned thumbnail per image.

    `images` are the request's `mlx_nbengine.notebook.prompting.ImageInput`s (duck-typed:
    `name`, `width`, `height` and the PIL `image`), in the order the model gets them.
    """
    figures = []
    for i, item in enumerate(images):
        name = html.escape(str(item.name))
        caption = f"{name} · {item.width}x{item.height}"
        figures.append(
            f'<figure class="mnb-image" data-index="{i}">'
            f'<img src="{thumbnail_uri(item.image, max_side=max_side)}" '
            f'alt="image {i + 1}: {name}" title="image {i + 1}: {name}">'
            f"<figcaption>{caption}</figcaption></figure>"
        )
    markup = f'{view_style()}<div class="mnb-images">{"".join(figures)}</div>'
    return {"text/plain": images_text(images), "text/html": markup}
