"""The tiny vision families (mlx-vlm), each registered with its tokenizer marks, config and
image processor. `load` returns each as kind ``"vision"``.

- ``qwen2_vl`` (`make_tiny_vlm`): two mlx-vlm `KVCache` layers, a two-block vision tower
  and Qwen2-VL's image processor (14-pixel patches merged 2x2: a 56x56 image becomes 4
  image tokens).
- ``gemma4`` (`make_tiny_gemma4_vlm`): mlx-vlm `RotatingKVCache(max_size=sliding_window)`
  and `KVCache` layers in turn (four layers, no KV sharing), image tokens attending to each
  other both ways (``use_bidirectional_attention: "vision"``), a two-block vision tower and
  Gemma 4's processor (8-pixel patches pooled 2x2, at most 16 image tokens an image).
- ``qwen3_5_vl`` (mlx-vlm model_type ``qwen3_5``; `make_tiny_qwen3_5_vlm`): hybrid like
  ``qwen3_5``, three mlx-vlm `ArraysCache` (gated-delta linear attention) layers then one
  `KVCache` (``full_attention_interval=4``), multimodal rotary positions, a two-block vision
  tower and mlx-vlm's Qwen3-VL processor (8-pixel patches merged 2x2, at most 64 image
  tokens an image; 64x64 gives 16).

One writer (`_write_vlm`) serves all three: a family is its marks, its chat template, the
tokens its processor reads as tokenizer attributes, and a function from the token ids to
its config.json and its processor's file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from mlx_nbengine.testing.families import Family, Options, make_tiny_model, register
from mlx_nbengine.testing.text import (
    LINEAR_ATTENTION,
    gemma4_rope,
    save_random_weights,
    text_common,
)
from mlx_nbengine.testing.tokenizer import VOCAB_SIZE, make_tiny_tokenizer, special_ids

VisionConfig = Callable[[dict[str, int], Options], tuple[dict[str, Any], dict[str, Any]]]


@dataclass(frozen=True)
class Vision:
    """A vision family's parts: its image marks (ids right after the special tokens), chat
    template, `config(ids, options)` giving config.json and the processor's file (named
    `processor_file`), and `named_tokens`, which tokenizer_config.json makes tokenizer
    attributes (``tokenizer.image_token``), where Gemma 4's processor looks for them."""

    tokens: tuple[str, ...]
    chat_template: str
    config: VisionConfig
    processor_file: str
    named_tokens: dict[str, str] | None = None


def _write_vlm(vision: Vision, directory: Path, options: Options) -> Path:
    """Write a vision family's directory: tokenizer, random weights, config, processor."""
    make_tiny_tokenizer(
        directory,
        extra_special_tokens=vision.tokens,
        chat_template=vision.chat_template,
        named_special_tokens=vision.named_tokens,
    )
    config, processor = vision.config(special_ids(vision.tokens), options)
    _save_random_vlm(config, directory, seed=options.seed, dtype=options.dtype)
    (directory / vision.processor_file).write_text(json.dumps(processor, indent=2))
    return directory


def vision_family(name: str, vision: Vision) -> Family:
    """Register `vision` as the vision family `name`."""
    return register(Family(name, "vision", partial(_write_vlm, vision)))


def _save_random_vlm(config: dict[str, Any], directory: Path, *, seed: int, dtype: str) -> None:
    """Build the mlx-vlm model `config` describes, write random weights and config.json."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    arch, _ = get_model_and_args(config=dict(config))
    # from_dict adds the text_config that update_module_configs then reads, as mlx-vlm's loader.
    working = json.loads(json.dumps(config))
    model_config = arch.ModelConfig.from_dict(working)
    model_config = update_module_configs(model_config, arch, working, ["text", "vision"])
    model = arch.Model(model_config)
    save_random_weights(model, directory, seed=seed, dtype=dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2))


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


VL_CHAT_TEMPLATE = (
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


def _qwen2_vl(ids: dict[str, int], options: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen2-VL: two layers, multimodal rotary sections, a two-block vision tower."""
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
    return config, _QWEN2_VL_PREPROCESSOR


