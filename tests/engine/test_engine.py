"""Engine behaviour on tiny random-weight models: restore parity, batching, streaming,
cancellation, failures, errors and clean shutdown.

Prompts are random token ids (BOS first) so their block structure is exact; blocks are
32 tokens so a few hundred tokens cover several blocks and the gemma3_text window (64).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import mlx.core as mx
import pytest

from mlx_nbengine import Engine
from mlx_nbengine.cache import PrefixCache, extract_block_records, partial_key
from mlx_nbengine.cache.followers import common_prefix
from mlx_nbengine.cache.store import BlockStore
from mlx_nbengine.engine import (
    BlockEvent,
    EngineClosedError,
    Finished,
    InvalidRequestError,
    Progress,
    PromptTooLongError,
    TextDelta,
)
from mlx_nbengine.engine.cacheio import CacheIO
from mlx_nbengine.models import load
from mlx_nbengine.testing import make_tiny_model

BS = 32
BOS = 2
FAMILIES = ["llama", "gemma3_text", "qwen3_5"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {fam: make_tiny_model(fam, root / fam, sliding_window=64) for fam in FAMILIES}


@pytest.fixture
def engine_factory(models, tmp_path):
    engines = []

    def make(family="llama", **kwargs):
        kwargs.setdefault("block_size", BS)
        kwargs.setdefault("cache_dir", tmp_path)
        engine = Engine.load(models[family], **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [BOS] + [rng.randrange(5, 512) for _ in range(n - 1)]


def edited(tokens, n_last, seed=99):
    rng = random.Random(seed)
    return tokens[:-n_last] + [rng.randrange(5, 512) for _ in range(n_last)]


@contextlib.contextmanager
def arriving_together(engine):
    """Hold the generation thread between steps, so requests submitted in the block reach
    its inbox together (as a burst does) however slowly this machine submits them."""
    entered, release = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(30)

    holder = threading.Thread(target=engine.on_model_thread, args=(hold,))
    holder.start()
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()
        holder.join()


def decoded(engine, tokens):
    # mlx-lm's streaming detokenizer drops the space that starts a completion.
    text = engine.model.decode(tokens)
    return text[1:] if text.startswith(" ") else text


# --- restore parity --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_edited_prompt_restored_from_disk_generates_like_a_cold_run(engine_factory, family):
    original = prompt(300)
    edit = edited(original, 40)  # blocks 0..7 (256 tokens) are unchanged
    engine = engine_factory(family)
    engine.submit(original, max_tokens=8).result(timeout=60)
    engine.submit(prompt(50, seed=5), max_tokens=4).result(timeout=60)  # replaces the hot cache
    warm = engine.submit(edit, max_tokens=24).result(timeout=60)

    cold = engine_factory(family, disk_budget=0).submit(edit, max_tokens=24).result(timeout=60)
    assert warm.tokens == cold.tokens
    # Up to the edit at 260: 8 whole blocks and 4 tokens of block 8 (a recurrent state
    # resumes only at a boundary).
    restored = 256 if family == "qwen3_5" else 260
    assert warm.report.restored_tokens == restored
    assert [b.source for b in warm.report.blocks] == ["disk"] * 8 + ["computed"] * 2
    assert warm.report.blocks[8].restored == restored - 256
    assert cold.report.restored_tokens == 0


def test_hot_cache_is_trimmed_to_the_common_prefix_when_every_layer_can_trim(engine_factory):
    original = prompt(300)
    edit = edited(original, 40)
    engine = engine_factory("llama")
    engine.submit(original, max_tokens=8).result(timeout=60)
    warm = engine.submit(edit, max_tokens=24).result(timeout=60)

    cold = engine_factory("llama", disk_budget=0).submit(edit, max_tokens=24).result(timeout=60)
    assert warm.tokens == cold.tokens
    assert warm.report.restore_source == "memory"
    assert warm.report.restored_tokens == 260  # not just whole blocks: the hot cache is exact
    assert warm.report.computed_tokens == 40


def test_rotated_sliding_window_cache_is_never_trimmed(engine_factory):
    original = prompt(300)
    edit = edited(original, 40)
    engine = engine_factory("gemma3_text")
    engine.submit(original, max_tokens=8).result(timeout=60)
    warm = engine.submit(edit, max_tokens=8).result(timeout=60)
    assert warm.report.restore_source == "disk"
    assert warm.report.restored_tokens == 260  # up to the edit, from the stored blocks


def test_clear_cache_empties_the_store_and_the_hot_cache(engine_factory):
    engine = engine_factory("llama")
    first = engine.submit(prompt(200), max_tokens=4).result(timeout=60)
    engine.wait_for_saves(timeout=30)
    assert engine.stats()["records"] > 0
    engine.clear_cache()
    assert engine.stats()["records"] == 0
    again = engine.submit(prompt(200), max_tokens=4).result(timeout=60)
    assert again.report.restored_tokens == 0 and again.report.restore_source is None
    assert {b.source for b in again.report.blocks} == {"computed"}
    assert again.tokens == first.tokens
    engine.wait_for_saves(timeout=30)
    assert engine.stats()["records"] > 0  # later checkpoints store again


def test_clear_cache_while_a_request_decodes_keeps_it_running(engine_factory):
    engine = engine_factory("llama")
    req = engine.submit(prompt(100), max_tokens=200)
    for event in req.stream():
        if isinstance(event, TextDelta):
            break
    engine.clear_cache()
    done = req.result(timeout=60)
    assert done.finish_reason == "length" and len(done.tokens) == 200
    engine.close()
    engine.clear_cache()  # a closed engine has nothing to clear


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_of_generated_tokens_are_checkpointed_during_decode(engine_factory, family):
    engine = engine_factory(family)
    first = engine.submit(prompt(70), max_tokens=100).result(timeout=60)
    assert first.finish_reason == "length"
    follow_up = prompt(70) + first.tokens[:90] + prompt(20, seed=3)[1:]
    engine.submit(prompt(40, seed=4), max_tokens=2).result(timeout=60)  # replaces the hot cache
    again = engine.submit(follow_up, max_tokens=4).result(timeout=60)
    # 160 cached tokens reach into the generated ones: block 4 (128..160) came from decode.
    assert again.report.restored_tokens == 160
    assert again.report.restore_source == "disk"


def test_agent_rewind_restores_the_prompt_before_the_dropped_reasoning(engine_factory):
    """Seed workflow: the follow-up drops the reasoning and appends only the final answer."""
    engine = engine_factory("gemma3_text")  # window 64: the cache rotates, it cannot be trimmed
    system = {"role": "system", "content": "You review code. " * 20}
    user = {"role": "user", "content": "Explain the function add in three sentences. " * 8}
    turn1 = engine.submit([system, user], max_tokens=80, template_kwargs={"enable_thinking": True})
    reasoning_and_answer = turn1.result(timeout=60)
    assert len(reasoning_and_answer.tokens) > 64  # decode went past the window

    messages = [
        system,
        user,
        {"role": "assistant", "content": "It returns a + b."},  # final answer, no reasoning
        {"role": "user", "content": "Now write a test for it."},
    ]
    turn2 = engine.submit(messages, max_tokens=8).result(timeout=60)
    prompt1 = reasoning_and_answer.prompt_tokens
    assert turn2.prompt_tokens[: len(prompt1)] == prompt1
    # Restored to the exact end of what turn 2 shares with turn 1's prompt and answer:
    # inside a block, from the block stored by turn 1's decode.
    kept = common_prefix(turn2.prompt_tokens, prompt1 + reasoning_and_answer.tokens)
    assert kept >= len(prompt1) >= 128
    assert turn2.report.restored_tokens == kept
    restored = [b for b in turn2.report.blocks if b.source == "disk"]
    assert [b.index for b in restored] == list(range(kept // BS))
    assert turn2.report.blocks[kept // BS].restored == kept % BS

    cold = engine_factory("gemma3_text", disk_budget=0).submit(messages, max_tokens=8)
    assert turn2.tokens == cold.result(timeout=60).tokens


def test_chat_template_options_pass_through(engine_factory):
    engine = engine_factory("llama")
    messages = [{"role": "user", "content": "hello world"}]
    req = engine.submit(messages, max_tokens=1, template_kwargs={"add_generation_prompt": False})
    expected = engine.model.apply_chat_template(messages, add_generation_prompt=False)
    assert req.prompt_tokens == expected
    assert req.result(timeout=60).prompt_tokens == expected


# --- batching --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_four_concurrent_requests_match_four_sequential_ones(engine_factory, family):
    prompts = [prompt(n, seed=n) for n in (40, 90, 150, 70)]
    sequential = engine_factory(family, parallel=1)
    expected = [sequential.submit(p, max_tokens=48).result(timeout=60).tokens for p in prompts]

    concurrent = engine_factory(family, parallel=4)
    requests = [concurrent.submit(p, max_tokens=48) for p in prompts]
    assert [r.result(timeout=60).tokens for r in requests] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_arriving_together_prefill_as_one_group_and_match_sequential(
    engine_factory, family
):
    # Short prompts of different lengths (right-padded in the group), then edits of
    # longer prompts whose restored prefixes differ in length (merged with left
    # padding): each burst is prefilled in one shared step.
    short = [prompt(n, seed=n) for n in (9, 14, 20, 27)]
    longs = [prompt(n, seed=n) for n in (75, 100, 120, 90)]
    edits = [edited(p, 8, seed=i) for i, p in enumerate(longs)]
    sequential = engine_factory(family, parallel=1)
    expected = [sequential.submit(p, max_tokens=24).result(timeout=60).tokens for p in short]

    engine = engine_factory(family, parallel=4)
    with arriving_together(engine):
        requests = [engine.submit(p, max_tokens=24) for p in short]
    assert [r.result(timeout=60).tokens for r in requests] == expected
    assert engine.stats()["group_prefills"] == 1

    for p in longs:  # stored one by one, so the edits find their blocks on disk
        engine.submit(p, max_tokens=2).result(timeout=60)
    engine.wait_for_saves(timeout=60)
    with arriving_together(engine):
        requests = [engine.submit(p, max_tokens=24) for p in edits]
    done = [r.result(timeout=60) for r in requests]
    assert engine.stats()["group_prefills"] == 2
    restored = [d.report.restored_tokens for d in done]
    # Up to each edit, 8 tokens before the end (from the blocks and the partial last block
    # each long prompt stored, or the hot cache); a recurrent state (qwen3_5) resumes only
    # at the boundaries before the edits, or from the last prompt's hot cache as it is.
    if family == "qwen3_5":
        assert restored[:3] == [64, 64, 96] and restored[3] in (64, 82)
    else:
        assert restored == [67, 92, 112, 82]
    cold = engine_factory(family, parallel=1)
    assert [d.tokens for d in done] == [
        cold.submit(p, max_tokens=24).result(timeout=60).tokens for p in edits
    ]


def test_a_group_joins_a_batch_that_is_decoding(engine_factory):
    engine = engine_factory("gemma3_text", parallel=4)
    first = engine.submit(prompt(30, seed=1), max_tokens=200)
    stream = first.stream(timeout=60)
    for event in stream:
        if isinstance(event, TextDelta):
            break
    with arriving_together(engine):
        pair = [engine.submit(prompt(n, seed=n), max_tokens=12) for n in (11, 19)]
    done = [r.result(timeout=60) for r in pair]
    assert not first.done and engine.stats()["group_prefills"] == 1
    alone = engine_factory("gemma3_text", parallel=1)
    assert [d.tokens for d in done] == [
        alone.submit(prompt(n, seed=n), max_tokens=12).result(timeout=60).tokens for n in (11, 19)
    ]
    assert len(first.result(timeout=120).tokens) == 200


def test_a_request_submitted_mid_decode_joins_without_waiting(engine_factory):
    engine = engine_factory("gemma3_text", parallel=2)
    long = engine.submit(prompt(60), max_tokens=400)
    stream = long.stream(timeout=60)
    deltas = 0
    for event in stream:
        deltas += isinstance(event, TextDelta)
        if deltas >= 5:
            break
    short = engine.submit(prompt(80, seed=1), max_tokens=6)
    done = short.result(timeout=60)
    assert not long.done  # the short one finished while the long one was decoding
    assert done.finish_reason == "length" and len(done.tokens) == 6
    alone = engine_factory("gemma3_text").submit(prompt(80, seed=1), max_tokens=6)
    assert done.tokens == alone.result(timeout=60).tokens
    assert len(long.result(timeout=120).tokens) > 6


def test_more_requests_than_parallel_queue_in_order(engine_factory):
    engine = engine_factory("llama", parallel=2)
    requests = [engine.submit(prompt(40, seed=i), max_tokens=30) for i in range(5)]
    order = []
    lock = threading.Lock()

    def wait(i):
        requests[i].result(timeout=60)
        with lock:
            order.append(i)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.result().finish_reason in ("length", "stop") for r in requests)
    assert order.index(4) > order.index(0) and order.index(4) > order.index(1)
    assert engine.stats()["active"] == 0 and engine.stats()["queued"] == 0


# --- streaming and sampling ------------------------------------------------------------------


def test_stream_yields_blocks_progress_text_then_finished(engine_factory):
    engine = engine_factory("llama")
    events = list(engine.submit(prompt(100), max_tokens=20).stream(timeout=60))
    assert isinstance(events[-1], Finished)
    done = events[-1].completion
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    spans = [(0, 0, 32), (1, 32, 64), (2, 64, 96), (3, 96, 100)]
    assert [(b.index, b.start, b.end) for b in blocks] == spans
    assert [(b.index, b.source) for b in done.report.blocks] == [
        (b.index, b.source) for b in blocks
    ]
    assert any(isinstance(e, Progress) and e.done == 100 for e in events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.text
    assert done.text == decoded(engine, done.tokens)
    assert done.report.ttft_s > 0 and done.report.tokens_per_s > 0


def test_stop_string_cuts_the_text_and_finishes(engine_factory):
    engine = engine_factory("llama")
    full = engine.submit(prompt(50), max_tokens=40).result(timeout=60)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    cut = engine.submit(prompt(50), max_tokens=40, stop=[stop]).result(timeout=60)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.tokens) < len(full.tokens)


def test_seeded_sampling_repeats_alone_and_in_a_batch(engine_factory):
    engine = engine_factory("llama", parallel=4)
    args = dict(max_tokens=30, temperature=0.9, top_p=0.9, seed=7)
    alone = engine.submit(prompt(40), **args).result(timeout=60).tokens
    batch = [engine.submit(prompt(40), **args) for _ in range(3)]
    assert [r.result(timeout=60).tokens for r in batch] == [alone] * 3
    other = engine.submit(prompt(40), **{**args, "seed": 8}).result(timeout=60).tokens
    assert other != alone


def test_greedy_and_sampled_requests_in_one_batch_each_get_their_own_choice(engine_factory):
    sampled_args = dict(max_tokens=30, temperature=0.9, seed=7)
    alone = engine_factory("llama", parallel=1)
    greedy_alone = alone.submit(prompt(9, seed=9), max_tokens=30).result(timeout=60).tokens
    sampled_alone = alone.submit(prompt(14, seed=14), **sampled_args).result(timeout=60).tokens
    engine = engine_factory("llama", parallel=4)
    with arriving_together(engine):
        greedy = engine.submit(prompt(9, seed=9), max_tokens=30)
        sampled = engine.submit(prompt(14, seed=14), **sampled_args)
    assert greedy.result(timeout=60).tokens == greedy_alone
    assert sampled.result(timeout=60).tokens == sampled_alone
    assert engine.stats()["group_prefills"] == 1  # prefilled together, then decoded together


def test_sampled_requests_leaving_a_batch_early_leave_the_others_draws_unchanged(engine_factory):
    # Members that finish while the next step is in flight drop their rows of it.
    jobs = [(prompt(9, seed=1), 3, 1), (prompt(14, seed=2), 9, 2), (prompt(20, seed=3), 16, 3)]
    alone = engine_factory("llama", parallel=1)
    expected = [
        alone.submit(p, max_tokens=n, temperature=0.8, top_p=0.9, seed=seed)
        .result(timeout=60)
        .tokens
        for p, n, seed in jobs
    ]
    engine = engine_factory("llama", parallel=4)
    with arriving_together(engine):
        requests = [
            engine.submit(p, max_tokens=n, temperature=0.8, top_p=0.9, seed=seed)
            for p, n, seed in jobs
        ]
    assert [r.result(timeout=60).tokens for r in requests] == expected
    assert [len(t) for t in expected] == [3, 9, 16]


def test_the_graph_sampling_path_also_repeats_alone_and_in_a_batch(engine_factory):
    # The path GPUs take (the CPU draws in numpy): forced here on the CPU.
    engine = engine_factory("llama", parallel=4)
    engine.internals.host_sampling = False
    args = dict(max_tokens=20, temperature=0.9, top_p=0.9, seed=5)
    alone = engine.submit(prompt(30), **args).result(timeout=60).tokens
    with arriving_together(engine):
        batch = [engine.submit(prompt(30), **args) for _ in range(3)]
    assert [r.result(timeout=60).tokens for r in batch] == [alone] * 3
    assert engine.submit(prompt(30), **{**args, "seed": 6}).result(timeout=60).tokens != alone


# --- cancellation ----------------------------------------------------------------------------


def test_cancel_mid_prefill_frees_the_slot(engine_factory):
    engine = engine_factory("llama", parallel=1, max_prefill_step=BS)
    long = engine.submit(prompt(3000), max_tokens=10)
    for event in long.stream(timeout=60):
        if isinstance(event, Progress) and event.phase == "prefill":
            long.cancel()
            break
    done = long.result(timeout=60)
    assert done.finish_reason == "cancelled"
    assert done.tokens == []
    assert done.report.computed_tokens < 3000
    after = engine.submit(prompt(40, seed=2), max_tokens=5).result(timeout=60)
    assert after.finish_reason == "length"


def test_cancel_mid_decode_keeps_the_tokens_and_others_continue(engine_factory):
    engine = engine_factory("llama", parallel=2)
    other = engine.submit(prompt(50, seed=1), max_tokens=60)
    victim = engine.submit(prompt(60), max_tokens=1000)
    seen = 0
    for event in victim.stream(timeout=60):
        seen += isinstance(event, TextDelta)
        if seen >= 3:
            victim.cancel()
            break
    done = victim.result(timeout=60)
    assert done.finish_reason == "cancelled"
    assert 3 <= len(done.tokens) < 1000
    assert done.text == decoded(engine, done.tokens)
    expected = engine_factory("llama").submit(prompt(50, seed=1), max_tokens=60)
    assert other.result(timeout=60).tokens == expected.result(timeout=60).tokens


# --- failures and errors ---------------------------------------------------------------------

POISON = 7


class PoisonedModel:
    """Wraps the model; a prefill containing the poison token raises, like a broken kernel."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):  # layers, make_cache...: the wrapped model's
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None):
        if inputs.shape[1] > 1 and POISON in inputs.tolist()[0]:
            raise RuntimeError("poisoned prompt")
        return self.model(inputs, cache=cache)


