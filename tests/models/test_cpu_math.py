"""The fused GELU swapped into float32 Gemma MLPs on the CPU (`models.cpu_math`)."""

from __future__ import annotations

import importlib
import inspect

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_nbengine.models import (
    attnroute,
    cpu_math,
    fastops,
    fingerprint_directory,
    layerroute,
    load,
    routes,
)


def test_rational_tanh_is_within_a_few_float32_ulps_everywhere():
    z = np.linspace(-40, 40, 2_000_001, dtype=np.float32)
    got = np.array(cpu_math.tanh_rational(mx.array(z)))
    err = np.abs(got.astype(np.float64) - np.tanh(z.astype(np.float64)))
    assert err.max() <= 3.5e-7
    assert np.all(np.abs(got) <= 1.0)
    assert np.array_equal(np.sign(got), np.sign(z))  # odd, and tanh(0) == 0


def test_fused_gelu_matches_the_exact_tanh_formula_and_mlx_gelu_approx():
    x = np.concatenate(
        [np.linspace(-12, 12, 200_001), np.random.default_rng(0).normal(0, 3, 100_000)]
    ).astype(np.float32)
    x64 = x.astype(np.float64)
    exact = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))
    fused = np.array(cpu_math.gelu_tanh(mx.array(x))).astype(np.float64)
    library = np.array(nn.gelu_approx(mx.array(x))).astype(np.float64)
    tolerance = 1e-6 * np.maximum(1.0, np.abs(x64))
    assert np.all(np.abs(fused - exact) <= tolerance)
    assert np.all(np.abs(fused - library) <= tolerance)
    special = mx.array([np.inf, 0.0, -0.0], dtype=mx.float32)
    assert np.array(cpu_math.gelu_tanh(special)).tolist() == [np.inf, 0.0, 0.0]


@pytest.mark.parametrize("route", cpu_math.GELU_MLPS, ids=lambda route: route.name)
def test_every_listed_library_mlp_still_computes_the_restated_expression(route):
    # If mlx-lm or mlx-vlm change this MLP (or Gemma 4's geglu), the swap stops (with one
    # line): this test says so.
    for body in route.bodies:
        importlib.import_module(body.module)
        assert not body.changed(), f"{body.name} changed"


def test_an_mlp_computing_something_else_is_never_swapped():
    def other(self, x):
        return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))

    [body] = cpu_math.GELU_MLPS[0].bodies
    assert routes.body_digest(inspect.getsource(other)) != routes.body_digest(body.source)


def test_loading_a_float32_gemma_on_cpu_swaps_every_mlp_and_keeps_its_greedy_output(
    tiny_model_dir,
):
    from mlx_lm.generate import generate_step

    path = tiny_model_dir("gemma3_text")
    lm = load(path)
    mlps = [layer.mlp for layer in lm.model.layers]
    assert all(type(m).__name__ == "CpuGeluMLP" for m in mlps)
    routes = (cpu_math.variant(), attnroute.variant(), fastops.variant(), layerroute.variant())
    variant = "+".join(v for v in routes if v)
    assert lm.fingerprint == fingerprint_directory(path, dtype="float32", variant=variant)
    assert lm.fingerprint != fingerprint_directory(path, dtype="float32")

    prompt = mx.array(list(range(3, 200)))
    fast_logits = lm.model(prompt[None])
    fast_tokens = [t for t, _ in generate_step(prompt, lm.model, max_tokens=24)]
    for m in mlps:  # back to the library's own class
        m.__class__ = type(m).__mro__[1]
    slow_logits = lm.model(prompt[None])
    slow_tokens = [t for t, _ in generate_step(prompt, lm.model, max_tokens=24)]
    scale = mx.abs(slow_logits).max().item()
    # Measured 2026-12-01 on an AMD EPYC (2 cores): at most 2.6e-6 of the largest logit
    # (9.2); the bound is 10x that.
    assert mx.abs(fast_logits - slow_logits).max().item() <= 2.6e-5 * scale
    assert fast_tokens == slow_tokens


def test_other_families_and_other_dtypes_are_left_as_the_library_wrote_them(tiny_model_dir):
    llama = tiny_model_dir("llama")
    lm = load(llama)
    assert lm.fingerprint == fingerprint_directory(
        llama,
        dtype="float32",
        variant="+".join(
            v for v in (attnroute.variant(), fastops.variant(), layerroute.variant()) if v
        )
        or None,
    )
    bf16 = load(tiny_model_dir("gemma3_text"), dtype="bfloat16")
    assert all(type(layer.mlp).__name__ == "MLP" for layer in bf16.model.layers)
    assert cpu_math.speed_up(bf16.model, routes.Routing()) == 0


def test_a_float32_gemma4_caps_its_logits_with_the_rational_tanh(tiny_model_dir):
    lm = load(tiny_model_dir("gemma4_text"))
    try:
        assert "cpu-softcap-gemma4_text" in lm.routing.names()
        assert cpu_math.softcap_variant() in lm.variant.split("+")
        assert cpu_math.SOFTCAP.probe_fails() is None, "mlx-lm changed Gemma 4's logit cap"
        prompt = mx.array([list(range(3, 120))])
        ours = lm.model(prompt)
        with lm.routing.suspended(cpu_math.SOFTCAP):
            library = lm.model(prompt)
        cap = lm.model.final_logit_softcapping
        # The rational tanh's error (at most 3.5e-7) times the cap, plus a rounding or two.
        assert 0 < mx.abs(ours - library).max().item() <= 1e-6 * cap
        assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(library, -1)).item()
    finally:
        lm.release_routes()
    # Given back with the model: the module's own function again.
    assert (
        importlib.import_module("mlx_lm.models.gemma4_text").logit_softcap
        is (cpu_math.SOFTCAP.library["logit_softcap"])
    )
