"""Our quantized matrix-vector kernels (`mlx_nbengine.kernels`) and their routing (`qroute`).

Every kernel is checked against ``mx.dequantize`` + matmul in float32 within `tolerance`:
the float32 rounding bound of a K-term dot product, 4 K eps times the sum of the terms'
magnitudes, plus for the vectorized sets the bound of their int16 activations
(`int16_bound`: each x rounded to 2^-16 of its group's largest magnitude, times the
weights' scaled values q * s it multiplies). The fused gated MLP (`kernels.gated_mlp`) is
checked against its three products and the activation run one by one. The portable set
keeps x float32 and differs from MLX only in summation order. Vectorized sets this CPU
lacks are skipped; the portable set always runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from kernelsets import ISAS, best_isa, isa_or_skip, needs_kernels  # tests/ is on sys.path

from mlx_nbengine import kernels
from mlx_nbengine.models import layerroute, load, qroute
from mlx_nbengine.models.loader import fingerprint_directory
from mlx_nbengine.testing import make_tiny_quantized_model

ROOT = Path(__file__).resolve().parents[2]
EPS32 = float(np.finfo(np.float32).eps)

pytestmark = needs_kernels


def quantized(n: int, k: int, *, bits: int, group_size: int, seed: int = 0, dtype=mx.float32):
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=bits)


def reference(x, q, s, b, *, bits: int, group_size: int):
    # Scales widened first: the kernels dequantize in float32 whatever the scales' dtype.
    s, b = s.astype(mx.float32), b.astype(mx.float32)
    dense = mx.dequantize(q, s, b, group_size=group_size, bits=bits)
    x32 = x.astype(mx.float32)
    return x32 @ dense.T, mx.abs(x32) @ mx.abs(dense).T


def tolerance(magnitudes: mx.array, k: int) -> mx.array:
    return 4 * k * EPS32 * magnitudes + 1e-6


def int16_bound(x, q, s, b, *, bits: int, group_size: int) -> mx.array:
    """What rounding x to int16 per group (qkernels.h, QActivations) can move each result."""
    s, b = s.astype(mx.float32), b.astype(mx.float32)
    dense = mx.dequantize(q, s, b, group_size=group_size, bits=bits)
    offset = mx.repeat(b, group_size, axis=1)  # the kernels multiply q itself: dense - b
    x32 = x.astype(mx.float32)
    rows, k = x32.shape
    largest = mx.abs(x32.reshape(rows, k // group_size, group_size)).max(axis=-1)
    step = mx.repeat(largest / 32767, group_size, axis=1)  # x's rounding is half a step
    return (step / 2) @ mx.abs(dense - offset).T


# Past 8 rows the vectorized sets run the integer GEMM, past `kernels.gemm_tile_rows` (96, or
# 4,096 with AVX-512 VNNI) the dequantized tiles on the BLAS (src/qgemm.h; forced past 96
# rows with ``long_products="blas"``, checked beside the default); the portable set
# takes blocks of 8 up to `kernels.MAX_ROWS` (64), and more is refused
# (test_more_rows_than_the_portable_set_takes_is_refused).
ROWS = [1, 2, 3, 8, 20, 64, 100, 300]
ISA_ROWS = [
    (isa, rows) for isa in ISAS for rows in ROWS if isa != "portable" or rows <= kernels.MAX_ROWS
]


@pytest.mark.parametrize(("isa", "rows"), ISA_ROWS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_matches_dequantize_then_matmul(isa, rows, group_size, bits):
    isa_or_skip(isa)
    # N odd; K seven groups (the 1- and 2-row kernels take four at a time, then the rest),
    # not a multiple of the widest vector step (4 x 16 floats).
    n, k = 77, 7 * group_size
    q, s, b = quantized(n, k, bits=bits, group_size=group_size)
    x = mx.random.normal((rows, k), key=mx.random.key(1))
    got = kernels.quantized_matmul(x, q, s, b, group_size=group_size, bits=bits, isa=isa)
    want, magnitudes = reference(x, q, s, b, bits=bits, group_size=group_size)
    assert got.shape == (rows, n) and got.dtype == mx.float32
    bound = tolerance(magnitudes, k)
    if isa != "portable":
        bound = bound + int16_bound(x, q, s, b, bits=bits, group_size=group_size)
    assert mx.all(mx.abs(got - want) <= bound).item()
    if isa != "portable" and rows > 96:
        # A long step with ``long_products="blas"``: the weights dequantized onto the BLAS on
        # every set, float32 x (what a CPU without VNNI runs past its tile rows).
        how = {"group_size": group_size, "bits": bits, "isa": isa, "long_products": "blas"}
        got = kernels.quantized_matmul(x, q, s, b, **how)
        assert mx.all(mx.abs(got - want) <= tolerance(magnitudes, k)).item()


@pytest.mark.parametrize("isa", ISAS)
def test_threads_split_the_columns_without_changing_the_result(isa):
    isa_or_skip(isa)
    q, s, b = quantized(1031, 512, bits=8, group_size=64)  # big enough to be split
    x = mx.random.normal((2, 512), key=mx.random.key(2))
    one = kernels.quantized_matmul(x, q, s, b, group_size=64, bits=8, isa=isa, threads=1)
    two = kernels.quantized_matmul(x, q, s, b, group_size=64, bits=8, isa=isa, threads=2)
    assert mx.array_equal(one, two).item()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("isa", ISAS)
def test_half_precision_scales_and_inputs(isa, dtype, rows):
    isa_or_skip(isa)
    q, s, b = quantized(65, 320, bits=4, group_size=64, dtype=dtype)
    assert s.dtype == dtype
    x = mx.random.normal((rows, 320), key=mx.random.key(3)).astype(dtype)
    got = kernels.quantized_matmul(x, q, s, b, group_size=64, bits=4, isa=isa)
    want, magnitudes = reference(x, q, s, b, bits=4, group_size=64)
    assert got.dtype == dtype
    # The result is rounded to the half type at the end.
    half_eps = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10
    bound = tolerance(magnitudes, 320) + half_eps * mx.abs(want)
    if isa != "portable":
        bound = bound + int16_bound(x, q, s, b, bits=4, group_size=64)
    assert mx.all(mx.abs(got.astype(mx.float32) - want) <= bound).item()


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("isa", ISAS)
def test_float16_scales_with_float32_inputs(isa, rows):
    # What quantize_for_cpu(half_scales=True) gives the kernels: a float32 model's x.
    isa_or_skip(isa)
    q, s, b = quantized(129, 9 * 32, bits=8, group_size=32)
    s, b = s.astype(mx.float16), b.astype(mx.float16)
    x = mx.random.normal((rows, 9 * 32), key=mx.random.key(4))
    got = kernels.quantized_matmul(x, q, s, b, group_size=32, bits=8, isa=isa)
    want, magnitudes = reference(x, q, s, b, bits=8, group_size=32)
    assert got.dtype == mx.float32
    bound = tolerance(magnitudes, 9 * 32)
    if isa != "portable":
        bound = bound + int16_bound(x, q, s, b, bits=8, group_size=32)
    assert mx.all(mx.abs(got - want) <= bound).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "portable"])  # it has no GEMM
def test_half_scales_give_the_bits_of_their_float32_values_in_a_gemm(isa, dtype):
    # The GEMM (9 to 96 rows) and a long step's dequantized tiles widen half scales and
    # biases 8 groups at a time (F16C, a shift) and the rest one by one: exact, so the same
    # bits as float32 scales of the same values. 9 groups: one vector and a tail.
    isa_or_skip(isa)
    q, s, b = quantized(37, 9 * 32, bits=8, group_size=32)
    s, b = s.astype(dtype), b.astype(dtype)
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    for rows, long in ((9, "int16"), (20, "int16"), (96, "int16"), (130, "int16"), (130, "blas")):
        x = mx.random.normal((rows, 9 * 32), key=mx.random.key(rows))
        how = {"group_size": 32, "bits": 8, "isa": isa, "long_products": long}
        half = kernels.quantized_matmul(x, q, s, b, **how)
        full = kernels.quantized_matmul(x, q, s32, b32, **how)
        assert mx.array_equal(half, full).item(), (rows, long)


def test_leading_dimensions_are_kept():
    q, s, b = quantized(33, 64, bits=8, group_size=32)
    x = mx.random.normal((2, 3, 64), key=mx.random.key(4))
    got = kernels.quantized_matmul(x, q, s, b, group_size=32, bits=8)
    want, _ = reference(x.reshape(6, 64), q, s, b, bits=8, group_size=32)
    assert got.shape == (2, 3, 33)
    assert mx.allclose(got.reshape(6, 33), want, atol=1e-2).item()  # int16 x: about 1e-3


def test_more_rows_than_the_portable_set_takes_is_refused():
    q, s, b = quantized(16, 64, bits=8, group_size=64)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        kernels.quantized_matmul(mx.zeros((65, 64)), q, s, b, group_size=64, bits=8, isa="portable")


VECTOR_ISAS = [isa for isa in ISAS if isa != "portable"]


@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_the_vectorized_sets_take_any_number_of_rows(isa):
    isa_or_skip(isa)
    assert kernels.gemm_available(isa)
    # Big enough that the tiles, and the dequantized tiles, are split over two threads.
    q, s, b = quantized(1031, 64, bits=8, group_size=64)
    x = mx.random.normal((1000, 64), key=mx.random.key(5))
    want, magnitudes = reference(x, q, s, b, bits=8, group_size=64)
    bound = tolerance(magnitudes, 64) + int16_bound(x, q, s, b, bits=8, group_size=64)
    for long in ("int16", "blas"):
        got = kernels.quantized_matmul(
            x, q, s, b, group_size=64, bits=8, isa=isa, threads=2, long_products=long
        )
        assert mx.all(mx.abs(got - want) <= bound).item(), long



@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_a_gemm_rows_bits_do_not_depend_on_the_rows_beside_it(isa, bits):
    # A cold prefill and a restored edit's tail compute the same rows in products of
    # different sizes: the integer GEMM (9 rows to the set's `gemm_tile_rows`: 96, or 4,096
    # with AVX-512 VNNI) gives each row the same bits.
    isa_or_skip(isa)
    q, s, b = quantized(83, 5 * 64, bits=bits, group_size=64)
    for rows in sorted({90, kernels.gemm_tile_rows(isa)}):
        x = mx.random.normal((rows, 5 * 64), key=mx.random.key(6))
        whole = kernels.quantized_matmul(x, q, s, b, group_size=64, bits=bits, isa=isa)
        tail = kernels.quantized_matmul(x[53:], q, s, b, group_size=64, bits=bits, isa=isa)
        assert mx.array_equal(whole[53:], tail).item(), rows
        one = kernels.quantized_matmul(x, q, s, b, group_size=64, bits=bits, isa=isa, threads=1)
        assert mx.array_equal(whole, one).item(), rows


def test_the_tiles_take_every_step_only_where_vnni_multiplies_int16_pairs():
    # Measured on an Intel Xeon with AVX-512 VNNI (2 threads): vpdpwssd's tiles 1.1-1.6x the
    # BLAS from 97 to 768 rows and level with it or faster to 2,048 (src/qgemm.h,
    # kVnniRows); without it (vpmaddwd + vpaddd) the BLAS wins past 96.
    assert kernels.gemm_tile_rows("portable") == 0
    for isa in VECTOR_ISAS:
        if kernels.usable_isa(isa) != isa:
            continue
        vnni = isa == "avx512" and kernels.gemm_int8_fast(isa)
        assert kernels.gemm_tile_rows(isa) == (4096 if vnni else 96), isa


def awkward_rows(rows: int, k: int, group_size: int, seed: int) -> np.ndarray:
    """x with the groups round_group treats apart: all zero, a NaN (left out of the
    largest), an infinity (not finite: nothing rounded), a subnormal largest (its int8 scale
    is 0, its integers x * inf), sums that overflow, and ties of the rounding."""
    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * 3
    x[0, :group_size] = 0
    if rows > 5:
        x[1, 5], x[1, 6] = 1000, np.nan  # the NaN after the largest: it must not reset it
        x[2, group_size + 3] = np.inf
        x[3, -group_size:] = np.float32(1e-44)
        x[4, :group_size] = np.float32(3e38)
        x[5, :group_size] = np.arange(group_size, dtype=np.float32) - 16.5  # .5 ties
        x[5, 0] = 32767  # so x * (32767 / largest) is x itself
    return x


def test_the_vectorized_packing_gives_the_scalar_loops_bits():
    # The GEMM rounds x one vector lane a row (src/qgemm_x86_pack.h); the scalar loop it
    # restates is round_group / round_group8, which the row kernels' rounding shares. Each
    # vectorized set this CPU has (its best one at least: `isa_or_skip` fails under CI).
    isa_or_skip(best_isa())
    sets = [isa for isa in VECTOR_ISAS if kernels.usable_isa(isa) == isa]
    for isa, int8, per_word in [(i, *w) for i in sets for w in ((0, 2), (1, 2), (1, 4))]:
        for group_size in (32, 64, 128):
            for rows in (1, 6, 9, 16, 20, 33):
                x = awkward_rows(rows, 3 * group_size, group_size, seed=rows + group_size)
                kw = {"int8": bool(int8), "per_word": per_word, "isa": isa}
                vector = kernels.gemm_pack(x, group_size, vector=True, **kw)
                scalar = kernels.gemm_pack(x, group_size, vector=False, **kw)
                assert vector[0] == scalar[0] > 0
                for got, want in zip(vector[1:], scalar[1:], strict=True):
                    # bit patterns, so that NaNs compare too
                    assert got.view(np.int32).tolist() == want.view(np.int32).tolist(), (
                        isa,
                        int8,
                        per_word,
                        group_size,
                        rows,
                    )


@pytest.mark.parametrize("bits", [4, 8])
def test_the_gemm_gives_the_same_bits_under_avx2_and_avx512(bits):
    isa_or_skip("avx512")
    q, s, b = quantized(45, 3 * 32, bits=bits, group_size=32)
    x = mx.random.normal((41, 3 * 32), key=mx.random.key(7))
    two = kernels.quantized_matmul(x, q, s, b, group_size=32, bits=bits, isa="avx2")
    five = kernels.quantized_matmul(x, q, s, b, group_size=32, bits=bits, isa="avx512")
    assert mx.array_equal(two, five).item()


def test_the_routed_library_methods_are_what_we_restate():
    # Fails when an MLX update changes QuantizedLinear.__call__ or QuantizedEmbedding.as_linear:
    # then read the new methods and update qroute's bodies and replacements.
    for route in (qroute.LINEAR, qroute.EMBEDDING_HEAD):
        assert all(not body.changed() for body in route.bodies), f"mlx changed {route.name}"


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    return make_tiny_quantized_model(
        "gemma3_text", tmp_path_factory.mktemp("q") / "tiny-q4", bits=4, group_size=32
    )


@pytest.fixture(scope="module")
def tiny_llama_q8(tmp_path_factory) -> Path:
    return make_tiny_quantized_model(
        "llama", tmp_path_factory.mktemp("q") / "tiny-llama-q8", bits=8, group_size=64
    )


def greedy(lm, prompt: list[int], *, rows: int, steps: int) -> list[list[int]]:
    cache = lm.make_cache()
    token = mx.argmax(lm.model(mx.array([prompt] * rows), cache=cache)[:, -1:, :], axis=-1)
    out = [token]
    for _ in range(steps - 1):
        token = mx.argmax(lm.model(token, cache=cache)[:, -1:, :], axis=-1)
        out.append(token)
    return mx.concatenate(out, axis=1).tolist()


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_quantized_model_decodes_the_same_tokens_with_and_without_the_kernels(
    request, family, rows
):
    # Gemma's GELU MLP and Llama's SwiGLU MLP each run as one gated-MLP primitive.
    lm = load(request.getfixturevalue("tiny_q4" if family == "gemma3_text" else "tiny_llama_q8"))
    assert "quantized-linear" in lm.routing.names()
    prompt = lm.tokenizer.encode("The Eiffel Tower is located in the city of")
    with_kernels = greedy(lm, prompt, rows=rows, steps=24)
    quantized = (qroute.LINEAR, qroute.EMBEDDING_HEAD, *qroute.SWIGLU_MLPS)
    with lm.routing.suspended(*quantized):
        without = greedy(lm, prompt, rows=rows, steps=24)
    assert with_kernels == without


@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", ISAS)
def test_the_gated_mlp_matches_its_products_run_one_by_one(isa, bits, rows, activation):
    isa_or_skip(isa)
    k, h = 7 * 32, 5 * 32  # group counts with a remainder past the kernels' four at a time
    gate, up = (quantized(h, k, bits=bits, group_size=32, seed=s) for s in (1, 2))
    down = quantized(k, h, bits=bits, group_size=32, seed=3)
    x = mx.random.normal((1, rows, k), key=mx.random.key(6))
    got = kernels.gated_mlp(
        x, gate, up, down, group_size=32, bits=bits, activation=activation, isa=isa
    )

    def product(m, v):
        return kernels.quantized_matmul(v, *m, group_size=32, bits=bits, isa=isa)

    act = nn.gelu_approx if activation == "gelu_tanh" else nn.silu
    want = product(down, act(product(gate, x)) * product(up, x))
    assert got.shape == want.shape == (1, rows, k)
    # The activations differ from MLX's by their polynomial's error (a few float32 ulps).
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4 * mx.abs(want).max().item()).item()


@pytest.mark.parametrize("isa", ISAS)
def test_the_gated_mlp_reads_a_strided_view_of_x_as_its_values(isa):
    isa_or_skip(isa)
    gate, up = (
        quantized(96, 64, bits=8, group_size=32, seed=1),
        quantized(96, 64, bits=8, group_size=32, seed=2),
    )
    down = quantized(64, 96, bits=8, group_size=32, seed=3)
    base = mx.random.normal((64, 3), key=mx.random.key(7))
    x = base.T  # rows not contiguous
    args = dict(group_size=32, bits=8, activation="silu", isa=isa)
    got = kernels.gated_mlp(x, gate, up, down, **args)
    assert mx.array_equal(
        got, kernels.gated_mlp(mx.array(np.array(x)), gate, up, down, **args)
    ).item()


def test_the_gated_mlp_takes_at_most_8_rows():
    gate = up = quantized(64, 64, bits=8, group_size=32)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        kernels.gated_mlp(
            mx.zeros((9, 64)), gate, up, gate, group_size=32, bits=8, activation="silu"
        )


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_a_decode_step_runs_each_mlp_as_one_primitive(request, tmp_path, family):
    lm = load(request.getfixturevalue("tiny_q4" if family == "gemma3_text" else "tiny_llama_q8"))
    cache = lm.make_cache()
    mx.eval(lm.model(mx.array([[1, 2, 3]]), cache=cache), [c.state for c in cache])
    # Gemma 3's whole layer is routed too (tests/integration/test_decode_layer.py): the MLP on
    # its own here.
    with lm.routing.suspended(layerroute.LAYER):
        step = lm.model(mx.array([[4]]), cache=cache)
    dot = tmp_path / f"{family}.dot"  # not pytest's cache: it may be off (-p no:cacheprovider)
    mx.export_to_dot(str(dot), step)
    text = dot.read_text()
    layers = len(lm.model.layers)
    assert text.count('label ="MnbGatedMlp"') == layers
    # Besides the MLPs' none: the attention projections and the head (4 + 1 per layer).
    assert text.count('label ="MnbQuantizedMatVec"') == 4 * layers + 1


def test_a_routed_layer_computes_on_the_kernels(tiny_q4):
    lm = load(tiny_q4)
    layer = next(m for _, m in lm.model.named_modules() if isinstance(m, nn.QuantizedLinear))
    x = mx.random.normal((1, layer.weight.shape[1] * 32 // layer.bits), key=mx.random.key(5))
    direct = kernels.quantized_matmul(
        x, layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=layer.bits
    )
    if "bias" in layer:
        direct = direct + layer.bias
    assert mx.array_equal(layer(x), direct).item()


def test_fingerprints_of_variants_differ(tiny_q4):
    plain = fingerprint_directory(tiny_q4, dtype="float32")
    assert plain != fingerprint_directory(tiny_q4, dtype="float32", variant="q8g64")


def _status_in_child(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = (
        "import mlx_nbengine\n"
        "from mlx_nbengine import kernels\n"
        "s = kernels.status()\n"
        "print(s.active, s.isa)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
        check=True,
    )


@pytest.mark.parametrize("isa", ["portable", "avx2"])
def test_the_switch_forces_a_kernel_set(isa):
    isa_or_skip(isa)
    done = _status_in_child({kernels.MODE_ENV: isa})
    assert done.stdout.split() == ["True", isa]


def test_the_switch_turns_the_kernels_off():
    done = _status_in_child({kernels.MODE_ENV: "off"})
    assert done.stdout.split() == ["False", "None"]
    assert done.stderr == ""


def test_the_build_key_covers_every_source_file():
    # An edited source the key does not read would leave a stale module in the cache home.
    from mlx_nbengine.kernels import build

    on_disk = {p.name for p in build.SOURCE_DIR.iterdir() if p.suffix in {".cpp", ".h", ".txt"}}
    assert on_disk == set(build.SOURCES)


def test_a_failed_build_says_one_line_and_models_run_as_before(tmp_path, tiny_q4):
    code = (
        "import mlx_nbengine\n"
        "import mlx.core as mx\n"
        "from mlx_nbengine import kernels\n"
        "from mlx_nbengine.models import load\n"
        f"lm = load({str(tiny_q4)!r})\n"
        "logits = lm.model(mx.array([[1, 2, 3]]))\n"
        "mx.eval(logits)\n"
        "routed = 'quantized-linear' in lm.routing.names()\n"
        "print(kernels.status().active, routed, logits.shape[-1])\n"
    )
    env = {**os.environ, "CXX": "false", "MLX_NBENGINE_HOME": str(tmp_path / "home")}
    env.pop(kernels.MODE_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
        check=True,
    )
    assert done.stdout.split() == ["False", "False", "512"]
    said = [line for line in done.stderr.splitlines() if "quantized kernels" in line]
    assert len(said) == 1 and "not used" in said[0]


def test_quantized_gemma_mlps_get_the_fused_gelu_too(tiny_q4):
    # cpu_math.speed_up takes a quantized gate whose scales are float32 (the CPU's cast).
    lm = load(tiny_q4)
    fused = [m for _, m in lm.model.named_modules() if type(m).__name__.startswith("CpuGelu")]
    assert fused


@pytest.mark.parametrize("isa", ISAS)
def test_a_strided_view_of_x_is_read_as_its_values(isa):
    isa_or_skip(isa)
    q, s, b = quantized(40, 128, bits=8, group_size=32)
    x = mx.random.normal((128, 3), key=mx.random.key(6)).T  # rows not contiguous
    got = kernels.quantized_matmul(x, q, s, b, group_size=32, bits=8, isa=isa)
    want = kernels.quantized_matmul(mx.array(x.tolist()), q, s, b, group_size=32, bits=8, isa=isa)
    assert mx.array_equal(got, want).item()
