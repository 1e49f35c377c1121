"""Qwen 3.5's linear attention on our CPU kernels (issue 35): the gated delta rule
(`kernels.delta.gated_delta`) against mlx-lm's ``gated_delta_ops``, the short convolution
(`kernels.delta.conv_silu`) against MLX's ``Conv1d`` and ``silu``, on every kernel set, and
the route (`models.deltaroute`) on tiny hybrid models.

The bounds: the primitive rearranges the recurrence (y = g (S q) + delta (k . q), one pass
over the state per token) and sums in another order than the library, so results differ by
float32 rounding that grows with the tokens a state has seen. Measured on these shapes and on
16 heads of 128 over 300 tokens (random unit keys, gates in [0.5, 1]), every kernel set, with
and without masks: at most 4.2e-7 absolute on y and 1.2e-7 on the state, on values up to
about 1; the bounds below are about 20x that. The convolution differs by silu's exp (our
polynomial) and the order of its four products: at most 1.9e-6 absolute on values up to 16.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from kernelsets import ISAS, isa_or_skip, needs_kernels  # tests/ is on sys.path
from mlx_lm.models.gated_delta import gated_delta_ops
from restoring import restored_and_cold  # tests/ is on sys.path

from mlx_nbengine import Engine, kernels
from mlx_nbengine.kernels import delta
from mlx_nbengine.models import deltaroute, load, qroute
from mlx_nbengine.testing import (
    make_tiny_model,
    make_tiny_quantized_model,
    make_tiny_qwen3_5_vlm,
)

pytestmark = needs_kernels

Y_BOUND = 1e-5
STATE_BOUND = 2e-6
CONV_BOUND = 1.2e-5


def inputs(b, t, hk, hv, dk, dv, *, seed=0, state=True):
    keys = mx.random.split(mx.random.key(seed), 7)
    q = mx.random.normal((b, t, hk, dk), key=keys[0]) * dk**-0.5
    k = mx.random.normal((b, t, hk, dk), key=keys[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((b, t, hv, dv), key=keys[2])
    g = mx.random.uniform(0.5, 1.0, (b, t, hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (b, t, hv), key=keys[4])
    s = mx.random.normal((b, hv, dv, dk), key=keys[5]) * 0.1 if state else mx.zeros((b, hv, dv, dk))
    mask = mx.random.uniform(shape=(b, t), key=keys[6]) > 0.25
    return q, k, v, g, beta, s, mask


def worst(got, want) -> float:
    return mx.abs(got - want).max().item()


SHAPES = (  # (B, T, Hk, Hv, Dk, Dv)
    (1, 1, 2, 2, 128, 128),  # a decode step, heads of the real shape (the state as laid out)
    (4, 3, 2, 4, 24, 40),  # a short step of four rows: the same path, odd widths
    (2, 37, 2, 4, 128, 128),  # grouped heads (Hv = 2 Hk), two batch rows
    (1, 300, 1, 2, 16, 16),  # the tiny family's heads: one block of rows, padded
    (1, 65, 2, 2, 24, 48),  # rows in 1.5 blocks, an odd key width (its tail)
)


@pytest.mark.parametrize("isa", ISAS)
def test_gated_delta_matches_the_librarys_loop(isa):
    isa_or_skip(isa)
    for shape in SHAPES:
        q, k, v, g, beta, s, _ = inputs(*shape)
        y, state = delta.gated_delta(q, k, v, g, beta, s, isa=isa)
        want_y, want_state = gated_delta_ops(q, k, v, g, beta, s)
        assert y.shape == want_y.shape and state.shape == want_state.shape, shape
        assert worst(y, want_y) <= Y_BOUND, shape
        assert worst(state, want_state) <= STATE_BOUND, shape


@pytest.mark.parametrize("isa", ISAS)
def test_a_masked_token_gives_its_y_and_leaves_the_state_as_it_was(isa):
    isa_or_skip(isa)
    for t in (40, 3):  # a prefill step, a short step
        q, k, v, g, beta, s, mask = inputs(2, t, 2, 2, 32, 32, seed=3)
        mask[:, -1] = False  # the last token a pad too
        y, state = delta.gated_delta(q, k, v, g, beta, s, mask, isa=isa)
        want_y, want_state = gated_delta_ops(q, k, v, g, beta, s, mask)
        assert worst(y, want_y) <= Y_BOUND and worst(state, want_state) <= STATE_BOUND
        none = mx.zeros((2, t), dtype=mx.bool_)
        _, kept = delta.gated_delta(q, k, v, g, beta, s, none, isa=isa)
        assert mx.array_equal(kept, s).item()  # every token a pad: the state untouched


@pytest.mark.parametrize("isa", ISAS)
def test_a_state_carried_between_steps_is_the_state_of_one_long_step(isa):
    # A state restored from a record (or a checkpoint) continues as if never stopped.
    isa_or_skip(isa)
    q, k, v, g, beta, s, _ = inputs(1, 50, 2, 2, 64, 64, seed=5, state=False)
    y, whole = delta.gated_delta(q, k, v, g, beta, s, isa=isa)
    cut = 23
    first = [a[:, :cut] for a in (q, k, v, g, beta)]
    rest = [a[:, cut:] for a in (q, k, v, g, beta)]
    y1, mid = delta.gated_delta(*first, s, isa=isa)
    y2, end = delta.gated_delta(*rest, mx.array(mid.tolist()), isa=isa)
    assert mx.array_equal(mx.concatenate([y1, y2], axis=1), y).item()
    assert mx.array_equal(end, whole).item()


@pytest.mark.parametrize("isa", ISAS)
def test_the_states_tapped_inside_a_step_are_those_of_steps_ending_there(isa):
    # A long prefill step's block boundaries get their states (deltaroute.tapping).
    isa_or_skip(isa)
    q, k, v, g, beta, s, mask = inputs(1, 70, 2, 4, 32, 48, seed=9)
    y, whole, tapped = delta.gated_delta(q, k, v, g, beta, s, mask, taps=(8, 32, 64, 70), isa=isa)
    assert tapped.shape == (4, *s.shape)
    for i, n in enumerate((8, 32, 64, 70)):
        part = [a[:, :n] for a in (q, k, v, g, beta)]
        _, state = delta.gated_delta(*part, s, mask[:, :n], isa=isa)
        assert mx.array_equal(tapped[i], state).item(), n
    assert mx.array_equal(tapped[-1], whole).item()
    with pytest.raises(ValueError, match="taps must ascend within 1..T"):
        delta.gated_delta(q, k, v, g, beta, s, taps=(32, 31), isa=isa)


@pytest.mark.parametrize("isa", ISAS)
def test_every_thread_count_gives_the_same_bits(isa):
    isa_or_skip(isa)
    q, k, v, g, beta, s, _ = inputs(2, 9, 2, 4, 64, 64, seed=7)
    one = delta.gated_delta(q, k, v, g, beta, s, isa=isa, threads=1)
    for threads in (2, 3):
        many = delta.gated_delta(q, k, v, g, beta, s, isa=isa, threads=threads)
        assert all(mx.array_equal(a, b).item() for a, b in zip(one, many, strict=True))


def test_bad_shapes_are_refused_in_one_line():
    q, k, v, g, beta, s, _ = inputs(1, 3, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="g and beta must be"):
        delta.gated_delta(q, k, v, g[..., None] * mx.ones(16), beta, s)
    with pytest.raises(ValueError, match="must be float32"):
        delta.gated_delta(q.astype(mx.bfloat16), k, v, g, beta, s)
    with pytest.raises(ValueError, match="a multiple of Hk"):
        delta.gated_delta(q, k, mx.zeros((1, 3, 3, 16)), mx.zeros((1, 3, 3)), beta, s)


@pytest.mark.parametrize("isa", ISAS)
def test_conv_silu_matches_mlxs_grouped_convolution_and_silu(isa):
    isa_or_skip(isa)
    width = 4
    for b, s, c in ((1, 1, 96), (2, 37, 200), (1, 256, 6144)):  # a decode step, prefill steps
        keys = mx.random.split(mx.random.key(11), 2)
        x = mx.random.normal((b, s + width - 1, c), key=keys[0]) * 2
        conv = nn.Conv1d(c, c, width, groups=c, bias=False, padding=0)
        conv.weight = mx.random.normal((c, width, 1), key=keys[1]) * 0.5
        got = delta.conv_silu(x, conv.weight, isa=isa)
        assert worst(got, nn.silu(conv(x))) <= CONV_BOUND, (b, s, c)
        # A transposed (strided) x reads the same values.
        strided = mx.swapaxes(mx.array(mx.swapaxes(x, 1, 2).tolist()), 1, 2)
        assert mx.array_equal(delta.conv_silu(strided, conv.weight, isa=isa), got).item()


def greedy(lm, prompt: list[int], n: int = 24) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), lm.model, max_tokens=n)
    return [int(token) for (token, _), _ in zip(steps, range(n), strict=False)]


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q8"])
def test_a_tiny_hybrid_decodes_the_library_s_greedy_tokens(tmp_path, quantized):
    if quantized:
        path = make_tiny_quantized_model("qwen3_5", tmp_path / "q8", bits=8, group_size=32)
    else:
        path = make_tiny_model("qwen3_5", tmp_path / "f32")
    lm = load(path)
    try:
        assert "gated-delta-qwen3_5" in lm.routing.names()
        assert f"delta-{kernels.status().isa}-" in lm.variant
        layers = [m for _, m in lm.model.named_modules() if deltaroute.DELTA.routes(m)]
        assert len(layers) == 2  # the tiny family's two linear-attention layers
        if quantized:
            assert "swiglu-mlp-qwen3_next" in lm.routing.names()
        prompt = [2, *range(5, 300)]  # a 296-token prefill step, then decode steps
        ours = greedy(lm, prompt)
        with lm.routing.suspended(deltaroute.DELTA, *qroute.SWIGLU_MLPS):
            library = greedy(lm, prompt)
        assert ours == library
    finally:
        lm.release_routes()
    assert not any(deltaroute.DELTA.routes(m) for _, m in lm.model.named_modules())


@pytest.mark.parametrize(
    ("family", "route"),
    [("qwen3_5", "gated-delta-qwen3_5"), ("qwen3_5_vl", "gated-delta-vlm-qwen3_5")],
    ids=["text", "vision"],
)
def test_the_engine_restores_an_edited_hybrid_prompt_to_a_cold_runs_tokens(tmp_path, family, route):
    # The 700-token prompt is read in one step: its blocks' states are taken inside it (the
    # vision checkpoint's mlx-vlm layers too).
    path = make_tiny_model(family, tmp_path / "m")
    prompt = [2, *[5 + (i * 7) % 400 for i in range(700)]]
    edited = [*prompt[:600], 9, *prompt[601:]]
    with Engine.load(path, store=False) as engine:
        assert route in engine.model.routing.names()
        assert engine.internals.takes_states_inside_steps
    warm, cold = restored_and_cold(path, tmp_path, prompt, edited)
    # Two blocks from disk, the second's recurrent state taken inside the prompt's one step.
    assert warm.report.restore_source == "disk"
    assert [b.source for b in warm.report.blocks[:3]] == ["disk", "disk", "computed"]
    assert warm.tokens == cold.tokens


@contextlib.contextmanager
def routed_delta_layer(tmp_path):
    """A tiny qwen3_5's first routed gated-delta layer (4 value heads of 16), its routes
    released after."""
    lm = load(make_tiny_model("qwen3_5", tmp_path / "m"))
    try:
        yield next(m for _, m in lm.model.named_modules() if deltaroute.DELTA.routes(m))
    finally:
        lm.release_routes()


def step_inputs(layer, rows: int, seed: int):
    """A decode step's x, conv state and state for `rows` batch rows of `layer`."""
    keys = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((rows, 1, 64), key=keys[0])
    keep = layer.conv_kernel_size - 1
    conv = mx.random.normal((rows, keep, layer.conv_dim), key=keys[1])
    state = mx.random.normal((rows, 4, 16, 16), key=keys[2]) * 0.1
    return x, conv, state


