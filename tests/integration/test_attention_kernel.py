"""Our attention kernel (`mlx_nbengine.kernels.attention`) and its routing (`attnroute`).

Every case is checked against ``mx.fast.scaled_dot_product_attention`` (on the CPU: MLX's
composed float32 matmul, softmax, matmul) with the same inputs, the masks given to MLX as
bool arrays. The kernel differs from it by summation order and its exp polynomial:
`TOLERANCE` bounds the largest absolute difference of an output element (inputs standard
normal, outputs of magnitude about 1). Vectorized sets this CPU lacks are skipped; the
portable set always runs.
"""

from __future__ import annotations

import inspect
import random
from contextlib import nullcontext

import mlx.core as mx
import numpy as np
import pytest
from kernelsets import ISAS, needs_kernels  # tests/ is on sys.path
from kernelsets import attention_isa_or_skip as isa_or_skip

from mlx_nbengine import Engine, kernels
from mlx_nbengine.kernels import digest
from mlx_nbengine.models import attnroute, fastops, layerroute, load
from mlx_nbengine.models.routes import Routing
from mlx_nbengine.testing import EXTRA_FAMILIES, FAMILIES, VISION_FAMILIES

# Measured 2026-12-01 on an AMD EPYC (Zen 4), every case below on every set: the largest
# difference was 8.3e-7; the bound is about 10x that.
TOLERANCE = 1e-5
# Soft-capped scores go through our rational tanh (error 3.2e-7, times the cap) instead of
# MLX's: measured 8.6e-6 with the cap at 5 and scores up to about 30; the bound is about 10x.
CAP_TOLERANCE = 1e-4
# The exp polynomial's largest relative error against float64 exp over [-87, 0]: measured
# 9.2e-8 (under 1 float32 ulp); the bound is 4x that.
EXP_TOLERANCE = 4e-7

pytestmark = needs_kernels


def qkv(b, hq, hkv, length, keys, d=64, seed=0):
    q = mx.random.normal((b, hq, length, d), key=mx.random.key(seed))
    k = mx.random.normal((b, hkv, keys, d), key=mx.random.key(seed + 1))
    v = mx.random.normal((b, hkv, keys, d), key=mx.random.key(seed + 2))
    return q, k, v


def visible(length, keys, *, window=0):
    """The bool mask of causal attention (query i at position keys - length + i), windowed."""
    q_pos = mx.arange(keys - length, keys)[:, None]
    k_pos = mx.arange(keys)[None]
    mask = k_pos <= q_pos
    if window:
        mask = mask & (k_pos > q_pos - window)
    return mask


def reference(q, k, v, *, scale, mask=None, softcap=0.0):
    if not softcap:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    g = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, g, axis=1), mx.repeat(v, g, axis=1)
    scores = softcap * mx.tanh((scale * q) @ k.swapaxes(-1, -2) / softcap)
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
    return mx.softmax(scores, axis=-1, precise=True) @ v


def largest_difference(got, want) -> float:
    assert got.shape == want.shape and got.dtype == mx.float32
    return mx.abs(got - want).max().item()


# --- the kernel against MLX ------------------------------------------------------------------

# (queries, keys): query lengths 1, 7, 256 and 300 against a short and a long cache.
LENGTHS = [(1, 1), (1, 9000), (7, 7), (7, 300), (256, 256), (256, 2048), (300, 300), (300, 9000)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(("length", "keys"), LENGTHS)
def test_causal_attention_matches_mlx(isa, group, length, keys):
    isa_or_skip(isa)
    q, k, v = qkv(1, 2 * group, 2, length, keys)
    got = kernels.attention(q, k, v, scale=0.125, causal=True, isa=isa)
    want = reference(q, k, v, scale=0.125, mask="causal")
    assert largest_difference(got, want) <= TOLERANCE


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [64, 512])
@pytest.mark.parametrize(("length", "keys"), [(1, 9000), (7, 600), (256, 2048), (300, 300)])
def test_sliding_windows_match_mlx_with_edges_inside_a_step(isa, window, length, keys):
    isa_or_skip(isa)
    q, k, v = qkv(1, 4, 1, length, keys, d=256)
    got = kernels.attention(q, k, v, scale=0.0625, window=window, isa=isa)
    want = reference(q, k, v, scale=0.0625, mask=visible(length, keys, window=window))
    assert largest_difference(got, want) <= TOLERANCE


