"""A slow path is never silent (issue 36): a script whose MLX was imported before
mlx_nbengine (every float32 product on the reference BLAS) hears it once from `Engine.load`,
and each route that refuses a library body it does not recognise says in one stderr line what
runs instead: the fused SwiGLU MLP (`qroute`), the fused Gemma 3 layer (`layerroute`), the CPU
GELU (`cpu_math`), Gemma's norms (`fastops`).

The BLAS case runs real Python processes on a tiny model; the routes' cases load tiny models
here with the restated body monkeypatched so that the library's no longer matches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kernelsets import needs_kernels  # tests/ is on sys.path

from mlx_nbengine import _blas
from mlx_nbengine.models import cpu_math, fastops, layerroute, load, qroute
from mlx_nbengine.models.routes import Body
from mlx_nbengine.testing import make_tiny_model, make_tiny_quantized_model

ROOT = Path(__file__).resolve().parents[2]
BLAS_LINE = "mlx_nbengine: mlx.core was imported before mlx_nbengine"

# Two loads in one process: the line comes once.
CHILD = textwrap.dedent(
    """
    import sys
    if sys.argv[2] == "mlx-first":
        import mlx.core
    from mlx_nbengine.engine import Engine

    for _ in range(2):
        with Engine.load(sys.argv[1], store=False) as engine:
            engine.submit([5, 6, 7, 8], max_tokens=2).result(timeout=300)
    print("loaded twice")
    """
)

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the BLAS binding is Linux's"
)


def run_child(model: Path, order: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLX_NBENGINE_BLAS"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), order],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0 and "loaded twice" in done.stdout, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("silent") / "llama")


@linux
def test_a_script_that_imports_mlx_first_hears_it_once_from_engine_load(llama):
    lines = [
        line for line in run_child(llama, "mlx-first").stderr.splitlines() if BLAS_LINE in line
    ]
    assert len(lines) == 1, lines
    [line] = lines
    assert "reference BLAS, about 40x slower" in line
    assert "import mlx_nbengine before mlx" in line and "restart" in line


@linux
def test_a_script_that_imports_mlx_nbengine_first_hears_nothing_of_it(llama):
    assert BLAS_LINE not in run_child(llama, "mlx_nbengine-first").stderr


def test_the_line_is_for_mlx_imported_first_only(monkeypatch):
    late = _blas.BlasStatus(False, "mlx.core was imported first; its BLAS is already bound")
    monkeypatch.setattr(_blas, "_status", late)
    monkeypatch.setattr(_blas, "_reference_said", False)
    assert _blas.reference_blas_line().startswith(BLAS_LINE)
    assert _blas.say_reference_blas(claimed=True) is False  # the notebook shows its own hint
    assert _blas.say_reference_blas() is False  # and nothing more is said
    chosen = _blas.BlasStatus(False, "MLX_NBENGINE_BLAS asks for the reference BLAS")
    monkeypatch.setattr(_blas, "_status", chosen)
    assert _blas.reference_blas_line() is None  # the user's own choice


def stderr_lines(capsys, words: str) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if words in line]


def changed(route, source: str = "return self.down_proj(other(x))") -> tuple[Body, ...]:
    """`route`'s bodies with the first one restated as `source` (the library's no longer
    matches it)."""
    first, *rest = route.bodies
    return (Body(first.module, first.qualname, source), *rest)


@needs_kernels
def test_the_swiglu_route_says_what_it_falls_back_to(tmp_path, capsys, monkeypatch):
    for route in qroute.SWIGLU_MLPS:
        monkeypatch.setattr(route, "bodies", changed(route))
    capsys.readouterr()
    lm = load(make_tiny_quantized_model("llama", tmp_path / "q4"))
    [line] = stderr_lines(capsys, "SwiGLU")
    assert line == (
        "mlx_nbengine: the fused SwiGLU MLP is not used for llama: "
        "mlx_lm.models.llama.MLP.__call__ is not the body restated (route swiglu-mlp-llama, "
        "read from mlx 0.32.4, mlx-lm 0.32.2); its decode steps run the library's MLP "
        "(three products, not one)"
    )
    assert "quantized-linear" in lm.routing.names()  # the projections still run on the kernels
    mlp = lm.model.layers[0].mlp
    assert type(mlp) is qroute.SWIGLU_MLPS[0].library_class()  # the library's own MLP
    load(make_tiny_quantized_model("llama", tmp_path / "q4-again", seed=1))
    assert stderr_lines(capsys, "SwiGLU") == []  # once


@needs_kernels
def test_the_layer_route_says_what_it_falls_back_to(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(layerroute.LAYER, "bodies", changed(layerroute.LAYER, "return x"))
    capsys.readouterr()
    lm = load(tiny_model_dir("gemma3_text"))
    [line] = stderr_lines(capsys, "decoder layer")
    assert line == (
        "mlx_nbengine: Gemma 3's decoder layer is not fused: "
        "mlx_lm.models.gemma3_text.TransformerBlock.__call__ is not the body restated "
        "(route gemma3-decoder-layer, read from mlx-lm 0.32.2); its decode steps run mlx-lm's "
        "unfused layer (about 16 graph nodes a layer)"
    )
    assert "layer-" not in (lm.variant or "")
    assert not any(layerroute.LAYER.routes(layer) for layer in lm.model.layers)
    load(tiny_model_dir("gemma3_text"))
    assert stderr_lines(capsys, "decoder layer") == []  # once


def test_the_cpu_gelu_says_what_it_falls_back_to(tiny_model_dir, capsys, monkeypatch):
    for route in cpu_math.GELU_MLPS:
        monkeypatch.setattr(route, "bodies", changed(route))
    capsys.readouterr()
    lm = load(tiny_model_dir("gemma3_text"))
    [line] = stderr_lines(capsys, "CPU GELU")
    assert line == (
        "mlx_nbengine: the CPU GELU is not used for mlx_lm.models.gemma3_text.MLP: "
        "mlx_lm.models.gemma3_text.MLP.__call__ is not the body restated "
        "(route cpu-gelu-gemma3_text, read from mlx-lm 0.32.2, mlx-vlm 0.7.10); it runs "
        "the library's nn.gelu_approx (about 3.5x slower on the CPU)"
    )
    assert all(type(layer.mlp).__name__ == "MLP" for layer in lm.model.layers)
    assert "cpu-gelu" not in (lm.variant or "")
    load(tiny_model_dir("gemma3_text"))
    assert stderr_lines(capsys, "CPU GELU") == []  # once per class


@needs_kernels
def test_gemma_norms_say_what_they_fall_back_to(tiny_model_dir, capsys, monkeypatch):
    for route in fastops.OFFSET_NORMS:
        monkeypatch.setattr(route, "bodies", changed(route, "return other(x)"))
    capsys.readouterr()
    lm = load(tiny_model_dir("gemma3_text"))
    [line] = stderr_lines(capsys, "Gemma's norms")
    assert line == (
        "mlx_nbengine: Gemma's norms keep their library call for gemma3_text: "
        "mlx_lm.models.gemma3_text.RMSNorm.__call__ is not the body restated "
        "(route offset-norm-gemma3_text, read from mlx 0.32.4, mlx-lm 0.32.2); "
        "they add 1 to their weight on every call (two graph nodes a norm more), and Gemma 3's "
        "decoder layer is not fused"
    )
    assert "rows" in lm.routing.names()  # mx.fast.rms_norm and rope still run on the kernels
    assert fastops.offset_norm_weight(lm.model.layers[0].input_layernorm) is None