vision_family(
    "qwen2_vl",
    Vision(VISION_TOKENS, VL_CHAT_TEMPLATE, _qwen2_vl, "preprocessor_config.json"),
)


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


def _gemma4(ids: dict[str, int], options: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 4: four decoder layers, sliding-window and full attention in turn, without KV
    sharing or per-layer inputs; ``use_bidirectional_attention: "vision"``, so in mlx-vlm's
    single-call prefill the image tokens attend to each other both ways. The vision tower has
    two blocks on 8-pixel patches pooled 2x2, and ``processor_config.json`` caps an image at
    16 soft tokens: a 64x64 image becomes 16 image tokens, 80x48 (either way round) 15 and
    200x150 12. The chat template writes ``<|image|>`` for an ``{"type": "image"}`` part;
    the processor expands it to ``<|image>`` + n x ``<|image|>`` + ``<image|>``."""
    patch_size, pooling, soft_tokens = 8, 2, 16
    text_config = _gemma4_text(ids, sliding_window=options.sliding_window)
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
    return config, processor


def _gemma4_text(ids: dict[str, int], *, sliding_window: int) -> dict[str, Any]:
    """The tiny Gemma 4 language model: sliding-window and full attention in turn."""
    return {
        **text_common(ids),
        "model_type": "gemma4_text",
        "num_hidden_layers": 4,
        "global_head_dim": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": sliding_window,
        "sliding_window_pattern": 2,
        "rope_parameters": gemma4_rope(),
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


vision_family(
    "gemma4",
    Vision(
        GEMMA4_VISION_TOKENS,
        _GEMMA4_CHAT_TEMPLATE,
        _gemma4,
        "processor_config.json",
        named_tokens={
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "image_token": "<|image|>",
            "video_token": "<|video|>",
        },
    ),
)


def _qwen3_5_vl(ids: dict[str, int], options: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen 3.5 with vision: a four-layer hybrid (three gated-delta layers, then one of full
    attention: Qwen3.5's own layout) with interleaved multimodal rotary positions on a
    quarter of each head. The vision tower has two blocks on 8-pixel patches merged 2x2
    (16-pixel cells, sides rounded to the nearest cell, at most 64 image tokens): a 64x64
    image becomes 16 image tokens, 80x48 (either way round) 15 and 200x150 54."""
    text_config = {
        **text_common(ids),
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        **LINEAR_ATTENTION,
        # 32 * 0.25 = 8 rotary dims: 4 frequencies split (time, height, width).
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 100000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }
    vision_config, preprocessor = qwen3_5_vision(patch_size=8, merge_size=2)
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
    return config, preprocessor


def qwen3_5_vision(*, patch_size: int, merge_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
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


vision_family(
    "qwen3_5_vl",
    Vision(VISION_TOKENS, VL_CHAT_TEMPLATE, _qwen3_5_vl, "preprocessor_config.json"),
)


def make_tiny_vlm(directory: str | Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a tiny random-weight Qwen2-VL model directory (``qwen2_vl``) and return it.

    Besides the text files it has ``preprocessor_config.json`` and a chat template that
    writes ``<|vision_start|><|image_pad|><|vision_end|>`` for an ``{"type": "image"}``
    content part."""
    return make_tiny_model("qwen2_vl", directory, seed=seed, dtype=dtype)


def make_tiny_qwen3_5_vlm(directory: str | Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a tiny random-weight Qwen3.5 vision model directory (``qwen3_5_vl``): tokens and
    chat template as `make_tiny_vlm`'s, mlx-vlm's Qwen3-VL processor."""
    return make_tiny_model("qwen3_5_vl", directory, seed=seed, dtype=dtype)


def make_tiny_gemma4_vlm(
    directory: str | Path, *, seed: int = 0, dtype: str = "float32", sliding_window: int = 64
) -> Path:
    """Write a tiny random-weight Gemma 4 vision model directory (``gemma4``) whose sliding
    layers keep `sliding_window` tokens."""
    return make_tiny_model(
        "gemma4", directory, seed=seed, dtype=dtype, sliding_window=sliding_window
    )
