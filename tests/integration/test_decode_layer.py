"""`kernels.qkv_step`, `kernels.block_tail` and their routing (`models/layerroute.py`): a
decode step of Gemma 3's decoder layer as two primitives around its cache and attention,
with the bits of the products, norms, RoPE and adds run one by one
(`kernels.quantized_matmul`, `kernels.gated_mlp`, `rowops.rms_norm`, `rowops.rope`), on
every kernel set this CPU has and the portable one."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import mlx.core as mx
import pytest
from decoding import decode_logits  # tests/ is on sys.path
from kernelsets import ISAS, isa_or_skip, needs_kernels
from mlx.utils import tree_flatten

from mlx_nbengine import kernels
from mlx_nbengine.kernels import rowops
from mlx_nbengine.models import layerroute, load
from mlx_nbengine.testing import make_tiny_quantized_model

pytestmark = needs_kernels

K, D = 5 * 32, 64  # model width (groups past the kernels' four at a time), head dim
EPS = 1e-6


def quantized(n: int, *, bits: int, seed: int):
    w = mx.random.normal((n, K), key=mx.random.key(seed))
    return mx.quantize(w, group_size=32, bits=bits)


def one_by_one(x, q, k, v, qn, kn, *, heads, kv_heads, offset, bits, isa, rope, xn=None):
    """The unfused graph of Gemma 3's attention heads on our kernels."""
    B, L, _ = x.shape
    if xn is not None:
        x = rowops.rms_norm(x, xn, EPS, isa=isa)

    def product(m):
        return kernels.quantized_matmul(x, *m, group_size=32, bits=bits, isa=isa)

    qs = product(q).reshape(B, L, heads, -1).transpose(0, 2, 1, 3)
    ks = product(k).reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
    vs = product(v).reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
    qs, ks = rowops.rms_norm(qs, qn, EPS, isa=isa), rowops.rms_norm(ks, kn, EPS, isa=isa)
    qs, ks = (rowops.rope(a, offset=offset, isa=isa, **rope) for a in (qs, ks))
    return qs, ks, vs


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("batch", "length", "offset"),
    [(1, 1, 0), (1, 1, 4000), (3, 1, 17), (3, 1, "rows"), (2, 4, 9), (8, 1, "rows")],
)
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("input_norm", [False, True])
def test_the_fused_heads_have_the_bits_of_the_graph_they_replace(
    isa, bits, batch, length, offset, heads, input_norm
):
    isa_or_skip(isa)
    hq, hkv = heads
    q, k, v = (quantized(n * D, bits=bits, seed=s) for s, n in ((1, hq), (2, hkv), (3, hkv)))
    qn = 1.0 + mx.random.normal((D,), key=mx.random.key(4))
    kn = 1.0 + mx.random.normal((D,), key=mx.random.key(5))
    x = mx.random.normal((batch, length, K), key=mx.random.key(6))
    xn = 1.0 + mx.random.normal((K,), key=mx.random.key(7)) if input_norm else None
    if offset == "rows":
        offset = mx.array([3 + 11 * b for b in range(batch)], dtype=mx.int32)
    rope = dict(dims=D, traditional=False, base=10000.0, scale=1.0)
    got = kernels.qkv_step(
        x, q, k, v, q_norm=qn, k_norm=kn, eps=EPS, heads=hq, kv_heads=hkv,
        rope_dims=D, traditional=False, base=10000.0, scale=1.0, offset=offset,
        group_size=32, bits=bits, isa=isa, x_norm=xn, x_eps=EPS,
    )  # fmt: skip
    want = one_by_one(
        x, q, k, v, qn, kn, heads=hq, kv_heads=hkv, offset=offset, bits=bits, isa=isa, rope=rope,
        xn=xn,
    )  # fmt: skip
    for name, a, b in zip(("queries", "keys", "values"), got, want, strict=True):
        assert a.shape == b.shape == (batch, hq if name == "queries" else hkv, length, D)
        assert mx.array_equal(a, b).item(), f"{name} differ"


@pytest.mark.parametrize("isa", ISAS)
def test_partial_rotation_and_traditional_pairs(isa):
    isa_or_skip(isa)
    q, k, v = (quantized(n * D, bits=8, seed=s) for s, n in ((1, 2), (2, 1), (3, 1)))
    qn = kn = mx.ones((D,))
    x = mx.random.normal((1, 1, K), key=mx.random.key(8))
    rope = dict(dims=D // 2, traditional=True, base=500.0, scale=0.5)
    got = kernels.qkv_step(
        x, q, k, v, q_norm=qn, k_norm=kn, eps=EPS, heads=2, kv_heads=1, rope_dims=D // 2,
        traditional=True, base=500.0, scale=0.5, offset=33, group_size=32, bits=8, isa=isa,
    )  # fmt: skip
    want = one_by_one(
        x, q, k, v, qn, kn, heads=2, kv_heads=1, offset=33, bits=8, isa=isa, rope=rope
    )
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))


