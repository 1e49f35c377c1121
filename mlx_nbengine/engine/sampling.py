"""Choosing the next token of a sampled request (temperature > 0) from a row of logits.

Temperature 0 is greedy: the engine takes the argmax itself (deterministic whatever
the batch) and builds no sampler. A `RequestSampler` draws from the row's softmax at
the request's temperature, after *nucleus* filtering (``top_p`` < 1): the most likely
tokens whose probabilities, before the temperature, reach ``top_p`` of the total, plus
any tied with the last of them. Every computation is invariant to a shift of the row,
so rows come shifted to a maximum of 0 and need no log-softmax.

Two paths draw from the same distribution:

- `RequestSampler.host` takes the row as a numpy array and returns a token id. The
  engine uses it on the CPU, where MLX's sort (the nucleus) and ``exp`` are scalar and
  numpy draws a row many times faster (`bench/bench_sampling.py`). A decode step with
  sampled rows is then a `HostDraw`: its logits compute while the generation
  thread streams the previous step, and its rows are drawn when it is read, so the next
  step's graph can only be built after that (steps are not pipelined).
  A row constrained by a grammar (`constraint`) takes this path on every device: its
  mask is computed in numpy, then its argmax or draw.
- `RequestSampler.graph` takes the row as an MLX array and returns a lazy token id, so
  steps stay pipelined on GPUs, where MLX's sort is fast.

Each request owns its random state, seeded from its `seed` (or a fresh one) and drawn
once a step, so a seeded request draws the same tokens whether it decodes alone or in
a batch, and no request disturbs numpy's or MLX's global random state. The same seed
gives different tokens on the two paths (numpy's and MLX's generators differ).
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

__all__ = ["HostDraw", "RequestSampler", "draw_rows", "validate"]


def validate(
    *, temperature: float, top_p: float, max_tokens: int, seed: int | None = None
) -> str | None:
    """Return what is wrong with these sampling values, or None when they are usable."""
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64
    ):  # numpy's and MLX's random keys take unsigned 64-bit seeds
        return f"seed must be an integer in [0, 2**64), got {seed!r}"
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return f"max_tokens must be an integer >= 1, got {max_tokens!r}"
    if not temperature >= 0:  # also rejects NaN
        return f"temperature must be >= 0 (0 = greedy), got {temperature!r}"
    if not 0 < top_p <= 1:
        return f"top_p must be in (0, 1] (1 = no nucleus filtering), got {top_p!r}"
    return None


class RequestSampler:
    """The sampler of one request with temperature > 0 (see the module docstring).

    Owned by the generation thread (the graph path's key is an MLX array, made there).
    """

    def __init__(self, *, temperature: float, top_p: float, seed: int | None) -> None:
        if not temperature > 0:
            raise ValueError("a RequestSampler needs temperature > 0 (0 is greedy)")
        seed = seed if seed is not None else random.getrandbits(63)
        self.inv_temp = 1.0 / temperature
        self.top_p = top_p
        self._rng = np.random.default_rng(seed)
        self._key = mx.random.key(seed)

    def host(self, logits: np.ndarray) -> int:
        """A token id drawn from one row of logits (1-D, any shift)."""
        shifted = logits.astype(np.float32, copy=False) - logits.max()
        weights = np.exp(shifted * np.float32(self.inv_temp))
        if self.top_p < 1.0:
            weights[shifted < _nucleus_threshold(shifted, self.top_p)] = 0.0
        return _inverse_cdf(weights, self._rng.random())

    def graph(self, logits: mx.array) -> mx.array:
        """A lazy token id, shape ``(1,)``, drawn from a ``(1, vocab)`` row shifted to max 0."""
        self._key, sub = mx.random.split(self._key)
        if self.top_p < 1.0:
            logits = apply_top_p(logits, self.top_p)  # normalizes its own mass
        return mx.random.categorical(logits * self.inv_temp, key=sub)


def _nucleus_threshold(shifted: np.ndarray, top_p: float) -> np.float32:
    """The smallest logit the nucleus keeps: the row's most likely tokens until the mass of
    those ranked above each one reaches `top_p` of the total (mlx-lm's `apply_top_p` rule).

    Only tokens at or above ``(1 - top_p) / vocab`` of the total are sorted: all those
    below it together hold less than ``1 - top_p``, so each has more than `top_p` ranked
    above it. On a peaked row that leaves a few hundred tokens to sort, not 262k.
    """
    probs = np.exp(shifted)
    total = probs.sum(dtype=np.float64)
    candidates = shifted[probs >= (1.0 - top_p) * total / len(shifted)]
    descending = np.sort(candidates)[::-1]
    mass = np.exp(descending).astype(np.float64)
    before = np.cumsum(mass) - mass  # mass of the tokens ranked above each one
    kept = int(np.count_nonzero(before < top_p * total))  # >= 1: before[0] == 0
    return descending[kept - 1]


_BLOCK = 1024  # weights summed per block by `_inverse_cdf`


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The token whose interval of the cumulative weights holds ``u`` x the total.

    In two levels (float64 block sums, then a cumulative sum inside one block): a
    float64 cumulative sum over the whole vocabulary would be the slow part of a row.
    Rounding never picks a token of weight 0: the nearest one with weight in the block is taken.
    """
    n = len(weights)
    padded = np.zeros(-(-n // _BLOCK) * _BLOCK, dtype=np.float32)
    padded[:n] = weights
    blocks = np.cumsum(padded.reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64))
    target = u * blocks[-1]
    b = min(int(np.searchsorted(blocks, target, side="right")), len(blocks) - 1)
    inside = padded[b * _BLOCK : (b + 1) * _BLOCK]
    rest = target - (blocks[b - 1] if b else 0.0)
    i = min(
        int(np.searchsorted(np.cumsum(inside, dtype=np.float64), rest, side="right")), _BLOCK - 1
    )
    if inside[i] == 0.0:
        positive = np.flatnonzero(inside)
        i = int(positive[np.abs(positive - i).argmin()])
    return b * _BLOCK + i


def draw_rows(seqs: list, logits: mx.array, *, host: bool = True) -> list[int]:
    """Each row's next token, in numpy: the argmax for greedy `seqs`, else a host draw.

    A constrained row (`constraint.Constraint`) gets its grammar's mask first. With
    ``host=False`` (the graph path's devices) an unconstrained sampled row is drawn by
    `RequestSampler.graph`, as it would be in a step without constrained rows.
    """
    rows = np.array(logits.astype(mx.float32))
    tokens = []
    for i, (s, row) in enumerate(zip(seqs, rows, strict=True)):
        constraint = s.constraint
        if constraint is not None:
            row = constraint.mask(row)
        if s.greedy:
            tokens.append(int(row.argmax()))
        elif host or constraint is not None:
            tokens.append(s.sampler.host(row))
        else:
            one = logits[i : i + 1]
            tokens.append(int(s.sampler.graph(one - one.max()).item()))
    return tokens


class HostDraw:
    """The tokens of a decode step whose logits are still computing: row ``i`` belongs to
    ``seqs[i]`` and is drawn once, on the first `tolist` (``host``: see `draw_rows`)."""

    def __init__(self, logits: mx.array, seqs: list, *, host: bool = True) -> None:
        self.logits = logits
        self.seqs = seqs
        self.host = host
        self._tokens: list[int] | None = None

    def __getitem__(self, rows: mx.array) -> HostDraw:
        """The rows still wanted (members left the batch before it was read)."""
        keep = rows.tolist()
        return HostDraw(self.logits[rows], [self.seqs[i] for i in keep], host=self.host)

    def tolist(self) -> list[int]:
        if self._tokens is None:
            self._tokens = draw_rows(self.seqs, self.logits, host=self.host)
        return self._tokens
