"""The output head applied to the last row only (`models.head`): found on each tiny text
family (Gemma 4's with its logit cap), exact against the whole model, refused where the
output does more than the head and the cap, and used by the engine for a final short
prefill step."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_nbengine import Engine
from mlx_nbengine.models import load
from mlx_nbengine.models.head import split_head

# gemma4_text caps its logits after the head: the split applies the library's own cap.
FAMILIES = ["llama", "gemma3_text", "qwen3_5", "gemma4_text"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tiny_model_dir):
    return load(tiny_model_dir(request.param))


def test_the_split_gives_the_models_last_row_logits(tiny):
    split = split_head(tiny.model, tiny.make_cache, 1)
    assert split is not None
    tokens = mx.array([[1, 5, 9, 12, 3, 7]], dtype=mx.uint32)
    whole = tiny.model(tokens, cache=tiny.make_cache())[:, -1:, :]
    last = split.last_logits(tokens, tiny.make_cache())
    assert last.shape == whole.shape
    # Another matmul shape for the head: equal up to the last bits, same greedy token.
    # Measured 2026-12-01 on an AMD EPYC (2 cores): at most 1.4e-6 over the three
    # families (largest logit 5.9); the bound is 10x that.
    diff = mx.abs(last - whole).max().item()
    assert diff < 1.5e-5, diff
    assert mx.argmax(last).item() == mx.argmax(whole).item()


def test_a_model_whose_output_is_more_than_the_head_is_refused(tiny):
    class SoftCapped:
        """The tiny model with a logit soft-cap after its head not made by the library's
        ``logit_softcap`` (as Gemma 2's is not)."""

        def __init__(self, model):
            self.model = model.model if hasattr(model, "model") else None
            self.language_model = getattr(model, "language_model", None)
            self.lm_head = getattr(model, "lm_head", None)
            self.inner = model

        def __call__(self, x, cache=None):
            return mx.tanh(self.inner(x, cache=cache) / 30.0) * 30.0

    assert split_head(SoftCapped(tiny.model), tiny.make_cache, 1) is None


def test_a_model_without_a_body_is_left_whole():
    class Opaque:
        def __call__(self, x, cache=None):
            return x

    assert split_head(Opaque(), list, 0) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_short_final_step_samples_the_models_greedy_token(tiny_model_dir, tmp_path, family):
    """A request alone whose final prefill step is short samples from that step through
    the split head; its greedy tokens are the whole model's, step by step."""
    lm = load(tiny_model_dir(family))
    prompt = [1] + [(7 * i) % 500 + 5 for i in range(40)]
    cache, tokens, x = lm.make_cache(), [], mx.array([prompt], dtype=mx.uint32)
    for _ in range(4):  # whole-model greedy decoding, the reference
        token = mx.argmax(lm.model(x, cache=cache)[0, -1]).item()
        tokens.append(token)
        x = mx.array([[token]], dtype=mx.uint32)
    with Engine.load(tiny_model_dir(family), block_size=16, cache_dir=tmp_path) as engine:
        assert engine.internals.splits_head  # the split was found and checked at load
        done = engine.submit(prompt, max_tokens=4).result(timeout=60)
    assert done.tokens == tokens