def test_bad_shapes_are_refused_in_one_line():
    q, k, v = (quantized(n * D, bits=8, seed=s) for s, n in ((1, 4), (2, 1), (3, 1)))
    ones = mx.ones((D,))
    args = dict(
        q_norm=ones, k_norm=ones, eps=EPS, heads=4, kv_heads=1, rope_dims=D,
        traditional=False, base=1e4, scale=1.0, offset=0, group_size=32, bits=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="1 to 8 rows"):
        kernels.qkv_step(mx.zeros((9, 1, K)), q, k, v, **args)
    with pytest.raises(ValueError, match="key matrix"):
        kernels.qkv_step(mx.zeros((1, 1, K)), q, q, v, **args)
    with pytest.raises(ValueError, match="head dim"):
        kernels.qkv_step(mx.zeros((1, 1, K)), q, k, v, **{**args, "q_norm": mx.ones((D + 1,))})
    with pytest.raises(ValueError, match="input norm"):
        kernels.qkv_step(mx.zeros((1, 1, K)), q, k, v, **{**args, "x_norm": mx.ones((K + 1,))})


KT, F = 256, 3 * 128  # the tail's model and MLP widths: whole groups of 128


def tail_args(*, heads: int, bits: int, group: int):
    def matrix(n, k, seed):
        w = mx.random.normal((n, k), key=mx.random.key(seed)) / 8
        return mx.quantize(w, group_size=group, bits=bits)

    o = matrix(KT, heads * D, 11)
    gate, up, down = matrix(F, KT, 12), matrix(F, KT, 13), matrix(KT, F, 14)
    n1, n2, n3 = (1.0 + mx.random.normal((KT,), key=mx.random.key(s)) / 4 for s in (15, 16, 17))
    return o, gate, up, down, n1, n2, n3


def tail_one_by_one(attn, x, o, gate, up, down, n1, n2, n3, *, bits, group, isa):
    """The unfused graph of Gemma 3's layer after attention, on our kernels."""
    B, _, L, _ = attn.shape
    rows = attn.transpose(0, 2, 1, 3).reshape(B, L, -1)
    r = kernels.quantized_matmul(rows, *o, group_size=group, bits=bits, isa=isa)
    h = x + rowops.rms_norm(r, n1, EPS, isa=isa)
    m = kernels.gated_mlp(
        rowops.rms_norm(h, n2, EPS, isa=isa), gate, up, down, group_size=group, bits=bits,
        activation="gelu_tanh", isa=isa,
    )  # fmt: skip
    return h + rowops.rms_norm(m, n3, EPS, isa=isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (8, 64), (4, 128)])
@pytest.mark.parametrize(("batch", "length", "heads"), [(1, 1, 4), (3, 1, 2), (2, 4, 2), (8, 1, 6)])
def test_the_fused_tail_has_the_bits_of_the_graph_it_replaces(
    isa, bits, group, batch, length, heads
):
    isa_or_skip(isa)
    o, gate, up, down, n1, n2, n3 = tail_args(heads=heads, bits=bits, group=group)
    attn = mx.random.normal((batch, heads, length, D), key=mx.random.key(18))
    x = mx.random.normal((batch, length, KT), key=mx.random.key(19))
    got = kernels.block_tail(
        attn, x, o, gate, up, down, post_attn_norm=n1, pre_ffn_norm=n2, post_ffn_norm=n3,
        eps=EPS, group_size=group, bits=bits, activation="gelu_tanh", isa=isa,
    )  # fmt: skip
    want = tail_one_by_one(attn, x, o, gate, up, down, n1, n2, n3, bits=bits, group=group, isa=isa)
    assert got.shape == want.shape == (batch, length, KT)
    assert mx.array_equal(got, want).item()


def test_the_fused_tail_reads_attention_as_a_view():
    o, gate, up, down, n1, n2, n3 = tail_args(heads=2, bits=8, group=32)
    # The heads of a [B, L, H, D] array seen as [B, H, L, D]: rows apart in memory.
    attn = mx.random.normal((2, 3, 2, D), key=mx.random.key(20)).transpose(0, 2, 1, 3)
    x = mx.random.normal((2, 3, KT), key=mx.random.key(21))
    kw = dict(post_attn_norm=n1, pre_ffn_norm=n2, post_ffn_norm=n3, eps=EPS, group_size=32, bits=8)
    got = kernels.block_tail(attn, x, o, gate, up, down, activation="gelu_tanh", **kw)
    dense = kernels.block_tail(mx.array(attn), x, o, gate, up, down, activation="gelu_tanh", **kw)
    want = tail_one_by_one(
        attn, x, o, gate, up, down, n1, n2, n3, bits=8, group=32, isa=kernels.status().isa
    )
    assert mx.array_equal(got, want).item() and mx.array_equal(dense, want).item()


