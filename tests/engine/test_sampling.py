"""Per-request samplers (`engine.sampling`): what they draw, on both paths."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_nbengine.engine.sampling import RequestSampler

PATHS = ("host", "graph")


def draws(sampler: RequestSampler, path: str, logits: np.ndarray, n: int) -> list[int]:
    if path == "host":
        return [sampler.host(logits) for _ in range(n)]
    row = mx.array(logits)[None]
    row = row - row.max()
    return [sampler.graph(row).item() for _ in range(n)]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_softmax_at_the_requests_temperature(path, temperature):
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32) + 40  # any shift
    n = 6000
    counts = np.bincount(
        draws(RequestSampler(temperature=temperature, top_p=1.0, seed=1), path, logits, n),
        minlength=len(logits),
    )
    expected = softmax(logits / temperature) * n
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected) + 3)


@pytest.mark.parametrize("path", PATHS)
def test_nucleus_keeps_the_top_tokens_until_top_p_and_draws_them_by_probability(path):
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps two (0.5 < 0.75 <= 0.8).
    logits = np.log(np.array([0.05, 0.5, 0.15, 0.3] + [1e-12] * 60)).astype(np.float32)
    n = 4000
    got = draws(RequestSampler(temperature=1.0, top_p=0.75, seed=0), path, logits, n)
    counts = np.bincount(got, minlength=len(logits))
    assert set(got) == {1, 3}
    assert abs(counts[1] / n - 0.5 / 0.8) < 0.03


def test_nucleus_keeps_tokens_tied_with_its_last_one():
    logits = np.log(np.array([0.4, 0.2, 0.2, 0.2])).astype(np.float32)
    sampler = RequestSampler(temperature=1.0, top_p=0.5, seed=0)
    assert set(draws(sampler, "host", logits, 400)) == {0, 1, 2, 3}


@pytest.mark.parametrize("path", PATHS)
def test_the_same_seed_draws_the_same_tokens_and_another_seed_others(path):
    logits = np.random.default_rng(0).normal(0, 2, 5000).astype(np.float32)
    first = draws(RequestSampler(temperature=0.9, top_p=0.9, seed=7), path, logits, 50)
    again = draws(RequestSampler(temperature=0.9, top_p=0.9, seed=7), path, logits, 50)
    other = draws(RequestSampler(temperature=0.9, top_p=0.9, seed=8), path, logits, 50)
    assert first == again
    assert first != other
    assert len(set(first)) > 3


def test_a_sampler_refuses_temperature_zero():
    with pytest.raises(ValueError, match="greedy"):
        RequestSampler(temperature=0.0, top_p=1.0, seed=0)