@pytest.mark.parametrize("isa", ISAS)
def test_bool_masks_of_every_broadcast_shape_match_mlx(isa):
    isa_or_skip(isa)
    q, k, v = qkv(2, 4, 2, 7, 300, d=80)  # a head size that is not a multiple of 16
    rng = np.random.default_rng(0)
    for shape in [(7, 300), (1, 1, 7, 300), (2, 1, 7, 300), (2, 4, 7, 300), (300,), (1, 300)]:
        mask = mx.array(rng.random(shape) < 0.7)
        got = kernels.attention(q, k, v, scale=0.1, mask=mask, isa=isa)
        want = reference(q, k, v, scale=0.1, mask=mask)
        assert largest_difference(got, want) <= TOLERANCE, shape


@pytest.mark.parametrize("isa", ISAS)
def test_a_query_that_sees_no_key_gets_what_mlx_gives_it(isa):
    isa_or_skip(isa)
    q, k, v = qkv(1, 2, 1, 3, 40)
    mask = mx.array(np.array([[False] * 40, [True] * 40, [False] * 39 + [True]]))
    got = kernels.attention(q, k, v, scale=0.1, mask=mask, isa=isa)
    assert largest_difference(got, reference(q, k, v, scale=0.1, mask=mask)) <= TOLERANCE


@pytest.mark.parametrize("isa", ISAS)
def test_no_mask_and_soft_capping_match(isa):
    isa_or_skip(isa)
    q, k, v = qkv(1, 4, 2, 33, 1000)
    q = 4 * q  # scores large enough for the cap to bend them
    got = kernels.attention(q, k, v, scale=0.125, isa=isa)
    assert largest_difference(got, reference(q, k, v, scale=0.125)) <= TOLERANCE
    for mask, causal in [(None, False), (visible(33, 1000), True)]:
        got = kernels.attention(q, k, v, scale=0.125, causal=causal, softcap=5.0, isa=isa)
        want = reference(q, k, v, scale=0.125, mask=mask, softcap=5.0)
        assert largest_difference(got, want) <= CAP_TOLERANCE


@pytest.mark.parametrize("isa", ISAS)
def test_an_empty_step_gives_an_empty_result(isa):
    isa_or_skip(isa)
    q, k, v = qkv(1, 4, 1, 0, 50)
    got = kernels.attention(q, k, v, scale=0.125, causal=True, isa=isa)
    assert got.shape == (1, 4, 0, 64) and got.dtype == mx.float32


def test_strided_inputs_as_caches_give_them_and_threads_do_not_change_bits():
    # A KV cache hands out a slice of its buffer; queries come transposed from [B, L, H, D].
    q, k, v = qkv(1, 4, 2, 256, 1024)
    k_buf, v_buf = (
        mx.pad(k, [(0, 0), (0, 0), (0, 256), (0, 0)]),
        mx.pad(v, [(0, 0)] * 2 + [(0, 256), (0, 0)]),
    )
    q_t = mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    ks, vs = k_buf[:, :, :1024, :], v_buf[:, :, :1024, :]
    mx.eval(q_t, ks, vs)
    one = kernels.attention(q_t, ks, vs, scale=0.125, causal=True, threads=1)
    two = kernels.attention(q_t, ks, vs, scale=0.125, causal=True, threads=2)
    assert mx.array_equal(one, two).item()
    assert largest_difference(one, reference(q, k, v, scale=0.125, mask="causal")) <= TOLERANCE


def test_the_exp_polynomial_error_is_as_stated():
    x = np.linspace(-87.0, 0.0, 20001).astype(np.float32)
    got = np.array([kernels._module.exp_poly(float(t)) for t in x], dtype=np.float64)
    relative = np.abs(got / np.exp(x.astype(np.float64)) - 1)
    assert relative.max() <= EXP_TOLERANCE
    assert kernels._module.exp_poly(-100.0) == 0.0
    assert kernels._module.exp_poly(float("-inf")) == 0.0


