"""The tiny vision families (``qwen2_vl``, ``gemma4``, ``qwen3_5_vl``): each loads offline
through `load` as a vision model; its processor expands the chat template's image
placeholder into a run of image tokens whose length follows the image's size;
`get_input_embeddings` gives the same text rows with or without pixel values (so image rows
can be swapped in from a memo); and in Gemma 4's single-call prefill the image tokens attend
to each other both ways. Qwen3.5's hybrid language model (linear-attention state plus a KV
cache) prefilled in chunks, with its multimodal positions sliced alongside, gives the
logits of one call."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import ArraysCache, KVCache, RotatingKVCache
from PIL import Image

from mlx_nbengine.models import load
from mlx_nbengine.testing import VISION_FAMILIES, VOCAB_SIZE

IMAGE_TOKEN = {"qwen2_vl": "<|image_pad|>", "gemma4": "<|image|>", "qwen3_5_vl": "<|image_pad|>"}
MODEL_TYPE = {"qwen3_5_vl": "qwen3_5"}  # the config's model_type where it is not the family
# What the run of image tokens is bracketed by once the processor has expanded it.
IMAGE_MARKS = {
    "qwen2_vl": ("<|vision_start|>", "<|vision_end|>"),
    "gemma4": ("<|image>", "<image|>"),
    "qwen3_5_vl": ("<|vision_start|>", "<|vision_end|>"),
}
# (width, height) -> image tokens. Qwen2-VL: 28-pixel cells (14-pixel patches merged 2x2),
# sides rounded to the nearest cell. Gemma 4: resized to fit 16 soft tokens of 2x2 8-pixel
# patches, sides floored to 16 pixels. Qwen3.5: 16-pixel cells (8-pixel patches merged 2x2),
# sides rounded to the nearest cell, at most 64 tokens (200x150 is shrunk to 96x144).
TOKENS_PER_IMAGE = {
    "qwen2_vl": {(64, 64): 4, (80, 48): 6, (48, 80): 6, (200, 150): 35},
    "gemma4": {(64, 64): 16, (80, 48): 15, (48, 80): 15, (200, 150): 12},
    "qwen3_5_vl": {(64, 64): 16, (80, 48): 15, (48, 80): 15, (200, 150): 54},
}
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Look at this:"},
            {"type": "image"},
            {"type": "text", "text": "What is in the picture?"},
        ],
    }
]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    models = {}

    def get(family: str):
        if family not in models:
            models[family] = load(tiny_model_dir(family))
        return models[family]

    return get


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def process(lm, size=(64, 64)) -> dict[str, np.ndarray]:
    """The processor's outputs (as numpy) for `MESSAGES` with one image of `size`."""
    text = lm.text_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    # The template writes BOS itself; without add_special_tokens=False the tokenizer adds another.
    inputs = lm.processor(
        text=[text], images=[image(*size)], return_tensors="np", add_special_tokens=False
    )
    # Gemma 4's processor ignores return_tensors and returns MLX arrays.
    return {k: np.asarray(v) for k, v in inputs.items()}


def token_id(lm, token: str) -> int:
    return lm.text_tokenizer.convert_tokens_to_ids(token)


def embeddings(lm, family: str, inputs: dict, *, with_pixels: bool) -> mx.array:
    extra = {}
    if with_pixels and family in ("qwen2_vl", "qwen3_5_vl"):
        extra["image_grid_thw"] = mx.array(inputs["image_grid_thw"])
    pixels = mx.array(inputs["pixel_values"]) if with_pixels else None
    features = lm.model.get_input_embeddings(
        input_ids=mx.array(inputs["input_ids"]), pixel_values=pixels, **extra
    )
    return features.inputs_embeds


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_each_vision_family_loads_offline_as_a_vision_model(loaded, family):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    lm = loaded(family)
    assert lm.modality == "vision" and lm.model_type == MODEL_TYPE.get(family, family)
    assert lm.processor is not None and lm.context_length == 8192


def test_gemma4_has_sliding_and_full_layers_and_bidirectional_vision(loaded):
    lm = loaded("gemma4")
    assert type(lm.processor).__name__ == "Gemma4Processor"
    assert [type(c) for c in lm.make_cache()] == [RotatingKVCache, KVCache] * 2
    assert all(c.max_size == 64 for c in lm.make_cache() if isinstance(c, RotatingKVCache))
    text_config = lm.config["text_config"]
    assert text_config["use_bidirectional_attention"] == "vision"
    assert text_config["num_kv_shared_layers"] == 0
    assert text_config["hidden_size_per_layer_input"] == 0
    assert lm.model.language_model.model.embed_tokens.weight.shape[0] == VOCAB_SIZE
    config = lm.config
    assert config["image_token_id"] == token_id(lm, "<|image|>")
    assert config["boi_token_id"] == token_id(lm, "<|image>")
    assert config["eoi_token_id"] == token_id(lm, "<image|>")