def test_bad_tails_are_refused_in_one_line():
    o, gate, up, down, n1, n2, n3 = tail_args(heads=2, bits=8, group=32)
    kw = dict(post_attn_norm=n1, pre_ffn_norm=n2, post_ffn_norm=n3, eps=EPS, group_size=32, bits=8)
    attn, x = mx.zeros((1, 2, 1, D)), mx.zeros((1, 1, KT))
    with pytest.raises(ValueError, match="1 to 8 rows"):
        kernels.block_tail(
            mx.zeros((9, 2, 1, D)), mx.zeros((9, 1, KT)), o, gate, up, down,
            activation="gelu_tanh", **kw,
        )  # fmt: skip
    with pytest.raises(ValueError, match="output matrix"):
        kernels.block_tail(mx.zeros((1, 4, 1, D)), x, o, gate, up, down, activation="silu", **kw)
    with pytest.raises(ValueError, match="down matrix"):
        kernels.block_tail(attn, x, o, gate, up, gate, activation="silu", **kw)
    with pytest.raises(ValueError, match="norms' weights"):
        kernels.block_tail(
            attn, x, o, gate, up, down, activation="silu", **{**kw, "pre_ffn_norm": mx.ones((3,))}
        )
    with pytest.raises(ValueError, match="activation"):
        kernels.block_tail(attn, x, o, gate, up, down, activation="relu", **kw)


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory) -> Path:
    return make_tiny_quantized_model(
        "gemma3_text", tmp_path_factory.mktemp("q") / "tiny-q8", bits=8, group_size=32
    )


def test_the_library_layer_and_attention_are_what_we_restate():
    from mlx_lm.models import gemma3_text

    block, attention = layerroute.LAYER.bodies
    assert block.library() is gemma3_text.TransformerBlock.__call__
    assert not block.changed(), "mlx-lm changed the layer"
    assert not attention.changed(), "mlx-lm changed the attention"


@pytest.mark.parametrize("rows", [1, 3])
def test_a_quantized_gemma_decodes_the_same_logits_with_and_without_the_fused_layers(tiny_q8, rows):
    lm = load(tiny_q8)
    assert {"gemma3-decoder-layer", "rows"} <= set(lm.routing.names())
    # Past the tiny model's sliding window (mlx_nbengine.testing): a rotating cache's offsets.
    prompt = list(range(5, 45))
    fused = decode_logits(lm, prompt, rows=rows, steps=30)
    with lm.routing.suspended(layerroute.LAYER):
        unfused = decode_logits(lm, prompt, rows=rows, steps=30)
    for step, (a, b) in enumerate(zip(fused, unfused, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"


def test_a_decode_step_runs_each_layer_as_two_primitives_around_its_attention(tiny_q8, tmp_path):
    lm = load(tiny_q8)
    cache = lm.make_cache()
    mx.eval(lm.model(mx.array([[1, 2, 3]]), cache=cache), [c.state for c in cache])
    dot = tmp_path / "step.dot"
    mx.export_to_dot(str(dot), lm.model(mx.array([[4]]), cache=cache))
    text = dot.read_text()
    layers = len(lm.model.layers)
    assert text.count('label ="MnbQkvStep"') == layers
    assert text.count('label ="MnbBlockTail"') == layers
    assert text.count('label ="MnbAttention"') == layers
    assert text.count('label ="MnbRope"') == text.count('label ="MnbGatedMlp"') == 0
    assert text.count('label ="MnbRmsNorm"') == 1  # the model's final norm
    assert text.count('label ="MnbQuantizedMatVec"') == 1  # the head
    mx.eval([c.state for c in cache])  # the decode step's keys, so the next graph is its own
    # A prefill step keeps the library's graph.
    dot2 = tmp_path / "prefill.dot"
    mx.export_to_dot(str(dot2), lm.model(mx.array([list(range(5, 25))]), cache=cache))
    assert 'label ="MnbQkvStep"' not in dot2.read_text()
    assert 'label ="MnbBlockTail"' not in dot2.read_text()


def test_new_weights_in_a_layer_make_a_new_plan(tiny_q8):
    lm = load(tiny_q8)
    block = lm.model.layers[0]
    cache = lm.make_cache()
    lm.model(mx.array([[1, 2, 3]]), cache=cache)
    first = layerroute.plan_of(block)
    assert first is not None
    block.post_feedforward_layernorm.weight = block.post_feedforward_layernorm.weight + 0.5
    lm.model(mx.array([[4]]), cache=cache)
    second = layerroute.plan_of(block)
    assert second is not first
    assert mx.allclose(second.post_ffn_norm, first.post_ffn_norm + 0.5).item()
    # The plan is no parameter of the layer: saving or updating the model never sees it.
    assert not any("plan" in name for name, _ in tree_flatten(block.parameters()))


def test_a_plan_goes_with_its_model(tiny_q8):
    lm = load(tiny_q8)
    cache = lm.make_cache()
    lm.model(mx.array([[1, 2, 3]]), cache=cache)
    mx.eval(lm.model(mx.array([[4]]), cache=cache))
    assert layerroute.plan_of(lm.model.layers[0]) is not None
    probe = weakref.ref(lm.model.layers[0].self_attn.q_proj.weight)
    del lm, cache
    gc.collect()
    assert probe() is None, "a plan kept an unloaded model's weights alive"
