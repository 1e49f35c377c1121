"""Real-shape models: random weights in published shapes, MLX-quantized, and their GGUFs.

`SHAPES` holds the text models' published shapes (their config.json); a hybrid's dense twin
has the same width, depth, MLP and full-attention heads, every layer full attention
(qwen3). Speed does not depend on the weights' values, so these measure what the real
models cost without downloading them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlx_nbengine.models import patches
from mlx_nbengine.testing.gguf import Rows, write_gguf
from mlx_nbengine.testing.text import gemma4_rope
from mlx_nbengine.testing.tokenizer import make_tiny_tokenizer, special_ids

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
        "rope_parameters": gemma4_rope(),
    },
}
# Gemma 4 E4B's text decoder: 42 layers of width 2,560, five sliding to one full, two KV
# heads, the last 18 layers sharing KV, single-width MLPs of 10,240.
SHAPES["gemma4-e4b"] = {
    **SHAPES["gemma4-e2b"],
    "hidden_size": 2560,
    "num_hidden_layers": 42,
    "intermediate_size": 10240,
    "num_key_value_heads": 2,
    "sliding_window_pattern": 6,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
    "num_kv_shared_layers": 18,
    "use_double_wide_mlp": False,
}


def shape_config(shape: str, *, dense: bool) -> dict[str, Any]:
    """The config.json of `shape` (or of its dense twin), with the tiny tokenizer's ids."""
    ids = special_ids()
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


def vision_config(shape: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Qwen 3.5 hybrid `shape` as Qwen publishes the family, with a vision tower (mlx-vlm's
    ``qwen3_5``): the text model's config under ``text_config`` with multimodal rotary
    positions (sections 11, 11, 10 of the rotated quarter, interleaved), beside the tiny
    vision tower of `make_tiny_qwen3_5_vlm` widened to the text model's width (the tower's
    own cost is not what this measures). Returns the config and the image processor's."""
    from mlx_nbengine.testing.vision import VISION_TOKENS, qwen3_5_vision

    text = shape_config(shape, dense=False)["text_config"]
    ids = special_ids(VISION_TOKENS)
    text.update(bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"])
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    vision, processor = qwen3_5_vision(patch_size=8, merge_size=2)
    vision["out_hidden_size"] = text["hidden_size"]
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vocab_size": text["vocab_size"],
        "tie_word_embeddings": True,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids["<eos>"],
    }
    return config, processor


def _vision_model(config: dict[str, Any]) -> Any:
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    arch, _ = get_model_and_args(config=dict(config))
    working = json.loads(json.dumps(config))  # from_dict adds what update_module_configs reads
    model_config = arch.ModelConfig.from_dict(working)
    model_config = update_module_configs(model_config, arch, working, ["text", "vision"])
    return arch.Model(model_config)


def make_shaped_model(
    shape: str,
    directory: str | Path,
    *,
    dense: bool = False,
    vision: bool = False,
    bits: int = 8,
    group_size: int = 64,
    seed: int = 0,
) -> Path:
    """Write a random-weight model in a published shape (`SHAPES`: ``qwen3_5-0.8b``, ``qwen3_5-2b``,
    ``gemma4-e2b``, ``gemma4-e4b``), or a hybrid's dense twin (`dense`), or a hybrid with a vision
    tower (`vision`: `vision_config`, loaded through mlx-vlm), its language model MLX-quantized at
    `bits` and `group_size`, with the tiny tokenizer (its ids lie below the vocabulary; the head
    still computes every row). Speed does not depend on the weights' values. Weights are drawn
    and quantized one module at a time, so a 2B model needs about its quantized size in memory
    (E2B's per-layer input table, 9.4 GB as float32, is drawn whole; E4B's 11.3 GB)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    if vision and (dense or SHAPES[shape].get("model_type") == "gemma4_text"):
        raise ValueError(f"{shape}{' (dense)' if dense else ''} has no vision form here")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    processor = None
    if vision:
        config, processor = vision_config(shape)
        model = _vision_model(config)
    else:
        config = shape_config(shape, dense=dense)
        model_class, args_class = patches.model_classes(config)
        model = model_class(args_class.from_dict(config))
    config["quantization"] = {"group_size": group_size, "bits": bits}
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
        class_predicate=lambda path, m: (
            isinstance(m, nn.Linear | nn.Embedding)
            and m.weight.shape[-1] % group_size == 0
            and not path.startswith("vision_tower")  # as mlx-vlm's converter leaves it
        ),
    )
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        mx.eval(value)
        weights[name] = value
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if processor is None:
        make_tiny_tokenizer(directory)
    else:
        from mlx_nbengine.testing.vision import VISION_TOKENS, VL_CHAT_TEMPLATE

        make_tiny_tokenizer(
            directory, extra_special_tokens=VISION_TOKENS, chat_template=VL_CHAT_TEMPLATE
        )
        (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return directory


# A matrix with more values than this is written a block of rows at a time (E2B's per-layer
# input table has 2.35 billion: 9.4 GB as float32, and quantizing makes copies of that).
_CHUNKED_VALUES = 1 << 26


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
                yield name.removeprefix("language_model."), Rows(rows, w.shape[0])
            else:
                yield name.removeprefix("language_model."), rows(0, w.shape[0])

    return write_gguf(family, path, source, quant, weights=weights())