def test_the_switch_picks_the_attention_set_by_the_cpu():
    chosen = kernels.attention_isa()
    assert chosen in ISAS
    assert kernels.attention_isa("portable") == "portable"


# --- routing ----------------------------------------------------------------------------------


def test_mlx_lm_still_reaches_attention_through_mx_fast():
    # attnroute replaces mx.fast.scaled_dot_product_attention: mlx-lm must still look it up.
    from mlx_lm.models import base

    source = inspect.getsource(base.scaled_dot_product_attention)
    assert "mx.fast.scaled_dot_product_attention(" in source, (
        "mlx-lm no longer calls mx.fast.scaled_dot_product_attention: attnroute misses it"
    )
    # The wrapper passes these by name to MLX's own function (a nanobind function: its
    # signature is the first line of its docstring).
    original = attnroute.ATTENTION.library["scaled_dot_product_attention"]
    signature = original.__doc__.strip().splitlines()[0]
    for name in ("q", "k", "v", "scale", "mask", "sinks", "stream"):
        assert f"{name}:" in signature, f"MLX's attention lost its argument {name!r}"


def test_routable_takes_what_the_kernel_handles_and_nothing_else():
    q, k, v = qkv(1, 4, 2, 7, 30)
    assert attnroute.routable(q, k, v, None)
    assert attnroute.routable(q, k, v, "causal")
    assert attnroute.routable(q, k, v, visible(7, 30))
    assert not attnroute.routable(q, k, v[:, :, :29], None)
    assert not attnroute.routable(q, k[:, :, :5], v[:, :, :5], "causal")  # fewer keys
    assert not attnroute.routable(q, k, v, mx.zeros((7, 30)))  # additive mask
    assert not attnroute.routable(q, k, v, None, sinks=mx.zeros((4,)))
    assert not attnroute.routable(q.astype(mx.bfloat16), k, v, None)
    three = mx.repeat(k[:, :1], 3, axis=1)
    assert not attnroute.routable(q, three, three)  # 4 query heads over 3 KV heads


@pytest.fixture
def routed():
    """Attention routed for the test (as a model on the CPU holds it), released after it."""
    routing = Routing()
    assert attnroute.route(routing)
    yield routing
    routing.release()


def test_a_routed_call_runs_on_the_kernel(routed, monkeypatch):
    calls = []
    real = kernels.attention
    monkeypatch.setattr(kernels, "attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q, k, v = qkv(1, 4, 2, 7, 30)
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert calls and calls[0]["causal"] is True
    additive = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mx.zeros((7, 30)))
    assert len(calls) == 1  # the library's own
    library = attnroute.ATTENTION.library["scaled_dot_product_attention"]
    want = library(q, k, v, scale=0.125, mask="causal")
    assert largest_difference(got, want) <= TOLERANCE
    assert largest_difference(additive, reference(q, k, v, scale=0.125)) <= TOLERANCE


def test_the_fingerprint_names_the_attention_variant(tiny_model_dir, routed):
    lm = load(tiny_model_dir("llama"))
    variant = attnroute.variant()
    named = digest.of_files(attnroute.VARIANT_SOURCES)
    assert variant == f"attn-{kernels.attention_isa()}-{named}"
    from mlx_nbengine.models.loader import fingerprint_directory

    path = tiny_model_dir("llama")
    # Norms and RoPE, and the fused decoder layer, too.
    routed = "+".join(v for v in (variant, fastops.variant(), layerroute.variant()) if v)
    assert lm.fingerprint == fingerprint_directory(path, dtype="float32", variant=routed)
    assert lm.fingerprint != fingerprint_directory(path, dtype="float32")


# --- models ------------------------------------------------------------------------------------

