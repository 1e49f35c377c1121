"""Vision models on the generation thread: prompt embeddings, the feature memo, masks.

Every request to a vision model (with images or not) is fed to the language model as
*embeddings*: the model's ``get_input_embeddings`` of the whole prompt, computed when the
request is admitted (after its restore), sliced per prefill step. Its other per-token
outputs are sliced alongside (Qwen2-VL's multimodal rotary ``position_ids``, Gemma 4's
``per_layer_inputs``); decode steps pass each row's *rope delta* (Qwen2-VL: how far the
positions after an image run behind the token count), since the language model would
otherwise keep one for the whole batch.

*Feature memo*: the image features (the embedding rows at an image's tokens, after the
vision tower and projector) of recently seen images, by digest, bounded in bytes, least
recently used dropped first. When every image a request still has to compute is in the
memo, its embeddings are built with mlx-vlm's ``cached_image_features`` and the vision
tower does not run; an image wholly inside the restored prefix needs no features at all
(its rows are never read), so it gets zeros. Otherwise the vision tower encodes the
request's images (counted in `encodes`) and their rows go to the memo.

*Image masks* (models whose image tokens attend both ways, `bidirectional_images`):
mlx-vlm lets Gemma 4's image tokens see each other only in a prompt's first model call
(its overlay needs a square mask). The engine restores prefixes and prefills in steps, so
the model's text model is given (per instance, as `models.cpu_math` does) a mask builder
that lays the same overlay over masks with a cached prefix too: a query token inside an
image also sees the image's later tokens in the same step. The generation thread makes
every image lie inside one prefill step, and the planner never restores to a point
inside an image, so each image is always computed whole, in one call, both ways.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_nbengine.models import patches
from mlx_nbengine.models.vision import ImageSpan, bidirectional_images

__all__ = ["DEFAULT_MEMO_BYTES", "Embedded", "FeatureMemo", "VisionInputs", "VisionRunner"]

DEFAULT_MEMO_BYTES = 256 * 1024**2

# Per-token outputs of get_input_embeddings and the axis their tokens lie on.
_PER_TOKEN = {"position_ids": -1, "per_layer_inputs": 1}


@dataclass(frozen=True)
class VisionInputs:
    """What `Engine.submit` made of a request's images: one span per image and the
    processor's arrays (numpy), turned into MLX arrays on the generation thread."""

    spans: tuple[ImageSpan, ...]
    inputs: dict[str, np.ndarray]


@dataclass
class Embedded:
    """A prompt's embeddings and the per-token arrays that go with them."""

    embeds: mx.array  # (1, L, hidden)
    per_token: dict[str, mx.array]
    rope_delta: int | None
    token_types: mx.array | None  # (1, L): 1 inside images (bidirectional models only)


class FeatureMemo:
    """Image features by digest, at most `budget_bytes`, least recently used dropped.

    A `get` that finds a digest and a `put` of a digest already held make it the most
    recently used (a held digest keeps its rows: the same image gives the same features).
    Rows larger than the whole budget are not kept, and evict nothing.
    """

    def __init__(self, budget_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._rows: OrderedDict[str, mx.array] = OrderedDict()
        self.nbytes = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, digest: str) -> mx.array | None:
        rows = self._rows.get(digest)
        if rows is not None:
            self._rows.move_to_end(digest)
            self.hits += 1
        return rows

    def put(self, digest: str, rows: mx.array) -> None:
        if digest in self._rows:
            self._rows.move_to_end(digest)
            return
        if rows.nbytes > self.budget_bytes:
            return
        self._rows[digest] = rows
        self.nbytes += rows.nbytes
        while self.nbytes > self.budget_bytes:
            _, old = self._rows.popitem(last=False)
            self.nbytes -= old.nbytes

    def clear(self) -> None:
        self._rows.clear()
        self.nbytes = 0