def test_an_exception_on_the_generation_thread_fails_only_its_request(engine_factory):
    engine = engine_factory("llama", parallel=4)
    lm = engine.model
    engine.on_model_thread(lambda: setattr(lm, "model", PoisonedModel(lm.model)))
    good = engine.submit(prompt(50, seed=1), max_tokens=40)
    bad = engine.submit(prompt(50, seed=2)[:10] + [POISON] + prompt(50, seed=2)[10:], max_tokens=40)
    with pytest.raises(RuntimeError, match="poisoned prompt"):
        bad.result(timeout=60)
    with pytest.raises(RuntimeError, match="poisoned prompt"):
        list(bad.stream(timeout=60))
    assert good.result(timeout=60).finish_reason == "length"
    after = engine.submit(prompt(50, seed=3), max_tokens=5).result(timeout=60)
    assert len(after.tokens) == 5
    assert engine.stats()["failures"] == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [3]}, "stop"),
    ],
)
def test_bad_sampling_values_raise_in_the_caller(engine_factory, kwargs, message):
    engine = engine_factory("llama")
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit("hello", **kwargs)


def test_bad_prompts_raise_in_the_caller(engine_factory):
    engine = engine_factory("llama")
    with pytest.raises(PromptTooLongError, match="shorten"):
        engine.submit([BOS] * engine.model.context_length)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.submit([])
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.submit([1, 2, 10_000])
    with pytest.raises(InvalidRequestError, match="images"):
        engine.submit("hello", images=["cat.png"])


