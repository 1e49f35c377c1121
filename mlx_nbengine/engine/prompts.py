"""Prompts as `Engine.submit` takes them, turned into token ids on the caller's thread.

A *prompt* is text (tokenized with BOS), token ids (used as they are) or chat messages
(rendered by the model's chat template). An *image prompt* (a vision model) is text or
chat messages with pictures: the processor expands each image's placeholder into its run
of image tokens (`models.vision`). Every error a caller can fix is an
`InvalidRequestError` (an `ImageError` for a picture) saying what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_nbengine.engine.request import InvalidRequestError, PromptTooLongError
from mlx_nbengine.engine.vision import VisionInputs
from mlx_nbengine.errors import ImageError
from mlx_nbengine.models.images import load_images
from mlx_nbengine.models.vision import messages_with_images, prepare_vision_prompt


def prompt_tokens(
    lm: Any,
    prompt: Any,
    *,
    images: Any = None,
    template_kwargs: dict[str, Any] | None = None,
    model_name: str = "this model",
) -> tuple[list[int], VisionInputs | None]:
    """The token ids of `prompt` (with `images`, if any) and its vision inputs (None for a
    prompt without images); raises for a prompt that does not fit the model's context.

    `images` (a vision model only): file paths, PIL images, numpy arrays (H x W x 3 uint8)
    or bytes of encoded images, in the order of their places in the prompt. Chat messages
    without image parts get them before the last user message's text; a string without
    the model's image placeholder gets the placeholders first. Raises `ImageError` (an
    `InvalidRequestError`) naming the image that cannot be read, and for images given to
    a text-only model or more images than places."""
    kwargs = template_kwargs or {}
    vision = None
    if images is not None and not (isinstance(images, list | tuple) and not images):
        processed = _vision_prompt(lm, prompt, images, kwargs, model_name=model_name)
        tokens = processed.tokens
        vision = VisionInputs(spans=processed.spans, inputs=processed.inputs)
    else:
        tokens = _tokenize(lm, prompt, kwargs)
    limit = lm.context_length
    if limit is not None and len(tokens) >= limit:
        raise PromptTooLongError(
            f"the prompt has {len(tokens)} tokens but the model's context holds {limit} "
            f"(including at least one generated token); shorten the prompt"
        )
    return tokens, vision


def stop_strings(stop: Any) -> list[str]:
    """`stop` (None, a string or strings) as a list of strings."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
    return stops


def _is_chat(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
    )


def _vision_prompt(
    lm: Any, prompt: Any, images: Any, template_kwargs: dict[str, Any], *, model_name: str
) -> Any:
    """The processed image prompt (`models.vision.VisionPrompt`) of `prompt` and `images`."""
    if lm.modality != "vision":
        raise ImageError(
            f"{model_name} reads text only; load a vision model (one with a vision "
            "tower, e.g. a Qwen2-VL or Gemma 4 model) to send images"
        )
    pictures = load_images(images)
    if isinstance(prompt, str):
        return prepare_vision_prompt(lm, prompt, pictures, templated=False)
    if _is_chat(prompt):
        messages = messages_with_images(list(prompt), len(pictures))
        text = lm.render_chat(messages, **template_kwargs)
        return prepare_vision_prompt(lm, text, pictures, templated=True)
    raise InvalidRequestError(
        "a prompt with images must be text or chat messages, not token ids (the "
        "processor has to expand the image placeholders)"
    )


def _tokenize(lm: Any, prompt: Any, template_kwargs: dict[str, Any]) -> list[int]:
    if isinstance(prompt, str):
        tokens = lm.encode(prompt)
    elif _is_chat(prompt):
        tokens = lm.apply_chat_template(list(prompt), **template_kwargs)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        tokens = [int(t) for t in prompt]
        vocab = _vocab_size(lm)
        bad = [t for t in tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise InvalidRequestError(
                f"token ids must be in [0, {vocab}); got {bad[:5]} - check the tokenizer"
            )
    else:
        raise InvalidRequestError(
            "prompt must be a string, a list of token ids or a list of chat messages "
            f"(dicts with 'role' and 'content'), got {type(prompt).__name__}"
        )
    if not tokens:
        raise InvalidRequestError("the prompt is empty; give at least one token")
    return tokens


def _vocab_size(lm: Any) -> int | None:
    config = lm.config.get("text_config", lm.config)
    return config.get("vocab_size")
