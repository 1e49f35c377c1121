"""GGUF import of files our own code did not write: each supported family, as llama.cpp's
``convert_hf_to_gguf.py`` would write it, converts into the model it came from.

`mlx_nbengine.testing.make_tiny_gguf` names tensors from a table that mirrors
`models.gguf`'s, so a shared mistake would pass `test_gguf.py`. Here a tiny random-weight
model (`make_tiny_model`, safetensors) is written with the `gguf` package alone, the way
llama.cpp's converter uses it: tensor names from `gguf.get_tensor_name_map` (built from
``gguf.TENSOR_NAMES`` per architecture), hyper-parameters through the writer's named
setters (``gguf.Keys``), llama.cpp's rewrites of the weights (llama's Q/K row interleave,
Gemma 3's norms stored as ``1 + w``; Qwen 3.5's linear-attention V heads tiled over the K
heads, ``A = -exp(A_log)``, conv1d kernels squeezed; Gemma 4's per-layer arrays and
``rope_freqs``), the vocabulary as ``gpt2`` tokens
with token types from the Hugging Face tokenizer, and merges, special token ids,
``add_bos_token`` and the chat template from `gguf.SpecialVocab`. The imported model's
logits are compared with the source's, loaded from its safetensors (for F16 and Q8_0
files: with its weights rounded as the file holds them).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlx_nbengine.models import load
from mlx_nbengine.models.gguf import convert
from mlx_nbengine.testing import make_tiny_model

# Every architecture `models.gguf` converts (its ``_MODEL_TYPES``), as a tiny family.
ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "qwen3_5": gguf.MODEL_ARCH.QWEN35,
    "gemma4_text": gguf.MODEL_ARCH.GEMMA4,
}
SAMPLE = "The Eiffel Tower is located in the city of Paris. 123 def add(a, b):"
TEXTS = (SAMPLE, "  two spaces\nand a newline", "<|im_start|>user\nhi<|im_end|>")

# Measured 2026-12-01 on an AMD EPYC (2 cores), over the four families: the imported
# logits equal the source's for F32 files, and those of the source with its 2-D weights
# rounded as the file stores them for F16 and Q8_0 files (largest difference 0.0 in all
# twelve cases), so the tests assert equality. Against the unrounded source, rounding
# alone moves these random models' logits (largest 4.4 to 8.9) by up to 0.07 (F16) and
# 1.5 (Q8_0, Gemma 3): no bound that would catch an importer's mistake.
OUTTYPES = ("F32", "F16", "Q8_0")


def test_the_families_here_are_every_architecture_the_importer_converts():
    from mlx_nbengine.models import gguf as importer

    assert {gguf.MODEL_ARCH_NAMES[a] for a in ARCHS.values()} == set(importer._MODEL_TYPES)


def source_model(family: str, directory: Path) -> Path:
    kw = {}
    if family == "gemma3_text":
        kw["num_layers"] = 6
    src = make_tiny_model(family, directory, seed=5, **kw)
    if family == "gemma3_text":
        # GGUF has no field for Gemma 3's layer layout: llama.cpp fixes it at five sliding
        # layers per global one (and a local rope base of 10,000), so the source has it too.
        config = json.loads((src / "config.json").read_text())
        config.update(sliding_window_pattern=6, rope_local_base_freq=10_000.0)
        (src / "config.json").write_text(json.dumps(config, indent=2))
    # `make_tiny_model` leaves norm scales at their init, all alike: random ones make a
    # norm put in another's place (Gemma's four per layer, Qwen3's QK norms) show.
    weights = mx.load(str(src / "model.safetensors"))
    key = mx.random.key(7)
    for name in sorted(weights):
        if name.endswith("norm.weight"):
            key, sub = mx.random.split(key)
            scale = mx.random.uniform(-0.5, 0.5, weights[name].shape, key=sub)
            weights[name] = weights[name] + scale.astype(weights[name].dtype)
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "mlx"})
    return src


def interleave_rotary_halves(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of llama's Q/K rows: per head, row ``2i + j`` of the file is
    row ``j * half + i`` of the Hugging Face matrix (the two rotary halves interleaved)."""
    head = w.shape[0] // n_head
    half = head // 2
    h, i, j = np.meshgrid(np.arange(n_head), np.arange(half), np.arange(2), indexing="ij")
    order = np.empty(w.shape[0], dtype=np.int64)
    order[(h * head + 2 * i + j).ravel()] = (h * head + j * half + i).ravel()
    return w[order]


