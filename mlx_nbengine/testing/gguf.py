"""Tiny models as GGUF files, written the way llama.cpp's converter writes them.

`make_tiny_gguf` writes a text family's model (the family's `gguf_arch` in the registry)
with llama.cpp's own rewrites: llama's Q/K rows permuted, Gemma 3's norms stored as
``1 + w``, Qwen 3.5's value heads tiled over its key heads, Gemma 4's per-layer sizes as
arrays. The tokenizer goes in as GGUF ``gpt2`` (byte-level BPE) metadata. A large matrix
(`Rows`) is converted and quantized a block of rows at a time.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_nbengine.models import patches
from mlx_nbengine.testing.families import REGISTRY, make_tiny_model
from mlx_nbengine.testing.tokenizer import SPECIAL_TOKENS


def gguf_families() -> dict[str, str]:
    """Each family a GGUF can be written of, with its GGUF architecture."""
    return {name: f.gguf_arch for name, f in REGISTRY.items() if f.gguf_arch is not None}


def make_tiny_gguf(
    family: str,
    path: str | Path,
    *,
    source: str | Path | None = None,
    quant: str = "Q8_0",
    seed: int = 0,
) -> Path:
    """Write a tiny model as a llama.cpp-style GGUF file at `path` and return it.

    `family` is ``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"gemma3_text"`` (GGUF arch ``gemma3``,
    six layers in Gemma 3's fixed 5-sliding-1-global layout), ``"qwen3_5"`` (GGUF arch
    ``qwen35``: V heads tiled over K heads, ``A = -exp(A_log)``, conv1d squeezed and F32) or
    ``"gemma4_text"`` (GGUF arch ``gemma4``: names from the `gguf` package's tensor map, the
    per-layer sizes as arrays, norms as they are, and the full layers' ``rope_freqs``).
    The weights come from `source` (a `make_tiny_model` directory of that family, whose
    config.json a gemma3_text GGUF rewrites to Gemma 3's layout, as llama.cpp assumes it) or
    a fresh one;
    2-D matrices are stored as `quant` (``"F32"`` or ``"Q8_0"``), everything else
    as F32, with llama.cpp's own rewrites (llama Q/K row permutation, Gemma norms
    stored as ``1 + w``, a llama source's ``llama3`` ``rope_scaling`` stored as the
    ``rope_freqs`` factor tensor). The tokenizer goes in as GGUF ``gpt2`` (byte-level
    BPE) metadata.
    """
    path = Path(path)
    archs = gguf_families()
    if family not in archs:
        raise ValueError(f"make_tiny_gguf supports {', '.join(archs)}, not {family!r}")
    if source is None:
        # A fresh source model, in a folder removed once the GGUF file is written.
        kw = {"num_layers": 6} if family == "gemma3_text" else {}
        with tempfile.TemporaryDirectory(prefix="tiny-gguf-src-") as scratch:
            made = make_tiny_model(family, scratch, seed=seed, **kw)
            return write_gguf(family, path, made, quant)
    return write_gguf(family, path, Path(source), quant)


def write_gguf(
    family: str,
    path: Path,
    source: Path,
    quant: str,
    weights: Iterable[tuple[str, Any]] | None = None,
) -> Path:
    """Write `source` (its config and tokenizer; its weights, or `weights`: float32 arrays
    under mlx-lm's names, taken one at a time) as a GGUF of `family` at `path`."""
    import gguf
    import mlx.core as mx
    import numpy as np

    config = json.loads((source / "config.json").read_text())
    if family == "gemma3_text":
        # GGUF has no field for these; llama.cpp assumes Gemma 3's values, so the source must too.
        config.update(sliding_window_pattern=6, rope_local_base_freq=10000.0)
        (source / "config.json").write_text(json.dumps(config, indent=2))
    arch = gguf_families()[family]
    if weights is None:
        weights = (
            (k.removeprefix("language_model."), np.array(v.astype(mx.float32)))
            for k, v in mx.load(str(source / "model.safetensors")).items()
        )

    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "qwen35":
        config = {**config["text_config"], "tie_word_embeddings": config["tie_word_embeddings"]}
        weights = ((name, _llama_cpp_qwen35(name, w, config)) for name, w in weights)
        _add_gguf_qwen35_hparams(writer, config)
    if arch == "gemma4":
        config = _add_gguf_gemma4_hparams(writer, config)
    else:
        _add_gguf_hparams(writer, arch, config)
    add_tokenizer(writer, source, vocab_size=config.get("vocab_size"))
    _add_gguf_tensors(writer, arch, config, weights, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gguf_gemma4_hparams(writer: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's hyper-parameters as llama.cpp's converter writes them (per-layer arrays for
    the sliding pattern and, with double-wide MLPs, the MLP widths), and its ``rope_freqs``:
    the full layers rotate a quarter of each head, so the rest get a frequency factor of
    1e30. Returns `config` completed as mlx-lm completes it (the layer kinds)."""
    import numpy as np

    _, args_class = patches.model_classes(config)
    args = args_class.from_dict(config)
    config = {**config, "layer_types": list(args.layer_types)}
    layers, shared = args.num_hidden_layers, args.num_kv_shared_layers
    sliding = [kind == "sliding_attention" for kind in args.layer_types]
    writer.add_block_count(layers)
    writer.add_context_length(args.max_position_embeddings)
    writer.add_embedding_length(args.hidden_size)
    width = args.intermediate_size
    if args.use_double_wide_mlp and shared:
        writer.add_feed_forward_length(
            [width * (2 if i >= layers - shared else 1) for i in range(layers)]
        )
    else:
        writer.add_feed_forward_length(width)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    full, local = args.rope_parameters["full_attention"], args.rope_parameters["sliding_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_freq_base_swa(local["rope_theta"])
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_key_length(args.global_head_dim)
    writer.add_value_length(args.global_head_dim)
    writer.add_key_length_swa(args.head_dim)
    writer.add_value_length_swa(args.head_dim)
    if args.final_logit_softcapping:
        writer.add_final_logit_softcapping(args.final_logit_softcapping)
    writer.add_sliding_window(args.sliding_window)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(args.hidden_size_per_layer_input)
    writer.add_sliding_window_pattern(sliding)
    writer.add_rope_dimension_count(args.global_head_dim)
    writer.add_rope_dimension_count_swa(
        int(args.head_dim * local.get("partial_rotary_factor", 1.0))
    )
    rotated = int(args.global_head_dim * full["partial_rotary_factor"] / 2)
    factors = [1.0] * rotated + [1e30] * (args.global_head_dim // 2 - rotated)
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    return config


def _add_gguf_hparams(writer: Any, arch: str, config: dict[str, Any]) -> None:
    """The hyper-parameters llama.cpp reads for `arch`, from the source's `config`."""
    writer.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    writer.add_uint32(f"{arch}.attention.key_length", config["head_dim"])
    writer.add_uint32(f"{arch}.attention.value_length", config["head_dim"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
    scaling = config.get("rope_scaling") or {}
    if arch == "llama" and scaling.get("rope_type") == "llama3":
        writer.add_uint32(f"{arch}.rope.dimension_count", config["head_dim"])
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(config))


def _tiled_v_heads(w: Any, axis: int, *, n_k: int, head_dim: int) -> Any:
    # llama.cpp's converter stores linear-attention V heads tiled over the K heads.
    import numpy as np

    w = np.moveaxis(w, axis, 0)
    n = w.shape[0]
    w = w.reshape(n_k, n // head_dim // n_k, head_dim, *w.shape[1:]).swapaxes(0, 1)
    return np.moveaxis(w.reshape(n, *w.shape[3:]), 0, axis)


def _llama_cpp_qwen35(name: str, w: Any, config: dict[str, Any]) -> Any:
    """A Qwen 3.5 linear-attention tensor as llama.cpp's converter rewrites it (its norms
    are already stored with the 1 added, as llama.cpp stores them)."""
    import numpy as np

    n_k, head_v = config["linear_num_key_heads"], config["linear_value_head_dim"]
    qk = 2 * n_k * config["linear_key_head_dim"]
    if name.endswith("A_log"):
        w = -np.exp(w)
    if name.endswith(("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight")):
        w = _tiled_v_heads(w, 0, n_k=n_k, head_dim=1)
    elif name.endswith("in_proj_z.weight"):
        w = _tiled_v_heads(w, 0, n_k=n_k, head_dim=head_v)
    elif name.endswith("out_proj.weight"):
        w = _tiled_v_heads(w, 1, n_k=n_k, head_dim=head_v)
    elif name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        w = np.concatenate([w[:qk], _tiled_v_heads(w[qk:], 0, n_k=n_k, head_dim=head_v)])
    if name.endswith("conv1d.weight"):
        w = w[:, :, 0]
    return w


def _add_gguf_qwen35_hparams(writer: Any, config: dict[str, Any]) -> None:
    """Qwen 3.5's gated-delta sizes, full-attention interval and partial rope."""
    n_v = config["linear_num_value_heads"]
    writer.add_uint32("qwen35.ssm.conv_kernel", config["linear_conv_kernel_dim"])
    writer.add_uint32("qwen35.ssm.state_size", config["linear_key_head_dim"])
    writer.add_uint32("qwen35.ssm.group_count", config["linear_num_key_heads"])
    writer.add_uint32("qwen35.ssm.time_step_rank", n_v)
    writer.add_uint32("qwen35.ssm.inner_size", config["linear_value_head_dim"] * n_v)
    writer.add_uint32("qwen35.full_attention_interval", config["full_attention_interval"])
    rope = config["rope_parameters"]
    rope_dims = int(config["head_dim"] * rope["partial_rotary_factor"])
    writer.add_uint32("qwen35.rope.dimension_count", rope_dims)
    writer.add_array("qwen35.rope.dimension_sections", [11, 11, 10, 0])
    config["rope_theta"] = rope["rope_theta"]


def add_tokenizer(writer: Any, source: Path, *, vocab_size: int | None = None) -> None:
    """The source's byte-level BPE tokenizer as GGUF's ``gpt2`` tokenizer model; where the
    model's vocabulary is larger (a real-shape model with the tiny tokenizer), padded with
    unused tokens, as llama.cpp wants one per row of the embedding."""
    import gguf

    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, idx in vocab.items():
        tokens[idx] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    types = [control if t in SPECIAL_TOKENS else normal for t in tokens]
    padding = max(0, (vocab_size or 0) - len(tokens))
    writer.add_token_list(tokens + [f"<unused_{i}>" for i in range(padding)])
    writer.add_token_merges(merges)
    writer.add_token_types(types + [int(gguf.TokenType.UNUSED)] * padding)
    writer.add_bos_token_id(vocab["<bos>"])
    writer.add_eos_token_id(vocab["<eos>"])
    writer.add_pad_token_id(vocab["<pad>"])
    writer.add_add_bos_token(True)


def _add_gguf_tensors(
    writer: Any,
    arch: str,
    config: dict[str, Any],
    weights: Iterable[tuple[str, Any]],
    quant: str,
) -> None:
    """The weights under llama.cpp's names and layouts, 2-D ones quantized as `quant` as
    they come (so a large model is held quantized, not as float32)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    layer_names = {"gemma3": _GGUF_GEMMA3_LAYER_NAMES, "qwen35": _GGUF_QWEN35_LAYER_NAMES}.get(
        arch, _GGUF_LAYER_NAMES
    )
    tensor_map = None
    if arch == "gemma4":
        tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config["num_hidden_layers"])
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, w in weights:
        if tensor_map is not None:
            gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise ValueError(f"the gguf package's gemma4 map has no name for {name}")
            if name.endswith(".layer_scalar"):
                gguf_name += ".weight"  # what llama.cpp's converter appends
        elif name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            if rest in _GGUF_QWEN35_BARE_NAMES:
                rest = _GGUF_QWEN35_BARE_NAMES[rest]
            module, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{layer_names.get(module, module)}.{kind}".removesuffix(".")
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            w = _llama_cpp_permute(w, config["num_attention_heads"])
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            w = _llama_cpp_permute(w, config["num_key_value_heads"])
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w + 1.0
        if isinstance(w, Rows):  # a large matrix: converted and quantized in blocks of rows
            plain = qtype == gguf.GGMLQuantizationType.F32
            blocks = []
            for i in range(0, w.count, w.step):
                block = np.ascontiguousarray(w.rows(i, min(i + w.step, w.count)), np.float32)
                blocks.append(block if plain else quantize(block, qtype))
            writer.add_tensor(gguf_name, np.concatenate(blocks), raw_dtype=None if plain else qtype)
            continue
        w = np.ascontiguousarray(w, dtype=np.float32)
        quantizable = w.ndim == 2 and w.shape[1] % 32 == 0  # conv1d kernels stay F32
        if quantizable and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)


def _llama_cpp_permute(w, n_head: int):
    # What llama.cpp's converter does to llama Q/K rows (interleaves the rotary halves).
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}


_GGUF_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


_GGUF_QWEN35_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}


_GGUF_QWEN35_BARE_NAMES = {"linear_attn.A_log": "ssm_a.", "linear_attn.dt_bias": "ssm_dt.bias"}


def _llama_cpp_rope_factors(config: dict[str, Any]) -> Any:
    """The ``rope_freqs`` tensor llama.cpp writes for a Llama 3.x ``rope_scaling``."""
    import numpy as np

    scaling, dims = config["rope_scaling"], config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, dims, 2, dtype=np.float32) / dims)
    original = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for f in inv_freq:
        wavelen = 2 * np.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(scaling["factor"])
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(out, dtype=np.float32)


@dataclass(frozen=True)
class Rows:
    """A large matrix, read as float32 a block of `step` rows at a time (`rows(start, stop)`)
    out of `count`."""

    rows: Callable[[int, int], Any]
    count: int
    step: int = 4096
