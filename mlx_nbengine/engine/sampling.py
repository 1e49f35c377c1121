"""Choosing the next token from a row of log-probabilities.

A *sampler* maps log-probabilities of shape ``(1, vocab)`` to a token id array of
shape ``(1,)``. Temperature 0 is greedy (argmax, deterministic whatever the batch).
Otherwise the request owns a PRNG key (from its `seed`, or a fresh one) that is split
every step, so a seeded request draws the same tokens whether it decodes alone or in a
batch, and no request disturbs MLX's global random state. Built on the generation
thread, since the key is an MLX array.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, make_sampler

Sampler = Callable[[mx.array], mx.array]


def validate(*, temperature: float, top_p: float, max_tokens: int) -> str | None:
    """Return what is wrong with these sampling values, or None when they are usable."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return f"max_tokens must be an integer >= 1, got {max_tokens!r}"
    if not temperature >= 0:  # also rejects NaN
        return f"temperature must be >= 0 (0 = greedy), got {temperature!r}"
    if not 0 < top_p <= 1:
        return f"top_p must be in (0, 1] (1 = no nucleus filtering), got {top_p!r}"
    return None


def make_request_sampler(*, temperature: float, top_p: float, seed: int | None) -> Sampler:
    """The sampler of one request (see the module docstring)."""
    if temperature == 0:
        return make_sampler(0.0)
    key = mx.random.key(seed if seed is not None else random.getrandbits(63))
    inv_temp = 1.0 / temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample
