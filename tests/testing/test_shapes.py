"""The real-shape random models (`testing.make_shaped_model`, issue 35): their configs build
mlx-lm's models in the published sizes, and the dense twins match the hybrids' width."""

from __future__ import annotations

import math

import pytest
from mlx.utils import tree_flatten

from mlx_nbengine.models import patches
from mlx_nbengine.testing import SHAPES
from mlx_nbengine.testing.shapes import shape_config

# Parameters of the published models' text part (embedding tied): about 0.75B and 1.9B.
PUBLISHED = {"qwen3_5-0.8b": 0.75e9, "qwen3_5-2b": 1.88e9}
HYBRIDS = sorted(PUBLISHED)


def build(shape: str, *, dense: bool):
    config = shape_config(shape, dense=dense)
    model_class, args_class = patches.model_classes(config)
    return config, model_class(args_class.from_dict(config))  # lazy: nothing is drawn


@pytest.mark.parametrize("shape", HYBRIDS)
def test_a_hybrid_shape_builds_the_published_size(shape):
    config, model = build(shape, dense=False)
    count = sum(math.prod(v.shape) for _, v in tree_flatten(model.parameters()))
    assert abs(count - PUBLISHED[shape]) / PUBLISHED[shape] < 0.05, count
    layers = model.language_model.model.layers
    assert [layer.is_linear for layer in layers[:4]] == [True, True, True, False]
    assert len(layers) == config["text_config"]["num_hidden_layers"] == 24


@pytest.mark.parametrize("shape", HYBRIDS)
def test_a_dense_twin_has_the_hybrids_width_depth_and_mlp(shape):
    hybrid = shape_config(shape, dense=False)["text_config"]
    _, model = build(shape, dense=True)
    twin = shape_config(shape, dense=True)
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
        assert twin[key] == hybrid[key], key
    assert len(model.model.layers) == 24 and model.model.layers[0].self_attn.n_heads == 8


@pytest.mark.parametrize("shape", HYBRIDS)
def test_a_hybrid_shapes_vision_form_is_mlx_vlms_model_of_the_same_text_model(shape):
    # Qwen publishes the family with a vision tower (mlx-vlm's qwen3_5): its language model
    # is the hybrid's, its tower the tiny one, widened to the text model's width.
    from mlx_nbengine.testing.shapes import _vision_model, vision_config

    config, processor = vision_config(shape)
    model = _vision_model(config)  # lazy: nothing is drawn
    text = dict(tree_flatten(model.language_model.parameters()))
    _, hybrid = build(shape, dense=False)
    want = dict(tree_flatten(hybrid.language_model.parameters()))
    assert {k: v.shape for k, v in text.items()} == {k: v.shape for k, v in want.items()}
    assert type(model.language_model.model.layers[0].linear_attn).__module__ == (
        "mlx_vlm.models.qwen3_5.language"
    )
    assert config["vision_config"]["out_hidden_size"] == config["text_config"]["hidden_size"]
    assert processor["processor_class"] == "Qwen3VLProcessor"
    with pytest.raises(ValueError, match="gemma4-e2b has no vision form here"):
        from mlx_nbengine.testing import make_shaped_model

        make_shaped_model("gemma4-e2b", "unused", vision=True)


def effective_and_table(model) -> tuple[int, int]:
    """A Gemma 4 model's parameters without its per-layer input table, and the table's."""
    params = dict(tree_flatten(model.parameters()))
    table = math.prod(params["model.embed_tokens_per_layer.weight"].shape)
    return sum(math.prod(v.shape) for v in params.values()) - table, table


def test_the_gemma4_shape_builds_e2b():
    # "E2B": 2.3B effective parameters, the per-layer input table (2.35B more) left out.
    config, model = build("gemma4-e2b", dense=False)
    effective, table = effective_and_table(model)
    assert abs(effective - 2.3e9) / 2.3e9 < 0.05, effective
    assert abs(table - 2.35e9) / 2.35e9 < 0.01, table
    layers = model.layers
    assert len(layers) == 35 and len(model.make_cache()) == 15  # 20 layers share KV
    assert [layer.self_attn.head_dim for layer in layers[:5]] == [256] * 4 + [512]
    assert set(SHAPES) >= {"gemma4-e2b", *HYBRIDS}
    with pytest.raises(ValueError, match="gemma4-e2b has no dense twin"):
        shape_config("gemma4-e2b", dense=True)


def test_the_gemma4_shape_builds_e4b():
    # "E4B": about 4.5B effective parameters (4.64B counted here), the per-layer input table
    # (42 layers of 256 features, 2.82B) left out; 24 layers keep KV, five sliding to one full.
    config, model = build("gemma4-e4b", dense=False)
    effective, table = effective_and_table(model)
    assert abs(effective - 4.5e9) / 4.5e9 < 0.05, effective
    assert table == 262_144 * 42 * 256
    layers = model.layers
    assert len(layers) == 42 and len(model.make_cache()) == 24
    assert [layer.self_attn.head_dim for layer in layers[:6]] == [256] * 5 + [512]
    assert layers[0].self_attn.n_kv_heads == 2
    assert layers[-1].mlp.gate_proj.weight.shape == (10240, 2560)  # not doubled when shared


def test_an_unknown_shape_is_refused_in_one_line(tmp_path):
    from mlx_nbengine.testing import make_shaped_model

    with pytest.raises(ValueError, match="unknown shape 'qwen9'; choose one of"):
        make_shaped_model("qwen9", tmp_path)


def test_a_gguf_tokenizer_is_padded_to_the_models_vocabulary(tmp_path):
    # A real-shape model keeps the tiny tokenizer; llama.cpp wants a token per embedding row.
    import gguf

    from mlx_nbengine.testing import make_tiny_tokenizer
    from mlx_nbengine.testing.gguf import add_tokenizer

    source = make_tiny_tokenizer(tmp_path / "tok")
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen35")
    add_tokenizer(writer, source, vocab_size=600)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    types = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    assert len(kinds) == 600
    assert kinds[-1] == int(gguf.TokenType.UNUSED) and kinds[5] == int(gguf.TokenType.NORMAL)


def test_a_gguf_written_in_blocks_of_rows_is_the_same_file(tmp_path, monkeypatch):
    # make_shaped_gguf converts and quantizes a large matrix a block of rows at a time (E2B's
    # per-layer table is 9.4 GB as float32): the same bytes as one conversion of the whole.
    from mlx_nbengine import testing
    from mlx_nbengine.testing import gguf as tiny_gguf
    from mlx_nbengine.testing import shapes

    source = testing.make_tiny_quantized_model(
        "gemma4_text", tmp_path / "q8", bits=8, group_size=32
    )
    whole = testing.make_shaped_gguf(source, tmp_path / "whole.gguf").read_bytes()
    monkeypatch.setattr(shapes, "_CHUNKED_VALUES", 1000)
    monkeypatch.setattr(tiny_gguf.Rows.__init__, "__defaults__", (7,))  # 7 rows a block
    blocks = testing.make_shaped_gguf(source, tmp_path / "blocks.gguf").read_bytes()
    assert blocks == whole
