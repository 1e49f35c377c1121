"""Decode steps of a loaded model, as the fused-layer tests compare them
(tests/integration/test_decode_layer.py, test_gemma4_layer.py)."""

from __future__ import annotations

import mlx.core as mx


def decode_logits(lm, prompt: list[int], *, rows: int, steps: int) -> list[mx.array]:
    """The last position's logits of a prefill of `prompt` (repeated over `rows` rows), then
    of `steps` greedy decode steps on the same cache."""
    cache = lm.make_cache()
    logits = lm.model(mx.array([prompt] * rows), cache=cache)[:, -1:, :]
    out = [logits]
    for _ in range(steps):
        logits = lm.model(mx.argmax(logits, axis=-1), cache=cache)[:, -1:, :]
        out.append(logits)
    mx.eval(out)
    return out
