"""The tiny model factories: each family loads through `load`, has the promised cache
layout, tokenizes with BOS and a chat template, and generates."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlx_nbengine.models import load
from mlx_nbengine.testing import FAMILIES, VOCAB_SIZE, make_tiny_model

EXPECTED_CACHES = {
    "llama": [KVCache, KVCache],
    "gemma3_text": [RotatingKVCache, KVCache, RotatingKVCache, KVCache],
    "qwen3_5": [ArraysCache, KVCache, ArraysCache, KVCache],
}


def greedy(lm, prompt: list[int], n: int) -> list[int]:
    cache = lm.make_cache()
    logits = lm.model(mx.array(prompt)[None], cache=cache)
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = lm.model(mx.array([[token]]), cache=cache)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_as_a_text_model(tiny_model_dir, family):
    lm = load(tiny_model_dir(family))
    assert lm.modality == "text"
    assert lm.model_type == family
    assert lm.processor is None
    assert lm.context_length == 8192
    assert len(lm.fingerprint) == 64


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_makes_its_cache_layout(tiny_model_dir, family):
    lm = load(tiny_model_dir(family))
    assert [type(c) for c in lm.make_cache()] == EXPECTED_CACHES[family]


@pytest.mark.parametrize("window", [64, 512])
def test_gemma_sliding_window_is_settable(tiny_model_dir, window):
    lm = load(tiny_model_dir("gemma3_text", sliding_window=window))
    rotating = [c for c in lm.make_cache() if isinstance(c, RotatingKVCache)]
    assert rotating and all(c.max_size == window for c in rotating)


def test_num_layers_overrides_depth(tiny_model_dir):
    lm = load(tiny_model_dir("gemma3_text", num_layers=6))
    assert len(lm.make_cache()) == 6


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_generates_deterministically_within_vocab(tiny_model_dir, family):
    lm = load(tiny_model_dir(family))
    prompt = lm.encode("The Eiffel Tower is located in")
    first = greedy(lm, prompt, 8)
    assert len(first) == 8 and all(0 <= t < VOCAB_SIZE for t in first)
    assert greedy(lm, prompt, 8) == first


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_prefill_fills_the_cache(tiny_model_dir, family):
    lm = load(tiny_model_dir(family))
    tokens = [(7 * i) % 500 + 5 for i in range(1500)]
    cache = lm.make_cache()
    mx.eval(lm.model(mx.array(tokens)[None], cache=cache))
    assert all(c.offset == 1500 for c in cache if not isinstance(c, ArraysCache))
    assert all(c[1] is not None for c in cache if isinstance(c, ArraysCache))


def test_tokenizer_prepends_bos_once_and_round_trips(tiny_model_dir):
    lm = load(tiny_model_dir("llama"))
    ids = lm.encode("hello world")
    assert ids[0] == lm.bos_token_id and ids.count(lm.bos_token_id) == 1
    assert lm.decode(ids[1:]) == "hello world"
    assert lm.encode("hello world", add_special_tokens=False) == ids[1:]


def test_chat_template_renders_roles_and_generation_prompt(tiny_model_dir):
    lm = load(tiny_model_dir("qwen3_5"))
    ids = lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == lm.bos_token_id and ids.count(lm.bos_token_id) == 1
    text = lm.decode(ids)
    assert text == "<bos><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family", [*FAMILIES, "qwen2", "qwen2_vl"])
def test_same_seed_writes_the_same_weights_and_another_seed_differs(tmp_path, family):
    a = make_tiny_model(family, tmp_path / "a", seed=1)
    b = make_tiny_model(family, tmp_path / "b", seed=1)
    c = make_tiny_model(family, tmp_path / "c", seed=2)
    wa, wb, wc = (mx.load(str(d / "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(mx.array_equal(wa[k], wb[k]) for k in wa)  # biases included (qwen2)
    assert not all(mx.array_equal(wa[k], wc[k]) for k in wa)


def test_stored_dtype_is_upcast_to_float32_on_cpu_unless_asked(tiny_model_dir):
    path = tiny_model_dir("llama", dtype="bfloat16")
    stored = mx.load(str(path / "model.safetensors"))["model.embed_tokens.weight"]
    assert stored.dtype == mx.bfloat16
    default = load(path)
    kept = load(path, dtype="bfloat16")
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    expected = mx.float32 if on_cpu else mx.bfloat16
    assert default.model.model.embed_tokens.weight.dtype == expected
    assert kept.model.model.embed_tokens.weight.dtype == mx.bfloat16
    if on_cpu:
        assert default.fingerprint != kept.fingerprint


def test_unknown_family_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model family"):
        make_tiny_model("gpt9", tmp_path)


def test_tiny_vision_model_loads_through_mlx_vlm(tiny_model_dir):
    lm = load(tiny_model_dir("qwen2_vl"))
    assert lm.modality == "vision" and lm.model_type == "qwen2_vl"
    assert type(lm.processor).__name__ == "Qwen2VLProcessor"
    assert len(lm.make_cache()) == 2


def test_tiny_vision_model_expands_an_image_and_runs(tiny_model_dir):
    import numpy as np
    from PIL import Image

    lm = load(tiny_model_dir("qwen2_vl"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = lm.decode(lm.apply_chat_template(messages))
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8))
    inputs = lm.processor(text=[text], images=[image], return_tensors="np")
    image_pad = lm.text_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_pad).sum()) == 4  # 56x56: 4x4 patches, merged 2x2
    out = lm.model(
        mx.array(inputs["input_ids"]),
        pixel_values=mx.array(inputs["pixel_values"]),
        image_grid_thw=mx.array(inputs["image_grid_thw"]),
        cache=lm.make_cache(),
    )
    assert out.logits.shape == (1, inputs["input_ids"].shape[1], VOCAB_SIZE)


def test_make_tiny_gguf_leaves_no_source_folder_behind(tmp_path, monkeypatch):
    import tempfile

    from mlx_nbengine.testing import make_tiny_gguf

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    gguf_file = make_tiny_gguf("llama", tmp_path / "tiny.gguf")
    assert gguf_file.stat().st_size > 0
    assert list(scratch.iterdir()) == [], "its source model folder was removed"