def cache_of(conv, state):
    from mlx_lm.models.cache import ArraysCache

    cache = ArraysCache(2)
    cache[0], cache[1] = conv, state
    return cache


@pytest.mark.parametrize("isa", ISAS)
def test_a_fused_decode_step_matches_the_librarys_layer(isa, tmp_path):
    # kernels.delta.delta_step: the convolution, norms, gate, recurrence and output norm of a
    # decode step in one primitive; its layer output, conv state and state against mlx-lm's
    # layer, one and three batch rows. Measured: at most 2.4e-7 on outputs up to about 2.
    isa_or_skip(isa)
    with routed_delta_layer(tmp_path) as layer:
        for rows in (1, 3):
            x, conv, state = step_inputs(layer, rows, seed=rows)
            ours, theirs = cache_of(conv, state), cache_of(conv, state)
            got = delta_step_of(layer, x, ours, isa)
            want = deltaroute._library_call(layer, x, None, theirs)
            assert worst(got, want) <= Y_BOUND
            assert mx.array_equal(ours[0], theirs[0]).item()
            assert worst(ours[1], theirs[1]) <= STATE_BOUND


@pytest.mark.parametrize("isa", ISAS)
def test_a_masked_decode_step_matches_the_librarys_masked_layer(isa, tmp_path):
    # A batched cache's left padding makes a row mask even for a decode step. delta_step takes
    # it: a masked row's input counts as zeros (its conv state still shifts) and its state is
    # kept, as the library's masked token; unmasked rows are the unmasked step's.
    isa_or_skip(isa)
    with routed_delta_layer(tmp_path) as layer:
        x, conv, state = step_inputs(layer, 3, seed=7)
        mask = mx.array([[True], [False], [True]])
        ours, theirs = cache_of(conv, state), cache_of(conv, state)
        got = delta_step_of(layer, x, ours, isa, mask=mask)
        want = deltaroute._library_call(layer, x, mask, theirs)
        assert worst(got, want) <= Y_BOUND
        assert mx.array_equal(ours[0], theirs[0]).item()
        assert worst(ours[1], theirs[1]) <= STATE_BOUND
        assert mx.array_equal(ours[1][1], state[1]).item()  # the masked row's state, kept
        plain = cache_of(conv, state)
        unmasked = delta_step_of(layer, x, plain, isa)
        assert mx.array_equal(got[0::2], unmasked[0::2]).item()
        assert mx.array_equal(ours[1][0::2], plain[1][0::2]).item()
        for bad in (mask.astype(mx.float32), mx.array([[True, False]] * 3)):
            with pytest.raises(ValueError, match=r"^delta_step: mask must be bool \[B, 1\]$"):
                delta_step_of(layer, x, cache_of(conv, state), isa, mask=bad)