def tile_v_heads(w: np.ndarray, axis: int, n_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's reordering of Qwen 3.5's linear-attention V heads along `axis`: file
    head ``j * n_k + k`` is Hugging Face head ``k * per_k + j`` (V heads grouped by K head
    become tiled over the K heads)."""
    n_heads = w.shape[axis] // head_dim
    per_k = n_heads // n_k
    j, k = np.meshgrid(np.arange(per_k), np.arange(n_k), indexing="ij")
    heads = (k * per_k + j).ravel()
    order = (heads[:, None] * head_dim + np.arange(head_dim)).ravel()
    return np.take(w, order, axis=axis)


def qwen35_like_llama_cpp(hf_name: str, w: np.ndarray, text: dict) -> tuple[str, np.ndarray]:
    """A Qwen 3.5 tensor as llama.cpp's converter rewrites it (the name it maps, the array);
    mlx-lm's norms already hold the 1 that llama.cpp adds to Hugging Face's."""
    n_k, head_v = text["linear_num_key_heads"], text["linear_value_head_dim"]
    qk = 2 * n_k * text["linear_key_head_dim"]
    if hf_name.endswith(".A_log"):
        w = -np.exp(w)
    elif hf_name.endswith(".dt_bias"):
        hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    if hf_name.endswith((".A_log", ".dt_proj.bias", "in_proj_a.weight", "in_proj_b.weight")):
        w = tile_v_heads(w, 0, n_k, 1)
    elif hf_name.endswith("in_proj_z.weight"):
        w = tile_v_heads(w, 0, n_k, head_v)
    elif hf_name.endswith("out_proj.weight"):
        w = tile_v_heads(w, 1, n_k, head_v)
    elif hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        w = np.concatenate([w[:qk], tile_v_heads(w[qk:], 0, n_k, head_v)])
    if hf_name.endswith("conv1d.weight"):
        w = w.squeeze()
    return hf_name, w


def add_vocab(writer: gguf.GGUFWriter, src: Path, vocab_size: int) -> None:
    """The tokenizer metadata of a byte-level BPE model, as llama.cpp's converter writes it:
    every id up to the model's vocabulary size (unknown ids as unused ``[PAD<id>]``),
    added tokens typed CONTROL when special, else USER_DEFINED."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif by_id[i] in added:
            tokens.append(by_id[i])
            special = tokenizer.added_tokens_decoder[i].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # GPT-2's split: a byte-level pre-tokenizer with its regex
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(src, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def add_gemma4_hparams(writer: gguf.GGUFWriter, hp: dict) -> None:
    """Gemma 4's hyper-parameters as llama.cpp's converter writes them: per-layer MLP widths
    (doubled in the KV-shared layers), both layer kinds' head widths and rope bases, the
    sliding pattern as one flag a layer, and ``rope_freqs`` (the full layers' unrotated
    frequencies given a factor of 1e30)."""
    layers, shared = hp["num_hidden_layers"], hp["num_kv_shared_layers"]
    width = hp["intermediate_size"]
    double = hp["use_double_wide_mlp"]
    writer.add_feed_forward_length(
        [2 * width if double and i >= layers - shared else width for i in range(layers)]
    )
    full, local = (
        hp["rope_parameters"]["full_attention"],
        hp["rope_parameters"]["sliding_attention"],
    )
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_freq_base_swa(local["rope_theta"])
    writer.add_key_length(hp["global_head_dim"])
    writer.add_value_length(hp["global_head_dim"])
    writer.add_key_length_swa(hp["head_dim"])
    writer.add_value_length_swa(hp["head_dim"])
    writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
    writer.add_sliding_window(hp["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(hp["hidden_size_per_layer_input"])
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in hp["layer_types"]])
    writer.add_rope_dimension_count(hp["global_head_dim"])
    writer.add_rope_dimension_count_swa(hp["head_dim"])
    half = hp["global_head_dim"] // 2
    rotated = int(half * full["partial_rotary_factor"])
    factors = np.array([1.0] * rotated + [1e30] * (half - rotated), dtype=np.float32)
    writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)


def write_like_llama_cpp(family: str, src: Path, path: Path, outtype: str) -> Path:
    arch = ARCHS[family]
    hp = json.loads((src / "config.json").read_text())
    if arch == gguf.MODEL_ARCH.QWEN35:
        hp = {**hp["text_config"], **hp["text_config"]["rope_parameters"]}
    n_layers = hp["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny {family}")
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if arch == gguf.MODEL_ARCH.GEMMA4:
        add_gemma4_hparams(writer, hp)
    else:
        writer.add_feed_forward_length(hp["intermediate_size"])
        writer.add_rope_freq_base(hp["rope_theta"])
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp["head_dim"])
    if arch == gguf.MODEL_ARCH.GEMMA3:
        writer.add_sliding_window(hp["sliding_window"])
    if arch == gguf.MODEL_ARCH.QWEN35:
        writer.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(hp["linear_key_head_dim"])
        writer.add_ssm_group_count(hp["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(hp["linear_num_value_heads"])
        writer.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
        writer.add_full_attention_interval(hp["full_attention_interval"])
        writer.add_rope_dimension_count(int(hp["head_dim"] * hp["partial_rotary_factor"]))
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    assert outtype in OUTTYPES
    file_type = {
        "F32": gguf.LlamaFileType.ALL_F32,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[outtype]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(writer, src, hp["vocab_size"])

    names = gguf.get_tensor_name_map(arch, n_layers)
    for hf_name, value in mx.load(str(src / "model.safetensors")).items():
        w = np.array(value.astype(mx.float32))
        if arch == gguf.MODEL_ARCH.QWEN35:
            hf_name, w = qwen35_like_llama_cpp(hf_name.removeprefix("language_model."), w, hp)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf's tensor map has no name for {hf_name}"
        if hf_name.endswith(".layer_scalar"):
            name += ".weight"  # Gemma 4's converter names the layer scalar a weight
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("self_attn.q_proj.weight"):
            w = interleave_rotary_halves(w, hp["num_attention_heads"])
        elif arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("self_attn.k_proj.weight"):
            w = interleave_rotary_halves(w, hp["num_key_value_heads"])
        if arch == gguf.MODEL_ARCH.GEMMA3 and hf_name.endswith("norm.weight"):
            w = w + 1.0
        # 1-D tensors (norms, biases) and conv kernels stay F32, as llama.cpp keeps them.
        if w.ndim < 2 or outtype == "F32" or name.endswith("ssm_conv1d.weight"):
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif outtype == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(w, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rounded_copy(src: Path, directory: Path, outtype: str) -> Path:
    """`src` with every 2-D weight rounded as an `outtype` file stores it (and as
    `gguf.quants` reads it back); 1-D weights as they are."""
    directory.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (directory / f.name).write_bytes(f.read_bytes())
    qtype = getattr(gguf.GGMLQuantizationType, outtype)
    text = json.loads((src / "config.json").read_text()).get("text_config", {})

    def rounded(w: np.ndarray) -> np.ndarray:
        return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)

    weights = {}
    for name, value in mx.load(str(src / "model.safetensors")).items():
        w = np.array(value.astype(mx.float32))
        if name.endswith("linear_attn.out_proj.weight"):
            # Q8_0 blocks run along the columns, which the file holds with V heads tiled.
            n_k, head_v = text["linear_num_key_heads"], text["linear_value_head_dim"]
            order = tile_v_heads(np.arange(w.shape[1])[None], 1, n_k, head_v)[0]
            w = rounded(w[:, order])[:, np.argsort(order)]
        elif w.ndim == 2:
            w = rounded(w)
        weights[name] = mx.array(w.astype(np.float32))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    return directory


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(source directory, imported model) per (family, outtype)."""
    base = tmp_path_factory.mktemp("gguf-reference")
    made: dict[tuple[str, str], tuple] = {}

    def get(family: str, outtype: str):
        if (family, outtype) not in made:
            src = source_model(family, base / f"{family}-{outtype}-src")
            path = write_like_llama_cpp(family, src, base / f"{family}-{outtype}.gguf", outtype)
            converted = convert(path, cache_dir=base / "cache", dtype="float32", show_bar=False)
            made[family, outtype] = (src, load(converted))
        return made[family, outtype]

    return get


def logits(lm) -> mx.array:
    # Past Gemma 3's 64-token sliding window: the window and the local rope base count.
    ids = lm.encode(" ".join([SAMPLE] * 5))
    assert len(ids) > 2 * 64
    return lm.model(mx.array(ids)[None])


@pytest.mark.parametrize("family", list(ARCHS))
def test_an_f32_file_as_llama_cpp_writes_it_imports_as_the_exact_source_model(imported, family):
    src, result = imported(family, "F32")
    source = load(src)
    assert result.model_type == family
    assert [type(c) for c in result.make_cache()] == [type(c) for c in source.make_cache()]
    assert mx.array_equal(logits(result), logits(source)).item()


@pytest.mark.parametrize("outtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("family", list(ARCHS))
def test_an_f16_or_q8_0_file_imports_as_the_source_with_rounded_weights(
    imported, tmp_path, family, outtype
):
    src, result = imported(family, outtype)
    got = logits(result)
    rounded = load(rounded_copy(src, tmp_path / "rounded", outtype))
    assert mx.array_equal(got, logits(rounded)).item()
    assert not mx.array_equal(got, logits(load(src))).item()  # the file was rounded


@pytest.mark.parametrize("family", list(ARCHS))
def test_the_tokenizer_from_llama_cpp_metadata_encodes_and_templates_as_the_source(
    imported, family
):
    src, result = imported(family, "F32")
    source = load(src)
    for text in TEXTS:
        assert result.encode(text) == source.encode(text), text
    assert result.bos_token_id == source.bos_token_id
    assert result.eos_token_ids >= source.eos_token_ids
    chat = [{"role": "user", "content": SAMPLE}]
    assert result.apply_chat_template(chat) == source.apply_chat_template(chat)
