"""`models/patches.py` against the installed mlx-lm and mlx-vlm: each reach into their
private parts still finds what it relies on. A failure here names the patch to redo."""

import inspect

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import RotatingKVCache
from mlx_vlm.models.cache import RotatingKVCache as VlmRotatingKVCache

from mlx_nbengine.models import patches


def tokens(first: int, n: int) -> mx.array:
    """`n` one-dimensional keys numbered from `first`, shaped (batch, heads, n, dim)."""
    return mx.arange(first, first + n, dtype=mx.float32).reshape(1, 1, n, 1)


def numbers(buffer: mx.array) -> list[int]:
    return [int(x) for x in buffer.reshape(-1).tolist()]


def test_mlx_lm_names_a_config_s_model_classes():
    model_class, args_class = patches.model_classes({"model_type": "llama"})
    assert issubclass(model_class, nn.Module)
    assert hasattr(args_class, "from_dict")


def test_mlx_lm_refuses_an_unknown_architecture_with_a_value_error():
    with pytest.raises(ValueError):
        patches.model_classes({"model_type": "no_such_architecture"})


# mlx-lm's window cache and mlx-vlm's own (vision models' text layers use it).
WINDOW_CACHES = pytest.mark.parametrize("window_cache", [RotatingKVCache, VlmRotatingKVCache])


@WINDOW_CACHES
def test_a_window_cache_is_recognised(window_cache):
    assert patches.is_window_cache(window_cache(max_size=4))
    assert not patches.is_window_cache(window_cache(max_size=4, keep=1))


@WINDOW_CACHES
def test_a_rotated_window_reads_back_in_token_order(window_cache):
    cache = window_cache(max_size=4)
    for t in range(7):  # single-token steps rotate the buffer
        cache.update_and_fetch(tokens(t, 1), tokens(t, 1))
    assert numbers(patches.window_in_token_order(cache, cache.keys)) == [3, 4, 5, 6]


@WINDOW_CACHES
def test_a_filled_window_cache_continues_after_the_tokens_given(window_cache):
    cache = window_cache(max_size=4)
    patches.set_window_state(cache, tokens(10, 4), tokens(10, 4), 14)  # a full window
    assert cache.offset == 14 and cache.keep == 0 and cache.max_size == 4
    cache.update_and_fetch(tokens(14, 1), tokens(14, 1))
    cache.update_and_fetch(tokens(15, 1), tokens(15, 1))
    assert cache.offset == 16
    assert numbers(patches.window_in_token_order(cache, cache.keys)) == [12, 13, 14, 15]


def test_an_instance_takes_a_subclass_s_behaviour_and_keeps_its_weights():
    layer = nn.Linear(2, 2)

    class Doubled(nn.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    x = mx.ones((1, 2))
    before = layer(x)
    patches.subclass_instance(layer, Doubled)
    assert mx.allclose(layer(x), 2 * before)
    with pytest.raises(TypeError):
        patches.subclass_instance(layer, nn.Embedding)


def test_an_instance_gets_its_library_class_back():
    layer = nn.Linear(2, 2)
    weight = layer.weight

    class Doubled(nn.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    patches.subclass_instance(layer, Doubled)
    patches.unsubclass_instance(layer, nn.Linear)
    assert type(layer) is nn.Linear and layer.weight is weight
    with pytest.raises(TypeError):
        patches.unsubclass_instance(layer, nn.Embedding)


def test_gemma4_s_text_model_still_builds_its_masks_where_the_image_overlay_hooks_in():
    language = pytest.importorskip("mlx_vlm.models.gemma4.language")
    make_masks = getattr(language.Gemma4TextModel, "_make_masks", None)
    assert make_masks is not None, "mlx-vlm renamed Gemma 4's mask builder: redo ImageMasks"
    assert list(inspect.signature(make_masks).parameters)[:4] == [
        "self",
        "h",
        "cache",
        "mm_token_type_ids",
    ]
