"""RMS norm and RoPE on our CPU kernels (`kernels.rowops`) and their routing (`fastops`).

Each kernel is checked against MLX's own ``mx.fast`` function. Norm: within 4 D eps of the
row's result magnitude (the sums run in another order; measured at most 2.4e-6 here on unit
normal rows of 640). RoPE: the angles are taken in double precision, MLX's in float32, so the
two differ by MLX's angle error, about position * 2**-24 radians: the tolerance is 4 ulps of
the largest position (measured: 6e-5 at position 700, 7e-4 at position 9,000 for the
fastest frequency). Vectorized sets this CPU lacks are skipped; the portable set always runs.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kernelsets import ISAS, isa_or_skip, needs_kernels  # tests/ is on sys.path

from mlx_nbengine import kernels
from mlx_nbengine.kernels import digest, rowops
from mlx_nbengine.models import fastops, load
from mlx_nbengine.models.routes import Routing
from mlx_nbengine.testing import make_tiny_model

EPS32 = float(np.finfo(np.float32).eps)

pytestmark = needs_kernels


def library(name: str):
    """MLX's own function, whether or not a model holds fastops' route in this process."""
    return fastops.ROWS.library[name]


def normal(shape, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 1, 640), (3, 7, 640), (2, 5, 100), (1, 4, 1, 256), (9,)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_mlx(isa, shape, weighted):
    isa_or_skip(isa)
    x = normal(shape, 1) * 3
    w = normal((shape[-1],), 2) if weighted else None
    got = rowops.rms_norm(x, w, 1e-6, isa=isa)
    want = library("rms_norm")(x, w, 1e-6)
    bound = 4 * shape[-1] * EPS32 * mx.abs(want) + 1e-7
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.all(mx.abs(got - want) <= bound).item()


@pytest.mark.parametrize("isa", ISAS)
def test_rms_norm_reads_a_transposed_view_in_place(isa):
    isa_or_skip(isa)
    x = normal((2, 6, 3, 64), 3).transpose(0, 2, 1, 3)  # [B, H, L, D] from [B, L, H, D]
    w = normal((64,), 4)
    want = library("rms_norm")(x, 1.0 + w, 1e-5)
    assert mx.allclose(rowops.rms_norm(x, 1.0 + w, 1e-5, isa=isa), want, atol=1e-5).item()
    # A strided last axis too (every other feature).
    y = normal((3, 128), 5)[:, ::2]
    want = library("rms_norm")(y, None, 1e-5)
    assert mx.allclose(rowops.rms_norm(y, None, 1e-5, isa=isa), want, atol=1e-5).item()


def rope_bound(want: mx.array, largest_position: int) -> mx.array:
    return 4 * max(largest_position, 1) * EPS32 * (mx.abs(want) + 1) + 1e-6


CASES = [
    # shape, dims, traditional, offset
    ((1, 4, 1, 256), 256, False, 700),
    ((2, 3, 9, 64), 64, True, 5),
    ((1, 2, 7, 128), 64, False, 3),  # dims < D: the rest is copied
    ((3, 2, 1, 64), 64, False, [1, 50, 9000]),  # one offset per batch row
    ((2, 1, 300, 32), 32, False, [0]),
    ((2, 7, 16), 16, False, 2),  # 3 dimensions: [B, T, D]
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("shape", "dims", "traditional", "offset"), CASES)
def test_rope_matches_mlx(isa, shape, dims, traditional, offset):
    isa_or_skip(isa)
    x = normal(shape, 6)
    off = mx.array(offset, dtype=mx.int32) if isinstance(offset, list) else offset
    largest = (max(offset) if isinstance(offset, list) else offset) + shape[-2]
    for base, freqs, scale in (
        (10000.0, None, 1.0),
        (None, mx.arange(1, dims // 2 + 1) * 3.0, 0.5),
    ):
        args = dict(traditional=traditional, base=base, scale=scale, offset=off, freqs=freqs)
        got = rowops.rope(x, dims, isa=isa, **args)
        want = library("rope")(x, dims, **args)
        assert got.shape == want.shape
        assert mx.all(mx.abs(got - want) <= rope_bound(want, largest)).item()


@pytest.mark.parametrize("isa", ISAS)
def test_rope_reads_a_transposed_view_in_place(isa):
    isa_or_skip(isa)
    x = normal((2, 5, 4, 64), 7).transpose(0, 2, 1, 3)
    args = dict(traditional=False, base=1e6, scale=1.0, offset=40)
    want = library("rope")(x, 64, **args)
    assert mx.all(mx.abs(rowops.rope(x, 64, isa=isa, **args) - want) <= rope_bound(want, 45)).item()


@pytest.fixture
def routing():
    """What a model on the CPU holds, released after the test."""
    held = Routing()
    yield held
    held.release()


def test_routed_calls_run_on_the_kernels_and_others_on_mlx(routing):
    assert routing.hold(fastops.ROWS)
    x = normal((1, 3, 640), 8)
    w = normal((640,), 9)
    assert mx.array_equal(mx.fast.rms_norm(x, w, 1e-6), rowops.rms_norm(x, w, 1e-6)).item()
    q = normal((1, 2, 3, 64), 10)
    args = dict(traditional=False, base=1e4, scale=1.0, offset=4)
    assert mx.array_equal(mx.fast.rope(q, 64, **args), rowops.rope(q, 64, **args)).item()
    # Half precision is MLX's: the same as the library's function, bit for bit.
    h = x.astype(mx.float16)
    lib = library("rms_norm")(h, w.astype(mx.float16), 1e-6)
    assert mx.array_equal(mx.fast.rms_norm(h, w.astype(mx.float16), 1e-6), lib).item()
    named = digest.of_files(fastops.VARIANT_SOURCES)
    assert fastops.variant() == f"rows-{kernels.status().isa}-{named}"


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_a_model_decodes_the_same_tokens_with_and_without_the_kernels(tmp_path, family):
    lm = load(make_tiny_model(family, tmp_path / family))
    assert "rows" in lm.routing.names()
    prompt = lm.tokenizer.encode("The Eiffel Tower is located in the city of")

    def greedy() -> list[int]:
        cache = lm.make_cache()
        token = mx.argmax(lm.model(mx.array([prompt]), cache=cache)[:, -1:, :], axis=-1)
        out = [token.item()]
        for _ in range(23):
            token = mx.argmax(lm.model(token, cache=cache)[:, -1:, :], axis=-1)
            out.append(token.item())
        return out

    with_kernels = greedy()
    with lm.routing.suspended(fastops.ROWS, *fastops.OFFSET_NORMS):
        without = greedy()
    assert with_kernels == without


def test_gemma_norms_add_one_to_their_weight_once_while_it_stays_the_same(routing):
    # Fails when mlx-lm changes Gemma's RMSNorm: then read it and update fastops.
    import mlx_lm.models.gemma3_text as gemma3

    route = next(r for r in fastops.OFFSET_NORMS if r.library_class() is gemma3.RMSNorm)
    assert all(not body.changed() for body in route.bodies)
    norm = gemma3.RMSNorm(64, eps=1e-6)
    assert fastops.route(norm, routing) and route.routes(norm)
    x = normal((1, 2, 64), 11)
    first = norm(x)
    assert mx.allclose(first, library("rms_norm")(x, 1.0 + norm.weight, 1e-6), atol=1e-6).item()
    assert mx.array_equal(norm(x), first).item()  # the held sum
    norm.weight = normal((64,), 12)  # new weights: the sum follows them
    assert mx.allclose(norm(x), library("rms_norm")(x, 1.0 + norm.weight, 1e-6), atol=1e-5).item()
    assert set(norm.parameters()) == {"weight"}  # nothing held on the module itself


# --- gelu_tanh(gate) * up ---------------------------------------------------------------------


def gelu_reference(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    x = g.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))) * u


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 2048), (3, 37), (1030, 64), (5,)])
def test_gelu_tanh_mul_matches_gelu_times_up(isa, shape):
    # The rational tanh is within 3.2e-7 of tanh (test_cpu_math); the rest is float32
    # rounding of a few operations: 8 eps of the result's magnitude, plus the tanh error.
    isa_or_skip(isa)
    g, u = normal(shape, 31) * 4, normal(shape, 32)
    got = np.array(rowops.gelu_tanh_mul(g, u, isa=isa))
    want = gelu_reference(np.array(g), np.array(u))
    x = np.abs(np.array(g, dtype=np.float64))
    bound = 8 * EPS32 * np.abs(want) + (0.5 * x * 3.2e-7 + 8 * EPS32 * x) * np.abs(np.array(u))
    assert got.shape == shape and np.all(np.abs(got - want) <= bound + 1e-30)


@pytest.mark.parametrize("isa", ISAS)
def test_gelu_tanh_mul_gives_an_element_the_same_bits_wherever_it_falls(isa):
    # In a vector or in the tail, in a long array or a short one (a cold prefill and an
    # edit's tail compute the same activations in arrays of other lengths), and with the
    # work split over threads or not.
    isa_or_skip(isa)
    g, u = normal((9001,), 33) * 3, normal((9001,), 34)
    whole = rowops.gelu_tanh_mul(g, u, isa=isa, threads=2)
    part = rowops.gelu_tanh_mul(g[5:], u[5:], isa=isa, threads=1)
    assert mx.array_equal(whole[5:], part).item()


def test_gelu_tanh_mul_refuses_arrays_that_do_not_fit():
    with pytest.raises(ValueError, match="one shape"):
        rowops.gelu_tanh_mul(mx.zeros((2, 3)), mx.zeros((3, 2)))


@pytest.mark.parametrize("isa", ISAS)
def test_silu_mul_matches_silu_times_up(isa):
    # silu(x) = x / (1 + exp(-x)) with the attention kernels' exp (a few float32 ulps) and a
    # divide: within 16 eps of the result's magnitude, measured at most 8.
    isa_or_skip(isa)
    for shape in ((1, 3584), (3, 37), (1030, 64), (5,)):
        g, u = normal(shape, 41) * 4, normal(shape, 42)
        got = np.array(rowops.silu_mul(g, u, isa=isa))
        x = np.array(g, dtype=np.float64)
        want = x / (1 + np.exp(-x)) * np.array(u, dtype=np.float64)
        bound = 16 * EPS32 * np.abs(want) + 1e-30
        assert got.shape == shape and np.all(np.abs(got - want) <= bound), shape


@pytest.mark.parametrize("isa", ISAS)
def test_silu_mul_is_exact_at_the_ends_of_exps_range(isa):
    # Past exp's range (-x > 88) silu is below 1e-34 in magnitude, and so is ours.
    isa_or_skip(isa)
    g = mx.array([-1000.0, -100.0, -88.5, -87.0, 0.0, 1e-30, 87.0, 89.0, 100.0, 1000.0] * 3)
    got = np.array(rowops.silu_mul(g, mx.ones_like(g), isa=isa))
    x = np.array(g, dtype=np.float64)
    want = x / (1 + np.exp(np.minimum(-x, 700)))
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - want) <= 16 * EPS32 * np.abs(want) + 1e-34)


@pytest.mark.parametrize("isa", ISAS)
def test_silu_mul_gives_an_element_the_same_bits_wherever_it_falls(isa):
    isa_or_skip(isa)
    g, u = normal((9001,), 43) * 3, normal((9001,), 44)
    whole = rowops.silu_mul(g, u, isa=isa, threads=2)
    part = rowops.silu_mul(g[5:], u[5:], isa=isa, threads=1)
    assert mx.array_equal(whole[5:], part).item()
