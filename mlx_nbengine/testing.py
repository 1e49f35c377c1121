"""Tiny random-weight model directories for tests, built offline.

A *tiny model* is a real MLX model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) whose weights are random and whose sizes
are small enough that a 1,500-token prefill takes a fraction of a second on a
CPU. It loads through `mlx_nbengine.models.load` exactly like a real model, so
tests exercise the same code paths (cache classes, chat template, BOS handling)
without downloading anything.

Families and the cache layout they produce (one entry per layer):

- ``llama``: plain `KVCache` everywhere.
- ``gemma3_text``: `RotatingKVCache(max_size=sliding_window)` on sliding
  layers and `KVCache` on every second layer (``sliding_window_pattern=2``).
- ``qwen3_5``: hybrid; `ArraysCache` (gated-delta linear attention) on even
  layers and `KVCache` (full attention) on odd ones (``full_attention_interval=2``).
- ``qwen2_vl`` (vision, mlx-vlm; `make_tiny_vlm`): two mlx-vlm `KVCache` layers,
  a two-block vision tower and Qwen2-VL's image processor.
- ``gemma4`` (vision, mlx-vlm; `make_tiny_gemma4_vlm`): mlx-vlm
  `RotatingKVCache(max_size=sliding_window)` and `KVCache` layers in turn (four layers,
  no KV sharing), image tokens attending to each other both ways
  (``use_bidirectional_attention: "vision"``), a two-block vision tower and Gemma 4's
  processor (8-pixel patches pooled 2x2, at most 16 image tokens an image).
- ``qwen3_5_vl`` (vision, mlx-vlm model_type ``qwen3_5``; `make_tiny_qwen3_5_vlm`): hybrid
  like ``qwen3_5``, three mlx-vlm `ArraysCache` (gated-delta linear attention) layers then
  one `KVCache` (``full_attention_interval=4``), multimodal rotary positions, a two-block
  vision tower and mlx-vlm's Qwen3-VL processor (8-pixel patches merged 2x2, at most 64
  image tokens an image; 64x64 gives 16).

The tokenizer is a byte-level BPE trained with the `tokenizers` library on the
text in `_TRAINING_TEXT` (vocab 512), with special tokens ``<bos>``, ``<eos>``,
``<pad>``, ``<|im_start|>``, ``<|im_end|>``; encoding with special tokens
prepends ``<bos>``, and the chat template is ChatML-like.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_nbengine.models import patches

__all__ = [
    "EXTRA_FAMILIES",
    "FAMILIES",
    "VISION_FAMILIES",
    "VOCAB_SIZE",
    "add_to_hub_cache",
    "make_tiny_gemma4_vlm",
    "make_tiny_gguf",
    "make_tiny_model",
    "make_tiny_quantized_model",
    "make_tiny_qwen3_5_vlm",
    "make_tiny_tokenizer",
    "make_tiny_vlm",
]

FAMILIES = ("llama", "gemma3_text", "qwen3_5")
VISION_FAMILIES = ("qwen2_vl", "gemma4", "qwen3_5_vl")
# Also buildable: qwen3 and qwen2 (plain KVCache, like llama; Q/K/V biases), the GGUF
# converter's other architectures, and text-only gemma4_text (per-layer inputs, shared KV).
EXTRA_FAMILIES = ("qwen3", "qwen2", "gemma4_text")
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<|im_start|>", "<|im_end|>"]

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Enough varied English, digits and code-ish punctuation for 500 BPE merges.
_TRAINING_TEXT = """\
The Eiffel Tower is located in the city of Paris, the capital of France.
A block of two hundred and fifty six tokens is cached on disk and restored later.
Notebook users edit long prompts and run the cell again; the answer starts at once.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 100 256 512 1024 2048 4096
Once upon a time there was a small model that learned to count and to speak.
The weather today is sunny with a light breeze from the west; tomorrow it may rain.
Machine learning models predict the next token from the tokens that came before.
Question: What is the capital of Italy? Answer: The capital of Italy is Rome.
Question: What is two plus two? Answer: Two plus two is four.
system user assistant hello world thank you please summarize explain translate
Jupyter kernels run code cells; magics start with a percent sign like %%llm.
"""


def make_tiny_tokenizer(
    directory: str | Path,
    *,
    extra_special_tokens: tuple[str, ...] = (),
    chat_template: str = _CHAT_TEMPLATE,
    named_special_tokens: dict[str, str] | None = None,
) -> Path:
    """Train the tiny byte-level BPE and write tokenizer.json and tokenizer_config.json.

    `extra_special_tokens` get ids right after `SPECIAL_TOKENS` (the vision families'
    image tokens), so the other families' ids never move. `named_special_tokens` (for
    example ``{"image_token": "<|image|>"}``) go in tokenizer_config.json's
    ``extra_special_tokens``, which makes them tokenizer attributes (``tokenizer.image_token``,
    ``tokenizer.image_token_id``), where Gemma 4's processor looks for them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the text changes counts, not the merges' order; 20 copies make ties rare.
    tok.train_from_iterator([_TRAINING_TEXT] * 20, trainer=trainer)
    bos_id = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos_id)]
    )
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 131072,
        "chat_template": chat_template,
    }
    if named_special_tokens:
        tokenizer_config["extra_special_tokens"] = dict(named_special_tokens)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return directory


