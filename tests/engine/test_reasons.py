"""Why every prompt block came from where it did: reasons, records, edit positions, the
hot-cache rule, stop reasons and the store view, on tiny random-weight models.

Prompts are random token ids (BOS first) so their block structure is exact; blocks are
16 tokens. A prompt of 133 tokens has whole blocks 0..7 and the tail block 8
(128..133). Between two runs of related prompts an unrelated one replaces the hot cache
where the test wants the disk to serve.
"""

from __future__ import annotations

import random

import pytest

from mlx_nbengine import Engine
from mlx_nbengine.cache import ROOT, FollowerIndex
from mlx_nbengine.engine import BlockEvent

BS = 16
BOS = 2


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [BOS] + [rng.randrange(5, 512) for _ in range(n - 1)]


def changed(tokens, at):
    """`tokens` with the token at position `at` replaced by another one."""
    out = list(tokens)
    out[at] = 5 if out[at] != 5 else 6
    return out


def reasons(report):
    return [b.reason for b in report.blocks]


@pytest.fixture
def engine_factory(tiny_model_dir, tmp_path):
    engines = []

    def make(family="llama", **kwargs):
        kwargs.setdefault("block_size", BS)
        kwargs.setdefault("cache_dir", tmp_path)
        model = tiny_model_dir(family, sliding_window=32)
        engine = Engine.load(model, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def run(engine, tokens, **kwargs):
    kwargs.setdefault("max_tokens", 4)
    done = engine.submit(tokens, **kwargs).result(timeout=60)
    engine.wait_for_saves(timeout=60)
    return done


def replace_hot_cache(engine):
    run(engine, prompt(20, seed=777), max_tokens=2)


# --- computed reasons ------------------------------------------------------------------------


def test_a_cold_prompt_is_all_new_then_the_tail(engine_factory):
    done = run(engine_factory(), prompt(133))
    assert reasons(done.report) == ["new"] * 8 + ["tail"]
    assert {b.source for b in done.report.blocks} == {"computed"}
    assert all(b.records == () and b.edit_at is None for b in done.report.blocks)
    assert done.report.edit_at is None


def test_an_edit_inside_block_2_restores_blocks_0_1_and_marks_the_edit(engine_factory):
    engine = engine_factory()
    run(engine, prompt(133))
    replace_hot_cache(engine)
    done = run(engine, changed(prompt(133), 37))
    blocks = done.report.blocks
    assert [(b.source, b.reason, b.records) for b in blocks[:2]] == [("disk", "kv", ("kv",))] * 2
    assert (blocks[2].source, blocks[2].reason, blocks[2].edit_at) == ("computed", "edited", 37)
    assert reasons(done.report)[3:] == ["after_miss"] * 5 + ["tail"]
    assert done.report.edit_at == 37


def test_an_edit_after_the_hot_cache_is_edited_at_its_position(engine_factory):
    engine = engine_factory()
    run(engine, prompt(133))
    done = run(engine, changed(prompt(133), 37))
    assert done.report.restore_source == "memory" and done.report.restored_tokens == 37
    assert [(b.source, b.reason) for b in done.report.blocks[:2]] == [("memory", "hot")] * 2
    assert (done.report.blocks[2].reason, done.report.edit_at) == ("edited", 37)


def test_an_edit_in_the_tail_sets_the_reports_edit_at(engine_factory):
    engine = engine_factory()
    first = run(engine, prompt(58), max_tokens=12)  # decode stores block 3 (48..64)
    assert len(first.tokens) >= 6
    replace_hot_cache(engine)
    done = run(engine, changed(prompt(58), 52))
    assert reasons(done.report) == ["kv"] * 3 + ["tail"]
    assert done.report.blocks[3].edit_at == 52
    assert done.report.edit_at == 52


def test_rerunning_a_prompt_sets_no_edit(engine_factory):
    engine = engine_factory()
    run(engine, prompt(58), max_tokens=12)
    replace_hot_cache(engine)
    done = run(engine, prompt(58))
    assert reasons(done.report) == ["kv"] * 3 + ["tail"]
    assert done.report.edit_at is None


def test_an_unrelated_prompt_sharing_only_bos_is_new_not_edited(engine_factory):
    engine = engine_factory()
    run(engine, prompt(133))
    done = run(engine, prompt(133, seed=1))
    assert reasons(done.report) == ["new"] * 8 + ["tail"]


def test_a_first_block_edit_counts_only_past_half_a_block(engine_factory):
    # Unrelated prompts share BOS and a chat template's header: so few shared tokens
    # make a new prompt, not an edit.
    engine = engine_factory()
    run(engine, prompt(133))
    late = run(engine, changed(prompt(133), 10))
    assert reasons(late.report) == ["edited"] + ["after_miss"] * 7 + ["tail"]
    assert late.report.edit_at == 10 and late.report.restored_tokens == 10  # cut to the token
    assert late.report.blocks[0].restored == 10
    early = run(engine, changed(prompt(133), 5))
    assert reasons(early.report) == ["new"] * 8 + ["tail"]
    assert early.report.edit_at is None


def test_a_flood_of_other_prompts_evicts_the_blocks(engine_factory):
    engine = engine_factory(disk_budget=12 * 9_000)  # about a dozen llama kv records
    run(engine, prompt(101))
    for seed in range(1, 4):
        run(engine, prompt(101, seed=seed))
    done = run(engine, prompt(101))
    got = reasons(done.report)
    assert got[0] == "evicted"
    assert set(got[1:6]) <= {"evicted", "after_miss"} and got[6] == "tail"
    assert done.report.restored_tokens == 0


def test_a_prompt_whose_first_block_was_evicted_computes_the_rest_after_the_miss(
    engine_factory,
):
    engine = engine_factory()
    run(engine, prompt(133))
    replace_hot_cache(engine)
    prefix = engine.internals.prefix_cache
    first_key = prefix.keys(prompt(133))[0]
    assert engine.internals.on_store_thread(lambda prefix: prefix.store.delete(first_key, "kv"))
    done = run(engine, prompt(133))
    assert reasons(done.report) == ["evicted"] + ["after_miss"] * 7 + ["tail"]


def test_without_a_store_every_whole_block_is_store_off(engine_factory, tmp_path):
    engine = engine_factory(store=False)
    done = run(engine, prompt(133))
    assert reasons(done.report) == ["store_off"] * 8 + ["tail"]
    assert list(tmp_path.iterdir()) == []  # no scratch file
    assert engine.stats()["block_size"] == BS


# --- records by model family -----------------------------------------------------------------


def test_sliding_window_blocks_inside_the_window_read_window_records(engine_factory):
    engine = engine_factory("gemma3_text")  # window 32: the last two restored blocks
    run(engine, prompt(133))
    replace_hot_cache(engine)
    done = run(engine, prompt(133))
    assert reasons(done.report) == ["kv"] * 6 + ["kv+window"] * 2 + ["tail"]
    assert done.report.blocks[7].records == ("kv", "window")


def test_a_dropped_window_record_makes_its_block_computed_for_the_window(engine_factory):
    engine = engine_factory("gemma3_text")
    run(engine, prompt(133))
    replace_hot_cache(engine)
    prefix = engine.internals.prefix_cache
    key = prefix.keys(prompt(133))[2]
    assert engine.internals.on_store_thread(lambda prefix: prefix.store.delete(key, "window"))
    done = run(engine, changed(prompt(133), 50))
    # Boundary 3 needs block 2's window record: block 2 is computed although its kv is held.
    expected = ["kv+window"] * 2 + ["window", "edited"] + ["after_miss"] * 4 + ["tail"]
    assert reasons(done.report) == expected
    assert done.report.edit_at == 50


def test_a_recurrent_model_reads_the_state_of_the_last_restored_block(engine_factory):
    engine = engine_factory("qwen3_5")
    run(engine, prompt(133))
    replace_hot_cache(engine)
    done = run(engine, prompt(133))
    assert [b.records for b in done.report.blocks[:8]] == [("kv",)] * 7 + [("kv", "state")]
    assert reasons(done.report)[7:] == ["kv+state", "tail"]


# --- events ----------------------------------------------------------------------------------


def test_block_events_during_prefill_carry_the_reasons_of_the_report(engine_factory):
    engine = engine_factory()
    run(engine, prompt(133))
    replace_hot_cache(engine)
    events = list(engine.submit(changed(prompt(133), 37), max_tokens=4).stream(timeout=60))
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    report = events[-1].completion.report

    def fields(b):
        return (b.index, b.start, b.end, b.source, b.reason, b.records, b.edit_at, b.restored)

    assert [fields(e) for e in blocks] == [fields(b) for b in report.blocks]
    assert blocks[2].reason == "edited" and blocks[2].edit_at == 37


# --- the hot cache ---------------------------------------------------------------------------


def test_a_cold_prompt_after_another_restores_nothing_from_memory(engine_factory):
    engine = engine_factory()
    run(engine, prompt(50, seed=1))
    done = run(engine, prompt(50, seed=2))  # shares only BOS with the hot cache
    assert done.report.restored_tokens == 0 and done.report.restore_source is None


def test_an_identical_short_rerun_is_restored_from_memory(engine_factory):
    engine = engine_factory()
    run(engine, prompt(10))
    done = run(engine, prompt(10))
    assert done.report.restore_source == "memory" and done.report.restored_tokens == 9
    assert [(b.source, b.reason) for b in done.report.blocks] == [("computed", "tail")]


def test_a_follow_up_restores_its_whole_blocks_from_memory(engine_factory):
    engine = engine_factory()
    first = run(engine, prompt(40), max_tokens=8)
    done = run(engine, prompt(40) + first.tokens + prompt(10, seed=3)[1:])
    restored = done.report.restored_tokens
    assert done.report.restore_source == "memory" and restored >= 40
    memory = [b for b in done.report.blocks if b.source == "memory"]
    assert [b.reason for b in memory] == ["hot"] * (restored // BS)
    assert all(b.records == () for b in memory)


# --- stop reasons ----------------------------------------------------------------------------


def test_stop_reason_names_the_stop_string_that_matched(engine_factory):
    engine = engine_factory()
    full = run(engine, prompt(50), max_tokens=40)
    assert full.finish_reason == "length" and full.stop_reason is None
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = run(engine, prompt(50), max_tokens=40, stop=["never there", stop])
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)


def test_stop_reason_is_eos_at_an_end_of_text_token(engine_factory):
    engine = engine_factory()
    full = run(engine, prompt(50), max_tokens=10)
    tokenizer = engine.model.tokenizer
    tokenizer.eos_token_ids = {*tokenizer.eos_token_ids, full.tokens[3]}
    done = run(engine, prompt(50), max_tokens=10)
    assert (done.finish_reason, done.stop_reason) == ("stop", "eos")
    assert done.tokens == full.tokens[: full.tokens.index(full.tokens[3])]


# --- the store view --------------------------------------------------------------------------

VIEW_KEYS = {
    "model",
    "block_size",
    "blocks_held",
    "records",
    "bytes_held",
    "budget_bytes",
    "file_size",
    "free_bytes",
    "backend",
    "by_kind",
    "blocks_restored",
    "blocks_computed",
    "tokens_restored",
    "tokens_computed",
    "blocks_evicted",
    "records_evicted",
    "requests",
    "history",
    "recent_evictions",
}


def test_cache_view_counts_blocks_and_grows_its_history(engine_factory):
    engine = engine_factory()
    run(engine, prompt(133))
    replace_hot_cache(engine)
    assert len(engine.cache_view()["history"]) == 2
    run(engine, changed(prompt(133), 37))
    view = engine.cache_view()
    assert set(view) == VIEW_KEYS
    assert view["requests"] == 3 and len(view["history"]) == 3
    assert view["blocks_restored"] == 2  # blocks 0 and 1 of the edit, from disk
    assert view["blocks_computed"] == 9 + 2 + 7
    # And 5 tokens of block 2, up to the edit at 37 (a cut: block 2 is computed).
    assert view["tokens_restored"] == 37 and view["tokens_computed"] == 133 + 20 + 96
    assert view["history"][-1] | {"t": 0} == {"t": 0, "restored": 2, "computed": 18, "evicted": 0}
    # The original, the unrelated prompt, the edit: whole blocks, plus each finished
    # request's partial last block.
    assert view["blocks_held"] == (8 + 1) + (1 + 1) + (6 + 1)
    assert view["by_kind"]["kv"]["records"] == view["records"] == view["blocks_held"]
    assert view["by_kind"]["kv"]["bytes"] == view["bytes_held"] > 0
    assert "scratch file" in view["backend"]
    assert view["recent_evictions"] == []


def test_cache_view_lists_recent_evictions_with_their_first_words(engine_factory):
    engine = engine_factory(disk_budget=12 * 9_000)
    for seed in range(4):
        run(engine, prompt(101, seed=seed))
    view = engine.cache_view()
    assert view["blocks_evicted"] > 0 and view["records_evicted"] >= view["blocks_evicted"]
    assert 0 < len(view["recent_evictions"]) <= 10
    newest = view["recent_evictions"][0]
    assert newest["kind"] == "kv" and newest["bytes"] > 0 and newest["text"]
    times = [e["t"] for e in view["recent_evictions"]]
    assert times == sorted(times, reverse=True)
    assert view["history"][-1]["evicted"] == view["blocks_evicted"]


def test_cache_view_without_a_store_is_off_and_empty(engine_factory):
    engine = engine_factory(store=False)
    run(engine, prompt(40))
    view = engine.cache_view()
    assert set(view) == VIEW_KEYS
    assert view["backend"] == "off" and view["blocks_held"] == view["bytes_held"] == 0
    assert view["by_kind"]["kv"] == {"records": 0, "bytes": 0}


# --- the follower index ----------------------------------------------------------------------


def test_ranked_followers_share_the_longest_common_prefix_first():
    index = FollowerIndex()
    index.add("a", ROOT, [2, 10, 11, 12])
    index.add("b", ROOT, [2, 10, 20, 21])
    index.add("c", "a", [30, 31, 32, 33])
    assert index.ranked(ROOT, [2, 10, 11, 99]) == [("a", 3, 4), ("b", 2, 4)]
    assert index.ranked("a", [30, 31]) == [("c", 2, 4)]
    assert index.ranked("b", [1, 2]) == []
    assert "a" in index and index.tokens("b") == [2, 10, 20, 21]


def test_follower_index_forgets_the_oldest_blocks_beyond_its_bounds():
    index = FollowerIndex(capacity=3, per_parent=2)
    for i, parent in enumerate(["p", "p", "p", "q", "r"]):
        index.add(f"k{i}", parent, [i])
    assert index.followers("p") == ["k2"]  # k0 left its parent's bound, k1 the capacity
    assert len(index) == 3 and "k0" not in index and index.tokens("k0") is None
