"""A decode step of Gemma 4's decoder layer as Gemma 3's two primitives (issue 35;
`models/gemma4route.py`): `kernels.qkv_step` with the values' weightless norm, the
proportional RoPE's frequencies and a queries-only form for the layers that read an earlier
layer's keys and values, and `kernels.block_tail` with the per-layer input's tail and the
layer scalar. Both have the bits of the operations they replace on our kernels, on every
kernel set; the per-layer tail's GELU is our row pass (`rowops.gelu_tanh_mul`) where the
library runs MLX's, and the bound that costs is stated here."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from decoding import decode_logits  # tests/ is on sys.path
from kernelsets import ISAS, isa_or_skip, needs_kernels

from mlx_nbengine import kernels
from mlx_nbengine.kernels import rowops
from mlx_nbengine.models import gemma4route, load
from mlx_nbengine.testing import make_tiny_quantized_model

pytestmark = needs_kernels

K, D, P = 5 * 32, 64, 64  # model width, head dim, per-layer input width
EPS = 1e-6


def quantized(n: int, k: int = K, *, bits: int = 8, seed: int):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) / k**0.5
    return mx.quantize(w, group_size=32, bits=bits)


def product(x, m, *, bits, isa):
    return kernels.quantized_matmul(x, *m, group_size=32, bits=bits, isa=isa)


def proportional_freqs(dims: int, rotated: int, base: float) -> mx.array:
    """ProportionalRoPE's frequencies (mlx-lm's rope_utils): a share rotated, the rest not."""
    exponents = mx.arange(0, rotated, 2, dtype=mx.float32) / dims
    return mx.concatenate([base**exponents, mx.full(((dims - rotated) // 2,), mx.inf)])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "batch", "offset"), [(8, 1, 700), (4, 3, "rows")])
@pytest.mark.parametrize("rope", ["base", "proportional"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-kv", "shared-kv"])
def test_gemma4_heads_have_the_bits_of_the_graph_they_replace(
    isa, bits, batch, offset, rope, shared
):
    isa_or_skip(isa)
    heads, kv_heads = 4, 1
    q, k, v = (
        quantized(n * D, bits=bits, seed=s) for s, n in ((1, heads), (2, kv_heads), (3, kv_heads))
    )
    qn, kn = (mx.random.normal((D,), key=mx.random.key(s)) for s in (4, 5))
    xn = mx.random.normal((K,), key=mx.random.key(6))
    x = mx.random.normal((batch, 1, K), key=mx.random.key(7))
    if offset == "rows":
        offset = mx.array([3 + 11 * b for b in range(batch)], dtype=mx.int32)
    if rope == "base":
        rope_args = dict(base=10_000.0, freqs=None)
    else:
        rope_args = dict(base=None, freqs=proportional_freqs(D, D // 4, 1_000_000.0))
    got = kernels.qkv_step(
        x, q, None if shared else k, None if shared else v,
        q_norm=qn, k_norm=None if shared else kn, eps=EPS, x_norm=xn, x_eps=EPS,
        heads=heads, kv_heads=kv_heads, rope_dims=D, traditional=False, scale=1.0,
        offset=offset, group_size=32, bits=bits, v_norm=True, isa=isa, **rope_args,
    )  # fmt: skip
    # The library's order: the input norm, each product's heads normed as [B, L, H, D],
    # transposed, rotated; the values normed without a weight.
    h = rowops.rms_norm(x, xn, EPS, isa=isa)

    def heads_of(m, n, norm):
        a = product(h, m, bits=bits, isa=isa).reshape(batch, 1, n, D)
        return rowops.rms_norm(a, norm, EPS, isa=isa).transpose(0, 2, 1, 3)

    def rotated(a):
        return rowops.rope(a, D, traditional=False, scale=1.0, offset=offset, isa=isa, **rope_args)

    want = [rotated(heads_of(q, heads, qn))]
    if not shared:
        want.append(rotated(heads_of(k, kv_heads, kn)))
        want.append(heads_of(v, kv_heads, None))
    assert len(got) == len(want)
    for name, a, b in zip("qkv", got, want, strict=False):
        assert a.shape == b.shape and mx.array_equal(a, b).item(), f"{name} differs"


def test_a_proportional_rope_leaves_its_unrotated_features_as_they_are():
    q = quantized(2 * D, seed=1)
    x = mx.random.normal((1, 1, K), key=mx.random.key(2))

    def queries(offset: int) -> mx.array:
        return kernels.qkv_step(
            x, q, None, None, q_norm=mx.ones((D,)), k_norm=None, eps=EPS, heads=2, kv_heads=1,
            rope_dims=D, traditional=False, base=None,
            freqs=proportional_freqs(D, D // 4, 1e6), scale=1.0, offset=offset, group_size=32,
            bits=8,
        )[0]  # fmt: skip

    got, at_zero = queries(900), queries(0)
    # Non-traditional RoPE pairs feature i with i + D/2; the first D/8 pairs turn.
    turning = list(range(D // 8)) + list(range(D // 2, D // 2 + D // 8))
    still = [i for i in range(D) if i not in turning]
    assert mx.array_equal(got[..., still], at_zero[..., still]).item()
    assert not mx.allclose(got[..., turning], at_zero[..., turning]).item()


def test_bad_gemma4_heads_are_refused_in_one_line():
    q, k = quantized(2 * D, seed=1), quantized(D, seed=2)
    args = dict(
        q_norm=mx.ones((D,)), eps=EPS, heads=2, kv_heads=1, rope_dims=D, traditional=False,
        scale=1.0, offset=0, group_size=32, bits=8,
    )  # fmt: skip
    x = mx.zeros((1, 1, K))
    with pytest.raises(ValueError, match="come together"):
        kernels.qkv_step(x, q, k, k, k_norm=None, base=1e4, **args)
    with pytest.raises(ValueError, match="freqs must have"):
        kernels.qkv_step(x, q, None, None, k_norm=None, base=None, freqs=mx.ones((3,)), **args)
    with pytest.raises(ValueError, match="exactly one of base and freqs"):
        kernels.qkv_step(x, q, None, None, k_norm=None, base=1e4, freqs=mx.ones((D // 2,)), **args)


def tail_inputs(*, batch: int, bits: int):
    heads = 2
    o = quantized(K, heads * D, bits=bits, seed=11)
    gate, up = quantized(128, bits=bits, seed=12), quantized(128, bits=bits, seed=13)
    down = quantized(K, 128, bits=bits, seed=14)
    norms = [mx.random.normal((K,), key=mx.random.key(s)) for s in (15, 16, 17, 18)]
    per_gate, per_proj = quantized(P, bits=bits, seed=19), quantized(K, P, bits=bits, seed=20)
    attn = mx.random.normal((batch, heads, 1, D), key=mx.random.key(21))
    x = mx.random.normal((batch, 1, K), key=mx.random.key(22))
    # The per-layer input as the model slices it: one layer's column of [B, L, layers, P].
    per_layer = mx.random.normal((batch, 1, 3, P), key=mx.random.key(23))[:, :, 1, :]
    scalar = mx.array([0.75])
    return o, gate, up, down, norms, per_gate, per_proj, attn, x, per_layer, scalar


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "batch"), [(8, 1), (4, 4)])
def test_the_per_layer_tail_has_the_bits_of_its_operations(isa, bits, batch):
    isa_or_skip(isa)
    o, gate, up, down, norms, per_gate, per_proj, attn, x, per_layer, scalar = tail_inputs(
        batch=batch, bits=bits
    )
    n1, n2, n3, n4 = norms
    common = dict(
        post_attn_norm=n1, pre_ffn_norm=n2, post_ffn_norm=n3, eps=EPS, group_size=32,
        bits=bits, activation="gelu_tanh", isa=isa,
    )  # fmt: skip
    plain = kernels.block_tail(attn, x, o, gate, up, down, **common)
    got = kernels.block_tail(
        attn, x, o, gate, up, down, per_layer_input=per_layer, per_layer_gate=per_gate,
        per_layer_projection=per_proj, post_per_layer_norm=n4, scalar=scalar, **common,
    )  # fmt: skip
    # The tail after the plain block, one operation at a time on our kernels: the same bits.
    g = rowops.gelu_tanh_mul(product(plain, per_gate, bits=bits, isa=isa), per_layer, isa=isa)
    r = rowops.rms_norm(product(g, per_proj, bits=bits, isa=isa), n4, EPS, isa=isa)
    assert mx.array_equal(got, (plain + r) * scalar).item()
    # The library runs MLX's GELU there: a few float32 ulps apart. Measured at most about
    # 2e-6 of the output's scale here; the bound leaves room for other sets.
    g = nn.gelu_approx(product(plain, per_gate, bits=bits, isa=isa)) * per_layer
    r = rowops.rms_norm(product(g, per_proj, bits=bits, isa=isa), n4, EPS, isa=isa)
    library = (plain + r) * scalar
    assert mx.abs(got - library).max().item() <= 1e-5 * mx.abs(library).max().item()
    # The scalar alone is one multiply: exact.
    alone = kernels.block_tail(attn, x, o, gate, up, down, scalar=scalar, **common)
    assert mx.array_equal(alone, plain * scalar).item()


def test_a_per_layer_tail_needs_all_its_parts():
    o, gate, up, down, norms, per_gate, per_proj, attn, x, per_layer, _ = tail_inputs(
        batch=1, bits=8
    )
    common = dict(
        post_attn_norm=norms[0], pre_ffn_norm=norms[1], post_ffn_norm=norms[2], eps=EPS,
        group_size=32, bits=8, activation="gelu_tanh",
    )  # fmt: skip
    with pytest.raises(ValueError, match="come together"):
        kernels.block_tail(attn, x, o, gate, up, down, per_layer_input=per_layer, **common)
    with pytest.raises(ValueError, match="per-layer input must be"):
        kernels.block_tail(
            attn, x, o, gate, up, down, per_layer_input=mx.zeros((1, 1, 40)),
            per_layer_gate=per_gate, per_layer_projection=per_proj,
            post_per_layer_norm=norms[3], **common,
        )  # fmt: skip
    with pytest.raises(ValueError, match="scalar"):
        kernels.block_tail(attn, x, o, gate, up, down, scalar=mx.ones((2,)), **common)


def test_the_library_layer_and_attention_are_what_we_restate():
    from mlx_lm.models import gemma4_text

    layer, attention = gemma4route.LAYER.bodies
    assert layer.library() is gemma4_text.DecoderLayer.__call__
    assert not layer.changed(), "mlx-lm changed Gemma 4's decoder layer"
    assert not attention.changed(), "mlx-lm changed Gemma 4's attention"


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory) -> Path:
    return make_tiny_quantized_model(
        "gemma4_text", tmp_path_factory.mktemp("q") / "tiny-q8", bits=8, group_size=32
    )


@pytest.mark.parametrize("rows", [1, 3])
def test_a_quantized_gemma4_decodes_the_bits_of_its_unfused_layers(tiny_q8, rows, monkeypatch):
    # The library's per-layer GELU made our row pass (the fused layer's), in every step of
    # both runs: then nothing else may differ.
    monkeypatch.setattr(nn, "gelu_approx", lambda g: rowops.gelu_tanh_mul(g, mx.ones_like(g)))
    lm = load(tiny_q8)
    try:
        assert "gemma4-decoder-layer" in lm.routing.names()
        # Past the tiny model's 64-token window: a rotating cache's offsets.
        prompt = [2, *range(5, 85)]
        fused = decode_logits(lm, prompt, rows=rows, steps=30)
        assert all(gemma4route.plan_of(layer) is not None for layer in lm.model.layers)
        with lm.routing.suspended(gemma4route.LAYER):
            unfused = decode_logits(lm, prompt, rows=rows, steps=30)
        for step, (a, b) in enumerate(zip(fused, unfused, strict=True)):
            assert mx.array_equal(a, b).item(), f"step {step} differs"
    finally:
        lm.release_routes()


def test_with_mlxs_gelu_the_unfused_layers_give_the_same_tokens_within_a_bound(tiny_q8):
    lm = load(tiny_q8)
    try:
        prompt = [2, *range(5, 85)]
        fused = decode_logits(lm, prompt, rows=1, steps=30)
        with lm.routing.suspended(gemma4route.LAYER):
            unfused = decode_logits(lm, prompt, rows=1, steps=30)
        for step, (a, b) in enumerate(zip(fused, unfused, strict=True)):
            assert mx.argmax(a, axis=-1).tolist() == mx.argmax(b, axis=-1).tolist(), step
            # The per-layer GELU's ulps carried through six layers and the head: measured
            # at most 2.4e-4 of the logits' scale on this random model.
            assert mx.abs(a - b).max().item() <= 1e-3 * mx.abs(b).max().item(), step
    finally:
        lm.release_routes()


def test_a_gemma4_decode_step_runs_each_layer_as_two_primitives(tiny_q8, tmp_path):
    lm = load(tiny_q8)
    try:
        cache = lm.make_cache()
        mx.eval(lm.model(mx.array([[2, 5, 6, 7]]), cache=cache), [c.state for c in cache])
        dot = tmp_path / "step.dot"
        mx.export_to_dot(str(dot), lm.model(mx.array([[8]]), cache=cache))
        text = dot.read_text()
        layers = len(lm.model.layers)
        assert text.count('label ="MnbQkvStep"') == layers  # the shared layers' queries too
        assert text.count('label ="MnbBlockTail"') == layers
        assert text.count('label ="MnbAttention"') == layers
        assert text.count('label ="MnbRope"') == text.count('label ="MnbGatedMlp"') == 0
        mx.eval([c.state for c in cache])
        # A prefill step keeps the library's graph.
        dot2 = tmp_path / "prefill.dot"
        mx.export_to_dot(str(dot2), lm.model(mx.array([list(range(9, 29))]), cache=cache))
        assert 'label ="MnbQkvStep"' not in dot2.read_text()
    finally:
        lm.release_routes()