def test_a_left_padded_decode_step_takes_the_fused_step(tmp_path, monkeypatch):
    # The engine's batched decode (ArraysCache with left padding: make_mask gives a [B, 1]
    # mask) goes to _decode_step, not the general path; a longer mask does not.
    with routed_delta_layer(tmp_path) as layer:
        fused = []
        real = deltaroute._decode_step
        monkeypatch.setattr(deltaroute, "_decode_step", lambda *a: fused.append(1) or real(*a))
        x, conv, state = step_inputs(layer, 2, seed=3)
        cache = cache_of(conv, state)
        cache.left_padding = mx.array([0, -2])
        layer(x, cache.make_mask(1), cache)
        assert fused == [1]
        cache = cache_of(conv, state)
        layer(mx.concatenate([x, x], axis=1), mx.ones((2, 2), dtype=mx.bool_), cache)
        assert fused == [1]


@pytest.mark.parametrize("isa", ISAS)
def test_a_decode_steps_heads_split_over_threads_give_the_same_bits(isa, tmp_path):
    # One sequence's heads split over the step's threads (a row's state is read by every
    # core), and rows and heads split together: the same output, conv state and state bits as
    # one thread, whatever the split.
    isa_or_skip(isa)
    with routed_delta_layer(tmp_path) as layer:
        for rows in (1, 2, 3):
            x, conv, state = step_inputs(layer, rows, seed=10 + rows)
            results = []
            for threads in (1, 2, 3, 5):
                cache = cache_of(conv, state)
                out = delta_step_of(layer, x, cache, isa, threads=threads)
                mx.eval(out, cache[0], cache[1])
                results.append((threads, out, cache[0], cache[1]))
            for threads, *arrays in results[1:]:
                for got, want in zip(arrays, results[0][1:], strict=True):
                    assert mx.array_equal(got, want).item(), (rows, threads)


