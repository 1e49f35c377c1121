"""`mlx_nbengine.models.load`: the errors a user sees, the fingerprint, kind detection,
dtype and BOS handling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mlx_nbengine.errors import (
    EngineError,
    ModelConfigError,
    ModelError,
    ModelNotFoundError,
    ModelWeightsError,
    TokenizerError,
    UnsupportedModelError,
)
from mlx_nbengine.models import fingerprint_directory, load, model_modality
from mlx_nbengine.testing import make_tiny_model


@pytest.fixture
def llama_copy(tiny_model_dir, tmp_path) -> Path:
    """A private, editable copy of the tiny llama model."""
    return Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "llama"))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_every_model_error_is_an_engine_error():
    assert issubclass(ModelError, EngineError)
    for cls in (ModelNotFoundError, ModelConfigError, UnsupportedModelError, ModelWeightsError):
        assert issubclass(cls, ModelError)


def test_missing_path_says_it_does_not_exist(tmp_path):
    with pytest.raises(ModelNotFoundError, match="the path does not exist"):
        load(tmp_path / "nowhere")


def test_a_plain_file_is_not_a_model_directory(llama_copy):
    with pytest.raises(ModelNotFoundError, match="is a file, not a model directory"):
        load(llama_copy / "tokenizer.json")


def test_directory_without_config_json_is_named(tmp_path):
    with pytest.raises(ModelConfigError, match="has no config.json"):
        load(tmp_path)


def test_directory_with_a_gguf_but_no_config_points_to_the_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(ModelConfigError, match="It holds a GGUF file: load '.*model.gguf'"):
        load(tmp_path)


def test_unreadable_config_json_is_named(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="config.json' is not readable JSON"):
        load(llama_copy)


def test_config_without_model_type_is_named(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    del config["model_type"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="has no model_type"):
        load(llama_copy)


def test_unsupported_model_type_is_named(llama_copy):
    edit_config(llama_copy, model_type="gpt9000")
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt9000' .* is not supported"):
        load(llama_copy)


def test_truncated_weights_are_named(llama_copy):
    weights = llama_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelWeightsError, match="model.safetensors' is truncated"):
        load(llama_copy)


def test_garbage_weights_are_named(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    with pytest.raises(ModelWeightsError, match="model.safetensors' is corrupt"):
        load(llama_copy)


def test_missing_weights_are_named(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelWeightsError, match="has no \\*.safetensors weight files"):
        load(llama_copy)


def test_weights_of_the_wrong_shape_are_named(llama_copy):
    edit_config(llama_copy, hidden_size=128)
    with pytest.raises(ModelWeightsError, match="do not load into a llama model: .*shape"):
        load(llama_copy)


def test_missing_tokenizer_is_named(llama_copy):
    (llama_copy / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer in .* could not be loaded"):
        load(llama_copy)


def test_unknown_dtype_is_rejected_before_loading(tmp_path):
    with pytest.raises(ModelError, match="Unknown dtype 'int7'"):
        load(tmp_path / "nowhere", dtype="int7")


def test_fingerprint_is_stable_across_loads_and_copies(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    copy = shutil.copytree(path, tmp_path / "copy")  # copy2 keeps mtimes
    assert load(path).fingerprint == load(path).fingerprint == load(copy).fingerprint


def test_fingerprint_changes_with_the_weights(llama_copy, tmp_path):
    before = fingerprint_directory(llama_copy)
    other = make_tiny_model("llama", tmp_path / "other", seed=5)
    shutil.copy(other / "model.safetensors", llama_copy / "model.safetensors")
    assert fingerprint_directory(llama_copy) != before


def test_fingerprint_changes_with_the_config(llama_copy):
    before = fingerprint_directory(llama_copy)
    edit_config(llama_copy, rope_theta=20000.0)
    assert fingerprint_directory(llama_copy) != before


def test_fingerprint_changes_with_the_dtype(llama_copy):
    f32 = fingerprint_directory(llama_copy, dtype="float32")
    assert f32 != fingerprint_directory(llama_copy, dtype="bfloat16")


def test_different_families_have_different_fingerprints(tiny_model_dir):
    prints = {load(tiny_model_dir(f)).fingerprint for f in ("llama", "gemma3_text", "qwen3_5")}
    assert len(prints) == 3


@pytest.mark.parametrize(
    ("config", "modality"),
    [
        ({"model_type": "llama"}, "text"),
        ({"model_type": "gemma3_text"}, "text"),
        ({"model_type": "qwen3_5", "text_config": {}}, "text"),
        ({"model_type": "qwen2_vl", "vision_config": {"depth": 2}}, "vision"),
        ({"model_type": "gemma3", "vision_config": {"hidden_size": 8}}, "vision"),
        ({"model_type": "qwen3_5", "vision_config": {"depth": 2}}, "vision"),
        ({"model_type": "not_a_model", "vision_config": {"depth": 2}}, "text"),
    ],
)
def test_modality_is_vision_only_with_a_vision_config_mlx_vlm_knows(config, modality):
    assert model_modality(config) == modality


def test_gemma_encode_has_exactly_one_bos_even_if_the_tokenizer_forgets_it(
    tiny_model_dir, tmp_path
):
    path = Path(shutil.copytree(tiny_model_dir("gemma3_text"), tmp_path / "gemma"))
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None  # a tokenizer that adds no BOS itself
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    lm = load(path)
    assert lm.text_tokenizer.encode("hello")[0] != lm.bos_token_id
    ids = lm.encode("hello")
    assert ids[0] == lm.bos_token_id and ids.count(lm.bos_token_id) == 1
    chat = lm.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat[0] == lm.bos_token_id and chat.count(lm.bos_token_id) == 1
