"""The default model on 8-bit weights on the CPU: what it loses against float32.

Teacher-forced over `TOKENS` tokens of this repository's own prose (README.md, then
ARCHITECTURE.md), the 8-bit model decodes in 8-row steps (our kernels' widest) beside the
float32 model; *top-1 agreement* is the share of positions whose argmax token is the same,
*largest logit difference* the largest absolute difference of any logit at any position.
The figures measured go in the README; the checks below hold them with a margin.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_nbengine import kernels
from mlx_nbengine.models import load
from mlx_nbengine.models.loader import DEFAULT_CPU_BITS

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 2048
STEP = 8

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.status().active, reason="the quantized kernels are not active"),
]


@pytest.fixture(scope="module")
def both():
    return load("default"), load("default", dtype="float32")


def test_the_default_model_loads_on_8_bit_weights_and_float32_on_request(both):
    q8, f32 = both
    embed = q8.model.model.embed_tokens
    assert isinstance(embed, nn.QuantizedEmbedding) and embed.bits == DEFAULT_CPU_BITS
    assert isinstance(f32.model.model.embed_tokens, nn.Embedding)
    assert q8.fingerprint != f32.fingerprint  # their cached blocks never mix


def test_8_bit_weights_agree_with_float32(both):
    q8, f32 = both
    text = (ROOT / "README.md").read_text() + "\n" + (ROOT / "ARCHITECTURE.md").read_text()
    ids = q8.encode(text)[:TOKENS]
    assert len(ids) == TOKENS
    caches = q8.make_cache(), f32.make_cache()
    same, largest, scale = 0, 0.0, 0.0
    for start in range(0, TOKENS, STEP):
        chunk = mx.array(ids[start : start + STEP])[None]
        a, b = (lm.model(chunk, cache=c)[0] for lm, c in zip(both, caches, strict=True))
        mx.eval(a, b, [c.state for c in caches[0]], [c.state for c in caches[1]])
        same += int((mx.argmax(a, axis=-1) == mx.argmax(b, axis=-1)).sum().item())
        largest = max(largest, mx.abs(a - b).max().item())
        scale = max(scale, mx.abs(b).max().item())
    agreement = same / TOKENS
    print(f"top-1 agreement {agreement:.4f}, largest logit difference {largest:.3f}")
    print(f"largest float32 logit {scale:.1f}")
    # A margin under the figures the README gives (its 8-bit agreement: 98.2% with the GGUF's
    # Q8_0 and Q5_0 blocks kept exactly, 97.4-97.6% before).
    assert agreement >= 0.97
    assert largest <= 0.1 * scale