def test_gemma4_sliding_window_is_settable(tiny_model_dir):
    lm = load(tiny_model_dir("gemma4", sliding_window=16))
    rotating = [c for c in lm.make_cache() if isinstance(c, RotatingKVCache)]
    assert len(rotating) == 2 and all(c.max_size == 16 for c in rotating)


@pytest.mark.parametrize("family", VISION_FAMILIES)
@pytest.mark.parametrize("size", [(64, 64), (80, 48), (48, 80), (200, 150)])
def test_the_processor_expands_the_placeholder_by_image_size(loaded, family, size):
    lm = loaded(family)
    ids = process(lm, size)["input_ids"][0]
    positions = np.flatnonzero(ids == token_id(lm, IMAGE_TOKEN[family]))
    assert len(positions) == TOKENS_PER_IMAGE[family][size]
    first, last = int(positions[0]), int(positions[-1])
    assert last - first + 1 == len(positions)  # one contiguous run
    begin, end = IMAGE_MARKS[family]
    assert ids[first - 1] == token_id(lm, begin) and ids[last + 1] == token_id(lm, end)
    assert ids[0] == lm.bos_token_id and ids[1] != lm.bos_token_id


def test_gemma4_token_types_mark_exactly_the_image_tokens(loaded):
    lm = loaded("gemma4")
    inputs = process(lm)
    assert set(inputs) == {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values"}
    assert inputs["pixel_values"].shape == (1, 3, 64, 64)
    is_image = inputs["input_ids"] == lm.config["image_token_id"]
    assert np.array_equal(inputs["mm_token_type_ids"], is_image.astype(np.int64))


def gemma4_logits(lm, inputs, embeds, per_layer_inputs, *, with_types: bool) -> np.ndarray:
    """Logits of ONE prefill call from offset 0, as mlx-vlm's generate makes it."""
    types = {"mm_token_type_ids": mx.array(inputs["mm_token_type_ids"])} if with_types else {}
    out = lm.model.language_model(
        inputs=mx.array(inputs["input_ids"]),
        inputs_embeds=embeds,
        cache=lm.make_cache(),
        per_layer_inputs=per_layer_inputs,
        **types,
    )
    return np.array(out.logits[0])


@pytest.mark.parametrize("with_types", [True, False])
def test_gemma4_image_tokens_attend_both_ways_only_with_token_types(loaded, with_types):
    lm = loaded("gemma4")
    inputs = process(lm)
    features = lm.model.get_input_embeddings(
        input_ids=mx.array(inputs["input_ids"]), pixel_values=mx.array(inputs["pixel_values"])
    )
    assert features.per_layer_inputs is None  # hidden_size_per_layer_input is 0
    embeds = features.inputs_embeds
    positions = np.flatnonzero(inputs["input_ids"][0] == lm.config["image_token_id"])
    first, last = int(positions[0]), int(positions[-1])
    noise = mx.random.normal((embeds.shape[-1],), key=mx.random.key(1))
    perturbed = mx.concatenate(
        [embeds[:, :last], embeds[:, last : last + 1] + noise, embeds[:, last + 1 :]], axis=1
    )
    base = gemma4_logits(lm, inputs, embeds, None, with_types=with_types)
    moved = gemma4_logits(lm, inputs, perturbed, None, with_types=with_types)
    change = np.abs(moved - base).max(axis=-1)
    # Text before the image (BOS ... the begin-of-image mark) never sees the image's last token.
    # (Measured 2026-12-01 on an AMD EPYC: equal, difference 0.0; 1e-6 allows a few ulps.)
    np.testing.assert_allclose(moved[:first], base[:first], rtol=0, atol=1e-6)
    if with_types:  # the first image token sees the last one: bidirectional within the image
        assert change[first] > 1e-3
    else:  # without token types the prefill is plain causal
        np.testing.assert_allclose(moved[:last], base[:last], rtol=0, atol=1e-6)
    assert change[last] > 1e-3 and change[last + 1 :].min() > 0


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_text_rows_do_not_depend_on_pixel_values(loaded, family):
    lm = loaded(family)
    inputs = process(lm)
    with_pixels = np.array(embeddings(lm, family, inputs, with_pixels=True)[0])
    without = np.array(embeddings(lm, family, inputs, with_pixels=False)[0])
    is_image = inputs["input_ids"][0] == token_id(lm, IMAGE_TOKEN[family])
    assert np.array_equal(with_pixels[~is_image], without[~is_image])
    assert all(not np.array_equal(with_pixels[i], without[i]) for i in np.flatnonzero(is_image))


def test_qwen3_5_vl_is_hybrid_linear_and_full_attention(loaded):
    lm = loaded("qwen3_5_vl")
    assert type(lm.processor).__name__ == "Qwen3VLProcessor"
    assert [type(c) for c in lm.make_cache()] == [ArraysCache] * 3 + [KVCache]
    assert lm.config["text_config"]["full_attention_interval"] == 4
    assert lm.model.language_model.model.embed_tokens.weight.shape[0] == VOCAB_SIZE
    config = lm.config
    assert config["image_token_id"] == token_id(lm, "<|image_pad|>")
    assert config["vision_start_token_id"] == token_id(lm, "<|vision_start|>")
    assert config["vision_end_token_id"] == token_id(lm, "<|vision_end|>")
    # Only the tiny tokenizer's <eos>: mlx-vlm would add Qwen's (out of vocab) if unset.
    assert set(lm.tokenizer.eos_token_ids) == {token_id(lm, "<eos>")}
    assert lm.model.config.eos_token_id == token_id(lm, "<eos>")


def qwen3_5_features(lm, inputs, **kw):
    return lm.model.get_input_embeddings(
        input_ids=mx.array(inputs["input_ids"]),
        pixel_values=mx.array(inputs["pixel_values"]),
        image_grid_thw=mx.array(inputs["image_grid_thw"]),
        **kw,
    )


def test_qwen3_5_vl_positions_and_cached_image_features(loaded):
    lm = loaded("qwen3_5_vl")
    inputs = process(lm)
    features = qwen3_5_features(lm, inputs)
    n = inputs["input_ids"].shape[1]
    assert features.position_ids.shape == (3, 1, n)
    # 16 image tokens on a 4x4 grid take 4 positions: the text after them runs 12 behind.
    assert np.array(features.rope_deltas).tolist() == [[-12]]
    is_image = inputs["input_ids"][0] == lm.config["image_token_id"]
    rows = features.inputs_embeds[0][mx.array(np.flatnonzero(is_image))]
    memo = qwen3_5_features(lm, inputs, cached_image_features=rows)
    assert np.array_equal(np.array(memo.inputs_embeds), np.array(features.inputs_embeds))
    assert np.array_equal(np.array(memo.position_ids), np.array(features.position_ids))


def test_qwen3_5_vl_chunked_prefill_and_decode_match_one_call(loaded):
    lm = loaded("qwen3_5_vl")
    inputs = process(lm)
    ids = mx.array(inputs["input_ids"])
    features = qwen3_5_features(lm, inputs)
    embeds, positions = features.inputs_embeds, features.position_ids
    n = ids.shape[1]
    is_image = np.flatnonzero(inputs["input_ids"][0] == lm.config["image_token_id"])

    def prefill(cuts):
        cache = lm.make_cache()
        bounds = [0, *cuts, n]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            out = lm.language_model(
                ids[:, a:b],
                inputs_embeds=embeds[:, a:b],
                cache=cache,
                position_ids=positions[..., a:b],
            )
        return np.array(out.logits[0, -1]), cache

    one, _ = prefill([])
    # Cuts at a block-like step, inside the image run, and right after it. Measured
    # 2026-12-01 on an AMD EPYC (2 cores): at most 6.6e-6 over the three cuts, 1.4e-5 for
    # the decode step below (largest logit 3.4); the bounds are 10x those.
    for cuts in ([16, 32], [int(is_image[0]) + 5], [int(is_image[-1]) + 1]):
        chunked, _ = prefill(cuts)
        np.testing.assert_allclose(chunked, one, rtol=0, atol=7e-5)

    # Decode: the next token's position comes from the cache offset plus the rope delta.
    token = int(one.argmax())
    longer = mx.concatenate([ids, mx.array([[token]])], axis=1)
    full = lm.model.get_input_embeddings(
        input_ids=longer,
        pixel_values=mx.array(inputs["pixel_values"]),
        image_grid_thw=mx.array(inputs["image_grid_thw"]),
    )
    reference = lm.language_model(
        longer,
        inputs_embeds=full.inputs_embeds,
        cache=lm.make_cache(),
        position_ids=full.position_ids,
    )
    _, cache = prefill([n // 2])
    step = lm.language_model(mx.array([[token]]), cache=cache, rope_deltas=features.rope_deltas)
    np.testing.assert_allclose(
        np.array(step.logits[0, -1]), np.array(reference.logits[0, -1]), rtol=0, atol=1.5e-4
    )
