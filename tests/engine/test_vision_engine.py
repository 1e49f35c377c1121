"""Image prompts through the engine, on both tiny vision models.

- ``qwen2_vl``: image tokens attend causally; multimodal rotary positions (decode steps
  need each row's rope delta).
- ``gemma4``: image tokens attend to each other both ways (sliding-window and full layers);
  restores never end inside an image, and an image is always computed in one call.
- ``qwen3_5_vl``: a hybrid (linear-attention layers with recurrent states, and full
  attention): a restore ends inside a block only where a state was taken, e.g. at the
  image-end checkpoint.

Every restore is checked against a cold run of the same prompt on a fresh engine (same
greedy tokens), so a wrong key, a wrong cut or a wrong mask shows up as other tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_nbengine.engine import Engine
from mlx_nbengine.errors import ImageError, InvalidRequestError

FAMILIES = ("qwen2_vl", "gemma4", "qwen3_5_vl")
BLOCK = 16
PRE = "Some long preamble text that goes on and on for a while " * 3


def picture(seed: int, height: int = 64, width: int = 64) -> np.ndarray:
    return (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")


def chat(question: str = "What is in this picture? Tell me all", pre: str = PRE) -> list:
    parts = [{"type": "text", "text": pre}, {"type": "image"}, {"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_model

    made = {}

    def make(family):
        if family not in made:
            made[family] = make_tiny_model(family, tmp_path_factory.mktemp(family))
        return made[family]

    return make


@pytest.fixture
def engines(model_dir):
    opened = []

    def make(family, **kwargs):
        kwargs.setdefault("block_size", BLOCK)
        engine = Engine.load(model_dir(family), **kwargs)
        opened.append(engine)
        return engine

    yield make
    for engine in opened:
        engine.close()


def run(engine, prompt, images, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return engine.submit(prompt, images=images, **kwargs).result()


def cold(engines, family, prompt, images):
    engine = engines(family)
    try:
        return run(engine, prompt, images).tokens
    finally:
        engine.close()


def displace_hot_cache(engine):
    run(engine, [{"role": "user", "content": "something else entirely"}], None, max_tokens=2)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_image_twice_restores_its_blocks_with_a_cold_runs_tokens(engines, family):
    engine = engines(family)
    first = run(engine, chat(), [picture(0)])
    span = first.report.images[0]
    displace_hot_cache(engine)
    again = run(engine, chat(), [picture(0)])
    report = again.report
    assert report.restore_source == "disk"
    assert report.restored_tokens >= span.end
    image_blocks = [b for b in report.blocks if b.images == (0,)]
    assert image_blocks and all(b.source == "disk" for b in image_blocks)
    assert again.tokens == first.tokens == cold(engines, family, chat(), [picture(0)])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_question_about_the_same_image_restores_the_whole_image(engines, family):
    engine = engines(family)
    run(engine, chat(), [picture(0)])
    displace_hot_cache(engine)
    question = chat("And what colour is the sky in it, roughly?")
    second = run(engine, question, [picture(0)])
    span = second.report.images[0]
    assert second.report.restored_tokens >= span.end
    assert second.tokens == cold(engines, family, question, [picture(0)])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_different_image_of_the_same_size_restores_nothing_of_it(engines, family):
    engine = engines(family)
    run(engine, chat(), [picture(0)])
    other = run(engine, chat(), [picture(1)])
    span = other.report.images[0]
    assert other.report.restored_tokens <= span.start
    assert [b.source for b in other.report.blocks if b.images] == ["computed"] * len(
        [b for b in other.report.blocks if b.images]
    )
    assert other.tokens == cold(engines, family, chat(), [picture(1)])


@pytest.mark.parametrize("family", FAMILIES)
def test_an_edit_after_the_image_keeps_the_image_blocks(engines, family):
    engine = engines(family)
    run(engine, chat("What is in this picture? Tell me all about it"), [picture(0)])
    edited = chat("What is in this picture? Tell me everything about it")
    second = run(engine, edited, [picture(0)])
    span = second.report.images[0]
    assert second.report.restored_tokens >= span.end
    assert all(b.source != "computed" for b in second.report.blocks if b.end <= span.end)
    assert second.tokens == cold(engines, family, edited, [picture(0)])


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_and_text_requests_batched_give_each_ones_tokens(engines, family):
    text = [{"role": "user", "content": "Tell me a story about a lighthouse keeper"}]
    alone_image = cold(engines, family, chat(), [picture(2)])
    alone_text = cold(engines, family, text, None)
    engine = engines(family, parallel=4)
    requests = [
        engine.submit(chat(), images=[picture(2)], max_tokens=8),
        engine.submit(text, max_tokens=8),
        engine.submit(chat("Another question about it"), images=[picture(3)], max_tokens=8),
    ]
    results = [r.result() for r in requests]
    assert results[0].tokens == alone_image
    assert results[1].tokens == alone_text
    assert results[2].tokens == cold(
        engines, family, chat("Another question about it"), [picture(3)]
    )


def test_the_bidirectional_model_never_restores_inside_an_image(engines):
    engine = engines("gemma4")
    # Two prompts that share every token up to the middle of the image's last block:
    # the same picture, then text; the image ends mid-block and blocks end inside it.
    first = run(engine, chat(), [picture(0)])
    span = first.report.images[0]
    assert any(span.cuts(b.end) for b in first.report.blocks), "a boundary inside the image"
    displace_hot_cache(engine)
    # The same prompt with the image's tokens unchanged but the one after it changed would
    # be restorable inside the image for a causal model; here every restore point lies
    # outside [start, end).
    for question in ("Q", "What is in this picture? Tell me all", "Other words here"):
        done = run(engine, chat(question), [picture(0)])
        assert not span.cuts(done.report.restored_tokens), question
        assert done.tokens == cold(engines, "gemma4", chat(question), [picture(0)])
    # And a different picture: the restore stops at (or before) the image's start.
    other = run(engine, chat(), [picture(5)])
    assert other.report.restored_tokens <= span.start


def test_chunked_prefill_with_image_masks_matches_mlx_vlms_single_call(model_dir):
    """What the generation path attends to: image tokens computed after a cached prefix
    see each other both ways, exactly as mlx-vlm's one-call prefill from offset 0."""
    import mlx.core as mx

    from mlx_nbengine.engine.vision import VisionInputs, VisionRunner
    from mlx_nbengine.models import load
    from mlx_nbengine.models.images import load_images
    from mlx_nbengine.models.vision import prepare_vision_prompt

    lm = load(model_dir("gemma4"))
    text = lm.render_chat(chat())
    vp = prepare_vision_prompt(lm, text, load_images([picture(0)]), templated=True)
    span = vp.spans[0]
    ids = mx.array(vp.tokens)[None]
    types = np.zeros((1, len(vp.tokens)), dtype=np.int32)
    types[0, span.start : span.end] = 1
    # mlx-vlm's own single call (its overlay applies at offset 0).
    feats = lm.model.get_input_embeddings(
        input_ids=ids, pixel_values=mx.array(vp.inputs["pixel_values"])
    )
    whole = lm.language_model(
        ids,
        inputs_embeds=feats.inputs_embeds,
        cache=lm.make_cache(),
        mm_token_type_ids=mx.array(types),
    ).logits
    runner = VisionRunner(lm)
    embedded = runner.embed(vp.tokens, VisionInputs(vp.spans, vp.inputs), need_from=0)
    cache = lm.make_cache()
    cut = span.start - 3  # a prefix, then a step holding the whole image
    parts = []
    for start, end in ((0, cut), (cut, len(vp.tokens))):
        kwargs = runner.prefill_kwargs(embedded, start, end)
        parts.append(lm.language_model(ids[:, start:end], cache=cache, **kwargs).logits)
    chunked = mx.concatenate(parts, axis=1)
    # Measured 2026-12-01 on an AMD EPYC (2 cores): equal (0.0; largest logit 5.4); on a Zen
    # 5 under OPENBLAS_CORETYPE=Haswell, whose sgemm gives a row other bits with other rows
    # beside it, 1.7e-5 (3e-6 of the largest logit). The bound: 2e-5 of the largest logit.
    largest = float(mx.abs(whole).max())
    assert float(mx.abs(chunked - whole).max()) < 2e-5 * largest
    # Without the masks the image would attend causally after the prefix: far off.
    causal = lm.language_model(ids, inputs_embeds=feats.inputs_embeds, cache=lm.make_cache()).logits
    assert float(mx.abs(causal - whole)[0, span.start].max()) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_the_feature_memo_spares_a_second_encode(engines, family):
    engine = engines(family)
    run(engine, chat(), [picture(0)])
    assert engine.stats()["vision_encodes"] == 1
    # An edit before the image: its blocks are computed again, from the memo's features.
    edited = chat(pre=PRE.replace("preamble", "prologue"))
    again = run(engine, edited, [picture(0)])
    span = again.report.images[0]
    assert again.report.restored_tokens < span.start
    stats = engine.stats()
    assert stats["vision_encodes"] == 1
    assert stats["feature_memo_hits"] >= 1
    assert again.tokens == cold(engines, family, edited, [picture(0)])
    # A new picture is encoded.
    run(engine, chat(), [picture(7)])
    assert engine.stats()["vision_encodes"] == 2


