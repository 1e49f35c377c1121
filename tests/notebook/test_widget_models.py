"""The block widgets' models after real requests on a tiny random-weight llama.

Each request's `stream()` feeds a `StripFeed` into a `BlockStrip`, as `%llm` does (see
`cellview.strip_feed`), and a finished report builds a `BlockMap` (see
`cellview.show_block_map`); the tests read the widgets' traitlets. Prompts are text
(tokenized with BOS); blocks are 16 tokens.
"""

from __future__ import annotations

import math
import re

import pytest

from mlx_nbengine import Engine
from mlx_nbengine.engine import BlockEvent
from mlx_nbengine.engine.events import Finished
from mlx_nbengine.notebook import widgets
from mlx_nbengine.notebook.blockinfo import block_dicts, edit_dict
from mlx_nbengine.notebook.stripfeed import StripFeed

BS = 16


def text(seed=0, lines=10):
    """A long prompt: `lines` lines, the first naming `seed` (distinct from its first block)."""
    body = [f"prompt {seed}: a story about widgets and blocks"]
    body += [f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(1, lines)]
    return "\n".join(body)


def edited(prompt):
    """`prompt` with its last line changed near its start (not in the tail block)."""
    head, _, last = prompt.rpartition("\n")
    return head + "\n" + last.replace("the quick", "a slow", 1)


class _Handle:
    def __init__(self):
        self.updates = 0

    def update(self, obj):
        self.updates += 1


def fake_display(obj, display_id=None):
    return _Handle()


@pytest.fixture
def engine_factory(tiny_model_dir, tmp_path):
    engines = []

    def make(**kwargs):
        kwargs.setdefault("block_size", BS)
        kwargs.setdefault("cache_dir", tmp_path)
        engine = Engine.load(tiny_model_dir("llama"), **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def special_ids(engine):
    return frozenset(int(t) for t in engine.model.tokenizer.all_special_ids)


def follow(engine, prompt, *, on_blocks=None, max_tokens=4, images=None):
    """Submit `prompt`, feed its events to a new strip; (strip, completion, changes).

    `changes` lists the strip's block indices at each `blocks` change before `finish`.
    """
    extra = {"images": images} if images else {}
    request = engine.submit(prompt, max_tokens=max_tokens, **extra)
    tokens = request.prompt_tokens
    strip = widgets.BlockStrip(
        n_blocks=math.ceil(len(tokens) / BS), block_size=BS, prompt_tokens=len(tokens)
    )
    changes = []
    strip.observe(lambda change: changes.append([b["index"] for b in change["new"]]), "blocks")
    feed = StripFeed(
        strip,
        tokens=tokens,
        decode=engine.model.tokenizer.decode,
        special=special_ids(engine),
        block_size=BS,
        display=fake_display,
    )
    feed.show()
    completion = None
    for event in request.stream(timeout=60):
        if isinstance(event, BlockEvent):
            feed.add(event)
        elif isinstance(event, Finished):
            completion = event.completion
    before_finish = list(changes)
    assert completion is not None
    feed.finish(completion)
    feed.close()
    engine.wait_for_saves(timeout=60)
    return strip, completion, before_finish


def kinds(strip):
    return [b["display"] for b in strip.blocks]


def reasons(strip):
    return [b["reason"] for b in strip.blocks]


def first_difference(a, b):
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_a_cold_long_prompt_fills_the_strip_with_new_blocks_then_the_tail(engine_factory):
    strip, completion, _ = follow(engine_factory(), text())
    n = math.ceil(len(completion.prompt_tokens) / BS)
    assert n > 8 and strip.n_blocks == n
    assert [b["index"] for b in strip.blocks] == list(range(n))
    assert kinds(strip) == ["computed"] * (n - 1) + ["tail"]
    assert reasons(strip) == ["new"] * (n - 1) + ["tail"]
    assert strip.edit is None
    assert strip.blocks[1]["head"]  # words decoded from the prompt


def test_an_edited_last_line_restores_the_blocks_before_and_marks_the_edit(engine_factory):
    engine = engine_factory()
    _, first, _ = follow(engine, text())
    strip, second, _ = follow(engine, edited(text()))
    position = first_difference(first.prompt_tokens, second.prompt_tokens)
    at = position // BS
    assert 0 < at < strip.n_blocks - 1
    assert set(kinds(strip)[:at]) <= {"disk", "memory"}
    assert strip.blocks[at]["reason"] == "edited"
    assert strip.edit is not None and strip.edit["position"] == position
    assert strip.edit["block"] == at
    assert reasons(strip)[-1] == "tail"


def test_a_flood_of_other_prompts_evicts_the_first_block(engine_factory):
    engine = engine_factory(disk_budget=12 * 9_000)  # about a dozen llama kv records
    follow(engine, text(lines=3))
    for seed in range(1, 5):
        follow(engine, text(seed, lines=3))
    stats = engine.cache_view()
    assert int(stats.get("blocks_evicted") or 0) > 0
    strip, _, _ = follow(engine, text(lines=3))
    assert strip.blocks[0]["reason"] == "evicted"
    assert strip.blocks[0]["display"] == "computed"
    assert reasons(strip)[-1] == "tail"


def test_without_a_store_every_whole_block_is_store_off(engine_factory):
    strip, _, _ = follow(engine_factory(store=False), text())
    n = strip.n_blocks
    assert reasons(strip) == ["store_off"] * (n - 1) + ["tail"]
    assert kinds(strip) == ["computed"] * (n - 1) + ["tail"]


def test_the_strip_fills_in_live_in_index_order(engine_factory):
    strip, _, changes = follow(engine_factory(), text())
    assert len(changes) > 1  # the strip changed during the prefill, not only at the end
    for seen in changes:
        assert seen == list(range(len(seen)))  # each change adds the next block
    assert changes[-1] == list(range(strip.n_blocks))
    assert len(strip.blocks) == strip.n_blocks
    assert not re.search(r'data-index="\d+" data-display="pending"', strip.html())


def test_the_block_map_of_an_edited_request_matches_its_strip(engine_factory):
    engine = engine_factory()
    follow(engine, text())
    strip, completion, _ = follow(engine, edited(text()))
    report, tokens = completion.report, completion.prompt_tokens
    decode, special = engine.model.tokenizer.decode, special_ids(engine)
    block_map = widgets.BlockMap(
        blocks=block_dicts(report.blocks, decode=decode, tokens=tokens, special=special),
        edit=edit_dict(report.edit_at, tokens, decode=decode, block_size=BS, special=special),
        block_size=BS,
        prompt_tokens=len(tokens),
    )
    assert [b["index"] for b in block_map.blocks] == list(range(strip.n_blocks))
    assert [b["display"] for b in block_map.blocks] == kinds(strip)
    assert [b["reason"] for b in block_map.blocks] == reasons(strip)
    assert block_map.edit == strip.edit
    assert 'data-reason="edited"' in block_map.html()


def test_an_image_prompt_marks_the_blocks_its_image_overlaps(tiny_model_dir, tmp_path):
    """A real vision request: the strip's blocks (fed its BlockEvents, then the report)
    carry the image whose tokens they hold, as the report's image span says."""
    import numpy as np

    engine = Engine.load(tiny_model_dir("qwen2_vl"), block_size=BS, cache_dir=tmp_path)
    try:
        picture = np.zeros((56, 56, 3), dtype=np.uint8)
        picture[:, :28] = (255, 128, 0)
        messages = [{"role": "user", "content": "What colours are in this picture?"}]
        strip, completion, _ = follow(engine, messages, images=[picture])
        (span,) = completion.report.images
        expected = [
            [0] if b["start"] < span.end and span.start < b["end"] else [] for b in strip.blocks
        ]
        assert [b["images"] for b in strip.blocks] == expected
        assert any(expected)
        # The same marks come out of the report's blocks (what --blocks draws).
        from mlx_nbengine.notebook.blockinfo import block_dicts

        assert [b["images"] for b in block_dicts(completion.report.blocks)] == expected
        assert 'data-image="0"' in strip.html()
    finally:
        engine.close()


def prefill_progress(engine, prompt, **options) -> list[tuple[str, int]]:
    """The (phase, done) of every `Progress` event of `prompt`'s request."""
    request = engine.submit(prompt, max_tokens=1, **options)
    return [(e.phase, e.done) for e in request.stream() if type(e).__name__ == "Progress"]


def test_a_request_with_nothing_to_restore_says_at_once_that_it_left_the_queue(engine_factory):
    progress = prefill_progress(engine_factory(), text(seed=7))
    assert progress[0] == ("restore", 0)


def test_live_blocks_prefill_one_block_per_step(engine_factory):
    engine = engine_factory(max_prefill_step=1024)
    n = len(engine.submit(text(seed=8), max_tokens=1).result().prompt_tokens)
    assert n > 4 * BS
    steps = [done for phase, done in prefill_progress(engine, text(seed=9)) if phase == "prefill"]
    assert len(steps) <= 2, "without live blocks: long steps"
    live = prefill_progress(engine, text(seed=10), live_blocks=True)
    steps = [done for phase, done in live if phase == "prefill"]
    assert steps[: n // BS] == [BS * (i + 1) for i in range(n // BS)]
