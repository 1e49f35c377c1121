"""A long step's int8 products (`kernels.long_products`, src/qgemm.h): x rounded to int8 per row
and group, times MLX's affine weights as integers.

Each product is checked against its own rounding computed here in float64 (`int8_reference`:
x rounded to 127 levels of its group's largest magnitude, as round_group8 rounds it), within
the float32 rounding bound of a K-term dot product; every kernel set computes it, the
portable one included (forced with ``long_products="int8"``), and all give the same bits. The
switch (``MLX_NBENGINE_LONG_PRODUCTS``) and the variant it names are checked in child
processes, and a routed model's tokens against int16's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from kernelsets import ISAS, isa_or_skip, needs_kernels  # tests/ is on sys.path

from mlx_nbengine import kernels
from mlx_nbengine.models import load, qroute
from mlx_nbengine.testing import make_tiny_quantized_model

EPS32 = float(np.finfo(np.float32).eps)
# A tiny model's int8 prefill against int16's (test_a_routed_model_prefills_on_int8_...):
# measured on Zen 4 (avx512, VNNI), 2026-12-05, largest difference over the largest logit and
# argmax agreement: llama 0.032 and 0.950, gemma3_text 0.261 and 0.855, qwen3_5 0.499 and 0.870.
RELATIVE, AGREEMENT = 0.75, 0.8

pytestmark = needs_kernels


def quantized(n: int, k: int, *, bits: int, group_size: int, seed: int = 0):
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    return mx.quantize(w, group_size=group_size, bits=bits)


def int8_reference(x, q, s, b, *, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as the int8 product rounds it, times the dequantized weights in float64, and
    the magnitudes of the terms (for the float32 rounding bound)."""
    x32 = np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1])
    rows, k = x32.shape
    groups = x32.reshape(rows, k // group_size, group_size)
    largest = np.abs(groups).max(axis=-1, keepdims=True)
    safe = np.where(largest == 0, np.float32(1), largest)
    codes = np.rint(groups * (np.float32(127) / safe))  # float32 product, ties to even
    rounded = (codes * (largest / np.float32(127))).reshape(rows, k).astype(np.float64)
    dense = np.array(mx.dequantize(q, s, b, group_size=group_size, bits=bits)).astype(np.float64)
    return rounded @ dense.T, np.abs(rounded) @ np.abs(dense).T


def int8(
    x, q, s, b, *, bits: int, group_size: int, isa: str, threads: int = 2, pairs: bool = False
) -> mx.array:
    """The int8 product; `pairs`: on the set's int16 tiles, never its VNNI quads (the path a
    CPU without VNNI takes)."""
    return kernels.quantized_matmul(
        x,
        q,
        s,
        b,
        group_size=group_size,
        bits=bits,
        isa=isa,
        threads=threads,
        long_products="int8-pairs" if pairs else "int8",
    )


# 97 is the first long step; a last block of few rows (half the lanes) and a full one.
ROWS = [97, 100, 300, 4096]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", ISAS)
def test_the_int8_product_is_its_rounding_times_the_weights(isa, bits):
    isa_or_skip(isa)
    for group_size in (32, 64, 128):
        n, k = 77, 5 * group_size
        q, s, b = quantized(n, k, bits=bits, group_size=group_size)
        for rows in ROWS if isa != "portable" else ROWS[:-1]:  # plain C++: the same loops
            x = mx.random.normal((rows, k), key=mx.random.key(rows)) * 3
            want, magnitudes = int8_reference(x, q, s, b, bits=bits, group_size=group_size)
            bound = 4 * k * EPS32 * magnitudes + 1e-6
            # The set's quads (VNNI) where it has them, and its int16 tiles (a few sizes).
            for pairs in (False, True) if isa != "portable" and rows < 300 else (False,):
                got = int8(x, q, s, b, bits=bits, group_size=group_size, isa=isa, pairs=pairs)
                got = np.array(got)
                assert got.shape == (rows, n)
                assert (np.abs(got - want) <= bound).all(), (group_size, rows, pairs)


@pytest.mark.parametrize("bits", [4, 8])
def test_every_set_gives_the_same_bits(bits):
    q, s, b = quantized(45, 3 * 64, bits=bits, group_size=64)
    x = mx.random.normal((131, 3 * 64), key=mx.random.key(2))
    sets = [isa for isa in ISAS if kernels.usable_isa(isa) == isa]
    paths = [(isa, pairs) for isa in sets for pairs in (False, True)]
    results = [int8(x, q, s, b, bits=bits, group_size=64, isa=i, pairs=p) for i, p in paths]
    assert all(mx.array_equal(results[0], other).item() for other in results[1:]), paths


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(isa):
    # A cold prefill and a turn's new tokens compute the same rows in long steps of other
    # sizes: each row gets the same bits.
    isa_or_skip(isa)
    q, s, b = quantized(83, 4 * 32, bits=8, group_size=32)
    x = mx.random.normal((400, 4 * 32), key=mx.random.key(3))
    whole = int8(x, q, s, b, bits=8, group_size=32, isa=isa)
    tail = int8(x[150:], q, s, b, bits=8, group_size=32, isa=isa)
    one = int8(x, q, s, b, bits=8, group_size=32, isa=isa, threads=1)
    assert mx.array_equal(whole[150:], tail).item()
    assert mx.array_equal(whole, one).item()


@pytest.mark.parametrize("isa", ISAS)
def test_a_strided_view_of_x_is_read_as_its_values(isa):
    isa_or_skip(isa)
    q, s, b = quantized(40, 128, bits=4, group_size=32)
    wide = mx.random.normal((200, 256), key=mx.random.key(4))
    view = wide[:, ::2]  # rows 256 floats apart, every second one
    got = int8(view, q, s, b, bits=4, group_size=32, isa=isa)
    assert mx.array_equal(
        got, int8(mx.array(np.array(view)), q, s, b, bits=4, group_size=32, isa=isa)
    ).item()


def test_the_long_step_choice_follows_the_switch(monkeypatch, capsys):
    # auto is int16 while int8 costs accuracy (test_default_q8.py measures it).
    monkeypatch.delenv(kernels.LONG_PRODUCTS_ENV, raising=False)
    assert kernels.long_products() == "int16"
    assert not kernels.gemm_int8_fast("portable")
    for asked in ("int8", "blas", "int16"):
        monkeypatch.setenv(kernels.LONG_PRODUCTS_ENV, asked)
        assert kernels.long_products() == asked
        assert qroute.variant().startswith(f"qmv-{kernels.status().isa}-{asked}-")
    monkeypatch.setenv(kernels.LONG_PRODUCTS_ENV, "fp4")
    assert kernels.long_products() == "int16"
    kernels.long_products()
    err = capsys.readouterr().err
    assert err.count("MLX_NBENGINE_LONG_PRODUCTS='fp4' is not one of auto, int16, blas, int8") == 1


def test_vnni_is_what_makes_int8_fast():
    # AVX-512 VNNI for the avx512 set, AVX-VNNI (VEX: Alder Lake, Zen 5) for the avx2 set.
    import re

    flags = re.search(r"^flags\s*:(.*)$", open("/proc/cpuinfo").read(), re.MULTILINE)
    flags = set(flags[1].split()) if flags else set()
    for isa, flag in (("avx512", "avx512_vnni"), ("avx2", "avx_vnni")):
        has = flag in flags and kernels.usable_isa(isa) == isa
        assert kernels.gemm_int8_fast(isa) == has, isa


def test_the_switch_is_read_by_a_fresh_process_and_named_in_the_fingerprint(tmp_path):
    path = make_tiny_quantized_model("llama", tmp_path / "q8", bits=8, group_size=32)
    code = (
        "import mlx_nbengine\nfrom mlx_nbengine.models import load\n"
        f"print(load({str(path)!r}).fingerprint)"
    )
    prints = {}
    for asked in ("int8", "blas", "int16"):
        env = {**os.environ, kernels.LONG_PRODUCTS_ENV: asked}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-2000:]
        prints[asked] = done.stdout.strip().splitlines()[-1]
    assert len(set(prints.values())) == 3  # their stored blocks never mix


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_a_routed_model_prefills_on_int8_close_to_int16(family, tmp_path, monkeypatch):
    # One 200-row prefill step of a tiny family on each product: its logits within
    # `RELATIVE` of the largest and its argmax tokens mostly the same. Random tiny models
    # amplify a product's error (about 1% here) and have near ties, so the bounds are loose;
    # test_default_q8.py measures a real model.
    lm = load(make_tiny_quantized_model(family, tmp_path / family, bits=8, group_size=32))
    prompt = mx.array([(i * 37) % 500 + 5 for i in range(200)])[None]
    logits = {}
    for asked in ("int16", "int8"):
        monkeypatch.setenv(kernels.LONG_PRODUCTS_ENV, asked)
        logits[asked] = lm.model(prompt, cache=lm.make_cache())[0]
    int16, ours = logits["int16"], logits["int8"]
    assert not mx.array_equal(ours, int16).item()  # the long step did run another product
    relative = mx.abs(ours - int16).max().item() / mx.abs(int16).max().item()
    agreement = (mx.argmax(ours, axis=-1) == mx.argmax(int16, axis=-1)).mean().item()
    print(f"{family}: largest difference {relative:.4f} of the largest logit, ", end="")
    print(f"agreement {agreement:.3f}")
    assert relative <= RELATIVE and agreement >= AGREEMENT