def test_the_same_picture_from_a_file_an_array_and_bytes_hits_the_same_blocks(engines, tmp_path):
    from PIL import Image

    engine = engines("qwen2_vl")
    array = picture(0)
    path = tmp_path / "pic.png"
    Image.fromarray(array).save(path)
    first = run(engine, chat(), [path])
    displace_hot_cache(engine)
    second = run(engine, chat(), [path.read_bytes()])
    third = run(engine, chat(), [Image.fromarray(array)])
    assert second.report.images == first.report.images == third.report.images
    assert second.report.restored_tokens == len(second.prompt_tokens) - 1
    assert first.tokens == second.tokens == third.tokens


def test_a_plain_string_prompt_gets_the_placeholders_first(engines):
    engine = engines("qwen2_vl")
    done = run(engine, "Describe it.", [picture(0), picture(1)])
    assert len(done.report.images) == 2
    assert done.report.images[0].end <= done.report.images[1].start


# --- errors ------------------------------------------------------------------------------


def test_a_missing_file_is_named(engines, tmp_path):
    engine = engines("qwen2_vl")
    with pytest.raises(ImageError, match=r"image 1: no such file '.*nope\.png'"):
        engine.submit(chat(), images=[tmp_path / "nope.png"])


def test_a_file_that_is_not_an_image_is_named(engines, tmp_path):
    engine = engines("qwen2_vl")
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ImageError, match=r"image 1 \('.*notes\.txt'\) is not an image"):
        engine.submit(chat(), images=[notes])