class VisionRunner:
    """Feeds one loaded vision model (see the module docstring); generation thread only."""

    def __init__(self, lm: Any, *, memo_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self.lm = lm
        self.memo = FeatureMemo(memo_bytes)
        self.encodes = 0  # images run through the vision tower
        self.bidirectional = bidirectional_images(lm)
        if self.bidirectional:
            install_image_masks(lm.language_model)
        probe = lm.model.get_input_embeddings(input_ids=mx.array([[0]]), pixel_values=None)
        self.uses_rope_deltas = getattr(probe, "rope_deltas", None) is not None
        self._hidden = probe.inputs_embeds.shape[-1]
        self._dtype = probe.inputs_embeds.dtype

    # --- embeddings ------------------------------------------------------------------------

    def embed(self, tokens: list[int], vision: VisionInputs | None, *, need_from: int) -> Embedded:
        """The embeddings of `tokens`; positions before `need_from` are restored (their
        image rows are never read)."""
        ids = mx.array(tokens, dtype=mx.int32)[None]
        spans = vision.spans if vision is not None else ()
        if not spans:
            features = self.lm.model.get_input_embeddings(input_ids=ids, pixel_values=None)
        else:
            features = self._embed_images(ids, vision, need_from=need_from)
        per_token = {}
        for name, axis in _PER_TOKEN.items():
            value = getattr(features, name, None)
            if isinstance(value, mx.array) and value.shape[axis] == len(tokens):
                per_token[name] = value
        delta = getattr(features, "rope_deltas", None)
        token_types = None
        if self.bidirectional and spans:
            types = np.zeros((1, len(tokens)), dtype=np.int32)
            for span in spans:
                types[0, span.start : span.end] = 1
            token_types = mx.array(types)
        embeds = features.inputs_embeds
        mx.eval(embeds, list(per_token.values()))
        return Embedded(
            embeds=embeds,
            per_token=per_token,
            rope_delta=None if delta is None else int(mx.array(delta).reshape(-1)[0].item()),
            token_types=token_types,
        )

    def _embed_images(self, ids: mx.array, vision: VisionInputs, *, need_from: int) -> Any:
        inputs = {
            k: [mx.array(x) for x in v] if isinstance(v, list) else mx.array(v)
            for k, v in vision.inputs.items()
        }
        pixel_values = inputs.pop("pixel_values", None)
        rows = []
        for span in vision.spans:
            found = self.memo.get(span.digest)
            if found is None and span.end <= need_from:
                found = mx.zeros((span.end - span.start, self._hidden), dtype=self._dtype)
            rows.append(found)
        model = self.lm.model
        if all(r is not None for r in rows):
            return model.get_input_embeddings(
                input_ids=ids,
                pixel_values=pixel_values,
                cached_image_features=mx.concatenate(rows, axis=0),
                **inputs,
            )
        features = model.get_input_embeddings(input_ids=ids, pixel_values=pixel_values, **inputs)
        mx.eval(features.inputs_embeds)
        self.encodes += len(vision.spans)
        for span in vision.spans:
            # A copy that owns its buffer: a slice would keep the whole prompt's rows alive.
            rows = mx.contiguous(features.inputs_embeds[0, span.start : span.end])
            mx.eval(rows)
            self.memo.put(span.digest, rows)
        return features

    # --- model calls -----------------------------------------------------------------------

    def prefill_kwargs(self, embedded: Embedded, start: int, end: int) -> dict[str, Any]:
        """Keyword arguments of the language model for prompt tokens ``start:end``."""
        out: dict[str, Any] = {"inputs_embeds": embedded.embeds[:, start:end]}
        for name, value in embedded.per_token.items():
            axis = _PER_TOKEN[name]
            index = [slice(None)] * value.ndim
            index[axis] = slice(start, end)
            out[name] = value[tuple(index)]
        types = embedded.token_types
        if types is not None and bool(types[0, start:end].any().item()):
            out["mm_token_type_ids"] = types[:, :end]
        return out

    def decode_kwargs(self, members: list[Any]) -> dict[str, Any]:
        """Keyword arguments of the language model for one decode step of `members` (each
        with a `rope_delta`, row order)."""
        if not self.uses_rope_deltas:
            return {}
        deltas = [[int(getattr(m, "rope_delta", 0) or 0)] for m in members]
        return {"rope_deltas": mx.array(deltas, dtype=mx.int32)}


# --- image masks ---------------------------------------------------------------------------


def _image_groups(types: mx.array) -> np.ndarray:
    """Per position: the number of the image it lies in (runs of 1), or -1."""
    t = np.asarray(types[0]).astype(bool)
    starts = t & ~np.concatenate([[False], t[:-1]])
    groups = np.cumsum(starts) - 1
    return np.where(t, groups, -1)


def _overlay(mask: mx.array, groups: np.ndarray, n_queries: int) -> mx.array:
    """`mask` (queries x keys, the keys ending with the queries) also letting a query see
    every key of its own image."""
    n_keys = mask.shape[-1]
    q = groups[len(groups) - n_queries :]
    k = groups[len(groups) - n_keys :] if n_keys <= len(groups) else None
    if k is None:  # keys the groups do not cover (never for a cache without padding)
        return mask
    same = (q[:, None] == k[None, :]) & (q[:, None] >= 0)
    return mx.logical_or(mask, mx.array(same))


def install_image_masks(language_model: Any) -> bool:
    """Give `language_model`'s text model the mask builder of the module docstring (once);
    False when the model has no mask builder of the kind expected."""
    inner = getattr(language_model, "model", None)
    cls = type(inner)
    if inner is None or not hasattr(cls, "_make_masks"):
        return False
    if getattr(cls, "_mnb_image_masks", False):
        return True

    from mlx_lm.models.base import create_causal_mask

    class ImageMasks(cls):  # type: ignore[misc, valid-type]
        _mnb_image_masks = True

        def _make_masks(self, h, cache, mm_token_type_ids=None):
            masks = super()._make_masks(h, cache, None)
            n = h.shape[1]
            if mm_token_type_ids is None or n == 1:
                return masks
            groups = _image_groups(mm_token_type_ids)
            if not (groups[len(groups) - n :] >= 0).any():
                return masks
            offset = len(groups) - n
            out, done = [], {}
            for layer, mask in zip(self.layers, masks, strict=True):
                kind = getattr(layer, "layer_type", "full_attention")
                if kind not in done:
                    if not isinstance(mask, mx.array):  # "causal" or None: build it
                        window = (
                            getattr(self, "window_size", None)
                            if kind == "sliding_attention"
                            else None
                        )
                        mask = create_causal_mask(n, offset, window_size=window)
                    done[kind] = _overlay(mask, groups, n)
                out.append(done[kind])
            return out

    ImageMasks.__name__ = ImageMasks.__qualname__ = f"{cls.__name__}WithImageMasks"
    patches.subclass_instance(inner, ImageMasks)
    return True
