"""GGUF import of the families the reference engine leads with: a tiny ``qwen3_5`` written
the way llama.cpp's converter writes ``qwen35`` (V heads tiled, ``A = -exp(A_log)``, conv1d
squeezed), and a tiny ``gemma4_text`` written as ``gemma4`` (per-layer arrays, shared KV
layers, per-layer inputs, ``rope_freqs``), convert back into the same weights, config and
greedy tokens as stock mlx-lm's model, and llama.cpp itself (llama-cpp-python) runs each
file to the same tokens."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_nbengine.errors import GGUFError, UnsupportedModelError
from mlx_nbengine.models.gguf import convert
from mlx_nbengine.testing import make_tiny_gguf, make_tiny_model

PROMPT = "The Eiffel Tower is located in the city of"


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """A tiny qwen3_5 source, its F32 GGUF, and that GGUF converted."""
    return round_trip("qwen3_5", tmp_path_factory.mktemp("qwen35"))


def round_trip(family: str, base):
    """A tiny `family` source in `base`, its F32 GGUF, and that GGUF converted."""
    src = make_tiny_model(family, base / "src")
    gguf_file = make_tiny_gguf(family, base / "tiny.gguf", source=src, quant="F32")
    out = convert(gguf_file, output_dir=base / "out", dtype="float32", show_bar=False)
    return src, gguf_file, out


def test_qwen35_round_trip_gives_every_weight_back(qwen3_5):
    src, _, out = qwen3_5
    before = mx.load(str(src / "model.safetensors"))
    after = mx.load(str(out / "model.safetensors"))
    assert set(after) == set(before)
    for name, w in before.items():
        assert np.allclose(np.array(after[name]), np.array(w), atol=1e-6), name


def test_qwen35_config_matches_the_source(qwen3_5):
    src, _, out = qwen3_5
    source = json.loads((src / "config.json").read_text())
    result = json.loads((out / "config.json").read_text())
    assert result["model_type"] == "qwen3_5"
    text, rope = dict(source["text_config"]), source["text_config"]["rope_parameters"]
    del text["rope_parameters"]  # its type key is spelled as mlx-lm rewrote it
    for key, value in text.items():
        assert result["text_config"][key] == pytest.approx(value), key
    got = result["text_config"]["rope_parameters"]
    assert got["rope_theta"] == rope["rope_theta"]
    assert got["partial_rotary_factor"] == rope["partial_rotary_factor"]


def test_qwen35_greedy_tokens_equal_stock_mlx_lm(qwen3_5):
    src, _, out = qwen3_5
    answers = []
    for directory in (src, out):
        model, tokenizer = load(str(directory))
        answers.append(generate(model, tokenizer, PROMPT, max_tokens=16, sampler=make_sampler(0.0)))
    assert answers[0] == answers[1]


def assert_q8_0_converts_close(family: str, tmp_path) -> None:
    """A tiny `family` written as a Q8_0 GGUF converts back within Q8_0's rounding."""
    src = make_tiny_model(family, tmp_path / "src")
    gguf_file = make_tiny_gguf(family, tmp_path / "q8.gguf", source=src, quant="Q8_0")
    out = convert(gguf_file, output_dir=tmp_path / "out", dtype="float32", show_bar=False)
    before = mx.load(str(src / "model.safetensors"))
    after = mx.load(str(out / "model.safetensors"))
    assert set(after) == set(before)
    for name, w in before.items():
        w = np.array(w)
        assert np.abs(np.array(after[name]) - w).max() <= 0.01 * np.abs(w).max() + 1e-6, name


def test_qwen35_q8_0_converts_close_to_the_source(tmp_path):
    assert_q8_0_converts_close("qwen3_5", tmp_path)


def test_qwen35_without_its_linear_attention_sizes_is_one_line(qwen3_5, tmp_path):
    import gguf

    _, gguf_file, _ = qwen3_5
    reader = gguf.GGUFReader(str(gguf_file))
    path = tmp_path / "partial.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_uint32("qwen35.embedding_length", 64)
    writer.add_uint32("qwen35.block_count", 4)
    writer.add_uint32("qwen35.attention.head_count", 2)
    writer.add_token_list(list(reader.fields["tokenizer.ggml.tokens"].contents()))
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"lacks 'qwen35\.ssm\.") as e:
        convert(path, output_dir=tmp_path / "out", show_bar=False)
    assert "\n" not in str(e.value)


