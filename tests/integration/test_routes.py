"""One mechanism for every route (`models/routes.py`, issue 37): each route checks the library
bodies it restates by one digest, refuses in one stderr line, applies to the engine's own
models only, and what it replaced process-wide is the library's own again once the last
engine holding it closes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from kernelsets import needs_kernels  # tests/ is on sys.path

from mlx_nbengine import Engine
from mlx_nbengine.models import (
    attnroute,
    cpu_math,
    deltaroute,
    fastops,
    layerroute,
    load,
    qroute,
    routes,
)
from mlx_nbengine.models.routes import Body
from mlx_nbengine.testing import make_tiny_quantized_model

ROOT = Path(__file__).resolve().parents[2]
MODULES = (qroute, fastops, attnroute, cpu_math, layerroute, deltaroute)


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory) -> Path:
    # Like the default model on the CPU: Gemma 3, 8-bit groups of 32, its head tied.
    return make_tiny_quantized_model(
        "gemma3_text", tmp_path_factory.mktemp("routes") / "gemma-q8", bits=8, group_size=32
    )


def test_the_digest_of_a_body_ignores_formatting_comments_and_the_docstring():
    written = "def f(self, x):\n    '''Doc.'''\n    # why\n    return g(\n        x, 1\n    )\n"
    assert routes.body_digest(written) == routes.body_digest("return g(x, 1)")
    assert routes.body_digest(written) != routes.body_digest("return g(x, 2)")


def test_every_route_is_registered_and_accepts_the_installed_libraries():
    registered = set(routes.registry())
    declared = {
        *qroute.SWIGLU_MLPS,
        qroute.LINEAR,
        qroute.EMBEDDING_HEAD,
        *fastops.OFFSET_NORMS,
        fastops.ROWS,
        attnroute.ATTENTION,
        *cpu_math.GELU_MLPS,
        layerroute.LAYER,
        deltaroute.DELTA,
        deltaroute.DELTA_VLM,
    }
    assert declared <= registered
    for route in registered:
        assert route.checked_with and route.refusal and route.fallback, route.name
        # Fails when a library update changes a body a route restates: read it, then update
        # the route's Body and its checked_with.
        assert not route.present() or route.refused() is None, route.refused()


# Three engines, quantized Gemma 3 (every route but the SwiGLU MLPs), Llama (the SwiGLU MLP)
# and the hybrid Qwen 3.5 (its gated delta and MLP):
# while open, mx.fast is ours; once both are closed every function and method a route
# replaced is the library's own object again. A process of its own: no other test's model
# may hold a route meanwhile.
CHILD = textwrap.dedent(
    """
    import sys
    import mlx_nbengine
    import mlx.core as mx
    from mlx_nbengine import Engine
    from mlx_nbengine.models import routes, qroute, fastops, attnroute, cpu_math, layerroute

    def replaced():
        out = {}
        for route in routes.registry():
            if not route.present():
                continue
            for body in route.bodies:
                out[body.name] = body.library()
            if isinstance(route, routes.ProcessRoute):
                for name in route.replacements:
                    out[route.namespace.__name__ + "." + name] = getattr(route.namespace, name)
        return out

    before = replaced()
    engines = [Engine.load(path, store=False) for path in sys.argv[1:]]
    models = [engine.model for engine in engines]
    for engine in engines:
        engine.submit([2, 5, 6, 7, 8], max_tokens=4).result(timeout=300)
    used = set().union(*(model.routing.names() for model in models))
    every = {route.name for route in routes.registry() if route.present()}
    qwen = {"swiglu-mlp-qwen2", "swiglu-mlp-qwen3"}
    others = {"offset-norm-gemma", "offset-norm-gemma2", "cpu-gelu-gemma2"}
    vlm = {
        "cpu-gelu-vlm-gemma3",
        "cpu-gelu-vlm-gemma4",
        "gated-delta-vlm-qwen3_5",
        "swiglu-mlp-vlm-qwen3_5",
    }
    assert every - used == qwen | others | vlm, sorted(every - used)
    during = replaced()
    ours = sorted(k for k in before if during[k] is not before[k])
    fast = ["rms_norm", "rope", "scaled_dot_product_attention"]
    want = ["mlx.core.fast." + name for name in fast] + ["mlx_lm.models.gemma4_text.logit_softcap"]
    assert ours == sorted(want), ours
    for engine in engines:
        engine.close()
    after = replaced()
    still_ours = [k for k in before if after[k] is not before[k]]
    assert still_ours == [], still_ours
    import mlx.nn as nn
    assert nn.QuantizedLinear.__call__ is before["mlx.nn.QuantizedLinear.__call__"]
    for model in models:  # the models themselves run the library's classes again
        names = {type(m).__module__ for _, m in model.model.named_modules()}
        assert all(not n.startswith("mlx_nbengine") for n in names), names
    print("library again", len(before))
    """
)


@needs_kernels
def test_after_close_every_function_and_method_a_route_replaced_is_the_librarys_own(
    tiny_q8, tmp_path
):
    llama = make_tiny_quantized_model("llama", tmp_path / "llama-q8", bits=8, group_size=32)
    hybrid = make_tiny_quantized_model("qwen3_5", tmp_path / "qwen3_5-q8", bits=8, group_size=32)
    gemma4 = make_tiny_quantized_model("gemma4_text", tmp_path / "gemma4-q8", bits=8, group_size=32)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_q8), str(llama), str(hybrid), str(gemma4)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0 and "library again" in done.stdout, done.stderr[-3000:]


def greedy(engine: Engine) -> list[int]:
    return engine.submit([2, 5, 6, 7, 8, 9], max_tokens=8).result(timeout=120).tokens


@needs_kernels
def test_with_two_engines_open_closing_one_leaves_the_other_routed(tiny_q8):
    first = Engine.load(tiny_q8, store=False)
    second = Engine.load(tiny_q8, store=False)
    try:
        model = second.model
        want = greedy(second)
        first.close()
        assert mx.fast.rms_norm is not fastops.ROWS.library["rms_norm"]
        attention = attnroute.ATTENTION.library["scaled_dot_product_attention"]
        assert mx.fast.scaled_dot_product_attention is not attention
        assert {"rows", "attention", "gemma3-decoder-layer"} <= set(model.routing.names())
        assert all(layerroute.LAYER.routes(layer) for layer in model.model.layers)
        assert greedy(second) == want
    finally:
        first.close()
        second.close()
    assert model.routing.names() == ()
    assert not any(layerroute.LAYER.routes(layer) for layer in model.model.layers)


def refusals(capsys, words: str) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if words in line]


@needs_kernels
def test_a_route_whose_body_changed_refuses_in_one_line_and_the_model_runs_the_librarys_code(
    tiny_q8, capsys, monkeypatch
):
    from mlx_lm.models import gemma3_text

    block, attention = layerroute.LAYER.bodies
    changed = Body(block.module, block.qualname, "return None")
    monkeypatch.setattr(layerroute.LAYER, "bodies", (changed, attention))
    capsys.readouterr()
    lm = load(tiny_q8)
    [line] = refusals(capsys, "decoder layer")
    assert line == (
        "mlx_nbengine: Gemma 3's decoder layer is not fused: "
        "mlx_lm.models.gemma3_text.TransformerBlock.__call__ is not the body restated "
        "(route gemma3-decoder-layer, read from mlx-lm 0.32.2); its decode steps run "
        "mlx-lm's unfused layer (about 16 graph nodes a layer)"
    )
    assert all(type(layer) is gemma3_text.TransformerBlock for layer in lm.model.layers)
    assert "layer-" not in lm.variant and "gemma3-decoder-layer" not in lm.routing.names()
    cache = lm.make_cache()
    mx.eval(lm.model(mx.array([[2, 5, 6]]), cache=cache))
    step = lm.model(mx.array([[7]]), cache=cache)  # a decode step: the library's layer
    assert step.shape[:2] == (1, 1) and layerroute.plan_of(lm.model.layers[0]) is None
    lm.release_routes()
    load(tiny_q8).release_routes()
    assert refusals(capsys, "decoder layer") == []  # once


@needs_kernels
def test_a_process_route_whose_body_changed_is_never_held(tiny_q8, capsys, monkeypatch):
    [body] = attnroute.ATTENTION.bodies
    changed = Body(body.module, body.qualname, "return other(queries)")
    monkeypatch.setattr(attnroute.ATTENTION, "bodies", (changed,))
    capsys.readouterr()
    lm = load(tiny_q8)
    [line] = refusals(capsys, "attention kernel")
    assert line.startswith(
        "mlx_nbengine: the CPU attention kernel is not used: "
        "mlx_lm.models.base.scaled_dot_product_attention is not the body restated"
    )
    assert "attention" not in lm.routing.names() and "attn-" not in lm.variant
    lm.release_routes()