def delta_step_of(layer, x, cache, isa, threads=None, mask=None):
    out, cache[0], cache[1] = delta.delta_step(
        layer.in_proj_qkv(x),
        cache[0],
        layer.conv1d.weight,
        layer.in_proj_a(x),
        layer.in_proj_b(x),
        layer.A_log,
        layer.dt_bias,
        cache[1],
        layer.in_proj_z(x).reshape(x.shape[0], 1, layer.num_v_heads, layer.head_v_dim),
        layer.norm.weight,
        heads_k=layer.num_k_heads,
        key_dim=layer.head_k_dim,
        value_dim=layer.head_v_dim,
        norm_eps=layer.norm.eps,
        mask=mask,
        isa=isa,
        threads=threads,
    )
    return layer.out_proj(out)


# --- mlx-vlm's Qwen 3.5 layer (the published checkpoints carry a vision tower) -------------


@contextlib.contextmanager
def routed_vlm(tmp_path):
    """A tiny Qwen 3.5 vision model (mlx-vlm's classes) and its first routed gated-delta layer
    (2 key and 4 value heads of 16), its routes released after."""
    lm = load(make_tiny_qwen3_5_vlm(tmp_path / "vlm"))
    try:
        yield lm, next(m for _, m in lm.model.named_modules() if deltaroute.DELTA_VLM.routes(m))
    finally:
        lm.release_routes()