def llama_greedy(llama_cpp, gguf_file, *, n_ctx: int, extra: list[int], n: int = 12):
    """The prompt's ids (PROMPT, then `extra`) and llama.cpp's `n` greedy tokens after it."""
    llm = llama_cpp.Llama(str(gguf_file), n_ctx=n_ctx, n_threads=1, verbose=False)
    ids = llm.tokenize(PROMPT.encode(), add_bos=True) + extra
    llm.eval(ids)
    theirs = []
    for _ in range(n):
        theirs.append(llm.sample(temp=0.0))
        llm.eval([theirs[-1]])
    return ids, theirs


def greedy_mlx(directory, ids: list[int], n: int) -> list[int]:
    model, _ = load(str(directory))
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(0.0))
    return [int(token) for token, _ in steps]


def test_llama_cpp_runs_the_written_qwen35_gguf_to_our_greedy_tokens(qwen3_5):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, gguf_file, out = qwen3_5
    ids, theirs = llama_greedy(llama_cpp, gguf_file, n_ctx=256, extra=[])
    assert theirs == greedy_mlx(out, ids, 12)


def test_a_qwen35_moe_gguf_is_refused_in_one_line(tmp_path):
    import gguf

    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'qwen35moe' .* not supported") as e:
        convert(path, output_dir=tmp_path / "out", show_bar=False)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """A tiny gemma4_text source (per-layer inputs, shared KV, double-wide MLPs), its F32
    GGUF as llama.cpp's converter writes ``gemma4``, and that GGUF converted."""
    return round_trip("gemma4_text", tmp_path_factory.mktemp("gemma4"))


def test_gemma4_round_trip_gives_every_weight_and_size_back(gemma4):
    src, _, out = gemma4
    before = mx.load(str(src / "model.safetensors"))
    after = mx.load(str(out / "model.safetensors"))
    assert set(after) == set(before)
    for name, w in before.items():
        assert np.array_equal(np.array(after[name]), np.array(w)), name
    source = json.loads((src / "config.json").read_text())
    result = json.loads((out / "config.json").read_text())
    assert result["model_type"] == "gemma4_text"
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "global_head_dim",
        "layer_types",
        "sliding_window",
        "num_kv_shared_layers",
        "hidden_size_per_layer_input",
        "vocab_size_per_layer_input",
        "use_double_wide_mlp",
        "final_logit_softcapping",
    ):
        assert result[key] == source[key], key
    for kind, rope in source["rope_parameters"].items():
        got = result["rope_parameters"][kind]
        assert got["rope_theta"] == rope["rope_theta"], kind
        assert got["partial_rotary_factor"] == rope.get("partial_rotary_factor", 1.0), kind


def test_gemma4_greedy_tokens_equal_stock_mlx_lm(gemma4):
    src, _, out = gemma4
    ids = [2, *[5 + (i * 7) % 400 for i in range(150)]]  # past the 64-token window
    assert greedy_mlx(out, ids, 12) == greedy_mlx(src, ids, 12)


def test_llama_cpp_runs_the_written_gemma4_gguf_to_our_greedy_tokens(gemma4):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, gguf_file, out = gemma4
    extra = [5 + (i * 7) % 400 for i in range(150)]  # past the 64-token window
    ids, theirs = llama_greedy(llama_cpp, gguf_file, n_ctx=512, extra=extra)
    assert theirs == greedy_mlx(out, ids, 12)


def test_a_gemma4_q8_0_gguf_converts_close_to_the_source(tmp_path):
    assert_q8_0_converts_close("gemma4_text", tmp_path)


def test_a_gemma4_moe_gguf_is_refused_in_one_line(gemma4, tmp_path):
    import gguf

    _, gguf_file, _ = gemma4
    reader = gguf.GGUFReader(str(gguf_file))
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma4")
    for key in ("gemma4.embedding_length", "gemma4.block_count", "gemma4.attention.head_count"):
        writer.add_uint32(key, int(reader.fields[key].contents()))
    writer.add_uint32("gemma4.expert_count", 128)
    writer.add_token_list(list(reader.fields["tokenizer.ggml.tokens"].contents()))
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts") as e:
        convert(path, output_dir=tmp_path / "out", show_bar=False)
    assert "\n" not in str(e.value)