# The tiny qwen3_5 families' linear-attention (gated delta) layers.
_LINEAR_ATTENTION = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}


def _text_common(ids: dict[str, int]) -> dict[str, Any]:
    """The language model's sizes every tiny family shares, and its special token ids."""
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        # Few, wide heads: MLX's CPU attention costs per head, and 1,500 tokens must stay fast.
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids["<eos>"],
        "pad_token_id": ids["<pad>"],
    }


def _gemma4_rope() -> dict[str, Any]:
    """Gemma 4's two rotary embeddings (a fresh dict): the full layers rotate a quarter of
    each head ("proportional"), the sliding layers all of it."""
    return {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
    }


def _config(family: str, *, sliding_window: int, num_layers: int | None) -> dict[str, Any]:
    ids = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    common = _text_common(ids)
    plain = {  # plain KVCache families: architecture class, rope base
        "llama": ("LlamaForCausalLM", 10_000.0),
        "qwen2": ("Qwen2ForCausalLM", 1_000_000.0),
        "qwen3": ("Qwen3ForCausalLM", 1_000_000.0),
    }
    if family in plain:
        architecture, rope_theta = plain[family]
        return {
            **common,
            "model_type": family,
            "architectures": [architecture],
            "num_hidden_layers": num_layers or 2,
            "rope_theta": rope_theta,
        }
    if family == "gemma3_text":
        return {
            **common,
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "num_hidden_layers": num_layers or 4,
            "query_pre_attn_scalar": 32,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "sliding_window": sliding_window,
            "sliding_window_pattern": 2,
        }
    if family == "qwen3_5":
        return _qwen3_5_config(common, num_layers=num_layers)
    if family == "gemma4_text":
        return _gemma4_text_config(common, sliding_window=sliding_window, num_layers=num_layers)
    raise ValueError(
        f"unknown tiny model family {family!r}; "
        f"choose one of {FAMILIES + EXTRA_FAMILIES + VISION_FAMILIES}"
    )


def _qwen3_5_config(common: dict[str, Any], *, num_layers: int | None) -> dict[str, Any]:
    """The hybrid ``qwen3_5`` family: linear attention with full attention every 2nd layer."""
    text_config = {
        **common,
        "model_type": "qwen3_5_text",
        "num_hidden_layers": num_layers or 4,
        "full_attention_interval": 2,
        **_LINEAR_ATTENTION,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 100000.0,
            "partial_rotary_factor": 0.25,
        },
    }
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForCausalLM"],
        "text_config": text_config,
        "tie_word_embeddings": True,
        "bos_token_id": common["bos_token_id"],
        "eos_token_id": common["eos_token_id"],
    }


def _gemma4_text_config(
    common: dict[str, Any], *, sliding_window: int, num_layers: int | None
) -> dict[str, Any]:
    """The text-only Gemma 4 family with what E2B has and the vision tiny model lacks:
    per-layer inputs, and its last half of layers reading the keys and values of the
    last unshared layer of their kind (`num_kv_shared_layers`), with double-wide MLPs
    there. Six layers by default: sliding, sliding, full, twice over (llama.cpp wants the
    unshared layers to end with a sliding then a full one, as E2B's do)."""
    layers = num_layers or 6
    kinds = (["sliding_attention"] * 2 + ["full_attention"]) * (layers // 3 + 1)
    return {
        **common,
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "num_hidden_layers": layers,
        "global_head_dim": 64,
        "layer_types": kinds[:layers],
        "sliding_window": sliding_window,
        "sliding_window_pattern": 3,
        "rope_parameters": _gemma4_rope(),
        "num_kv_shared_layers": layers // 2,
        "hidden_size_per_layer_input": 32,
        "vocab_size_per_layer_input": VOCAB_SIZE,
        "use_double_wide_mlp": True,
        "final_logit_softcapping": 30.0,
    }


def _save_random_weights(model: Any, directory: Path, *, seed: int, dtype: str) -> None:
    """Write `model`'s parameters, drawn at random from `seed`, as ``model.safetensors``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    target = getattr(mx, dtype)
    key = mx.random.key(seed)
    weights = {}
    # Explicit keys (not mx.random.seed) keep the caller's global random stream untouched.
    for name, value in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        if name.endswith("A_log"):
            value = mx.log(mx.random.uniform(1.0, 16.0, value.shape, key=sub))
        elif value.ndim >= 2:
            fan_in = value.size // value.shape[0]
            value = mx.random.normal(value.shape, key=sub) * fan_in**-0.5
        elif name.endswith(".bias"):
            # Linear biases (qwen2's Q/K/V): MLX initialises them from its global random
            # stream, which would make the same seed write different models.
            value = mx.random.uniform(-0.125, 0.125, value.shape, key=sub)
        # Other 1-D parameters keep their deterministic init (norm scales of one...).
        weights[name] = value.astype(target)
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})


def make_tiny_model(
    family: str,
    directory: str | Path,
    *,
    sliding_window: int = 64,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: str = "float32",
    kv_heads: int | None = None,
) -> Path:
    """Write a random-weight model directory of `family` into `directory` and return it.

    `sliding_window` only matters for ``gemma3_text`` and ``gemma4``; `num_layers` overrides
    the depth of a text family (llama 2, the others 4, so both layer kinds exist);
    `seed` fixes the weights; `dtype` is the dtype the weights are stored in; `kv_heads`
    (a text family) sets the key/value heads (default 1) and as many query heads, at
    least 2: tensor parallelism over N ranks splits both, so it needs N of each.
    """
    if family == "gemma4":
        return make_tiny_gemma4_vlm(
            directory, seed=seed, dtype=dtype, sliding_window=sliding_window
        )
    if family == "qwen3_5_vl":
        return make_tiny_qwen3_5_vlm(directory, seed=seed, dtype=dtype)
    if family in VISION_FAMILIES:
        return make_tiny_vlm(directory, seed=seed, dtype=dtype)
    config = _config(family, sliding_window=sliding_window, num_layers=num_layers)
    if kv_heads is not None:
        text = config.get("text_config", config)
        text["num_key_value_heads"] = kv_heads
        text["num_attention_heads"] = max(2, kv_heads)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    model_class, args_class = patches.model_classes(config)
    model = model_class(args_class.from_dict(config))
    _save_random_weights(model, directory, seed=seed, dtype=dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    make_tiny_tokenizer(directory)
    return directory


def make_tiny_quantized_model(
    family: str,
    directory: str | Path,
    *,
    bits: int = 4,
    group_size: int = 32,
    seed: int = 0,
    kv_heads: int | None = None,
) -> Path:
    """A tiny text model of `family` quantized by mlx-lm (MLX's affine format, as the
    mlx-community checkpoints are), written into `directory` (which must not exist);
    `kv_heads` as in `make_tiny_model`."""
    from mlx_lm import convert

    directory = Path(directory)
    with tempfile.TemporaryDirectory() as tmp:
        source = make_tiny_model(family, Path(tmp) / "float32", seed=seed, kv_heads=kv_heads)
        convert(str(source), str(directory), quantize=True, q_group_size=group_size, q_bits=bits)
    return directory


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
    import tempfile

    path = Path(path)
    if family not in _GGUF_ARCHS:
        raise ValueError(f"make_tiny_gguf supports {', '.join(_GGUF_ARCHS)}, not {family!r}")
    if source is None:
        # A fresh source model, in a folder removed once the GGUF file is written.
        kw = {"num_layers": 6} if family == "gemma3_text" else {}
        with tempfile.TemporaryDirectory(prefix="tiny-gguf-src-") as scratch:
            made = make_tiny_model(family, scratch, seed=seed, **kw)
            return _write_tiny_gguf(family, path, made, quant)
    return _write_tiny_gguf(family, path, Path(source), quant)


_GGUF_ARCHS = {
    "llama": "llama",
    "gemma3_text": "gemma3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_5": "qwen35",
    "gemma4_text": "gemma4",
}


def _write_tiny_gguf(
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
    arch = _GGUF_ARCHS[family]
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
    _add_gguf_tokenizer(writer, source, vocab_size=config.get("vocab_size"))
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


def _add_gguf_tokenizer(writer: Any, source: Path, *, vocab_size: int | None = None) -> None:
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
        if isinstance(w, _Rows):  # a large matrix: converted and quantized in blocks of rows
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


# A matrix with more values than this is written a block of rows at a time (E2B's per-layer
# input table has 2.35 billion: 9.4 GB as float32, and quantizing makes copies of that).
_CHUNKED_VALUES = 1 << 26


@dataclass(frozen=True)
class _Rows:
    """A large matrix, read as float32 a block of `step` rows at a time (`rows(start, stop)`)
    out of `count`."""

    rows: Callable[[int, int], Any]
    count: int
    step: int = 4096


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

_VL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen2-VL's image processor: 14-pixel patches merged 2x2, 56x56 pixels at least.
_QWEN2_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 64,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _qwen_vl_tokenizer(directory: Path) -> dict[str, int]:
    """Write the tiny tokenizer with Qwen-VL's image marks and chat template; its ids."""
    make_tiny_tokenizer(
        directory, extra_special_tokens=VISION_TOKENS, chat_template=_VL_CHAT_TEMPLATE
    )
    return {name: i for i, name in enumerate([*SPECIAL_TOKENS, *VISION_TOKENS])}


def make_tiny_vlm(directory: str | Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a tiny random-weight Qwen2-VL model directory (mlx-vlm) and return it.

    Besides the text files it has ``preprocessor_config.json`` (Qwen2-VL's image
    processor: 14-pixel patches merged 2x2, so a 56x56 image becomes 4 image tokens)
    and a chat template that writes ``<|vision_start|><|image_pad|><|vision_end|>``
    for an ``{"type": "image"}`` content part. `load` returns it as kind ``"vision"``.
    """
    directory = Path(directory)
    ids = _qwen_vl_tokenizer(directory)
    config = {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        # Multimodal rotary sections (time, height, width) must sum to head_dim / 2 = 16.
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "tie_word_embeddings": True,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids["<eos>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }
    _save_random_vlm(config, directory, seed=seed, dtype=dtype)
    (directory / "preprocessor_config.json").write_text(
        json.dumps(_QWEN2_VL_PREPROCESSOR, indent=2)
    )
    return directory


def _save_random_vlm(config: dict[str, Any], directory: Path, *, seed: int, dtype: str) -> None:
    """Build the mlx-vlm model `config` describes, write random weights and config.json."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    arch, _ = get_model_and_args(config=dict(config))
    # from_dict adds the text_config that update_module_configs then reads, as mlx-vlm's loader.
    working = json.loads(json.dumps(config))
    model_config = arch.ModelConfig.from_dict(working)
    model_config = update_module_configs(model_config, arch, working, ["text", "vision"])
    model = arch.Model(model_config)
    _save_random_weights(model, directory, seed=seed, dtype=dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def make_tiny_qwen3_5_vlm(directory: str | Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a tiny random-weight Qwen3.5 vision model directory (mlx-vlm) and return it.

    Its language model is hybrid like the ``qwen3_5`` text family: four layers, gated-delta
    linear attention (mlx-vlm `ArraysCache`) in the first three and full attention
    (`KVCache`) in the fourth (``full_attention_interval=4``, Qwen3.5's own layout), with
    interleaved multimodal rotary positions on a quarter of each head. The vision tower has
    two blocks on 8-pixel patches merged 2x2 (16-pixel cells, sides rounded to the nearest
    cell, at most 64 image tokens): a 64x64 image becomes 16 image tokens, 80x48 (either
    way round) 15 and 200x150 54. Tokens and chat template are `make_tiny_vlm`'s
    (``<|vision_start|><|image_pad|><|vision_end|>`` for an ``{"type": "image"}`` part),
    the processor is mlx-vlm's Qwen3-VL one. `load` returns it as kind ``"vision"``.
    """
    directory = Path(directory)
    ids = _qwen_vl_tokenizer(directory)
    text_config = {
        **_text_common(ids),
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        **_LINEAR_ATTENTION,
        # 32 * 0.25 = 8 rotary dims: 4 frequencies split (time, height, width).
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 100000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }
    vision_config, preprocessor = _qwen3_5_vision(patch_size=8, merge_size=2)
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": True,
        "bos_token_id": ids["<bos>"],
        # Set, not left to mlx-vlm: without it the loader adds Qwen's chat end id (248046).
        "eos_token_id": ids["<eos>"],
    }
    _save_random_vlm(config, directory, seed=seed, dtype=dtype)
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return directory


def _qwen3_5_vision(*, patch_size: int, merge_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tiny Qwen3.5 vision tower's config and its image processor's."""
    cell = patch_size * merge_size
    vision_config = {
        "model_type": "qwen3_5",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,  # the language model's hidden size
        "in_channels": 3,
        "patch_size": patch_size,
        "spatial_merge_size": merge_size,
        "temporal_patch_size": 2,
        # Learned positions on an 8x8 grid, interpolated to each image's patch grid.
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [],
    }
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": 2,
        "min_pixels": cell * cell,
        "max_pixels": cell * cell * 64,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    return vision_config, preprocessor


# Gemma 4-style image marks (begin, end, image token); `<|video|>` is here because
# Gemma 4's processor adds it to the tokenizer (past the model's vocab) when it is missing.
GEMMA4_VISION_TOKENS = ("<|image>", "<image|>", "<|image|>", "<|video|>")

_GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_gemma4_vlm(
    directory: str | Path, *, seed: int = 0, dtype: str = "float32", sliding_window: int = 64
) -> Path:
    """Write a tiny random-weight Gemma 4 vision model directory (mlx-vlm) and return it.

    Four decoder layers, sliding-window (`sliding_window`) and full attention in turn,
    without KV sharing or per-layer inputs; ``use_bidirectional_attention: "vision"``, so
    in mlx-vlm's single-call prefill the image tokens attend to each other both ways. The
    vision tower has two blocks on 8-pixel patches pooled 2x2, and ``processor_config.json``
    caps an image at 16 soft tokens: a 64x64 image becomes 16 image tokens, 80x48 (either
    way round) 15 and 200x150 12. The chat template writes ``<|image|>`` for an
    ``{"type": "image"}`` content part; the processor expands it to
    ``<|image>`` + n x ``<|image|>`` + ``<image|>``. `load` returns it as kind ``"vision"``.
    """
    directory = Path(directory)
    make_tiny_tokenizer(
        directory,
        extra_special_tokens=GEMMA4_VISION_TOKENS,
        chat_template=_GEMMA4_CHAT_TEMPLATE,
        named_special_tokens={
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "image_token": "<|image|>",
            "video_token": "<|video|>",
        },
    )
    ids = {name: i for i, name in enumerate([*SPECIAL_TOKENS, *GEMMA4_VISION_TOKENS])}
    patch_size, pooling, soft_tokens = 8, 2, 16
    text_config = _gemma4_text(ids, sliding_window=sliding_window)
    vision_config, processor = _gemma4_vision(
        patch_size=patch_size, pooling=pooling, soft_tokens=soft_tokens
    )
    config = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": vision_config,
        # Null, not absent: mlx-vlm's loader would build (then drop) a full-size audio tower.
        "audio_config": None,
        "image_token_id": ids["<|image|>"],
        "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"],
        "video_token_id": ids["<|video|>"],
        "vision_soft_tokens_per_image": soft_tokens,
        "tie_word_embeddings": True,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"]],
    }
    _save_random_vlm(config, directory, seed=seed, dtype=dtype)
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return directory


def _gemma4_text(ids: dict[str, int], *, sliding_window: int) -> dict[str, Any]:
    """The tiny Gemma 4 language model: sliding-window and full attention in turn."""
    return {
        **_text_common(ids),
        "model_type": "gemma4_text",
        "num_hidden_layers": 4,
        "global_head_dim": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": sliding_window,
        "sliding_window_pattern": 2,
        "rope_parameters": _gemma4_rope(),
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": VOCAB_SIZE,
        "use_double_wide_mlp": False,
        "use_bidirectional_attention": "vision",
        "final_logit_softcapping": 30.0,
    }


def _gemma4_vision(
    *, patch_size: int, pooling: int, soft_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tiny Gemma 4 vision tower's config and its processor's (images and video)."""
    vision_config = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": patch_size,
        "pooling_kernel_size": pooling,
        "default_output_length": soft_tokens,
        # One-hot patch coordinates: an image is at most soft_tokens * pooling patches a side.
        "position_embedding_size": 64,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
        "use_bidirectional_attention": "vision",
        "rms_norm_eps": 1e-6,
    }
    image_processor = {
        "image_processor_type": "Gemma4ImageProcessor",
        "patch_size": patch_size,
        "pooling_kernel_size": pooling,
        "max_soft_tokens": soft_tokens,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "do_convert_rgb": True,
    }
    processor = {
        "processor_class": "Gemma4Processor",
        "image_seq_length": soft_tokens,
        "image_processor": image_processor,
        # The video processor's defaults (16-pixel patches pooled 3x3) would not fit the tower.
        "video_processor": {
            "patch_size": patch_size,
            "pooling_kernel_size": pooling,
            "max_soft_tokens": 70,
            "num_frames": 4,
        },
    }
    return vision_config, processor


def add_to_hub_cache(
    hub: str | Path,
    repo_id: str,
    files: list[Path],
    *,
    commit: str = "c" * 40,
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Lay `files` out in the hub cache `hub` as huggingface_hub does (blobs named by their
    hash, a snapshot of relative symlinks to them, `refs/<ref>` naming the commit) and
    return the snapshot folder; several commits of one repository share its blobs."""
    repo = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for file in files:
        digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        if not (repo / "blobs" / digest).exists():
            shutil.copy2(file, repo / "blobs" / digest)
        (snapshot / Path(file).name).symlink_to(Path("..", "..", "blobs", digest))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


# --- real-shape models: random weights in published shapes ----------------------------------

# The text models' published shapes (their config.json), and a dense twin of each hybrid: the
# same width, depth, MLP and full-attention heads, every layer full attention (qwen3).
_QWEN3_5_SHAPE = {
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "vocab_size": 248_320,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262_144,
    "tie_word_embeddings": True,
}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_5-0.8b": {"hidden_size": 1024, "intermediate_size": 3584},
    "qwen3_5-2b": {"hidden_size": 2048, "intermediate_size": 6144},
    # Gemma 4 E2B's text decoder (mlx-lm's gemma4_text defaults are its published config):
    # 35 layers, four sliding (heads of 256, window 512) to one full (heads of 512, a quarter
    # rotated), one KV head, the last 20 layers reading earlier layers' keys and values with
    # double-wide MLPs, and 256 per-layer input features a layer from a 262,144-row table.
    "gemma4-e2b": {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": 1536,
        "num_hidden_layers": 35,
        "intermediate_size": 6144,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "sliding_window": 512,
        "sliding_window_pattern": 5,
        # Spelled out, as the published config does (transformers assumes another pattern).
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
        "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256,
        "vocab_size": 262_144,
        "vocab_size_per_layer_input": 262_144,
        "use_double_wide_mlp": True,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131_072,
        "tie_word_embeddings": True,
        "rope_parameters": _gemma4_rope(),
    },
}


def _shape_config(shape: str, *, dense: bool) -> dict[str, Any]:
    ids = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    special = {"bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"]}
    if SHAPES[shape].get("model_type") == "gemma4_text":
        if dense:
            raise ValueError(f"{shape} has no dense twin (only the Qwen 3.5 hybrids do)")
        shaped = json.loads(json.dumps(SHAPES[shape]))  # a copy, nested dicts too
        return {**shaped, **special, "pad_token_id": ids["<pad>"]}
    sizes = {**_QWEN3_5_SHAPE, **SHAPES[shape]}
    if dense:
        return {
            **sizes,
            **special,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "rope_theta": 10_000_000.0,
        }
    text = {
        **sizes,
        **special,
        "model_type": "qwen3_5_text",
        "full_attention_interval": 4,
        "linear_num_value_heads": 16,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
    }
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForCausalLM"],
        "text_config": text,
        "tie_word_embeddings": True,
        **special,
    }


def make_shaped_model(
    shape: str,
    directory: str | Path,
    *,
    dense: bool = False,
    bits: int = 8,
    group_size: int = 64,
    seed: int = 0,
) -> Path:
    """Write a random-weight model in a published shape (`SHAPES`: ``qwen3_5-0.8b``,
    ``qwen3_5-2b``, ``gemma4-e2b``), or a hybrid's dense twin (`dense`), MLX-quantized at
    `bits` and `group_size`, with the tiny tokenizer (its ids lie below the vocabulary; the
    head still computes every row). Speed does not depend on the weights' values. Weights are
    drawn and quantized one module at a time, so a 2B model needs about its quantized size in
    memory (E2B's per-layer input table, 9.4 GB as float32, is drawn whole)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = _shape_config(shape, dense=dense)
    config["quantization"] = {"group_size": group_size, "bits": bits}
    model_class, args_class = patches.model_classes(config)
    model = model_class(args_class.from_dict(config))
    key = mx.random.key(seed)
    for _, module in model.named_modules():
        drawn = {}
        for name, value in module.items():
            if not isinstance(value, mx.array):
                continue
            key, sub = mx.random.split(key)
            if name == "A_log":
                drawn[name] = mx.log(mx.random.uniform(1.0, 16.0, value.shape, key=sub))
            elif value.ndim >= 2:
                fan_in = value.size // value.shape[0]
                drawn[name] = mx.random.normal(value.shape, key=sub) * fan_in**-0.5
        if drawn:
            module.update(drawn)
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: (
            isinstance(m, nn.Linear | nn.Embedding) and m.weight.shape[-1] % group_size == 0
        ),
    )
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        mx.eval(value)
        weights[name] = value
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    make_tiny_tokenizer(directory)
    return directory


def make_shaped_gguf(source: str | Path, path: str | Path, *, quant: str = "Q8_0") -> Path:
    """Write a `make_shaped_model` directory as a llama.cpp GGUF at `path`: the same weights
    (dequantized from MLX's format) the way llama.cpp's converter writes them
    (`make_tiny_gguf`'s rewrites), 2-D matrices as `quant`, the tiny tokenizer padded to the
    vocabulary. Tensors are dequantized and requantized one at a time: about the GGUF's size in
    memory, besides the source's, while it is written."""
    import mlx.core as mx
    import numpy as np

    source, path = Path(source), Path(path)
    config = json.loads((source / "config.json").read_text())
    family = {"qwen3_5": "qwen3_5", "qwen3": "qwen3", "gemma4_text": "gemma4_text"}[
        config["model_type"]
    ]
    group_size, bits = config["quantization"]["group_size"], config["quantization"]["bits"]
    raw = mx.load(str(source / "model.safetensors"))

    def rows_of(name: str, w: Any) -> Callable[[int, int], Any]:
        base = name.removesuffix(".weight")
        if base == name or f"{base}.scales" not in raw:
            return lambda start, stop: np.array(w[start:stop].astype(mx.float32))
        scales, biases = raw[f"{base}.scales"], raw[f"{base}.biases"]

        def rows(start: int, stop: int) -> Any:
            part = mx.dequantize(
                w[start:stop],
                scales[start:stop],
                biases[start:stop],
                group_size=group_size,
                bits=bits,
            )
            return np.array(part.astype(mx.float32))

        return rows

    def weights() -> Iterator[tuple[str, Any]]:  # one tensor (or a block of rows) at a time
        for name, w in raw.items():
            if name.endswith((".scales", ".biases")):
                continue
            rows = rows_of(name, w)
            if w.ndim == 2 and w.shape[0] * w.shape[1] * (32 // bits) > _CHUNKED_VALUES:
                yield name.removeprefix("language_model."), _Rows(rows, w.shape[0])
            else:
                yield name.removeprefix("language_model."), rows(0, w.shape[0])

    return _write_tiny_gguf(family, path, source, quant, weights=weights())
