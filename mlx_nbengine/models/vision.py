"""Image prompts for vision models: from text and pictures to token ids and image spans.

Runs on the caller's thread (``Engine.submit``), with numpy only: the processor's arrays
become MLX arrays on the generation thread.

Terms:

- *placeholder*: the text the model's processor expands into an image's tokens (Qwen2-VL's
  ``<|image_pad|>``, Gemma 4's image token); a chat template writes one for each
  ``{"type": "image"}`` content part.
- *image tokens*: the run of ``image_token_id`` the processor puts where a placeholder
  was; its length depends on the picture's size after the processor's resizing.
- *image span* (`ImageSpan`): an image's token range and its *digest*, a SHA-256 of what
  the processor makes of that picture alone (the resized, normalised pixel arrays and
  their grid), so the same picture saved twice has one digest and two pictures of one
  size have two. Block keys hash the spans overlapping each block.
- *bidirectional images*: models whose image tokens attend to each other both ways
  (``use_bidirectional_attention: "vision"``, Gemma 4; PaliGemma's whole prefix): the
  prefix cache never restores to a point inside an image of theirs, and the engine
  prefills an image in one model call.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from mlx_nbengine.errors import ImageError

__all__ = [
    "ImageSpan",
    "VisionPrompt",
    "bidirectional_images",
    "image_digest",
    "image_token_id",
    "messages_with_images",
    "prepare_vision_prompt",
]


@dataclass(frozen=True)
class ImageSpan:
    """Token range ``[start, end)`` of one image and a content hash of the image."""

    start: int
    end: int
    digest: str

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"image span needs 0 <= start < end, got {self.start}..{self.end}")

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and self.end > start

    def cuts(self, boundary: int) -> bool:
        """True when `boundary` falls strictly inside the image's tokens."""
        return self.start < boundary < self.end


# Keys of the processor's output that are not per-request model inputs (the token types
# are rebuilt from the spans: a BOS fix may shift the ids).
_NOT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


@dataclass(frozen=True)
class VisionPrompt:
    """A processed image prompt: its token ids (image placeholders expanded), one span per
    image, the processor's other outputs (numpy, e.g. ``pixel_values``,
    ``image_grid_thw``) and each picture's size (width, height)."""

    tokens: list[int]
    spans: tuple[ImageSpan, ...]
    inputs: dict[str, np.ndarray] = field(repr=False)
    sizes: tuple[tuple[int, int], ...] = ()


def _config_value(lm: Any, *names: str) -> Any:
    for name in names:
        for config in (lm.config, lm.config.get("text_config") or {}):
            if config.get(name) is not None:
                return config[name]
    return None


def image_token_id(lm: Any) -> int:
    """The token id the processor repeats for an image's tokens."""
    value = _config_value(lm, "image_token_id", "image_token_index")
    if value is not None:
        return int(value)
    token = getattr(lm.processor, "image_token", None)
    if token is None:
        raise ImageError(f"{lm.path.name}: cannot tell which token stands for an image")
    return int(lm.text_tokenizer.convert_tokens_to_ids(token))


def bidirectional_images(lm: Any) -> bool:
    """Whether the model's image tokens attend to each other both ways."""
    if lm.model_type == "paligemma":
        return True
    return _config_value(lm, "use_bidirectional_attention") in ("vision", True, "all")


def placeholder(lm: Any) -> str:
    """The text a plain-string prompt gets per image: what the chat template writes for an
    image part (with its markers, e.g. ``<|vision_start|>...<|vision_end|>``) when it can
    be found, else the processor's image token."""
    token = getattr(lm.processor, "image_token", None)
    marker = "\ue000"
    if lm.has_chat_template and token:
        parts = [{"type": "image"}, {"type": "text", "text": marker}]
        try:
            text = lm.render_chat([{"role": "user", "content": parts}])
        except Exception:  # a template without image parts: the token alone
            text = ""
        at = text.find(token)
        end = text.find(marker, at)
        if at >= 0 and end > at:
            start = text.rfind("\n", 0, at) + 1
            return text[start:end]
    if not token:
        raise ImageError(f"{lm.path.name}: its processor names no image placeholder")
    return token


