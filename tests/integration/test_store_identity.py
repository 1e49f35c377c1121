"""A persistent store names what computed its numbers (MLX, mlx-lm, mlx-vlm, our kernels, the
BLAS core) in its identity; a store written under another set is set aside whole, nothing of it
read, and one line says which version differs (issue 36).

Real engines on a tiny random model, a real store on disk; only the version a store records is
monkeypatched (`blockstore.software`), as if another mlx-lm had written it.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

from mlx_nbengine import _blas, kernels
from mlx_nbengine.cache import persist
from mlx_nbengine.engine import Engine, blockstore
from mlx_nbengine.kernels import digest
from mlx_nbengine.testing import make_tiny_model

PROMPT = [(7 * i + 3) % 500 + 2 for i in range(70)]  # 4 whole blocks of 16 and 6 tokens
REAL = blockstore.software


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("identity-model") / "llama")


def write_store(model: Path, store: Path, monkeypatch, **versions: str) -> None:
    """PROMPT's blocks in a persistent store at `store`, written as if under `versions`."""
    with monkeypatch.context() as patch:
        patch.setattr(blockstore, "software", lambda: {**REAL(), **versions})
        with Engine.load(model, block_size=16, persist_dir=store) as engine:
            engine.submit(PROMPT, max_tokens=4).result(timeout=300)
            assert engine.store_note is None
    header, _ = persist.decode_header((store / persist.INDEX_FILE).read_bytes())
    assert header["identity"][persist.SOFTWARE] == {**REAL(), **versions}


def test_the_identity_names_what_computes_the_numbers(model, tmp_path, monkeypatch):
    software = blockstore.software()
    assert software == {
        "MLX": importlib.metadata.version("mlx"),
        "mlx-lm": importlib.metadata.version("mlx-lm"),
        "mlx-vlm": importlib.metadata.version("mlx-vlm"),
        "kernel sources": digest.kernel_sources_digest(),
        "kernel build": kernels.build_identity(),
        "BLAS": _blas.blas_identity(),
    }
    status = _blas.blas_status()
    if status is not None and status.active and status.core:
        assert software["BLAS"].endswith(status.core)  # e.g. "OpenBLAS 0.3.34 SkylakeX"
    if kernels.status().active:
        assert software["kernel build"].endswith(kernels.status().isa)
    # The same software reads its own store back: every whole block and more from disk.
    store = tmp_path / "store"
    write_store(model, store, monkeypatch)
    with Engine.load(model, block_size=16, persist_dir=store) as engine:
        assert engine.store_note is None
        report = engine.submit(PROMPT, max_tokens=4).result(timeout=300).report
        assert report.restore_source == "disk" and report.restored_tokens == len(PROMPT) - 1


@pytest.mark.parametrize(
    "name,there",
    [("mlx-lm", "0.32.1"), ("BLAS", "OpenBLAS 0.3.29 Haswell"), ("kernel sources", "0badc0de")],
)
def test_a_store_written_under_another_version_restores_nothing_and_says_why(
    name, there, model, tmp_path, monkeypatch
):
    store = tmp_path / "store"
    write_store(model, store, monkeypatch, **{name: there})
    now = REAL()[name]
    with Engine.load(model, block_size=16, persist_dir=store) as engine:
        note = engine.store_note
        report = engine.submit(PROMPT, max_tokens=4).result(timeout=300).report
        records_at_open = engine.stats()["records_at_open"]
    assert note is not None and "\n" not in note  # one line
    assert f"it was written by {name} {there}, this process runs {name} {now}" in note
    assert f"the block store in {store} was set aside" in note
    assert "also:" not in note  # nothing else differs
    # Never read: nothing restored, nothing adopted at open.
    assert report.restore_source is None and report.restored_tokens == 0
    assert all(block.source == "computed" for block in report.blocks)
    assert records_at_open == 0
    # Set aside, not deleted: the old files whole in one folder the line names.
    [aside] = [n for n in os.listdir(store) if n.startswith(persist.SET_ASIDE_PREFIX)]
    assert str(store / aside) in note
    assert sorted(os.listdir(store / aside)) == [persist.DATA_FILE, persist.INDEX_FILE]
    header, _ = persist.decode_header((store / aside / persist.INDEX_FILE).read_bytes())
    assert header["identity"][persist.SOFTWARE][name] == there


def test_the_line_names_every_version_that_differs_and_an_older_store():
    old = {"MLX": "0.32.3", "mlx-lm": "0.32.1", "BLAS": "reference"}
    new = {"MLX": "0.32.4", "mlx-lm": "0.32.1", "BLAS": "OpenBLAS 0.3.34 SkylakeX"}
    assert persist._describe_software(old, new) == (
        "it was written by MLX 0.32.3, BLAS reference, "
        "this process runs MLX 0.32.4, BLAS OpenBLAS 0.3.34 SkylakeX"
    )
    assert persist._describe_software(new, new) is None
    assert "recorded no software versions" in persist._describe_software(None, new)
    # A variant's parts: only those that differ are named.
    said = persist._describe_mismatch(
        {"variant": "attn-avx2-11111111+rows-avx2-22222222", "fingerprint": "a" * 64},
        {"variant": "attn-avx2-11111111+rows-avx2-33333333", "fingerprint": "b" * 64},
    )
    assert said.startswith("variant rows-avx2-22222222 there, rows-avx2-33333333 now; ")
