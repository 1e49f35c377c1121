"""`qroute.quantize_for_cpu` at 8 bits keeps a GGUF's round-to-nearest blocks exactly: a
group of float32 weights that is a Q8_0, Q5_0 or Q4_0 block dequantized (llama.cpp's formats,
made here by the `gguf` package's own quantizer) gets codes whose dequantization is the
weights themselves, where mx.quantize's (max - min) / 255 steps miss the block's grid."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from kernelsets import needs_kernels  # tests/ is on sys.path

from mlx_nbengine import kernels
from mlx_nbengine.models import qroute

GROUP = 32


def gguf_blocks(kind: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Float32 weights as a GGUF of `kind` holds them: quantized and dequantized by gguf."""
    kind_type = GGMLQuantizationType[kind]
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) / 10
    return dequantize(quantize(x, kind_type), kind_type).astype(np.float32)


class Tiny(nn.Module):
    def __init__(self, linear: np.ndarray, embedding: np.ndarray) -> None:
        super().__init__()
        self.proj = nn.Linear(linear.shape[1], linear.shape[0], bias=False)
        self.proj.weight = mx.array(linear)
        self.embed = nn.Embedding(*embedding.shape)
        self.embed.weight = mx.array(embedding)


def dequantized(module) -> np.ndarray:
    return np.array(
        mx.dequantize(
            module.weight, module.scales, module.biases, group_size=GROUP, bits=module.bits
        )
    )


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0"])
def test_blocks_of_a_gguf_format_are_kept_exactly(kind):
    linear, embedding = gguf_blocks(kind, (48, 96), 1), gguf_blocks(kind, (40, 64), 2)
    model = Tiny(linear, embedding)
    assert qroute.quantize_for_cpu(model, bits=8, group_size=GROUP) == "q8g32x"
    assert isinstance(model.proj, nn.QuantizedLinear)
    assert isinstance(model.embed, nn.QuantizedEmbedding)
    assert np.array_equal(dequantized(model.proj), linear)
    assert np.array_equal(dequantized(model.embed), embedding)
    # The lookup and the product read the same exact weights.
    assert np.array_equal(np.array(model.embed(mx.array([3, 7]))), embedding[[3, 7]])


def test_mx_quantize_alone_misses_the_q8_0_grid():
    """Why: the step (max - min) / 255 is not a Q8_0 block's d."""
    w = mx.array(gguf_blocks("Q8_0", (16, 64), 3))
    plain = mx.dequantize(*mx.quantize(w, group_size=GROUP, bits=8), group_size=GROUP, bits=8)
    assert not mx.array_equal(plain, w).item()


def test_other_groups_keep_mx_quantize_codes():
    rng = np.random.default_rng(4)
    grid = gguf_blocks("Q8_0", (8, 64), 5)
    free = rng.normal(size=(8, 64)).astype(np.float32)  # on no block grid
    linear = np.concatenate([grid, free])
    linear[0, :GROUP] = 0.0  # a group of zeros stays as mx.quantize gives it
    model = Tiny(linear, grid)
    reference = mx.quantize(mx.array(linear), group_size=GROUP, bits=8)
    qroute.quantize_for_cpu(model, bits=8, group_size=GROUP)
    assert np.array_equal(dequantized(model.proj)[:8, GROUP:], grid[:, GROUP:][:8])
    assert np.array_equal(dequantized(model.proj)[1:8], grid[1:8])
    rows = slice(8, 16)
    assert np.array_equal(np.array(model.proj.weight)[rows], np.array(reference[0])[rows])
    assert np.array_equal(np.array(model.proj.scales)[rows], np.array(reference[1])[rows])
    assert np.array_equal(dequantized(model.proj)[0, :GROUP], np.zeros(GROUP, np.float32))


def test_4_bit_keeps_mx_quantize():
    linear = gguf_blocks("Q8_0", (16, 64), 6)
    model = Tiny(linear, linear)
    assert qroute.quantize_for_cpu(model, bits=4, group_size=GROUP) == "q4g32"
    want = mx.quantize(mx.array(linear), group_size=GROUP, bits=4)
    assert np.array_equal(np.array(model.proj.weight), np.array(want[0]))


def test_the_check_reads_a_large_matrix_in_parts(monkeypatch):
    monkeypatch.setattr(qroute, "_GRID_ROWS", 5)  # several parts and a short last one
    linear = gguf_blocks("Q5_0", (23, 64), 7)
    model = Tiny(linear, linear[:16])
    qroute.quantize_for_cpu(model, bits=8, group_size=GROUP)
    assert np.array_equal(dequantized(model.proj), linear)


@needs_kernels
def test_exact_layers_give_the_kernels_float16_copies_with_the_same_bits():
    linear, embedding = gguf_blocks("Q8_0", (48, 96), 8), gguf_blocks("Q5_0", (40, 64), 9)
    model = Tiny(linear, embedding)
    qroute.quantize_for_cpu(model, bits=8, group_size=GROUP)
    for module in (model.proj, model.embed):
        w, scales, biases = qroute.product_arrays(module)
        assert scales.dtype == biases.dtype == mx.float16
        assert module.scales.dtype == mx.float32  # the layer's own (the library's paths)
        assert mx.array_equal(scales.astype(mx.float32), module.scales).item()
        assert mx.array_equal(biases.astype(mx.float32), module.biases).item()
    # A decode step's rows, an edit tail's (the integer GEMM) and a prefill step's.
    for rows in (3, 20, 130) if kernels.gemm_available() else (3,):
        x = mx.random.normal((rows, 96), key=mx.random.key(10))
        layer = model.proj
        own = kernels.quantized_matmul(
            x, layer.weight, layer.scales, layer.biases, group_size=GROUP, bits=8
        )
        half = kernels.quantized_matmul(x, *qroute.product_arrays(layer), group_size=GROUP, bits=8)
        assert mx.array_equal(own, half).item(), f"{rows} rows"


def test_no_float16_copies_where_a_group_is_off_the_grids():
    linear = gguf_blocks("Q8_0", (8, 64), 11)
    linear[3, 40] += 1e-3  # one group off every grid
    model = Tiny(linear, gguf_blocks("Q8_0", (8, 64), 12))
    qroute.quantize_for_cpu(model, bits=8, group_size=GROUP)
    assert qroute.product_arrays(model.proj)[1].dtype == mx.float32
    assert qroute.product_arrays(model.embed)[1].dtype == mx.float16


def test_new_scales_in_a_layer_drop_its_float16_copies():
    linear = gguf_blocks("Q8_0", (8, 64), 13)
    model = Tiny(linear, linear)
    qroute.quantize_for_cpu(model, bits=8, group_size=GROUP)
    model.proj.scales = model.proj.scales * 2  # e.g. other weights loaded into the layer
    w, scales, biases = qroute.product_arrays(model.proj)
    assert scales is model.proj.scales and biases is model.proj.biases