def vlm_cache_of(conv, state):
    from mlx_vlm.models.cache import ArraysCache

    cache = ArraysCache(2)
    cache[0], cache[1] = conv, state
    return cache


def test_mlx_vlms_layer_on_our_primitive_matches_its_sequential_loop(tmp_path, monkeypatch):
    # Prefill steps (fresh and from a restored state, two rows with a pad mask) and decode
    # steps (one and three rows, with a row mask) of the routed layer against mlx-vlm's own,
    # whose prefill on the CPU is a chunked scan: here it runs its sequential loop
    # (gated_delta_ops), which our primitive restates, so the bounds are the loop's.
    from mlx_vlm.models.qwen3_5 import gated_delta as vlm_delta

    monkeypatch.setattr(vlm_delta, "gated_delta_chunked", vlm_delta.gated_delta_ops)
    fused = []
    real = deltaroute._decode_step
    monkeypatch.setattr(deltaroute, "_decode_step", lambda *a: fused.append(1) or real(*a))
    with routed_vlm(tmp_path) as (_, layer):
        keep = layer.conv_kernel_size - 1
        cases = (  # rows, tokens, restored, mask
            (1, 37, False, None),
            (2, 37, True, mx.array([[True] * 37, [False] * 5 + [True] * 32])),
            (1, 1, True, None),
            (3, 1, True, mx.array([[True], [False], [True]])),
        )
        for i, (rows, tokens, restored, mask) in enumerate(cases):
            keys = mx.random.split(mx.random.key(20 + i), 3)
            x = mx.random.normal((rows, tokens, layer.hidden_size), key=keys[0])
            conv = mx.random.normal((rows, keep, layer.conv_dim), key=keys[1]) if restored else None
            shape = (rows, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim)
            state = mx.random.normal(shape, key=keys[2]) * 0.1 if restored else None
            ours, theirs = vlm_cache_of(conv, state), vlm_cache_of(conv, state)
            got = layer(x, mask, ours)
            want = deltaroute.DELTA_VLM.library_class().__call__(layer, x, mask, theirs)
            assert worst(got, want) <= Y_BOUND, i
            assert mx.array_equal(ours[0], theirs[0]).item(), i
            assert worst(ours[1], theirs[1]) <= STATE_BOUND, i
    assert fused == [1, 1]  # both decode steps took the one-node step


def test_a_tiny_qwen3_5_vlm_decodes_the_librarys_greedy_tokens(tmp_path):
    # Through mlx-vlm's language model: a 296-token prefill step, then decode steps, against
    # the library's layer (its chunked scan, then its per-token loop).
    def greedy_vlm(lm, prompt, n=24):
        cache = lm.make_cache()
        out = []
        logits = lm.language_model(mx.array(prompt)[None], cache=cache).logits
        for _ in range(n):
            out.append(int(mx.argmax(logits[0, -1]).item()))
            logits = lm.language_model(mx.array([[out[-1]]]), cache=cache).logits
        return out

    with routed_vlm(tmp_path) as (lm, _):
        assert "gated-delta-vlm-qwen3_5" in lm.routing.names()
        assert f"delta-{kernels.status().isa}-" in lm.variant
        assert sum(deltaroute.DELTA_VLM.routes(m) for _, m in lm.model.named_modules()) == 3
        prompt = [2, *range(5, 300)]
        ours = greedy_vlm(lm, prompt)
        with lm.routing.suspended(deltaroute.DELTA_VLM):
            assert greedy_vlm(lm, prompt) == ours
    assert not any(deltaroute.DELTA_VLM.routes(m) for _, m in lm.model.named_modules())


def test_a_text_model_never_imports_mlx_vlm_for_a_route(tmp_path):
    # Routes of mlx-vlm's classes are looked at only once mlx-vlm's model module is imported
    # (a vision model loaded): importing it for a text model would cost seconds.
    import subprocess
    import sys

    path = make_tiny_model("qwen3_5", tmp_path / "m")
    code = (
        "import sys, mlx_nbengine\n"
        "from mlx_nbengine.models import load\n"
        f"lm = load({str(path)!r})\n"
        "assert 'gated-delta-qwen3_5' in lm.routing.names(), lm.routing.names()\n"
        "print(sorted(m for m in sys.modules if m.startswith('mlx_vlm')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
