"""The embedded default model (Gemma 3 270M, converted from its GGUF once into the cache home)
loads and answers; slow, so an integration test (the GGUF import itself is
tests/models/test_gguf.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_nbengine.models import load


@pytest.mark.slow
def test_default_model_is_gemma3_and_knows_where_the_eiffel_tower_is():
    lm = load("default")
    assert lm.model_type == "gemma3_text" and lm.modality == "text"
    prompt = lm.encode("The Eiffel Tower is located in the city of")
    assert prompt[0] == 2 and prompt.count(2) == 1
    cache = lm.make_cache()
    out = lm.model(mx.array(prompt)[None], cache=cache)
    tokens = []
    for _ in range(8):
        token = int(mx.argmax(out[0, -1]).item())
        tokens.append(token)
        out = lm.model(mx.array([[token]]), cache=cache)
    assert "Paris" in lm.decode(tokens)
