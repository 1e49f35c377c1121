"""GGUF import: convert a llama.cpp GGUF file into an MLX model directory, once.

Terms:
- *GGUF*: llama.cpp's single-file format; metadata (architecture hyper-parameters,
  tokenizer vocabulary) plus tensors, many of them block-quantized (Q4_K, Q8_0...).
- *conversion*: every tensor is dequantized with the `gguf` package
  (`gguf.quants.dequantize`), renamed to the Hugging Face / mlx-lm names, undone
  where llama.cpp rewrote it (llama's Q/K row permutation; Gemma's norm weights,
  stored as ``w + 1``, while mlx-lm's Gemma adds the 1 itself; Llama 3.x's
  ``rope_freqs`` factors, turned back into the ``rope_scaling`` they came from), and
  written as
  ``model.safetensors`` with ``config.json``, ``tokenizer.json`` (rebuilt from the
  metadata with transformers' GGUF tokenizer builders, no torch needed) and
  ``tokenizer_config.json``.
- *conversion cache*: converted directories live under
  ``$MLX_NBENGINE_HOME/gguf`` (default ``~/.cache/mlx_nbengine/gguf``), one per
  source file, keyed by the file's size, mtime and sampled content plus the
  converter version, so the second `convert` of the same file is instant.
  A conversion writes into a temporary directory renamed into place at the end:
  an interrupted one leaves nothing behind that looks finished. Once it is in place,
  the cache's conversions of the same file by other converter versions (never used
  again) are deleted.

Qwen 3.5 (``qwen35``, mlx-lm's ``qwen3_5``) also gets its gated-delta layers back:
``A = -exp(A_log)`` logged again, the squeezed conv1d kernel given its axis back, and the
linear attention's V heads, which llama.cpp tiles over the K heads, grouped by K head again.

Gemma 4 (``gemma4``, mlx-lm's ``gemma4_text``) is read from its per-layer arrays (sliding
pattern, MLP widths), its KV-sharing and per-layer input sizes, and the full layers' rotated
share from ``rope_freqs``; its norms are stored as they are.

Supported architectures: ``llama``, ``gemma3``, ``qwen2``, ``qwen3``, ``qwen35``, ``gemma4``
(dense, text only); tensor types:
whatever `gguf.quants.dequantize` handles (F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K...).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlx_nbengine.errors import GGUFError, UnsupportedModelError
from mlx_nbengine.home import home

__all__ = [
    "cache_home",
    "conversion_dir",
    "convert",
    "read_metadata",
    "remove_older_conversions",
]

Progress = Callable[[int, int], None]

# Bumped whenever the converter's output changes, so stale conversions are redone.
CONVERTER_VERSION = "3"


def converter_tag(dtype: str) -> str:
    """What a conversion's ``mlx_nbengine_source.json`` records as its converter: the version,
    and the weights' dtype where it is not the default bfloat16 (a conversion of the same GGUF
    under another tag is another one, and `remove_older_conversions` takes it away)."""
    return CONVERTER_VERSION if dtype == "bfloat16" else f"{CONVERTER_VERSION}-{dtype}"


_SAMPLE_BYTES = 1 << 20

_MODEL_TYPES = {
    "llama": "llama",
    "gemma3": "gemma3_text",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen35": "qwen3_5",
    "gemma4": "gemma4_text",
}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}

# GGUF tensor name (after "blk.N.") -> mlx-lm name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per layer; llama.cpp's ffn_norm is its *pre*-feedforward norm.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen 3.5: the full-attention layers' norms, plus the gated-delta (linear attention) layers.
_QWEN35_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Tensors without a ``.weight``/``.bias`` kind: GGUF name (after "blk.N.") -> mlx-lm name.
_QWEN35_BARE_NAMES = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
# Gemma 4: Gemma 3's norms, plus the per-layer input's gate, projection and norm.
_GEMMA4_LAYER_NAMES = {
    **_GEMMA3_LAYER_NAMES,
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
# Tensors without a ``.weight``/``.bias`` kind: GGUF name (after "blk.N.") -> mlx-lm name.
_GEMMA4_BARE_NAMES = {"layer_output_scale.weight": "layer_scalar"}
_LAYER_NAMES_BY_ARCH = {
    "gemma3": _GEMMA3_LAYER_NAMES,
    "qwen35": _QWEN35_LAYER_NAMES,
    "gemma4": _GEMMA4_LAYER_NAMES,
}
_BARE_NAMES_BY_ARCH = {"qwen35": _QWEN35_BARE_NAMES, "gemma4": _GEMMA4_BARE_NAMES}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Gemma 4's per-layer inputs: a table of every layer's features per token, and their
    # projection from the embedding.
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# Tensors llama.cpp keeps for its own use and mlx-lm computes itself (from config.json:
# `rope_freqs` becomes ``rope_scaling``, see `_llama3_rope_scaling`).
_SKIPPED = {"rope_freqs"}
# How closely rope factors must match: to count as 1 or `factor`, and when rebuilt.
_ROPE_TOL = 1e-4


def cache_home() -> Path:
    """Where mlx_nbengine keeps converted models: ``$MLX_NBENGINE_HOME`` or ``~/.cache/...``."""
    return home()


def _file_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{CONVERTER_VERSION}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    with open(path, "rb") as f:
        for offset in (0, st.st_size // 2, max(0, st.st_size - _SAMPLE_BYTES)):
            f.seek(offset)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:20]


def conversion_dir(
    gguf_path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The directory `convert` writes (or has written) for `gguf_path`."""
    path = Path(gguf_path)
    base = Path(cache_dir) if cache_dir is not None else cache_home() / "gguf"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.stem)
    return base / f"{stem}-{_file_key(path)}"


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError...
        raise GGUFError(
            f"'{path}' is not a readable GGUF file ({type(e).__name__}: {e}). "
            "Check that the download finished, or re-create the file."
        ) from e


