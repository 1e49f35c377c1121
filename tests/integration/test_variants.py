"""The fingerprint's variants are digests of the sources that decide the bits, not numbers a
person bumps: a change to a route's module or to a kernel source it calls changes its variant,
every kernel source belongs to some route, and the fused decoder layer (`layerroute`) is named
too (issue 36).
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest
from kernelsets import needs_kernels  # tests/ is on sys.path

import mlx_nbengine.models as models_package
from mlx_nbengine import kernels
from mlx_nbengine.kernels import build, digest
from mlx_nbengine.models import (
    attnroute,
    cpu_math,
    fastops,
    fingerprint_directory,
    layerroute,
    load,
    qroute,
)


def _route_modules() -> dict:
    """Every module of the models package that names the sources deciding its bits: found,
    not listed, so a new route cannot be left out of these tests."""
    found = {}
    for info in pkgutil.iter_modules(models_package.__path__):
        module = importlib.import_module(f"mlx_nbengine.models.{info.name}")
        if hasattr(module, "VARIANT_SOURCES"):
            found[info.name] = module
    return found


ROUTES = _route_modules()


def changed(texts: list[tuple[str, bytes]], path: str) -> list[tuple[str, bytes]]:
    """`texts` with one character of `path`'s text changed (an operation: `*` for `+`,
    else a character appended)."""
    out = []
    for name, text in texts:
        if name == path:
            text = text.replace(b"+", b"*", 1) if b"+" in text else text + b" "
        out.append((name, text))
    return out


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_variant_changes_when_any_source_that_decides_its_bits_changes(route):
    sources = ROUTES[route].VARIANT_SOURCES
    assert f"models/{route}.py" in sources  # the route's own module, first of all
    texts = digest.read_sources(sources)
    assert all(not text.startswith(b"<unreadable") for _, text in texts)
    base = digest.digest(texts)
    assert base == digest.of_files(sources)
    assert re.fullmatch(f"[0-9a-f]{{{digest.DIGEST_CHARS}}}", base)
    for path in sources:  # the module, the kernels' Python face, each C++ source it calls
        assert digest.digest(changed(texts, path)) != base, path


def test_every_kernel_source_decides_some_route():
    # A new kernel source no route names could change bits without a variant saying so.
    named = set().union(*(module.VARIANT_SOURCES for module in ROUTES.values()))
    assert set(digest.kernel_source(*build.SOURCES)) <= named
    assert digest.kernel_sources_digest() == digest.of_files(digest.kernel_source(*build.SOURCES))


def test_the_routes_keep_no_version_constants():
    # The digests replace them: a constant a person must remember to bump is what went wrong.
    for module in (*ROUTES.values(), kernels):
        constants = [
            name for name in vars(module) if re.fullmatch(r"[A-Z_]*(VERSION|VARIANT)", name)
        ]
        assert constants == [], module.__name__


@needs_kernels
def test_each_installed_route_names_its_digest_in_the_fingerprint(tiny_model_dir):
    path = tiny_model_dir("gemma3_text")
    lm = load(path)  # float32 on the CPU: cpu_math's GELU, attention, norms and RoPE, the layer
    assert "gemma3-decoder-layer" in lm.routing.names()
    isa = kernels.status().isa
    expected = [
        f"cpu-gelu-r44-{digest.of_files(cpu_math.VARIANT_SOURCES)}",
        f"attn-{kernels.attention_isa()}-{digest.of_files(attnroute.VARIANT_SOURCES)}",
        f"rows-{isa}-{digest.of_files(fastops.VARIANT_SOURCES)}",
        f"layer-{digest.of_files(layerroute.VARIANT_SOURCES)}",
    ]
    assert lm.variant == "+".join(expected)
    assert lm.fingerprint == fingerprint_directory(path, dtype="float32", variant=lm.variant)
    without_layer = "+".join(expected[:-1])
    assert lm.fingerprint != fingerprint_directory(path, dtype="float32", variant=without_layer)


@needs_kernels
def test_the_quantized_route_names_its_digest(tmp_path):
    from mlx_nbengine.testing import make_tiny_quantized_model

    lm = load(make_tiny_quantized_model("llama", tmp_path / "q4"))
    long = kernels.long_products()
    qmv = f"qmv-{kernels.status().isa}-{long}-{digest.of_files(qroute.VARIANT_SOURCES)}"
    assert qroute.variant() == qmv
    assert lm.variant.split("+")[0] == qmv