def test_submit_after_close_raises_and_close_is_idempotent(engine_factory):
    engine = engine_factory("llama")
    engine.close()
    engine.close()
    with pytest.raises(EngineClosedError, match="Engine.load"):
        engine.submit("hello")


def test_close_cancels_requests_in_flight(engine_factory):
    engine = engine_factory("llama", parallel=1)
    running = engine.submit(prompt(40), max_tokens=100_000)
    queued = engine.submit(prompt(40, seed=1), max_tokens=5)
    next(iter(running.stream(timeout=60)))
    engine.close()
    assert running.result(timeout=10).finish_reason == "cancelled"
    assert queued.result(timeout=10).finish_reason == "cancelled"


def test_stats_report_the_store_and_the_requests(engine_factory):
    engine = engine_factory("llama", parallel=3)
    engine.submit(prompt(100), max_tokens=4).result(timeout=60)
    engine.wait_for_saves(timeout=60)
    stats = engine.stats()
    assert stats["parallel"] == 3 and stats["model"] == "llama"
    assert stats["active"] == 0 and stats["queued"] == 0
    # Three whole blocks of kv slices and the partial last block (96..103).
    assert stats["records"] == 4 and stats["stored"] == 4
    assert stats["file_size"] > 0


def test_stored_chain_is_touched_suffix_first(engine_factory):
    engine = engine_factory("llama")
    done = engine.submit(prompt(140), max_tokens=4).result(timeout=60)
    engine.wait_for_saves(timeout=60)
    prefix = engine.internals.prefix_cache
    keys = prefix.keys(done.prompt_tokens)
    held = done.prompt_tokens + done.tokens[:-1]  # the last answer token was never fed
    partial = partial_key(held, fingerprint=engine.model.fingerprint, block_size=BS)
    items = engine.internals.on_store_thread(lambda p: p.store.items())  # least recent first
    # The partial last block evicts first, block 0 last.
    assert [key for key, _ in items] == [partial, *reversed(keys)]


def test_a_restore_first_stores_the_queued_saves_of_its_chain(models, tmp_path):
    lm = load(models["llama"])
    tokens = prompt(100)
    cache = lm.make_cache()
    lm.model(mx.array(tokens[:96])[None], cache=cache)
    records = [extract_block_records(cache, block=b, block_size=BS) for b in range(3)]
    io = CacheIO()
    try:
        store = BlockStore(directory=tmp_path)
        template = lm.make_cache()
        io.open(
            lambda: PrefixCache.for_cache(
                template, fingerprint=lm.fingerprint, store=store, block_size=BS
            )
        )
        keys = io.prefix.keys(tokens)
        gate = threading.Event()
        io.call(gate.wait)  # holds the I/O thread while the saves and the restore queue up
        for b in range(3):
            io.save(keys[b], records[b])
        try:  # outranks the saves in the queue
            restore = io.restore(tokens, other_source_tokens=0, make_cache=lm.make_cache)
        finally:
            gate.set()
        result = restore.result(timeout=60)
    finally:
        io.close()
    assert result.plan.n_blocks == 3 and sorted(result.restored.kinds) == [0, 1, 2]
    assert result.restored.cache[0].offset == 96


def test_a_member_finishing_mid_pipeline_leaves_a_hot_cache_that_continues_right(
    engine_factory,
):
    # When the short request ends, the next decode step (feeding its last token) is
    # already in flight: its hot cache holds that token too, and must say so.
    engine = engine_factory("llama")
    long = engine.submit(prompt(40, seed=1), max_tokens=200)
    short = engine.submit(prompt(40, seed=2), max_tokens=12).result(timeout=60)
    follow_up = prompt(40, seed=2) + short.tokens + prompt(10, seed=5)[1:]
    warm = engine.submit(follow_up, max_tokens=16).result(timeout=60)
    assert long.result(timeout=60).finish_reason == "length"
    assert warm.report.restore_source == "memory"
    assert warm.report.restored_tokens == 40 + 12
    cold = engine_factory("llama", disk_budget=0).submit(follow_up, max_tokens=16)
    assert warm.tokens == cold.result(timeout=60).tokens


# --- memory ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_an_idle_engine_keeps_one_sequences_cache_not_the_whole_batch(engine_factory, family):
    engine = engine_factory(family, parallel=4)
    engine.submit(prompt(1500, seed=99), max_tokens=4).result(timeout=60)
    engine.wait_for_saves(timeout=60)
    one_sequence = mx.get_active_memory()  # the weights and one hot cache
    requests = [engine.submit(prompt(1500, seed=i), max_tokens=4) for i in range(4)]
    for request in requests:
        request.result(timeout=60)
    engine.wait_for_saves(timeout=60)
    time.sleep(0.2)  # the generation thread drops the finished batch after the last step
    # Four batched sequences of the same length would hold about four times the cache.
    assert mx.get_active_memory() <= one_sequence * 1.25