TEXT_FAMILIES = [*FAMILIES, *EXTRA_FAMILIES]
# Measured 2026-12-01 (Zen 4): the largest logit difference with and without the kernel was
# 6.4e-6 of the largest logit (gemma3_text) over these families; the bound is about 10x that.
LOGIT_TOLERANCE = 6e-5


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_every_tiny_family_gives_the_same_greedy_tokens_with_and_without_the_kernel(
    family, tiny_model_dir, routed, monkeypatch
):
    from mlx_lm.generate import generate_step

    kwargs = {"sliding_window": 64} if family == "gemma3_text" else {}
    lm = load(tiny_model_dir(family, **kwargs))
    calls = []
    real = kernels.attention
    monkeypatch.setattr(kernels, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompt = mx.array(list(range(3, 300)))
    fast_logits = lm.model(prompt[None])
    fast_tokens = [t for t, _ in generate_step(prompt, lm.model, max_tokens=16)]
    assert calls, "the model's attention did not reach the kernel"
    with lm.routing.suspended(attnroute.ATTENTION):
        slow_logits = lm.model(prompt[None])
        slow_tokens = [t for t, _ in generate_step(prompt, lm.model, max_tokens=16)]
    scale = mx.abs(slow_logits).max().item()
    assert mx.abs(fast_logits - slow_logits).max().item() <= LOGIT_TOLERANCE * scale
    assert fast_tokens == slow_tokens


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [2] + [rng.randrange(5, 512) for _ in range(n - 1)]


@pytest.mark.parametrize(
    ("family", "kwargs"), [("llama", {}), ("gemma3_text", {"sliding_window": 24})]
)
def test_an_edited_rerun_restores_with_the_kernel_exactly_as_without(
    family, kwargs, tiny_model_dir, tmp_path, routed
):
    path = tiny_model_dir(family, **kwargs)
    edit = _prompt(133)
    edit[37] = 5 if edit[37] != 5 else 6

    def edited_run(directory, *, with_kernel: bool):
        (directory / "cold").mkdir(parents=True)
        engine = Engine.load(path, block_size=16, cache_dir=directory)
        routes = () if with_kernel else (attnroute.ATTENTION,)
        try:
            with engine.model.routing.suspended(*routes) if routes else nullcontext():
                engine.submit(_prompt(133), max_tokens=6).result(timeout=60)
                engine.submit(_prompt(20, seed=777), max_tokens=2).result(timeout=60)
                engine.wait_for_saves(timeout=60)
                done = engine.submit(edit, max_tokens=6).result(timeout=60)
            cold = Engine.load(path, block_size=16, cache_dir=directory / "cold")
            try:
                with cold.model.routing.suspended(*routes) if routes else nullcontext():
                    cold_tokens = cold.submit(edit, max_tokens=6).result(timeout=60).tokens
            finally:
                cold.close()
            return done, cold_tokens
        finally:
            engine.close()

    fast, fast_cold = edited_run(tmp_path / "fast", with_kernel=True)
    slow, slow_cold = edited_run(tmp_path / "slow", with_kernel=False)
    assert fast.report.restored_tokens == slow.report.restored_tokens == 37
    assert fast.tokens == fast_cold == slow.tokens == slow_cold


def _image_chat() -> list:
    parts = [
        {"type": "text", "text": "Some long preamble text that goes on and on " * 3},
        {"type": "image"},
        {"type": "text", "text": "What is in this picture? Tell me all"},
    ]
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_every_tiny_vision_family_answers_an_image_prompt_alike_with_and_without_the_kernel(
    family, tiny_model_dir, routed, monkeypatch
):
    # Vision models call mx.fast's attention directly, with image-overlay bool masks.
    path = tiny_model_dir(family)
    image = (np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8")
    calls = []
    real = kernels.attention
    monkeypatch.setattr(kernels, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def answer(*, with_kernel: bool) -> list[int]:
        engine = Engine.load(path, block_size=16, store=False)
        routes = () if with_kernel else (attnroute.ATTENTION,)
        try:
            with engine.model.routing.suspended(*routes) if routes else nullcontext():
                chat = engine.submit(_image_chat(), images=[image], max_tokens=8)
                return chat.result(timeout=120).tokens
        finally:
            engine.close()

    fast = answer(with_kernel=True)
    assert calls, "the vision model's attention did not reach the kernel"
    assert fast == answer(with_kernel=False)