def test_an_image_for_a_text_only_model_is_refused(tiny_model_dir):
    engine = Engine.load(tiny_model_dir("llama"), block_size=BLOCK)
    try:
        with pytest.raises(ImageError, match="reads text only"):
            engine.submit("Describe it.", images=[picture(0)])
    finally:
        engine.close()


def test_more_images_than_places_is_refused(engines):
    engine = engines("qwen2_vl")
    with pytest.raises(ImageError, match=r"places for 1 image\(s\) but 2 were given"):
        engine.submit(chat(), images=[picture(0), picture(1)])


def test_an_image_too_large_is_refused(engines, monkeypatch):
    from mlx_nbengine.models import images

    engine = engines("qwen2_vl")
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ImageError, match=r"image 1 has 64x64 = 4,096 pixels, more than"):
        engine.submit(chat(), images=[picture(0)])


def test_a_wrong_array_and_a_wrong_type_are_refused(engines):
    engine = engines("qwen2_vl")
    with pytest.raises(ImageError, match=r"shape \(4, 4, 2\).*H x W x 3"):
        engine.submit(chat(), images=[np.zeros((4, 4, 2), dtype=np.uint8)])
    with pytest.raises(ImageError, match="image 1 is a dict"):
        engine.submit(chat(), images=[{"a": 1}])
    with pytest.raises(InvalidRequestError, match="not token ids"):
        engine.submit([1, 2, 3], images=[picture(0)])


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_block_restores_stop_before_a_bidirectional_image(engines, family):
    """With whole blocks only, the last boundary before the edit lies inside the image: a
    causal model restores up to it, the bidirectional one stops before the image."""
    engine = engines(family, restore="block")
    # A preamble that puts the question in the block where the image ends.
    for extra in range(12):
        pre = PRE + "word " * extra
        first = run(engine, chat(pre=pre), [picture(0)])
        span = first.report.images[0]
        if span.end % BLOCK and BLOCK - span.end % BLOCK > 3 and span.end % BLOCK > 2:
            break
    inside = [b.end for b in first.report.blocks if span.cuts(b.end)]
    assert inside, "a block boundary inside the image"
    displace_hot_cache(engine)
    question = chat("Something else entirely, at once", pre=pre)
    second = run(engine, question, [picture(0)])
    restored = second.report.restored_tokens
    if family == "gemma4":
        assert restored <= span.start
    else:
        assert restored == inside[-1]
    assert second.tokens == cold(engines, family, question, [picture(0)])


def test_a_hybrid_resumes_after_the_whole_image_from_its_image_end_checkpoint(engines):
    """qwen3_5_vl keeps recurrent states: a restore can end inside a block only where a
    state was taken. The engine ends a prefill step at each image's end and stores a
    partial block there, so a new question resumes right after the image."""
    engine = engines("qwen3_5_vl")
    for extra in range(16):  # a preamble that makes the image end early in its block
        pre = PRE + "word " * extra
        first = run(engine, chat(pre=pre), [picture(0)])
        span = first.report.images[0]
        if 2 <= span.end % BLOCK <= BLOCK - 6:
            break
    assert 2 <= span.end % BLOCK <= BLOCK - 6
    displace_hot_cache(engine)
    question = chat("Which colours?", pre=pre)
    second = run(engine, question, [picture(0)])
    assert second.report.restored_tokens == span.end
    assert second.report.kept_boundary is None
    assert engine.stats()["vision_encodes"] == 1
    assert second.tokens == cold(engines, "qwen3_5_vl", question, [picture(0)])
