"""Tiny random-weight model directories for tests, built offline.

A *tiny model* is a real MLX model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) whose weights are random and whose sizes
are small enough that a 1,500-token prefill takes a fraction of a second on a
CPU. It loads through `mlx_nbengine.models.load` exactly like a real model, so
tests exercise the same code paths (cache classes, chat template, BOS handling)
without downloading anything.

The modules:

- `families`: the registry of families (`make_tiny_model` looks a name up there) and the
  quantized variant;
- `text`, `vision`: the families themselves, each registered with what it writes;
- `tokenizer`: the byte-level BPE every family shares;
- `gguf`: the text families as llama.cpp's converter writes them;
- `shapes`: random weights in published shapes (Qwen 3.5 0.8B/2B, Gemma 4 E2B) and their
  GGUFs, for the benchmarks;
- `hub`: a Hugging Face hub cache laid out by hand.
"""

from __future__ import annotations

# The family modules register their families on import, before the groups are read.
from mlx_nbengine.testing import text, vision  # noqa: F401
from mlx_nbengine.testing.families import make_tiny_model, make_tiny_quantized_model, names
from mlx_nbengine.testing.gguf import make_tiny_gguf
from mlx_nbengine.testing.hub import add_to_hub_cache
from mlx_nbengine.testing.shapes import SHAPES, make_shaped_gguf, make_shaped_model
from mlx_nbengine.testing.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, make_tiny_tokenizer
from mlx_nbengine.testing.vision import make_tiny_gemma4_vlm, make_tiny_qwen3_5_vlm, make_tiny_vlm

FAMILIES = names("core")
EXTRA_FAMILIES = names("extra")
VISION_FAMILIES = names("vision")

__all__ = [
    "EXTRA_FAMILIES",
    "FAMILIES",
    "SHAPES",
    "SPECIAL_TOKENS",
    "VISION_FAMILIES",
    "VOCAB_SIZE",
    "add_to_hub_cache",
    "make_shaped_gguf",
    "make_shaped_model",
    "make_tiny_gemma4_vlm",
    "make_tiny_gguf",
    "make_tiny_model",
    "make_tiny_quantized_model",
    "make_tiny_qwen3_5_vlm",
    "make_tiny_tokenizer",
    "make_tiny_vlm",
]
