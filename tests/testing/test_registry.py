"""The registry of tiny families (`mlx_nbengine.testing.families`): the groups the tests
parametrize over come from it, `make_tiny_model` and `make_tiny_gguf` look names up in it, and
a new family is one registration."""

from __future__ import annotations

import json

import pytest

from mlx_nbengine import testing
from mlx_nbengine.models import load
from mlx_nbengine.testing import families
from mlx_nbengine.testing.gguf import gguf_families
from mlx_nbengine.testing.text import text_common, text_family


def test_the_groups_are_the_registrations_in_order():
    assert testing.FAMILIES == ("llama", "gemma3_text", "qwen3_5")
    assert testing.EXTRA_FAMILIES == ("qwen3", "qwen2", "gemma4_text")
    assert testing.VISION_FAMILIES == ("qwen2_vl", "gemma4", "qwen3_5_vl")
    every = testing.FAMILIES + testing.EXTRA_FAMILIES + testing.VISION_FAMILIES
    assert set(every) == set(families.REGISTRY)


def test_the_gguf_architectures_are_the_text_families():
    assert gguf_families() == {
        "llama": "llama",
        "gemma3_text": "gemma3",
        "qwen3_5": "qwen35",
        "qwen3": "qwen3",
        "qwen2": "qwen2",
        "gemma4_text": "gemma4",
    }
    with pytest.raises(ValueError, match="make_tiny_gguf supports llama, .*not 'qwen2_vl'"):
        testing.make_tiny_gguf("qwen2_vl", "unused.gguf")


def test_an_unknown_family_is_refused_naming_every_family(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt9'") as refused:
        testing.make_tiny_model("gpt9", tmp_path)
    assert all(name in str(refused.value) for name in families.REGISTRY)
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_name_or_a_group_registers_once(monkeypatch):
    monkeypatch.setattr(families, "REGISTRY", dict(families.REGISTRY))
    llama = families.REGISTRY["llama"]
    with pytest.raises(ValueError, match="'llama' is registered already"):
        families.register(llama)
    with pytest.raises(ValueError, match="unknown family group 'big'"):
        families.register(families.Family("x", "big", llama.write))


def test_a_new_text_family_is_one_registration(monkeypatch, tmp_path):
    # A registered config function is all make_tiny_model needs; the model loads like any.
    monkeypatch.setattr(families, "REGISTRY", dict(families.REGISTRY))

    @text_family("llama_deep", "extra", None)
    def _llama_deep(ids, options):
        return {
            **text_common(ids),
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": options.num_layers or 3,
            "rope_theta": 10_000.0,
        }

    assert families.names("extra")[-1] == "llama_deep"
    path = testing.make_tiny_model("llama_deep", tmp_path / "deep", kv_heads=2)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (3, 2)
    lm = load(path)
    assert len(lm.make_cache()) == 3