def read_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of an open `gguf.GGUFReader`, as Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _config(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    if isinstance(n_heads, list):  # per-layer counts; these architectures use one value
        n_heads = max(n_heads)
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        n_kv = max(n_kv)
    config: dict[str, Any] = {
        "model_type": _MODEL_TYPES[arch],
        "architectures": [_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": get("attention.key_length", hidden // n_heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": get("context_length"),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if get("rope.scaling.type") == "linear" and get("rope.scaling.factor"):
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    if arch == "gemma3":
        config.update(
            {
                "query_pre_attn_scalar": config["head_dim"],
                "sliding_window": get("attention.sliding_window", 512),
                # llama.cpp fixes Gemma 3's layout at five sliding layers per global one.
                "sliding_window_pattern": 6,
                "rope_local_base_freq": 10000.0,
            }
        )
    if arch == "qwen2":
        config["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_names)
    for name, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[name] = meta[f"tokenizer.ggml.{key}"]
    eos = [
        meta[f"tokenizer.ggml.{k}"]
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{k}" in meta
    ]
    # Gemma's chat turns end with their own token, which the file does not name as EOS.
    for end in {"gemma3": ("<end_of_turn>",), "gemma4": ("<turn|>",)}.get(arch, ()):
        end_of_turn = _token_id(meta, end)
        if end_of_turn is not None:
            eos.append(end_of_turn)
    eos = list(dict.fromkeys(eos))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if arch == "gemma4":
        return _gemma4_config(meta, config, tensor_names)
    return _qwen35_config(meta, config) if arch == "qwen35" else config


def _gemma4_config(
    meta: dict[str, Any], config: dict[str, Any], tensor_names: set[str]
) -> dict[str, Any]:
    """mlx-lm's ``gemma4_text`` config: the sliding pattern, head widths and per-layer MLP
    widths from their arrays, the KV-sharing and per-layer input sizes; the full layers'
    rotated share comes from ``rope_freqs`` (`_gemma4_rope`)."""

    def get(key: str, default: Any = None) -> Any:
        if f"gemma4.{key}" not in meta and default is None:
            raise GGUFError(f"This gemma4 GGUF lacks 'gemma4.{key}', which the model needs.")
        return meta.get(f"gemma4.{key}", default)

    if "gemma4.expert_count" in meta:
        raise UnsupportedModelError(
            "Gemma 4's mixture-of-experts GGUFs (26B-A4B) are not supported; the dense "
            "ones (E2B, E4B, 31B) are."
        )
    sliding = get("attention.sliding_window_pattern")
    layers = config["num_hidden_layers"]
    if not isinstance(sliding, list) or len(sliding) != layers:
        raise GGUFError("This gemma4 GGUF's sliding_window_pattern is not one flag per layer.")
    kinds = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    widths = get("feed_forward_length")
    widths = widths if isinstance(widths, list) else [widths] * layers
    shared = int(get("attention.shared_kv_layers", 0))
    kv = get("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    first_full = full[0] if full else 0
    unshared_full = [i for i in full if i < layers - shared]
    k_eq_v = bool(unshared_full) and all(
        f"blk.{i}.attn_v.weight" not in tensor_names for i in unshared_full
    )
    head_swa = int(get("attention.key_length_swa"))
    per_layer = int(get("embedding_length_per_layer_input", 0))
    config.pop("rope_theta")
    config.update(
        {
            "num_key_value_heads": kv[sliding.index(True)] if True in sliding else kv[0],
            "intermediate_size": min(widths),
            "use_double_wide_mlp": max(widths) == 2 * min(widths),
            "head_dim": head_swa,
            "global_head_dim": int(get("attention.key_length")),
            "layer_types": kinds,
            "sliding_window": int(get("attention.sliding_window")),
            "num_kv_shared_layers": shared,
            "hidden_size_per_layer_input": per_layer,
            "vocab_size_per_layer_input": config["vocab_size"],
            "final_logit_softcapping": get("final_logit_softcapping", 0.0) or None,
            "attention_k_eq_v": k_eq_v,
            "rope_parameters": {
                "full_attention": {
                    "partial_rotary_factor": 1.0,  # set from rope_freqs (`_gemma4_rope`)
                    "rope_theta": float(get("rope.freq_base")),
                    "rope_type": "proportional",
                },
                "sliding_attention": {
                    "partial_rotary_factor": int(get("rope.dimension_count_swa", head_swa))
                    / head_swa,
                    "rope_theta": float(get("rope.freq_base_swa", 10_000.0)),
                    "rope_type": "default",
                },
            },
        }
    )
    if k_eq_v:
        config["num_global_key_value_heads"] = kv[first_full]
    return config


def _gemma4_rope(factors: np.ndarray, config: dict[str, Any]) -> None:
    """Set the full layers' rotated share from llama.cpp's ``rope_freqs``: it rotates every
    frequency and gives the unrotated ones a factor of 1e30 (a frequency of 0)."""
    r = np.asarray(factors, dtype=np.float64).reshape(-1)
    dims = config["global_head_dim"]
    if r.size != dims // 2:
        raise GGUFError(f"rope_freqs has {r.size} factors, but the full layers have {dims // 2}.")
    rotated = r < 1e20
    count = int(rotated.sum())
    if not rotated[:count].all() or not np.allclose(r[:count], 1.0):
        raise UnsupportedModelError(
            "This gemma4 GGUF's rope_freqs is not a rotated prefix of factor 1 followed by "
            "unrotated frequencies, the only form Gemma 4's proportional rope takes."
        )
    full = config["rope_parameters"]["full_attention"]
    full["partial_rotary_factor"] = 2 * count / dims


def _qwen35_config(meta: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's nested ``qwen3_5`` config around the common `text` fields."""

    def get(key: str) -> Any:
        if f"qwen35.{key}" not in meta:
            raise GGUFError(f"This qwen35 GGUF lacks 'qwen35.{key}', which the model needs.")
        return meta[f"qwen35.{key}"]

    outer = ("model_type", "architectures", "tie_word_embeddings", "bos_token_id", "eos_token_id")
    config = {key: text[key] for key in outer if key in text}
    n_v, n_k = get("ssm.time_step_rank"), get("ssm.group_count")
    text = {
        **text,
        "model_type": "qwen3_5_text",
        "full_attention_interval": get("full_attention_interval"),
        "linear_num_value_heads": n_v,
        "linear_num_key_heads": n_k,
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_value_head_dim": get("ssm.inner_size") // n_v,
        "linear_conv_kernel_dim": get("ssm.conv_kernel"),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": text["rope_theta"],
            "partial_rotary_factor": get("rope.dimension_count") / text["head_dim"],
        },
    }
    config["text_config"] = {k: v for k, v in text.items() if k != "architectures"}
    return config


def _llama3_factors(
    dims: int, base: float, factor: float, low_wavelen: float, high_wavelen: float
) -> np.ndarray:
    """Llama 3's per-frequency wavelength factors (as mlx-lm's ``llama3`` rope computes)."""
    wavelen = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (1 / wavelen - 1 / low_wavelen) / (1 / high_wavelen - 1 / low_wavelen)
    blended = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen > low_wavelen, factor, 1.0)
    return np.where((wavelen > high_wavelen) & (wavelen < low_wavelen), blended, out)


def _llama3_rope_scaling(factors: np.ndarray, *, dims: int, base: float) -> dict | None:
    """The ``rope_scaling`` config of llama.cpp's ``rope_freqs`` tensor, or None if all 1.

    Llama 3.x stretches long wavelengths by ``factor``, keeps short ones, and blends
    in between; llama.cpp stores only the resulting factor per frequency. In the blend,
    ``smooth`` is linear in 1 / wavelength, so a line through the blended points gives
    the two edge wavelengths (``original / low_freq_factor`` and ``original /
    high_freq_factor``: only these ratios matter). The rebuilt factors must match the
    file's, or the file uses a scheme we cannot express: an error, not a silently
    different model.
    """
    r = np.asarray(factors, dtype=np.float64).reshape(-1)
    if r.size != dims // 2:
        raise GGUFError(
            f"rope_freqs has {r.size} factors, but the rope has {dims // 2} frequencies."
        )
    if np.allclose(r, 1.0, rtol=0, atol=_ROPE_TOL):
        return None
    factor = float(r.max())
    inv_wavelen = 1 / (2 * np.pi * base ** (np.arange(0, dims, 2) / dims))
    stretched = r >= factor * (1 - _ROPE_TOL)
    kept = np.abs(r - 1) <= _ROPE_TOL
    blended = ~(stretched | kept)
    if blended.sum() >= 2:
        smooth = (1 / r[blended] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelen[blended], smooth, 1)
        low_inv, high_inv = -intercept / slope, (1 - intercept) / slope
    else:
        # Nothing to fit: put each edge halfway between its neighbouring frequencies.
        low_inv = (inv_wavelen[stretched].max() + inv_wavelen[~stretched].min()) / 2
        high_inv = (inv_wavelen[~kept].max() + inv_wavelen[kept].min()) / 2
        if high_inv <= low_inv:
            high_inv = low_inv * (1 + 1e-9)
    original = float(round(1 / low_inv))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": original * low_inv,
        "high_freq_factor": original * high_inv,
        "original_max_position_embeddings": original,
    }
    rebuilt = _llama3_factors(dims, base, factor, 1 / low_inv, 1 / high_inv)
    if not np.allclose(rebuilt, r, rtol=_ROPE_TOL, atol=0):
        raise UnsupportedModelError(
            "This GGUF's rope_freqs factors do not follow Llama 3's rope scaling, the only "
            "per-frequency scheme this converter can express."
        )
    return scaling


def _token_id(meta: dict[str, Any], token: str) -> int | None:
    try:
        return meta["tokenizer.ggml.tokens"].index(token)
    except ValueError:
        return None


def _mlx_name(gguf_name: str, arch: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base in _SKIPPED:
        return None
    prefix = "language_model." if arch == "qwen35" else ""  # mlx-lm's qwen3_5 nests its LM
    if base in _GLOBAL_NAMES:
        return f"{prefix}{_GLOBAL_NAMES[base]}.{kind}"
    bare = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    bare_names = _BARE_NAMES_BY_ARCH.get(arch, {})
    if bare and bare.group(2) in bare_names:
        return f"{prefix}model.layers.{bare.group(1)}.{bare_names[bare.group(2)]}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)
    if m and m.group(2) in names:
        return f"{prefix}model.layers.{m.group(1)}.{names[m.group(2)]}.{kind}"
    raise UnsupportedModelError(
        f"GGUF tensor '{gguf_name}' has no counterpart in the {arch} model; "
        "the file's layout is not one this converter knows."
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the two rotary halves of each head's Q/K rows; put them back.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor(tensor, arch: str, config: dict[str, Any]) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        w = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"GGUF tensor '{tensor.name}' uses type {tensor.tensor_type.name}, which cannot be "
            f"dequantized here ({e}). Use a file quantized with F16, Q8_0, Q4_K, Q5_0 or Q6_K."
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    w = np.asarray(w, dtype=np.float32).reshape(shape)
    name = tensor.name
    if arch == "llama":
        if name.endswith("attn_q.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp stored 1 + w; mlx-lm's Gemma RMSNorm adds the 1 back
    if arch == "qwen35":
        w = _qwen35_tensor(name, w, config["text_config"])
    return w


def _grouped_v_heads(w: np.ndarray, axis: int, *, n_k: int, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's V-head reorder along `axis`: it stores the linear attention's V heads
    tiled over the K heads (k0 k1 k0 k1...); mlx-lm groups them by K head (k0 k0 k1 k1...)."""
    w = np.moveaxis(w, axis, 0)
    n = w.shape[0]
    per_k = n // head_dim // n_k
    w = w.reshape(per_k, n_k, head_dim, *w.shape[1:]).swapaxes(0, 1).reshape(n, *w.shape[1:])
    return np.moveaxis(w, 0, axis)


def _qwen35_tensor(name: str, w: np.ndarray, text: dict[str, Any]) -> np.ndarray:
    """A Qwen 3.5 tensor back in mlx-lm's form (its norms are stored as mlx-lm keeps them)."""
    n_k, n_v = text["linear_num_key_heads"], text["linear_num_value_heads"]
    head_v = text["linear_value_head_dim"]
    qk = 2 * n_k * text["linear_key_head_dim"]
    regroup = n_k != n_v
    if name.endswith(".ssm_a"):
        w = np.log(-w)  # llama.cpp stores A = -exp(A_log)
    if regroup and name.endswith((".ssm_a", ".ssm_dt.bias", "ssm_alpha.weight", "ssm_beta.weight")):
        w = _grouped_v_heads(w, 0, n_k=n_k, head_dim=1)
    elif regroup and name.endswith("attn_gate.weight"):
        w = _grouped_v_heads(w, 0, n_k=n_k, head_dim=head_v)
    elif regroup and name.endswith("ssm_out.weight"):
        w = _grouped_v_heads(w, 1, n_k=n_k, head_dim=head_v)
    elif regroup and name.endswith(("attn_qkv.weight", "ssm_conv1d.weight")):
        w = np.concatenate([w[:qk], _grouped_v_heads(w[qk:], 0, n_k=n_k, head_dim=head_v)])
    if name.endswith("ssm_conv1d.weight"):
        w = w[:, :, None]  # llama.cpp squeezed the conv's input-channel axis
    return w


def _tokenizer_files(meta: dict[str, Any], arch: str, directory: Path) -> None:
    """Write the GGUF's tokenizer as ``tokenizer.json`` and ``tokenizer_config.json``."""
    add_bos, add_eos = _write_tokenizer_json(meta, arch, directory)
    _write_tokenizer_config(meta, arch, directory, add_bos=add_bos, add_eos=add_eos)


def _special_token(meta: dict[str, Any], key: str) -> str | None:
    """The text of the token whose id ``tokenizer.ggml.<key>`` names, None if none."""
    tokens = meta["tokenizer.ggml.tokens"]
    idx = meta.get(f"tokenizer.ggml.{key}")
    return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None


def _write_tokenizer_json(meta: dict[str, Any], arch: str, directory: Path) -> tuple[bool, bool]:
    """Rebuild the fast tokenizer (transformers' GGUF builders) with a post-processor that
    adds BOS/EOS as the file says; write it; return whether it adds BOS and EOS."""
    from tokenizers import processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    try:
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except Exception as e:  # transformers' builders raise ValueError, KeyError...
        raise GGUFError(
            f"The tokenizer in the GGUF metadata could not be rebuilt ({type(e).__name__}: {e})."
        ) from e
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = _special_token(meta, "bos_token_id"), _special_token(meta, "eos_token_id")
    add_bos = bool(
        meta.get("tokenizer.ggml.add_bos_token", tokenizer_dict.get("tokenizer_type") == "llama")
    )
    if arch == "gemma3":
        add_bos = True  # Gemma's outputs fall apart without BOS; llama.cpp forces it too
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    single, special = "$A", []
    if add_bos and bos is not None:
        single = f"{bos} $A"
        special.append((bos, tokens.index(bos)))
    if add_eos and eos is not None:
        single = f"{single} {eos}"
        special.append((eos, tokens.index(eos)))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B", special_tokens=special
    )
    backend.save(str(directory / "tokenizer.json"))
    return add_bos, add_eos


def _write_tokenizer_config(
    meta: dict[str, Any], arch: str, directory: Path, *, add_bos: bool, add_eos: bool
) -> None:
    # A file without a chat template is a base model: it gets none, so prompts go in raw
    # (a made-up turn format only makes a base model ramble).
    template = meta.get("tokenizer.chat_template")
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": int(meta.get(f"{arch}.context_length") or 131072),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if _special_token(meta, key) is not None:
            tokenizer_config[name] = _special_token(meta, key)
    if template:
        tokenizer_config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


class _Bar:
    """Progress over tensor bytes: a tqdm bar on stderr and/or a ``progress(done, total)`` hook."""

    def __init__(self, total: int, name: str, progress: Progress | None, show_bar: bool):
        self.total, self.done, self.progress = total, 0, progress
        self.bar = None
        if show_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"Converting {name}",
                file=sys.stderr,
                leave=False,
            )

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        if self.progress is not None:
            self.progress(self.done, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def convert(
    gguf_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    output_dir: str | os.PathLike | None = None,
    progress: Progress | None = None,
    show_bar: bool = True,
    dtype: str = "bfloat16",
) -> Path:
    """Convert `gguf_path` into an MLX model directory and return it; reuse it if done before.

    The result lands in `output_dir` if given, else in `conversion_dir(gguf_path,
    cache_dir=cache_dir)`. `progress(done, total)` is called as tensor bytes are
    converted; `show_bar` draws a tqdm bar on stderr. Weights are stored as
    `dtype` (bfloat16 by default: half the disk of float32 and far below the
    quantization error; `load` upcasts to float32 on CPU).
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise GGUFError(f"No GGUF file at '{path}'.")
    target = (
        Path(output_dir) if output_dir is not None else conversion_dir(path, cache_dir=cache_dir)
    )
    if (target / "config.json").is_file():
        return target

    reader = _reader(path)
    meta = read_metadata(reader)
    arch, config = _model_config(reader, meta, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    bar = _Bar(sum(int(t.n_bytes) for t in reader.tensors), path.name, progress, show_bar)
    try:
        _write_model(reader, meta, arch, config, tmp, bar=bar, source=path, dtype=dtype)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first; its result is as good.
            if not (target / "config.json").is_file():
                raise
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if output_dir is None:  # in the conversion cache; a directory the caller named is theirs
        remove_older_conversions(target)
    return target


def _model_config(reader: Any, meta: dict[str, Any], path: Path) -> tuple[str, dict[str, Any]]:
    """The architecture and the mlx-lm ``config.json`` of the GGUF file at `path`;
    `UnsupportedModelError` or `GGUFError` when it cannot be converted."""
    arch = meta.get("general.architecture")
    if arch not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"GGUF architecture '{arch}' in '{path}' is not supported; "
            f"convertible architectures: {', '.join(sorted(_MODEL_TYPES))}."
        )
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"'{path}' has no tokenizer in its metadata, so it cannot be used alone.")
    tensor_names = {t.name for t in reader.tensors}
    config = _config(meta, arch, tensor_names)
    text = config.get("text_config", config)
    if None in (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]):
        raise GGUFError(f"'{path}' lacks the {arch}.* hyper-parameters needed to build the model.")
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None and arch == "gemma4":
        _gemma4_rope(_tensor(rope_freqs, arch, config), config)
    elif rope_freqs is not None:
        dims = meta.get(f"{arch}.rope.dimension_count") or config["head_dim"]
        scaling = _llama3_rope_scaling(
            _tensor(rope_freqs, arch, config), dims=int(dims), base=config["rope_theta"]
        )
        if scaling is not None:
            config["rope_scaling"] = scaling
    return arch, config


def _write_model(
    reader: Any,
    meta: dict[str, Any],
    arch: str,
    config: dict[str, Any],
    directory: Path,
    *,
    bar: _Bar,
    source: Path,
    dtype: str,
) -> None:
    """Write the MLX model directory's files: the weights as `dtype`, ``config.json``, the
    tokenizer and where it came from."""
    import mlx.core as mx

    store = getattr(mx, dtype)
    weights: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = _mlx_name(tensor.name, arch)
        if name is not None:
            weights[name] = mx.array(_tensor(tensor, arch, config)).astype(store)
            mx.eval(weights[name])
        bar.advance(int(tensor.n_bytes))
    mx.save_safetensors(
        str(directory / "model.safetensors"),
        weights,
        metadata={"format": "mlx", "source": source.name},
    )
    del weights
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer_files(meta, arch, directory)
    (directory / "mlx_nbengine_source.json").write_text(
        json.dumps(
            {
                "gguf": source.name,
                "size": source.stat().st_size,
                "converter": converter_tag(dtype),
            }
        )
    )


def remove_older_conversions(target: Path) -> list[Path]:
    """Delete the siblings of `target` that converted the same GGUF file (same name and
    size, per their ``mlx_nbengine_source.json``) with another converter version."""
    try:
        source = json.loads((target / "mlx_nbengine_source.json").read_text())
    except (OSError, ValueError):
        return []
    removed = []
    for sibling in target.parent.iterdir():
        if sibling == target or not sibling.is_dir() or sibling.name.startswith("."):
            continue
        try:
            other = json.loads((sibling / "mlx_nbengine_source.json").read_text())
        except (OSError, ValueError):
            continue
        same_file = (other.get("gguf"), other.get("size")) == (source["gguf"], source["size"])
        if same_file and other.get("converter") != source["converter"]:
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed
