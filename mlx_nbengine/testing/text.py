"""The tiny text families, each registered with the config.json it writes.

Families and the cache layout they produce (one entry per layer):

- ``llama`` (core): plain `KVCache` everywhere.
- ``gemma3_text`` (core): `RotatingKVCache(max_size=sliding_window)` on sliding layers and
  `KVCache` on every second layer (``sliding_window_pattern=2``).
- ``qwen3_5`` (core): hybrid; `ArraysCache` (gated-delta linear attention) on even layers
  and `KVCache` (full attention) on odd ones (``full_attention_interval=2``).
- ``qwen3``, ``qwen2`` (extra): plain `KVCache`, like llama; qwen2 with Q/K/V biases.
- ``gemma4_text`` (extra): what Gemma 4 E2B has and the vision tiny model lacks: per-layer
  inputs and shared KV layers.

Every family shares `_text_common`'s sizes: small enough that a 1,500-token prefill takes a
fraction of a second on a CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from mlx_nbengine.models import patches
from mlx_nbengine.testing.families import Family, Options, register
from mlx_nbengine.testing.tokenizer import VOCAB_SIZE, make_tiny_tokenizer, special_ids

TextConfig = Callable[[dict[str, int], Options], dict[str, Any]]

# The tiny qwen3_5 families' linear-attention (gated delta) layers.
LINEAR_ATTENTION = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}


def text_common(ids: dict[str, int]) -> dict[str, Any]:
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


def gemma4_rope() -> dict[str, Any]:
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


def _write_text(config: TextConfig, directory: Path, options: Options) -> Path:
    """Write a text family's directory: `config` for its config.json (with `options.kv_heads`
    key/value heads, and as many query heads, at least 2), random weights, the tokenizer."""
    config_dict = config(special_ids(), options)
    if options.kv_heads is not None:
        text = config_dict.get("text_config", config_dict)
        text["num_key_value_heads"] = options.kv_heads
        text["num_attention_heads"] = max(2, options.kv_heads)
    directory.mkdir(parents=True, exist_ok=True)
    model_class, args_class = patches.model_classes(config_dict)
    model = model_class(args_class.from_dict(config_dict))
    save_random_weights(model, directory, seed=options.seed, dtype=options.dtype)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2))
    make_tiny_tokenizer(directory)
    return directory


def text_family(name: str, group: str, gguf_arch: str | None) -> Callable[[TextConfig], TextConfig]:
    """Register the decorated config function as the text family `name`."""

    def registered(config: TextConfig) -> TextConfig:
        register(Family(name, group, partial(_write_text, config), gguf_arch))
        return config

    return registered


def _plain(architecture: str, rope_theta: float, model_type: str) -> TextConfig:
    """A plain `KVCache` family's config function (two layers by default)."""

    def config(ids: dict[str, int], options: Options) -> dict[str, Any]:
        return {
            **text_common(ids),
            "model_type": model_type,
            "architectures": [architecture],
            "num_hidden_layers": options.num_layers or 2,
            "rope_theta": rope_theta,
        }

    return config


text_family("llama", "core", "llama")(_plain("LlamaForCausalLM", 10_000.0, "llama"))


@text_family("gemma3_text", "core", "gemma3")
def _gemma3_text(ids: dict[str, int], options: Options) -> dict[str, Any]:
    """Gemma 3: sliding-window and full attention in turn (four layers by default)."""
    return {
        **text_common(ids),
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": options.num_layers or 4,
        "query_pre_attn_scalar": 32,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": options.sliding_window,
        "sliding_window_pattern": 2,
    }


@text_family("qwen3_5", "core", "qwen35")
def _qwen3_5(ids: dict[str, int], options: Options) -> dict[str, Any]:
    """The hybrid ``qwen3_5`` family: linear attention with full attention every 2nd layer."""
    common = text_common(ids)
    text_config = {
        **common,
        "model_type": "qwen3_5_text",
        "num_hidden_layers": options.num_layers or 4,
        "full_attention_interval": 2,
        **LINEAR_ATTENTION,
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


text_family("qwen3", "extra", "qwen3")(_plain("Qwen3ForCausalLM", 1_000_000.0, "qwen3"))
text_family("qwen2", "extra", "qwen2")(_plain("Qwen2ForCausalLM", 1_000_000.0, "qwen2"))


@text_family("gemma4_text", "extra", "gemma4")
def _gemma4_text(ids: dict[str, int], options: Options) -> dict[str, Any]:
    """The text-only Gemma 4 family with what E2B has and the vision tiny model lacks:
    per-layer inputs, and its last half of layers reading the keys and values of the
    last unshared layer of their kind (`num_kv_shared_layers`), with double-wide MLPs
    there. Six layers by default: sliding, sliding, full, twice over (llama.cpp wants the
    unshared layers to end with a sliding then a full one, as E2B's do)."""
    layers = options.num_layers or 6
    kinds = (["sliding_attention"] * 2 + ["full_attention"]) * (layers // 3 + 1)
    return {
        **text_common(ids),
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "num_hidden_layers": layers,
        "global_head_dim": 64,
        "layer_types": kinds[:layers],
        "sliding_window": options.sliding_window,
        "sliding_window_pattern": 3,
        "rope_parameters": gemma4_rope(),
        "num_kv_shared_layers": layers // 2,
        "hidden_size_per_layer_input": 32,
        "vocab_size_per_layer_input": VOCAB_SIZE,
        "use_double_wide_mlp": True,
        "final_logit_softcapping": 30.0,
    }


def save_random_weights(model: Any, directory: Path, *, seed: int, dtype: str) -> None:
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