def messages_with_images(messages: list[dict], n_images: int) -> list[dict]:
    """`messages` with `n_images` image parts before the text of the last user message,
    unless some message already has image parts (then they are kept as written)."""
    if any(
        isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
        for m in messages
    ):
        return messages
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise ImageError("the chat messages have no user message to put the images in")
    out = [dict(m) for m in messages]
    last = out[users[-1]]
    content = last.get("content")
    parts = [{"type": "image"} for _ in range(n_images)]
    if isinstance(content, list):
        parts += content
    elif content:
        parts.append({"type": "text", "text": str(content)})
    last["content"] = parts
    return out


def _numpy(value: Any) -> Any:
    """A processor output as numpy (a list of arrays of several shapes stays a list)."""
    if isinstance(value, list | tuple):
        try:
            return np.asarray(value)
        except ValueError:
            return [np.asarray(v) for v in value]
    return np.asarray(value)


def _feed(h: Any, value: Any) -> None:
    """Hash `value` (a processor's output: dicts, lists, arrays, numbers) into `h`."""
    if isinstance(value, dict) or hasattr(value, "keys"):
        for name in sorted(value.keys()):
            h.update(f"\0key\0{name}".encode())
            _feed(h, value[name])
    elif isinstance(value, list | tuple):
        h.update(f"\0list\0{len(value)}".encode())
        for item in value:
            _feed(h, item)
    else:
        array = np.asarray(value)
        h.update(f"\0array\0{array.dtype.str}\0{array.shape}\0".encode())
        h.update(np.ascontiguousarray(array).tobytes())


_DIGESTS: OrderedDict[tuple[str, str], str] = OrderedDict()
_DIGESTS_LOCK = threading.Lock()
_DIGESTS_KEPT = 256


def _pixels_hash(image: Any) -> str:
    h = xxhash.xxh3_128(f"{image.mode}\0{image.size}\0".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def image_digest(lm: Any, image: Any) -> str:
    """SHA-256 of what the processor makes of `image` alone (see the module docstring).

    Remembered (the last 256, per model) by a hash of the decoded pixels, so a picture
    sent again is not processed twice for its digest."""
    key = (lm.fingerprint, _pixels_hash(image))
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            _DIGESTS.move_to_end(key)
            return _DIGESTS[key]
    digest = _processed_digest(lm, image)
    with _DIGESTS_LOCK:
        _DIGESTS[key] = digest
        while len(_DIGESTS) > _DIGESTS_KEPT:
            _DIGESTS.popitem(last=False)
    return digest


def _processed_digest(lm: Any, image: Any) -> str:
    processor = getattr(lm.processor, "image_processor", None) or lm.processor
    try:
        out = processor(images=[image], return_tensors="np")
    except Exception as exc:
        raise ImageError(f"the processor cannot read an image: {exc}") from None
    h = hashlib.sha256(b"mlx_nbengine.image.v1")
    _feed(h, out)
    return h.hexdigest()


def _runs(tokens: list[int], token_id: int) -> list[tuple[int, int]]:
    ids = np.asarray(tokens)
    hit = np.concatenate([[False], ids == token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def prepare_vision_prompt(
    lm: Any, text: str, images: list[Any], *, templated: bool
) -> VisionPrompt:
    """Run the model's processor on `text` and the RGB `images`.

    `templated`: `text` came from the chat template (it writes its own special tokens, so
    the processor must not add them again). A plain string without placeholders gets one
    per image first. Raises `ImageError` when the text has fewer places than images, or
    the processor fails on them.
    """
    token = getattr(lm.processor, "image_token", None)
    if not templated and images and (not token or token not in text):
        text = placeholder(lm) * len(images) + text
    try:
        out = lm.processor(
            text=[text], images=list(images), return_tensors="np", add_special_tokens=not templated
        )
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ImageError(
            f"the {lm.model_type} processor could not take these {len(images)} image(s): {message}"
        ) from None
    tokens = [int(t) for t in _numpy(out["input_ids"]).reshape(-1)]
    tokens = lm._fix_bos(tokens)
    runs = _runs(tokens, image_token_id(lm))
    if len(runs) != len(images):
        raise ImageError(
            f"the prompt has places for {len(runs)} image(s) but {len(images)} were given; "
            "remove images or add image parts"
        )
    spans = tuple(
        ImageSpan(start, end, image_digest(lm, image))
        for (start, end), image in zip(runs, images, strict=True)
    )
    inputs = {k: _numpy(v) for k, v in out.items() if k not in _NOT_INPUTS}
    return VisionPrompt(
        tokens=tokens, spans=spans, inputs=inputs, sizes=tuple(im.size for im in images)
    )
