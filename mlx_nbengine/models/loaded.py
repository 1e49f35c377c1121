"""`LoadedModel`: one model in memory with everything the engine needs to run it.

Terms:
- *modality*: ``"text"`` for an mlx-lm model with a tokenizer, ``"vision"`` for an
  mlx-vlm model with a processor (which holds the tokenizer).
- *fingerprint*: a hex digest that changes whenever the model's outputs could
  change (config, weight files, the dtype the weights were cast to). Prefix
  cache keys are seeded with it, so two models never share cached blocks.
- *BOS handling*: `encode` with special tokens always starts with the model's
  BOS token when the model family needs one (Gemma's id 2), once, even if the
  tokenizer file forgets it or a chat template already wrote it.

A `LoadedModel` is owned by the thread that loaded it (MLX streams are
per-thread); only that thread should call the model or make caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from mlx_nbengine.errors import InvalidRequestError, TokenizerError
from mlx_nbengine.models.architectures import Modality
from mlx_nbengine.models.routes import Routing

__all__ = ["LoadedModel"]

# Families whose weights were trained with BOS first; without it their outputs degrade badly.
_BOS_REQUIRED_PREFIXES = ("gemma",)


@dataclass(eq=False)
class LoadedModel:
    """A loaded model, its tokenizer (or processor) and what identifies it."""

    model: Any
    tokenizer: Any
    modality: Modality
    model_type: str
    config: dict
    fingerprint: str
    path: Path
    processor: Any = None
    dtype: str | None = None
    context_length: int | None = field(default=None)
    # What the fingerprint names beyond the files and dtype: the routes' variants joined by
    # "+" (e.g. "qmv-avx2-1f2e3d4c+attn-avx2-..."), None where the model runs as written.
    variant: str | None = None
    # The routes this model holds (`models.routes`): its modules' routed classes and its holds
    # on mx.fast's functions; `release_routes` gives them back.
    routing: Routing = field(default_factory=Routing, repr=False)

    def release_routes(self) -> None:
        """Give back every route this model holds (Engine.close): its modules run the
        library's classes again, and mx.fast has MLX's own functions once no other model holds
        them. Idempotent."""
        self.routing.release()

    @property
    def text_tokenizer(self) -> Any:
        """The Hugging Face tokenizer underneath (mlx-lm wraps it; mlx-vlm's processor holds it)."""
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        tok = self.tokenizer
        return tok._tokenizer if isinstance(tok, TokenizerWrapper) else tok

    @property
    def bos_token_id(self) -> int | None:
        return getattr(self.text_tokenizer, "bos_token_id", None)

    @property
    def eos_token_ids(self) -> set[int]:
        ids = getattr(self.tokenizer, "eos_token_ids", None)
        if ids:
            return set(ids)
        eos = getattr(self.text_tokenizer, "eos_token_id", None)
        return {eos} if eos is not None else set()

    @property
    def language_model(self) -> Any:
        """The part of the model that owns the per-layer caches."""
        if self.modality == "vision":
            return self.model.language_model
        return self.model

    def make_cache(self) -> list:
        """A fresh per-sequence cache list, one entry per layer."""
        if self.modality == "vision":
            from mlx_vlm.models.cache import make_prompt_cache

            return make_prompt_cache(self.model.language_model)
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def _needs_bos(self) -> bool:
        return self.bos_token_id is not None and self.model_type.startswith(_BOS_REQUIRED_PREFIXES)

    def _fix_bos(self, ids: list[int]) -> list[int]:
        bos = self.bos_token_id
        if not self._needs_bos():
            return ids
        # Exactly one BOS: templates that write it and tokenizers that add it can double it.
        while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        if not ids or ids[0] != bos:
            ids = [bos, *ids]
        return ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, BOS first where the model needs it."""
        ids = list(self.text_tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return self._fix_bos(ids) if add_special_tokens else ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.text_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        """False for base models (no chat template): their prompts go in as plain text."""
        return bool(getattr(self.text_tokenizer, "chat_template", None))

    def render_chat(self, messages: list[dict], **template_kwargs: Any) -> str:
        """`messages` rendered with the chat template as text (``add_generation_prompt``
        defaults to True); `TokenizerError` for a model without one, `InvalidRequestError`
        (its first line) for messages or values the template refuses or cannot render."""
        if not self.has_chat_template:
            raise TokenizerError(
                f"{self.path.name} has no chat template (a base model): send the prompt as "
                "plain text (%%llm --raw, or a string to Engine.submit)"
            )
        template_kwargs.setdefault("add_generation_prompt", True)
        template_kwargs.pop("tokenize", None)
        try:
            return self.text_tokenizer.apply_chat_template(
                messages, tokenize=False, **template_kwargs
            )
        except (TemplateError, TypeError, ValueError) as exc:  # e.g. raise_exception(...)
            line = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise InvalidRequestError(
                f"the chat template cannot render this prompt: {line}"
            ) from exc

    def apply_chat_template(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template.

        ``add_generation_prompt`` defaults to True; other keyword arguments go to the template.
        A model without a chat template raises `TokenizerError`.
        """
        text = self.render_chat(messages, **template_kwargs)
        # The template writes its own special tokens (BOS included); do not add them twice.
        ids = list(self.text_tokenizer.encode(text, add_special_tokens=False))
        return self._fix_bos(ids)

    def __repr__(self) -> str:
        return (
            f"LoadedModel(modality={self.modality!r}, model_type={self.model_type!r}, "
            f"path='{self.path}', dtype={self.dtype!r}, fingerprint={self.fingerprint[:12]!r})"
        )
